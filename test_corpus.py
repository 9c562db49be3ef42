"""Tests of corpus.py on its own: document names (which decide the split), record numbering, the
held-out decision, and the default corpus's held-out set. Round trips of every input format through
preparation, and skipping of unreadable inputs, are tested in test_data.py."""
import gzip
import hashlib
import json
import os
import pathlib
import shutil

import pytest

from tokendata import corpus


def test_names_are_relative_to_the_patterns_fixed_directories_and_survive_a_move(tmp_path):
    for name in ("a.txt", "sub/b.jsonl.gz", "sub/c.NDJSON", "sub/deep/d.parquet", "e.jsonl.zst"):
        (tmp_path / "one" / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "one" / "corpus" / name).write_text("x")
    sources = corpus.expand([str(tmp_path / "one" / "corpus" / "**" / "*")])
    expected = [("text", "a.txt"), ("jsonl", "e.jsonl.zst"), ("jsonl", "sub/b.jsonl.gz"),
                ("jsonl", "sub/c.NDJSON"), ("parquet", "sub/deep/d.parquet")]
    assert [(kind, pathlib.Path(name).as_posix()) for kind, _, name in sources] == expected
    assert all(os.path.isfile(location) for _, location, _ in sources)

    # the same corpus elsewhere, named by a directory instead of a glob: the same names
    shutil.move(tmp_path / "one" / "corpus", tmp_path / "moved")
    moved = corpus.expand([str(tmp_path / "moved")])
    assert [name for *_, name in moved] == [name for *_, name in sources]
    # a file named twice (directly and through its directory) is read once; hf: passes through
    again = corpus.expand([str(tmp_path / "moved" / "a.txt"), str(tmp_path / "moved"), "hf:org/x:train"])
    assert [name for *_, name in again] == ["a.txt"] + [n for *_, n in moved if n != "a.txt"] + ["hf:org/x:train"]
    with pytest.raises(corpus.DataError, match="no file matches"):
        corpus.expand([str(tmp_path / "moved" / "*.csv")])


def test_reader_names_records_by_line_and_counts_what_it_skips(tmp_path):
    lines = ['{"text": "first"}', "", '{"text": null}', '{"text": "fourth"}', "{broken", '{"text": 7}',
             '{"text": ""}', '{"text": "eighth"}']
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "t.txt").write_text("a whole file")
    (tmp_path / "u.txt").write_bytes(b"\xff\xfe not utf-8")
    reader = corpus.Reader(corpus.expand([str(tmp_path)]), "text", strict=False)
    # line numbers count blank lines; an empty record is an empty document (nothing to yield), while a
    # null one is no text: skipped, counted and named like the broken line and the number
    assert list(reader) == [("r.jsonl:1", "first"), ("r.jsonl:4", "fourth"), ("r.jsonl:8", "eighth"),
                            ("t.txt", "a whole file")]
    assert (reader.tally.files, reader.tally.skipped_files, reader.tally.skipped_records) == (3, 1, 3)
    assert {"input": f"{tmp_path / 'r.jsonl'}:3", "reason": "not a text record (None)"} in reader.tally.skipped
    with pytest.raises(corpus.DataError, match=r"r\.jsonl:3: not a text record \(None\).*drop --strict"):
        list(corpus.Reader(corpus.expand([str(tmp_path)]), "text", strict=True))


@pytest.mark.parametrize("compression", ["", ".gz"])
def test_an_invalid_utf8_byte_costs_only_its_own_record(tmp_path, compression):
    records = [f"record {i}: caf\u00e9 \u65e5\u672c" for i in range(1, 51)]
    lines = [json.dumps({"text": text}, ensure_ascii=False).encode() for text in records]
    lines[9] = lines[9].replace(b"caf\xc3\xa9", b"caf\xe9")  # record 10: a Latin-1 byte, not UTF-8
    raw = b"\n".join(lines) + b"\n"
    path = tmp_path / f"r.jsonl{compression}"
    path.write_bytes(gzip.compress(raw) if compression else raw)
    reader = corpus.Reader(corpus.expand([str(path)]), "text", strict=False)
    assert list(reader) == [(f"r.jsonl{compression}:{i}", text) for i, text in enumerate(records, 1) if i != 10]
    assert (reader.tally.files, reader.tally.skipped_files, reader.tally.skipped_records) == (1, 0, 1)
    at = lines[9].index(b"\xe9") + 1  # only ASCII before it: its byte offset is its character position
    reason = f"not UTF-8: byte 0xe9 at character {at}"
    assert reader.tally.skipped == [{"input": f"{path}:10", "reason": reason}]
    with pytest.raises(corpus.DataError) as err:
        list(corpus.Reader(corpus.expand([str(path)]), "text", strict=True))
    assert str(err.value) == f"{path}:10: {reason} (drop --strict to skip it)"


def test_skipped_inputs_are_named_up_to_a_limit_in_input_order(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": 1}\n' * 3 + '{"text": "ok"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n' + "{broken\n" * 104)
    (tmp_path / "c.txt").write_bytes(b"\xff")
    sources = corpus.expand([str(tmp_path)])
    reader = corpus.Reader(sources, "text", strict=False)
    assert len(list(reader)) == 2
    tally = reader.tally
    assert (tally.skipped_files, tally.skipped_records) == (1, 107)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    expected = [f"{a}:{n}" for n in (1, 2, 3)] + [f"{b}:{n}" for n in range(2, 99)]  # the first 100 in order
    assert [s["input"] for s in tally.skipped] == expected
    assert tally.skipped_names() == f"{a}:1, {a}:2, {a}:3, {b}:2, {b}:3 and 103 more"
    # tallies of parts, added in input order, come to the tally of one reader over all of them
    whole = corpus.Tally()
    for source in sources:
        part = corpus.Reader([source], "text", strict=False)
        list(part)
        whole.add(part.tally)
    assert whole == tally


def test_held_out_decision_has_the_requested_share_and_is_nested():
    names = [f"dir/file_{i}.txt:{i % 97}" for i in range(20_000)]
    for fraction in (0.0, 0.01, 0.25):
        share = sum(corpus.in_val(n, fraction) for n in names) / len(names)
        sigma = (fraction * (1 - fraction) / len(names)) ** 0.5
        assert abs(share - fraction) <= 5 * sigma  # a fair hash: a binomial share
    # a larger fraction holds out a superset, so raising it never moves a document into train
    assert all(corpus.in_val(n, 0.2) for n in names if corpus.in_val(n, 0.1))
    # the decision is the name's blake2b-64 (little-endian) against fraction * 2^64; a float fraction
    # near 1 resolves 2^-53, i.e. 2^11 hash values, hence the margin
    for n in names[:50]:
        h = int.from_bytes(hashlib.blake2b(n.encode(), digest_size=8).digest(), "little")
        assert corpus.in_val(n, (h + 2**12) / 2**64) and not corpus.in_val(n, (h - 2**12) / 2**64)


def test_held_out_extra_only_where_the_fraction_holds_out_none():
    names = [f"d{i}.txt" for i in range(5)]
    tally = corpus.Tally()
    for name in names:
        tally.saw(name)
    first = min(names, key=lambda n: hashlib.blake2b(n.encode(), digest_size=8).digest()[::-1])  # little-endian
    assert corpus.held_out_extra(tally, train_documents=5, val_documents=0, fraction=0.01) == first
    assert corpus.held_out_extra(tally, train_documents=4, val_documents=1, fraction=0.01) is None  # kept as is
    assert corpus.held_out_extra(tally, train_documents=5, val_documents=0, fraction=0.0) is None  # none asked for
    with pytest.raises(corpus.DataError, match="one document.*--val-fraction 0.2"):
        corpus.held_out_extra(tally, train_documents=1, val_documents=0, fraction=0.2)
    with pytest.raises(corpus.DataError, match="--val-fraction 0.9 holds out all 2 documents"):
        corpus.held_out_extra(tally, train_documents=0, val_documents=2, fraction=0.9)


def test_default_held_out_is_the_shortest_hash_ordered_prefix_reaching_the_byte_share(tmp_path):
    sizes = {f"pkg{i % 5}/m{i:02d}.py": 100 + 37 * i * i for i in range(60)}  # sizes vary a hundredfold
    for name, size in sizes.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"#" * size)
    files = sorted(tmp_path / name for name in sizes)
    held = corpus.default_held_out(tmp_path, files)
    order = sorted(sizes, key=lambda n: hashlib.blake2b(n.encode(), digest_size=8).digest())
    target = corpus.DEFAULT_VAL_FRACTION * sum(sizes.values())
    k = next(i for i in range(1, len(order) + 1) if sum(sizes[n] for n in order[:i]) >= target)
    assert held == set(order[:k])
    assert corpus.default_held_out(tmp_path, files[::-1]) == held  # independent of the listing order


def test_data_reexports_the_one_user_error_class():
    import data
    assert data.DataError is corpus.DataError
    assert data.default_corpus_files is corpus.default_corpus_files
    with pytest.raises(data.DataError):
        corpus.expand([json.dumps("no such file")])
