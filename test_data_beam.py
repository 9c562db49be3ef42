"""Tests of data.py --runner beam (data_beam.py) on Beam's in-process DirectRunner: the same directory as
the default runner on a mixed-format corpus, the loader on it, input errors, and nothing left by a failure."""
import gzip
import json
import pathlib

import numpy as np
import pytest

import data
from test_data import assert_one_line_error, make_docs, run_cli, split_stream
from tokendata import corpus, loader, shards

SHARD_TOKENS = 300  # small, so splits have several shards and shards cut through documents


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Text files, JSON Lines (plain, .gz, .zst) and Parquet; returns (root, [(name, text)] in input order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    root = tmp_path_factory.mktemp("beam")
    c = root / "c"
    (c / "txt").mkdir(parents=True)
    docs = iter(make_docs(64, seed=11))
    named = []  # what corpus.expand and corpus.Reader should yield, written out here by hand
    for i in range(6):
        text = next(docs)
        (c / "txt" / f"{i}.txt").write_text(text, encoding="utf-8")
        named.append((f"txt/{i}.txt", text))
    for name, pack in (("a.jsonl", bytes), ("b.jsonl.gz", gzip.compress),
                       ("c.jsonl.zst", zstandard.ZstdCompressor().compress)):
        texts = [next(docs) for _ in range(12)]
        (c / name).write_bytes(pack("".join(json.dumps({"text": t}) + "\n" for t in texts).encode()))
        named += [(f"{name}:{k}", t) for k, t in enumerate(texts, 1)]
    texts = [next(docs) for _ in range(15)]
    pq.write_table(pa.table({"text": texts}), c / "d.parquet", row_group_size=4)
    named += [(f"d.parquet:{k}", t) for k, t in enumerate(texts, 1)]
    named.sort(key=lambda nt: nt[0].split(":")[0])  # a directory input is read in sorted path order
    return root, named


def prep(inputs, out, **kw):
    kw = {"vocab_size": 320, "val_fraction": 0.3, "workers": 1, "shard_tokens": SHARD_TOKENS,
          "progress": False, **kw}
    return data.prepare([str(i) for i in inputs], out, **kw)


def expected_stream(directory: pathlib.Path, named, split: str, val_fraction: float) -> np.ndarray:
    """The split's stream from first principles: each document's ids then end-of-text, in input order."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for name, text in named:
        if corpus.in_val(name, val_fraction) == (split == "val"):
            ids += tok.encode(text, add_special_tokens=False).ids + [eot]
    return np.array(ids, np.int64)


@pytest.fixture(scope="module")
def both(mixed):
    """The corpus prepared by each runner; Beam trains its tokenizer with the same function in the launcher,
    and runs on two worker threads so sources and shards finish out of order."""
    root, _ = mixed
    local = prep([root / "c"], root / "local")
    beam = prep([root / "c"], root / "beam", runner="beam",
                beam_options=["--direct_num_workers=2", "--direct_running_mode=multi_threading"])
    return root / "local", root / "beam", local, beam


def test_beam_and_default_runner_write_the_same_directory(mixed, both):
    _, named = mixed
    local_dir, beam_dir, local, beam = both
    assert beam == local  # every index field: tokens, documents, bytes, entropy, shard names and sizes
    assert shards.open_data(beam_dir).index == beam
    assert sorted(p.name for p in beam_dir.iterdir()) == sorted(p.name for p in local_dir.iterdir())
    for path in local_dir.iterdir():  # tokenizer.json, index.json and every shard, byte for byte
        assert (beam_dir / path.name).read_bytes() == path.read_bytes(), path.name
    for split in ("train", "val"):
        stream = split_stream(beam_dir, split)
        np.testing.assert_array_equal(stream, expected_stream(beam_dir, named, split, 0.3))
        files = beam["splits"][split]["shards"]
        assert [s["tokens"] for s in files[:-1]] == [SHARD_TOKENS] * (len(files) - 1)
        assert 0 < files[-1]["tokens"] <= SHARD_TOKENS
        # a shard's documents are those whose end-of-text falls inside it
        eot_at = np.flatnonzero(stream == beam["eot_id"])
        assert [s["documents"] for s in files] == \
            np.bincount(eot_at // SHARD_TOKENS, minlength=len(files)).tolist()
    assert len(beam["splits"]["train"]["shards"]) > 5 and beam["splits"]["val"]["documents"] > 3
    assert beam["documents"] == len(named)


def test_loader_reads_beam_output(both):
    local_dir, beam_dir, _, _ = both
    seq_len = 16
    from_beam = loader.TextLoader(shards.open_data(beam_dir), "train", seq_len, 4, seed=3)
    from_local = loader.TextLoader(shards.open_data(local_dir), "train", seq_len, 4, seed=3)
    stream = split_stream(beam_dir, "train")
    windows = {tuple(stream[i * seq_len:i * seq_len + seq_len + 1]) for i in range(from_beam.num_windows)}
    for step in range(5):
        batch = from_beam.get_batch(step)
        np.testing.assert_array_equal(batch, from_local.get_batch(step))
        assert all(tuple(row) in windows for row in batch.tolist())
    (first,) = loader.eval_windows(shards.open_data(beam_dir), "val", seq_len, 1, max_windows=1)
    np.testing.assert_array_equal(first[0], split_stream(beam_dir, "val")[:seq_len + 1])


def test_beam_holds_out_the_same_document_when_the_fraction_holds_out_none(tmp_path):
    from test_data import blake2b_rank, write_text_files
    write_text_files(tmp_path / "c", make_docs(3, seed=12))
    lowest = min((blake2b_rank(f"{i:04d}.txt"), f"{i:04d}.txt") for i in range(3))
    kw = dict(val_fraction=lowest[0] / 2**64 / 2, shard_tokens=2**20)  # below every document's hash
    local = prep([tmp_path / "c"], tmp_path / "local", **kw)
    assert local["val_extra"] == lowest[1] and local["splits"]["val"]["documents"] == 1
    assert prep([tmp_path / "c"], tmp_path / "beam", runner="beam", **kw) == local


def test_beam_runs_the_default_corpus_too(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    for i in range(12):
        (root / f"mod{i:02d}.py").write_text("\n".join(make_docs(3, seed=40 + i)))
    kw = dict(vocab_size=300, stdlib_dir=root, progress=False)
    local = data.prepare_default(tmp_path / "local", **kw)
    assert data.prepare_default(tmp_path / "beam", runner="beam", **kw) == local
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_stream(tmp_path / "beam", split), split_stream(tmp_path / "local", split))


# ------------------------------------------------------------------------------------------------
# Input errors and failures: one line from the CLI, nothing left behind, nothing overwritten

def test_corrupt_input_is_skipped_like_the_default_runner_or_fatal_with_strict(mixed, both, tmp_path):
    root, _ = mixed
    local_dir = both[0]
    bad = tmp_path / "c"
    bad.mkdir()
    for path in (root / "c" / "txt").iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    (bad / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    (bad / "lines.jsonl").write_text('{"text": "a good record"}\n{"text": tru\n{"text": 5}\n')
    tokenizer = str(local_dir / "tokenizer.json")  # given, so the inputs are first read on the workers
    local = prep([bad], tmp_path / "local", tokenizer=tokenizer)
    beam = prep([bad], tmp_path / "beam", tokenizer=tokenizer, runner="beam")
    assert beam == local and (beam["skipped_files"], beam["skipped_records"]) == (1, 2)
    assert [s["input"] for s in beam["skipped_inputs"]] == [
        str(bad / "broken.jsonl.gz"), f"{bad / 'lines.jsonl'}:2", f"{bad / 'lines.jsonl'}:3"]

    result = run_cli("--runner", "beam", "--input", "c", "--out", "strict", "--strict", "--tokenizer", tokenizer,
                     cwd=tmp_path)
    assert_one_line_error(result, "broken.jsonl.gz", "drop --strict")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beam", "c", "local"]  # no DIR, no DIR.tmp-*

    (bad / "broken.jsonl.gz").unlink()
    (bad / "other.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(data.DataError, match="other.jsonl:1: no field 'text' \\(has: body\\)"):
        prep([bad], tmp_path / "beam", tokenizer=tokenizer, runner="beam", overwrite=True)
    assert (tmp_path / "beam" / "index.json").read_bytes() == (tmp_path / "local" / "index.json").read_bytes()


def test_failed_pipeline_leaves_no_index_and_keeps_the_old_directory(mixed, both, tmp_path, monkeypatch):
    from tokendata import data_beam
    root, _ = mixed
    old = {p.name: p.read_bytes() for p in both[1].iterdir()}
    out = tmp_path / "out"
    out.mkdir()
    for name, content in old.items():
        (out / name).write_bytes(content)
    real, written = data_beam.write_shard, []

    def crash_after_two(task, **kw):
        if len(written) == 2:
            raise OSError("disk full")
        written.append(real(task, **kw))
        return written[-1]
    monkeypatch.setattr(data_beam, "write_shard", crash_after_two)
    with pytest.raises(data.DataError, match="beam pipeline failed: .*disk full"):
        prep([root / "c"], out, runner="beam", overwrite=True, tokenizer=str(out / "tokenizer.json"))
    assert len(written) == 2  # shards were written, yet no index names them: the old directory is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old


def test_cli_options(mixed, both, tmp_path):
    root, _ = mixed
    args = ["--input", str(root / "c"), "--out", "out", "--tokenizer", str(both[0] / "tokenizer.json")]
    assert_one_line_error(run_cli(*args, "--beam-option", "runner=DirectRunner", cwd=tmp_path), "--runner beam")
    assert_one_line_error(run_cli(*args, "--runner", "beam", "--beam-option", "runner", cwd=tmp_path), "KEY=VALUE")
    assert_one_line_error(run_cli(*args, "--runner", "beam", "--beam-option", "runner=NoSuchRunner",
                                  cwd=tmp_path), "NoSuchRunner")
    assert_one_line_error(run_cli("--runner", "beam", "--input", str(root / "c"), "--out", str(both[0]),
                                  cwd=tmp_path), "exists; pass --overwrite")
    assert list(tmp_path.iterdir()) == []
    result = run_cli(*args, "--val-fraction", "0.3", "--shard-tokens", SHARD_TOKENS, "--runner", "beam",
                     "--beam-option", "runner=DirectRunner", "--beam-option", "direct_num_workers=1", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert f"{both[3]['documents']} documents" in result.stdout
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_stream(tmp_path / "out", split), split_stream(both[0], split))


def test_without_apache_beam_the_default_runner_still_works(mixed, tmp_path, monkeypatch):
    import sys
    root, _ = mixed
    monkeypatch.setitem(sys.modules, "apache_beam", None)  # as if not installed
    import tokendata
    monkeypatch.delitem(sys.modules, "tokendata.data_beam", raising=False)  # imported again, as if for the first time
    monkeypatch.delattr(tokendata, "data_beam", raising=False)
    with pytest.raises(data.DataError, match="--runner beam needs apache-beam.*pip install apache-beam"):
        prep([root / "c"], tmp_path / "beam", runner="beam")
    assert prep([root / "c"], tmp_path / "local", val_fraction=0.0)["documents"] == len(mixed[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]
