"""Tests of data.py: preparation round trip, every input format, the loader's determinism and resume,
process slices, evaluation windows, each kind of bad input, and damaged prepared data (what the loaders
stop on, what `--verify` reports, and train.py's one line). Each test writes its own corpus."""
import collections
import gc
import gzip
import itertools
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import data
import train
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture: a prepared directory train.py runs on)
from tokendata import loader, permutation, shard_writer, shards

DATA_PY = pathlib.Path(__file__).resolve().parent / "data.py"
WORDS = ["the", "data", "loader", "token", "shard", "résumé", "naïve", "über", "日本語", "✓", "def", "return",
         "\n", "    ", "x = 1", "(", ")", ":", "π ≈ 3.14159", "\t", "{}", "emoji 🐍"]


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, size=rng.integers(5, 120))) for i in range(n)]


def write_text_files(directory: pathlib.Path, docs: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (directory / f"{i:04d}.txt").write_text(doc, encoding="utf-8")


def split_stream(directory: pathlib.Path, split: str) -> np.ndarray:
    """A split's tokens read with plain numpy: its shard files concatenated in index order."""
    index = json.loads((directory / "index.json").read_text())
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    parts = [np.fromfile(directory / s["file"], dtype=dtype) for s in index["splits"][split]["shards"]]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def decode_documents(directory: pathlib.Path, split: str) -> list[str]:
    """Cuts the stream after each end-of-text token and decodes each piece."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eot = tokenizer.token_to_id("<|endoftext|>")
    stream = split_stream(directory, split)
    assert len(stream) == 0 or stream[-1] == eot  # every document, the last included, ends with end-of-text
    ends = np.flatnonzero(stream == eot)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(stream[a:b].tolist(), skip_special_tokens=False) for a, b in zip(starts, ends)]


def prep(inputs, out, **kw):
    kw = {"vocab_size": 300, "val_fraction": 0.25, "workers": 2, "progress": False, **kw}
    return data.prepare([str(i) for i in inputs], out, **kw)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A small directory with many shards, so windows cross shard boundaries."""
    root = tmp_path_factory.mktemp("prepared")
    docs = make_docs(60)
    write_text_files(root / "corpus", docs)
    prep([root / "corpus" / "*.txt"], root / "out", shard_tokens=257)
    return root / "out", docs


def shard_path(directory: pathlib.Path, split: str, number: int, key: str = "shards") -> pathlib.Path:
    """The file of a split's shard `number` (key "mask_shards": its loss-mask shard), from index.json."""
    index = json.loads((directory / "index.json").read_text())
    return directory / index["splits"][split][key][number]["file"]


def overwrite_token(shard: pathlib.Path, offset: int, value: int, dtype: str = "<u2") -> None:
    """Overwrites token `offset` of a shard in place, as flipped bits on disk would: its size stays."""
    with open(shard, "r+b") as f:
        f.seek(offset * np.dtype(dtype).itemsize)
        f.write(np.array([value], dtype).tobytes())


def run_cli(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DATA_PY), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0]


# ------------------------------------------------------------------------------------------------
# Preparation

def test_round_trip_and_index(prepared):
    out, docs = prepared
    train, val = decode_documents(out, "train"), decode_documents(out, "val")
    # together exactly the documents, each split keeping the corpus order
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d in set(train)] and val == [d for d in docs if d in set(val)]
    assert 0 < len(val) < len(docs) // 2

    index = shards.open_data(out).index
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert index["eot_id"] == tokenizer.token_to_id("<|endoftext|>")
    assert index["vocab_size"] == tokenizer.get_vocab_size() <= 300
    assert index["dtype"] == "uint16"
    for split, decoded in (("train", train), ("val", val)):
        info, stream = index["splits"][split], split_stream(out, split)
        assert info["tokens"] == len(stream) == sum(s["tokens"] for s in info["shards"])
        assert info["documents"] == len(decoded) == sum(s["documents"] for s in info["shards"])
        assert all(s["tokens"] <= 257 for s in info["shards"])
    assert len(index["splits"]["train"]["shards"]) > 3
    # corpus statistics, recomputed from the shards
    counts = np.unique(split_stream(out, "train"), return_counts=True)[1]
    p = counts / counts.sum()
    assert index["unigram_entropy"] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-9)
    total_bytes = sum(len(d.encode()) for d in docs)
    assert index["bytes_per_token"] == pytest.approx(total_bytes / (len(split_stream(out, "train"))
                                                                    + len(split_stream(out, "val"))))


def test_split_is_deterministic_and_given_tokenizer_is_kept(prepared, tmp_path):
    out, docs = prepared
    write_text_files(tmp_path / "corpus", docs)
    again = prep([tmp_path / "corpus" / "*.txt"], tmp_path / "again", tokenizer=str(out / "tokenizer.json"))
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    assert again["splits"]["val"]["documents"] == shards.open_data(out).index["splits"]["val"]["documents"]
    for split in ("train", "val"):  # same tokenizer, same documents held out: the same streams
        np.testing.assert_array_equal(split_stream(tmp_path / "again", split), split_stream(out, split))


def _write_format(fmt: str, path: pathlib.Path, docs: list[str]) -> str:
    records = [{"id": i, "body": d} for i, d in enumerate(docs)]
    if fmt in ("jsonl", "jsonl.gz", "jsonl.zst"):
        payload = "".join(json.dumps(r) + "\n" for r in records).encode()
        file = path / f"part.{fmt}"
        if fmt == "jsonl.gz":
            payload = gzip.compress(payload)
        elif fmt == "jsonl.zst":
            payload = pytest.importorskip("zstandard").ZstdCompressor().compress(payload)
        file.write_bytes(payload)
        return str(file)
    if fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"id": [r["id"] for r in records], "body": docs}), path / "part.parquet",
                       row_group_size=7)
        return str(path / "part.parquet")
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_record_formats_round_trip(tmp_path, fmt):
    docs = make_docs(30, seed=1)
    pattern = _write_format(fmt, tmp_path, docs)
    index = prep([pattern], tmp_path / "out", text_field="body", val_fraction=0.0)
    assert index["splits"]["val"]["tokens"] == 0
    assert decode_documents(tmp_path / "out", "train") == docs


def test_huggingface_source_through_datasets(tmp_path, monkeypatch):
    """hf:NAME/CONFIG:SPLIT goes to datasets.load_dataset (replaced here by a stand-in: tests are offline)."""
    import types
    docs, calls = make_docs(12, seed=2), []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter([{"text": d} for d in docs])
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    prep(["hf:org/corpus/cfg:train"], tmp_path / "out", val_fraction=0.0)
    assert calls == [("org/corpus", "cfg", "train", True)] * 2  # tokenizer training, then encoding
    assert decode_documents(tmp_path / "out", "train") == docs
    prep(["hf:corpus:validation"], tmp_path / "plain", val_fraction=0.0)  # a name without org or config
    assert calls[-1] == ("corpus", None, "validation", True)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: one clear error
    with pytest.raises(data.DataError, match="datasets"):
        prep(["hf:corpus:train"], tmp_path / "other")


def test_huggingface_source_offline_fails_at_once_in_one_line(tmp_path, offline_user):
    """Offline with an empty cache, an hf: input stops with one line naming the dataset, the cache and
    the Hub that did not answer: no warning of the Hugging Face libraries' retries, no traceback."""
    result = subprocess.run([sys.executable, str(DATA_PY), "--input", "hf:org/corpus:train", "--out", "out",
                             "--vocab-size", "300"], cwd=tmp_path, env=offline_user, capture_output=True, text=True,
                            timeout=120)
    assert_one_line_error(result)
    cache, hub = tmp_path / "hf" / "datasets", offline_user["HF_ENDPOINT"]
    assert result.stderr.startswith(f"error: hf:org/corpus:train: org/corpus is not in the datasets cache {cache} "
                                    f"and the Hugging Face Hub at {hub} does not answer (")
    assert not (tmp_path / "out").exists()


def test_huggingface_source_offline_reads_the_local_cache(tmp_path, offline_user):
    """Offline, an hf: dataset in the local cache is prepared at once, without retries. The cache is what
    datasets keeps of a Hub dataset loaded once, <cache>/<org>___<name>/<config>/<version>/<hash>/ with
    <name>-<split>.arrow, made here by datasets from local JSON Lines."""
    import datasets
    docs = make_docs(20, seed=4)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    cache = tmp_path / "hf" / "datasets"
    datasets.load_dataset("json", data_files={"train": str(tmp_path / "docs.jsonl")}, cache_dir=str(cache))
    [built] = [p for p in (cache / "json").glob("*/*/*") if p.is_dir()]
    filed = cache / "org___corpus" / "default" / built.parent.name / built.name
    shutil.copytree(built, filed)
    for arrow in filed.glob("json-*.arrow"):
        arrow.rename(filed / arrow.name.replace("json-", "corpus-", 1))
    result = subprocess.run([sys.executable, str(DATA_PY), "--input", "hf:org/corpus:train", "--out", "out",
                             "--vocab-size", "300", "--val-fraction", "0"], cwd=tmp_path, env=offline_user,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Retry" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert decode_documents(tmp_path / "out", "train") == docs


def test_default_corpus_selection_on_a_fake_stdlib(tmp_path):
    root = tmp_path / "lib"
    keep = ["a.py", "email/b.py", "pkg/sub/c.py"]
    drop = ["test/t.py", "pkg/tests/u.py", "idlelib/i.py", "lib2to3/l.py", "site-packages/s.py", "notes.txt"]
    for name in keep + drop + ["latin1.py"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name}\nx = 1\n")
    (root / "latin1.py").write_bytes("s = 'caf\u00e9'\n".encode("latin-1"))
    assert data.default_corpus_files(root) == [root / k for k in keep]

    for i in range(40):  # enough files for a validation split
        (root / f"mod{i:02d}.py").write_text("\n".join(make_docs(3, seed=i)))
    index = data.prepare_default(tmp_path / "out", vocab_size=300, stdlib_dir=root, progress=False)
    val = decode_documents(tmp_path / "out", "val")
    assert index["documents"] == 43 and 1 <= len(val) < 10
    data.prepare_default(tmp_path / "again", vocab_size=300, stdlib_dir=root, progress=False)
    assert decode_documents(tmp_path / "again", "val") == val  # the same files held out


def blake2b_rank(name: str) -> int:
    """A document's place in the held-out order, written out: blake2b-64 of its name, little-endian."""
    import hashlib
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def test_a_small_corpus_always_gets_a_validation_document(tmp_path):
    docs = make_docs(4, seed=8)
    write_text_files(tmp_path / "c", docs)
    names = [f"{i:04d}.txt" for i in range(4)]
    ranks = sorted((blake2b_rank(n), i) for i, n in enumerate(names))
    first = ranks[0][1]  # the document a growing fraction holds out first
    # a fraction below every hash holds out none by itself: the first-ranked document is held out
    none_below = ranks[0][0] / 2**64 / 2
    index = prep([tmp_path / "c"], tmp_path / "small", val_fraction=none_below)
    assert decode_documents(tmp_path / "small", "val") == [docs[first]] and index["val_extra"] == names[first]
    assert decode_documents(tmp_path / "small", "train") == [d for i, d in enumerate(docs) if i != first]
    # ... and unseen by the tokenizer: the same BPE as one trained on the other three documents alone
    write_text_files(tmp_path / "three", [d for i, d in enumerate(docs) if i != first])
    prep([tmp_path / "three"], tmp_path / "three-out", val_fraction=0.0)
    assert (tmp_path / "small" / "tokenizer.json").read_bytes() == \
        (tmp_path / "three-out" / "tokenizer.json").read_bytes()
    # a fraction that holds out a document by itself keeps exactly the split it makes: here the first two
    two = (ranks[1][0] + 1) / 2**64
    index = prep([tmp_path / "c"], tmp_path / "two", val_fraction=two)
    assert decode_documents(tmp_path / "two", "val") == [docs[i] for i in sorted(i for _, i in ranks[:2])]
    assert index["val_extra"] is None

    # one document cannot be split: one line naming --val-fraction, nothing written; 0 trains on it whole
    write_text_files(tmp_path / "one", docs[:1])
    result = run_cli("--input", "one", "--out", "out", "--vocab-size", "300", "--val-fraction", "0.1", cwd=tmp_path)
    assert_one_line_error(result, "one document", "--val-fraction")
    assert not (tmp_path / "out").exists()
    assert prep([tmp_path / "one"], tmp_path / "whole", val_fraction=0.0)["documents"] == 1


def test_cli_prepares_and_summarises(tmp_path):
    write_text_files(tmp_path / "corpus", make_docs(20, seed=3))
    result = run_cli("--input", "corpus/*.txt", "--out", "out", "--vocab-size", "300", "--workers", "1",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "20 documents" in result.stdout and "unigram entropy" in result.stdout
    assert shards.open_data(tmp_path / "out").index["documents"] == 20


@pytest.mark.parametrize("kind", ["text", "prompt_completion"])
def test_a_bpe_short_of_the_requested_vocabulary_says_so_and_records_its_own_size(tmp_path, capsys, kind):
    """A corpus of a few dozen distinct words cannot fill 16384 tokens: the BPE stops when every word is
    one token. The last line says so, and the index (which loader.py and train.py read) holds the real size."""
    if kind == "text":
        write_text_files(tmp_path / "corpus", make_docs(20, seed=3))
        argv = ["--input", str(tmp_path / "corpus"), "--val-fraction", "0.25"]
    else:
        docs = make_docs(40, seed=3)
        (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"in_text": a, "out_text": b}) + "\n"
                                                      for a, b in zip(docs[::2], docs[1::2])))
        argv = ["--format", "prompt_completion", "--input", str(tmp_path / "pairs.jsonl"), "--seq-len", "512"]
    assert data.cli([*argv, "--out", str(tmp_path / "out"), "--vocab-size", "16384", "--workers", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    actual = tokenizer.get_vocab_size()
    assert 258 < actual < 16384
    assert out[-1] == (f"note: vocab {actual:,} instead of the 16,384 requested: the corpus is too small for more "
                       f"BPE merges (every word in it is already one token); the data directory records "
                       f"{actual:,}, which train.py sizes the model by")
    index = shards.open_data(tmp_path / "out").index
    assert index["vocab_size"] == actual and index["vocab_size_requested"] == 16384
    if kind == "text":
        # the reason given holds: every word of the documents the BPE learnt from is one token
        for doc in decode_documents(tmp_path / "out", "train"):
            words = tokenizer.pre_tokenizer.pre_tokenize_str(doc)
            assert len(tokenizer.encode(doc).ids) == len(words), doc
    # a vocabulary filled as asked: no such line
    assert data.cli([*argv, "--out", str(tmp_path / "full"), "--vocab-size", "260", "--workers", "1"]) == 0
    assert "note: vocab" not in capsys.readouterr().out
    assert shards.open_data(tmp_path / "full").index["vocab_size"] == 260


# ------------------------------------------------------------------------------------------------
# The window permutation and the loader

@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_permutation_is_a_bijection_that_changes_with_the_epoch(n):
    first = permutation.permute(np.arange(n), n, seed=7, epoch=0)
    assert sorted(first.tolist()) == list(range(n))
    assert sorted(permutation.permute(np.arange(n), n, seed=7, epoch=1).tolist()) == list(range(n))
    if n >= 64:
        assert not np.array_equal(first, permutation.permute(np.arange(n), n, seed=7, epoch=1))
        assert not np.array_equal(first, permutation.permute(np.arange(n), n, seed=8, epoch=0))
        assert not np.array_equal(first, np.arange(n))


@pytest.mark.parametrize("n", [1, 3, 1024, 4097])
def test_permutation_of_many_epochs_at_once_is_each_epochs_own(n):
    """Positions of several epochs in one call (each element with its epoch's keys) give what each epoch's
    own call gives, element by element."""
    rng = np.random.default_rng(n)
    positions, epochs = rng.integers(0, n, 3000), rng.integers(0, 6, 3000)
    together = permutation.permute(positions, n, seed=11, epoch=epochs)
    each = [int(permutation.permute(np.array([p]), n, seed=11, epoch=int(e))[0]) for p, e in zip(positions, epochs)]
    assert together.tolist() == each


def test_an_epoch_visits_every_window_once(prepared):
    out, _ = prepared
    seq_len, batch = 16, 6
    stream = split_stream(out, "train")
    n = (len(stream) - 1) // seq_len
    expected = sorted(stream[i * seq_len:i * seq_len + seq_len + 1].tobytes() for i in range(n))
    train_loader = loader.TextLoader(shards.open_data(out), "train", seq_len, batch, seed=3)
    assert train_loader.num_windows == n and train_loader.local_batch_size == batch
    steps = -(-2 * n // batch)  # two epochs
    rows = np.concatenate([train_loader.get_batch(s) for s in range(steps)]).astype(np.int64)
    assert rows.shape[1] == seq_len + 1
    assert sorted(r.tobytes() for r in rows[:n]) == expected
    assert sorted(r.tobytes() for r in rows[n:2 * n]) == expected
    assert not np.array_equal(rows[:n], rows[n:2 * n])  # reshuffled each epoch


def test_rows_read_by_gather_are_the_streams_slices(prepared, tmp_path):
    """Stream.read_rows: the rows inside one shard gathered together, those across a shard's end piece by
    piece, a one-shard stream in one gather: each row the concatenated shards' slice."""
    out, docs = prepared
    one = tmp_path / "one"
    write_text_files(tmp_path / "corpus", docs[:20])
    prep([tmp_path / "corpus" / "*.txt"], one, shard_tokens=10**6)
    for directory, shard_count in [(out, None), (one, 1)]:
        data = shards.open_data(directory)
        stream, expected = loader.Stream(data, "train"), split_stream(directory, "train")
        assert len(stream.shards) > 3 if shard_count is None else len(stream.shards) == shard_count
        n = 40
        starts = np.random.default_rng(0).integers(0, len(expected) - n, 300)
        ends = [e - 7 for e in stream.starts[1:-1] if e - 7 + n <= len(expected)]
        starts[:len(ends)] = ends  # across a shard's end
        rows = stream.read_rows(starts, n)
        assert rows.dtype == np.int32 and rows.shape == (300, n)
        np.testing.assert_array_equal(rows, np.stack([expected[s:s + n] for s in starts]))


def test_fresh_loaders_agree_and_seeds_differ(prepared):
    out, _ = prepared
    a, b = loader.TextLoader(shards.open_data(out), "train", 32, 4, seed=1), loader.TextLoader(shards.open_data(out), "train", 32, 4, seed=1)
    for step in (0, 1, 17, 10_000):
        batch = a.get_batch(step)
        assert batch.dtype == np.int32 and batch.shape == (4, 33)
        np.testing.assert_array_equal(batch, b.get_batch(step))
    assert not np.array_equal(a.get_batch(0), loader.TextLoader(shards.open_data(out), "train", 32, 4, seed=2).get_batch(0))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_at_step_s_equals_uninterrupted_iteration(prepared, prefetch):
    out, _ = prepared
    straight = list(itertools.islice(loader.TextLoader(shards.open_data(out), "train", 16, 4, seed=5).iterate(0, prefetch), 12))
    for s in (0, 5, 11):
        resumed = loader.TextLoader(shards.open_data(out), "train", 16, 4, seed=5).iterate(start_step=s, prefetch=prefetch)
        np.testing.assert_array_equal(next(resumed), straight[s])
        np.testing.assert_array_equal(next(resumed), straight[s + 1]) if s + 1 < 12 else None
        resumed.close()


@pytest.mark.parametrize("processes", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(prepared, processes):
    out, _ = prepared
    whole = loader.TextLoader(shards.open_data(out), "train", 8, 8, seed=9)
    parts = [loader.TextLoader(shards.open_data(out), "train", 8, 8, seed=9, process_index=p, process_count=processes)
             for p in range(processes)]
    assert all(p.local_batch_size == 8 // processes for p in parts)
    for step in (0, 3, 250):
        np.testing.assert_array_equal(np.concatenate([p.get_batch(step) for p in parts]), whole.get_batch(step))


def prefetchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "data-prefetch" and t.is_alive()]


def test_prefetch_thread_stops_when_the_consumer_stops(prepared):
    out, _ = prepared
    train_loader = loader.TextLoader(shards.open_data(out), "train", 16, 4)
    batches = train_loader.iterate(prefetch=3)
    next(batches)
    assert len(prefetchers()) == 1
    batches.close()
    assert prefetchers() == []
    batches = train_loader.iterate(prefetch=3)
    next(batches)
    del batches
    gc.collect()
    assert prefetchers() == []


@pytest.mark.parametrize("seq_len", [7, 64])
def test_eval_batches_cover_the_split_in_order(prepared, seq_len):
    out, _ = prepared
    stream = split_stream(out, "val")
    n = (len(stream) - 1) // seq_len
    expected = np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
    batches = list(loader.eval_windows(shards.open_data(out), "val", seq_len, 5))
    assert all(b.dtype == np.int32 and len(b) == 5 for b in batches[:-1]) and 1 <= len(batches[-1]) <= 5
    np.testing.assert_array_equal(np.concatenate(batches), expected)
    # a sample of 3 stands for the whole split: windows 0, n/3 and 2n/3 (rounded down), not the first 3
    limited = np.concatenate(list(loader.eval_windows(shards.open_data(out), "val", seq_len, 5, max_windows=3)))
    assert n > 6
    np.testing.assert_array_equal(limited, expected[[0, n // 3, 2 * n // 3]])
    np.testing.assert_array_equal(np.concatenate(list(loader.eval_windows(shards.open_data(out), "val", seq_len, 5, max_windows=n))),
                                  expected)


# ------------------------------------------------------------------------------------------------
# Bad input: a DataError naming the problem, and from the CLI one `error:` line and exit status 2

def test_no_matching_file(tmp_path):
    with pytest.raises(data.DataError, match="no file matches"):
        prep([tmp_path / "nothing*.txt"], tmp_path / "out")
    assert_one_line_error(run_cli("--input", "nothing*.txt", "--out", "out", cwd=tmp_path), "nothing*.txt")
    assert not (tmp_path / "out").exists()


def test_empty_corpus(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("")
    with pytest.raises(data.DataError, match="empty corpus"):
        prep([tmp_path / "c"], tmp_path / "out")
    assert_one_line_error(run_cli("--input", "c", "--out", "out", cwd=tmp_path), "empty corpus")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "c"]


def test_undecodable_file_is_skipped_or_fatal_with_strict(tmp_path):
    write_text_files(tmp_path / "c", make_docs(10, seed=4))
    (tmp_path / "c" / "bad.txt").write_bytes(b"caf\xe9 latin-1")
    (tmp_path / "c" / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    (tmp_path / "c" / "broken.jsonl.zst").write_bytes(b"not zstd at all")
    # a good record, then broken JSON, a number, and a lone surrogate (valid JSON, but no tokenizer takes it)
    (tmp_path / "c" / "lines.jsonl").write_text('{"text": "a good record"}\n{"text": tru\n{"text": 5}\n'
                                                '{"text": "x \\ud800 y"}\n')
    index = prep([tmp_path / "c"], tmp_path / "out", val_fraction=0.0)
    assert index["skipped_files"] == 3 and index["skipped_records"] == 3 and index["documents"] == 11
    c = tmp_path / "c"  # each named in input order (a directory is read in sorted order), records by line
    assert [s["input"] for s in index["skipped_inputs"]] == [
        str(c / "bad.txt"), str(c / "broken.jsonl.gz"), str(c / "broken.jsonl.zst"), f"{c / 'lines.jsonl'}:2",
        f"{c / 'lines.jsonl'}:3", f"{c / 'lines.jsonl'}:4"]
    assert "UnicodeDecodeError" in index["skipped_inputs"][0]["reason"]
    assert index["skipped_inputs"][4]["reason"] == "not a text record (5)"
    result = run_cli("--input", "c", "--out", "cli", "--vocab-size", "300", "--val-fraction", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ", 6 unreadable or invalid inputs skipped (c/bad.txt, c/broken.jsonl.gz, c/broken.jsonl.zst, " \
           "c/lines.jsonl:2, c/lines.jsonl:3 and 1 more; listed in cli/index.json), " in result.stdout
    with pytest.raises(data.DataError, match="bad.txt"):
        prep([tmp_path / "c"], tmp_path / "strict", strict=True)
    assert_one_line_error(run_cli("--input", "c", "--out", "strict", "--strict", "--vocab-size", "300",
                                  cwd=tmp_path), "bad.txt")
    assert not (tmp_path / "strict").exists()
    for size in ("0", "257"):  # 0 is no request for the default: one line, nothing made
        assert data.cli(["--input", str(c), "--out", str(tmp_path / "zero"), "--vocab-size", size]) == 2
        assert not (tmp_path / "zero").exists()


def test_utf16_nul_bytes_and_whitespace_only_documents_are_no_text(tmp_path):
    """A text file in UTF-16, with a byte-order mark or without (where NUL bytes fill every other
    position, valid UTF-8 that would be tokenized), and one with NUL bytes among its text, are skipped and
    named alike, each with its reason (or stop the run with --strict); a file or record that is only
    whitespace is no document: left out, and counted where skips are reported."""
    docs = make_docs(8, seed=21)
    write_text_files(tmp_path / "c", docs)
    c = tmp_path / "c"
    text = "a document in another encoding\n"
    (c / "u16bom.txt").write_bytes(text.encode("utf-16"))  # with its byte-order mark
    (c / "u16le.txt").write_bytes(text.encode("utf-16-le"))  # none: "a\0 \0d\0..."
    (c / "u16be.txt").write_bytes(text.encode("utf-16-be"))
    (c / "nul.txt").write_bytes(b"plain text with a stray \0 byte inside")
    (c / "space.txt").write_text(" \n\t \r\n  ")
    (c / "void.txt").write_text("")
    (c / "r.jsonl").write_text('{"text": "a real record"}\n{"text": "  \\n  "}\n')
    index = prep([c], tmp_path / "out", val_fraction=0.0)
    reasons = {pathlib.Path(s["input"]).name: s["reason"] for s in index["skipped_inputs"]}
    assert sorted(reasons) == ["nul.txt", "u16be.txt", "u16bom.txt", "u16le.txt"]
    assert reasons["u16bom.txt"].startswith("UTF-16 text (byte-order mark FF FE), not UTF-8")
    assert reasons["u16le.txt"].startswith("UTF-16LE text without a byte-order mark")
    assert reasons["u16be.txt"].startswith("UTF-16BE text without a byte-order mark")
    assert reasons["nul.txt"].startswith(f"1 NUL byte, the first at byte {len(b'plain text with a stray ')}")
    assert (index["skipped_files"], index["skipped_records"], index["skipped_empty"]) == (4, 0, 3)
    # what is left: the documents, and the one real record, each as written (no NUL byte tokenized)
    assert sorted(decode_documents(tmp_path / "out", "train")) == sorted(docs + ["a real record"])
    result = run_cli("--input", "c", "--out", "cli", "--vocab-size", "300", "--val-fraction", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ", 4 unreadable or invalid inputs skipped (c/nul.txt, c/u16be.txt, c/u16bom.txt, c/u16le.txt; listed " \
           "in cli/index.json), 3 empty or whitespace-only documents skipped, " in result.stdout
    assert_one_line_error(run_cli("--input", "c/u16le.txt", "--out", "strict", "--strict", cwd=tmp_path),
                          "u16le.txt: UTF-16LE text without a byte-order mark", "--strict")
    # a corpus of whitespace alone is empty, and says why
    assert_one_line_error(run_cli("--input", "c/space.txt", "--input", "c/void.txt", "--out", "none", cwd=tmp_path),
                          "empty corpus: no text in 2 input file(s), 2 empty or only whitespace")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "cli", "out"]


def test_missing_text_field(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"content": "hello"}\n')
    with pytest.raises(data.DataError, match="no field 'text'.*content"):
        prep([tmp_path / "a.jsonl"], tmp_path / "out")


def test_token_id_that_does_not_fit_the_dtype(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "<|endoftext|>": 1, "big": 70_000}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("big big small")
    monkeypatch.setattr(shards, "dtype_for", lambda vocab_size: "uint16")  # as if the dtype were chosen wrongly
    with pytest.raises(data.DataError, match="token id 70000 does not fit.*uint16"):
        prep([tmp_path / "a.txt"], tmp_path / "out", tokenizer=str(tmp_path / "tok.json"))
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()  # with the right choice the id fits: a uint32 directory
    assert prep([tmp_path / "a.txt"], tmp_path / "out", tokenizer=str(tmp_path / "tok.json"),
                val_fraction=0.0)["dtype"] == "uint32"
    assert split_stream(tmp_path / "out", "train").tolist() == [70_000, 70_000, 0, 1]
    # a damaged uint32 id past 2^31 is a negative int32 in a batch: the vocabulary check still catches it
    overwrite_token(tmp_path / "out" / "train_00000.bin", 1, 2**32 - 16, "<u4")
    with pytest.raises(data.DataError, match=r"train_00000\.bin: token 1 \(at byte 4\) is id 4294967280, outside"):
        loader.TextLoader(shards.open_data(tmp_path / "out"), "train", 1, 3).get_batch(0)  # the batch holds all three windows


def test_bad_tokenizer_file(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "tok.json").write_text("{not json")
    for path, words in ((tmp_path / "tok.json", "cannot load tokenizer"), (tmp_path / "missing.json", "tokenizer"),
                        (tmp_path, "tokenizer")):  # a directory without a tokenizer.json in it
        with pytest.raises(data.DataError, match=f"{words} {path}( not found|:)"):
            prep([tmp_path / "a.txt"], tmp_path / "out", tokenizer=str(path))


def test_missing_corrupt_or_mismatched_index(prepared, tmp_path):
    import shutil
    out = tmp_path / "d"
    shutil.copytree(prepared[0], out)
    with pytest.raises(data.DataError, match="not found"):
        shards.open_data(tmp_path).index
    shard = out / json.loads((out / "index.json").read_text())["splits"]["train"]["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])  # one token short
    with pytest.raises(data.DataError, match=f"{shard.name}: expected 514 bytes .*found 512 bytes"):
        loader.TextLoader(shards.open_data(out), "train", 8, 2)
    shard.write_bytes(shard.read_bytes() + b"\0\0\0\0")  # one token long
    with pytest.raises(data.DataError, match=rf"{shard.name}: expected 514 bytes \(257 uint16 tokens\), found 516"):
        loader.eval_windows(shards.open_data(out), "val", 8, 2).__next__()
    shard.unlink()
    with pytest.raises(data.DataError, match=f"{shard.name}.*missing"):
        shards.open_data(out).index
    shutil.rmtree(out)
    shutil.copytree(prepared[0], out)
    with open(out / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(data.DataError, match="sha256"):
        shards.open_data(out).index
    (out / "index.json").write_text('{"format_version": 1, "dtype": ')
    with pytest.raises(data.DataError, match="corrupt"):
        loader.eval_windows(shards.open_data(out), "val", 8, 2).__next__()
    index = json.loads((prepared[0] / "index.json").read_text())
    index["splits"]["train"]["tokens"] = 1e400  # JSON's number past any float: infinity
    (out / "index.json").write_text(json.dumps(index).replace("Infinity", "1e400"))
    with pytest.raises(data.DataError, match=r"index.json is corrupt \(OverflowError"):
        shards.open_data(out).index
    with pytest.raises(data.DataError, match="no split 'test'"):
        loader.TextLoader(shards.open_data(prepared[0]), "test", 8, 2)


def test_window_longer_than_the_split_and_bad_batch_shapes(prepared):
    out, _ = prepared
    tokens = shards.open_data(out).index["splits"]["val"]["tokens"]
    with pytest.raises(data.DataError, match=f"window of {tokens + 1} tokens is longer than the split") as err:
        loader.TextLoader(shards.open_data(out), "val", tokens, 2)
    # a fix that works: a larger --val-fraction cannot help a corpus of two files, a shorter context can
    assert str(err.value).endswith("train with a shorter training.seq_len, or prepare the data with more documents "
                                   "or a larger --val-fraction")
    with pytest.raises(data.DataError, match="longer than the split"):
        next(loader.eval_windows(shards.open_data(out), "val", tokens, 2))
    loader.TextLoader(shards.open_data(out), "val", tokens - 1, 2)  # exactly one window
    with pytest.raises(data.DataError, match="batch size 6 does not divide by 4"):
        loader.TextLoader(shards.open_data(out), "train", 8, 6, process_index=0, process_count=4)


def test_existing_directory_needs_overwrite_and_inputs_are_never_touched(tmp_path):
    write_text_files(tmp_path / "c", make_docs(8, seed=5))
    before = {p: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    prep([tmp_path / "c"], tmp_path / "out")
    with pytest.raises(data.DataError, match="exists; pass --overwrite"):
        prep([tmp_path / "c"], tmp_path / "out")
    (tmp_path / "c" / "more.txt").write_text("one more document")
    assert prep([tmp_path / "c"], tmp_path / "out", overwrite=True)["documents"] == 9
    with pytest.raises(data.DataError, match="lies inside the output directory"):
        prep([tmp_path / "out" / "tokenizer.json"], tmp_path / "out", overwrite=True)
    assert all(p.read_bytes() == b for p, b in before.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "out"]


def test_interrupted_prepare_leaves_nothing_and_a_rerun_completes(tmp_path, monkeypatch):
    write_text_files(tmp_path / "c", make_docs(30, seed=6))
    real_write, calls = shard_writer.ShardWriter.write, []

    def failing_write(self, tokens, ends):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C midway
        real_write(self, tokens, ends)
    monkeypatch.setattr(shard_writer.ShardWriter, "write", failing_write)
    monkeypatch.setattr(shard_writer, "CHUNK_BYTES", 500)  # many chunks, so the failure lands midway
    with pytest.raises(KeyboardInterrupt):
        prep([tmp_path / "c"], tmp_path / "out", shard_tokens=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]

    # a run killed outright leaves its temporary directory, with a partial index; the rerun removes it
    monkeypatch.undo()
    leftover = tmp_path / "out.tmp-999999999"
    leftover.mkdir()
    (leftover / "index.json").write_text('{"format_version": 1, "splits": {"train": {"shards": [{"file"')
    prep([tmp_path / "c"], tmp_path / "out", shard_tokens=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "out"]
    assert shards.open_data(tmp_path / "out").index["documents"] == 30
    assert sorted(decode_documents(tmp_path / "out", "train") + decode_documents(tmp_path / "out", "val")) \
        == sorted(make_docs(30, seed=6))


def test_killed_prepare_is_cleaned_up_by_the_next_run(tmp_path):
    """A real process, killed outright (no clean-up possible) while it writes, then run again."""
    import os
    import signal
    import time
    rng = np.random.default_rng(7)
    (tmp_path / "c").mkdir()
    for i in range(16):  # about 1.5 MB: tokenizing it on one thread takes a good fraction of a second
        (tmp_path / "c" / f"{i}.txt").write_text(" ".join(rng.choice(WORDS, 30_000)))
    args = [sys.executable, str(DATA_PY), "--input", "c", "--out", "out", "--vocab-size", "300", "--workers", "1"]
    process = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = tmp_path / f"out.tmp-{process.pid}"
    deadline = time.monotonic() + 60
    while not (tmp / "tokenizer.json").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # the tokenizer is saved before the shards are written
    if process.poll() is not None:
        pytest.skip("the prepare finished before it could be killed")
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert tmp.is_dir() and not (tmp_path / "out").exists()
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "out"]
    assert shards.open_data(tmp_path / "out").index["documents"] == 16


def staging_window(argv, cwd, staging) -> float:
    """Runs the command argv to completion: seconds from the appearance of its staging directory
    (staging(pid), a path) to its renaming at the commit, i.e. how long it writes."""
    process = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not staging(process.pid).exists() and process.poll() is None:
        time.sleep(0.001)
    start = time.monotonic()
    while staging(process.pid).exists() and process.poll() is None:
        time.sleep(0.001)
    window = time.monotonic() - start
    assert process.wait(timeout=120) == 0
    return window


def kill_at_random_moments(argv, cwd, staging, window: float, kills: int, reset, check) -> collections.Counter:
    """Starts argv `kills` times, each after reset() and SIGKILLed at a random moment of its write (0 to
    1.2 `window` seconds, at least 0.06, after its staging directory appears); after each, check() asserts
    what must hold and says which output is there. Returns the outcomes counted: (killed or finished, what
    check() said)."""
    rng, outcomes = random.Random(0), collections.Counter()
    window = max(window, 0.05)  # a write of a few milliseconds: some kills land after it, in the old copy's removal
    for _ in range(kills):
        reset()
        process = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not staging(process.pid).exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 1.2 * window))
        finished = process.poll() is not None
        process.send_signal(signal.SIGKILL)
        process.wait()
        outcomes["finished" if finished else "killed", check()] += 1
    return outcomes


KILLED_AFTER_THE_OLD_MOVES_ASIDE = """
import os, runpy, signal, sys
from core import outputs
outputs.exchange = lambda a, b: False  # as where renameat2 is unavailable: the old moves aside, then the new in
out, real_rename = os.path.abspath(sys.argv[-1]), os.rename
def rename(a, b):
    real_rename(a, b)
    if os.path.abspath(a) == out:
        os.kill(os.getpid(), signal.SIGKILL)  # the worst moment: the old directory aside, the new one not in
os.rename = rename
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_overwrite_killed_at_random_moments_keeps_the_old_or_the_new_directory(tmp_path):
    """A real `data.py --overwrite`, killed outright (no clean-up possible) at random moments while it
    writes: each time the directory is the old one or the new one, whole (every file matches its
    sha256); never missing, never partial. Then once at the worst moment, where the system cannot swap
    two directories in one step: after the old one moved aside, before the new one moved in; the next
    run into it, even one that fails, first puts the complete new one into place. A rerun then completes
    and leaves nothing else behind."""
    write_text_files(tmp_path / "old", make_docs(8, seed=12))
    prep([tmp_path / "old"], tmp_path / "kept", val_fraction=0.2)
    rng = np.random.default_rng(13)
    (tmp_path / "new").mkdir()
    for i in range(12):  # about 400 kB: its write takes a few tenths of a second
        (tmp_path / "new" / f"{i}.txt").write_text(" ".join(rng.choice(WORDS, 8_000)))
    argv = [sys.executable, str(DATA_PY), "--input", "new", "--vocab-size", "300", "--workers", "1",
            "--val-fraction", "0.2", "--overwrite", "--out"]
    window = staging_window(argv + ["ref"], tmp_path, lambda pid: tmp_path / f"ref.tmp-{pid}")

    def check():
        problems, _ = shards.verify(tmp_path / "out")  # every file there, against its size and sha256
        assert problems == []
        index = json.loads((tmp_path / "out" / "index.json").read_text())
        assert (index["documents"], index["inputs"]) in [(8, [str(tmp_path / "old")]), (12, ["new"])]
        return "old" if index["documents"] == 8 else "new"

    def reset():  # the old directory in place again, and a trial's leftovers, if any, kept
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        shutil.copytree(tmp_path / "kept", tmp_path / "out")

    outcomes = kill_at_random_moments(argv + ["out"], tmp_path, lambda pid: tmp_path / f"out.tmp-{pid}", window,
                                      5, reset, check)
    print(f"write window {window:.2f}s, outcomes {dict(outcomes)}")
    assert sum(outcomes.values()) == 5

    reset()
    worst = subprocess.run([sys.executable, "-c", KILLED_AFTER_THE_OLD_MOVES_ASIDE, *argv[1:], "out"], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(DATA_PY.parent)}, capture_output=True, timeout=120)
    assert worst.returncode == -signal.SIGKILL and not (tmp_path / "out").exists()
    failing = run_cli("--input", "new", "--out", "out", "--overwrite", "--tokenizer", "missing.json", cwd=tmp_path)
    assert_one_line_error(failing, "missing.json")
    assert check() == "new"

    assert subprocess.run(argv + ["out"], cwd=tmp_path, capture_output=True, timeout=120).returncode == 0
    assert check() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "new", "old", "out", "ref"]
    assert json.loads((tmp_path / "out" / "index.json").read_text())["splits"] == \
        json.loads((tmp_path / "ref" / "index.json").read_text())["splits"]


STOPPED_WHILE_WRITING = """
import os, runpy, signal, sys
moment, sig = sys.argv.pop(1), signal.Signals[sys.argv.pop(1)]
from tokendata import shard_writer

def stop():
    os.kill(os.getpid(), sig)  # a real signal, its Python handler run at the next line of Python
    for _ in range(1000):
        pass

if moment == "writing":  # once the first shard's tokens are written into the staging directory
    write = shard_writer.ShardWriter.write
    def written(self, *args):
        write(self, *args)
        stop()
    shard_writer.ShardWriter.write = written
else:  # just after the new directory is renamed into place
    rename, out = os.rename, os.path.abspath(sys.argv[-1])
    def renamed(a, b):
        rename(a, b)
        if os.path.abspath(b) == out:
            stop()
    os.rename = renamed
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def stop_lines(sig: signal.Signals, out: str) -> dict:
    """What data.py says on stderr when `sig` stops it: before its directory is in place, and after."""
    return {"before": f"error: stopped by {sig.name}; nothing was written (--out {out} is as it was)\n",
            "after": f"stopped by {sig.name} after {out} was complete: it is written whole\n"}


@pytest.mark.parametrize("moment, sig", [("writing", signal.SIGTERM), ("writing", signal.SIGHUP),
                                         ("commit", signal.SIGTERM)])
def test_a_stop_signal_while_writing_is_one_line_and_leaves_no_staging(big_inputs, tmp_path, moment, sig):
    """A real SIGTERM or SIGHUP to a real `python data.py` while it writes its shards stops it as Ctrl-C
    does: one line, exit status 128 + N, the staging directory removed and nothing at --out; one that
    comes once the directory is in place lets it finish and says so after the summary."""
    argv = ["--input", str(big_inputs / "text"), "--workers", "1", "--tokenizer", str(big_inputs / "tokenizer.json"),
            "--out", "out"]
    done = subprocess.run([sys.executable, "-c", STOPPED_WHILE_WRITING, moment, sig.name, str(DATA_PY), *argv],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(DATA_PY.parent)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 128 + sig, done.stderr
    if moment == "writing":
        assert (done.stdout, done.stderr) == ("", stop_lines(sig, "out")["before"])
        assert list(tmp_path.iterdir()) == []
    else:
        assert done.stdout.startswith("6 documents, ") and done.stderr == stop_lines(sig, "out")["after"]
        assert shards.verify(tmp_path / "out")[0] == [] and list(tmp_path.iterdir()) == [tmp_path / "out"]


def test_a_stop_signal_from_outside_at_a_moment_of_the_write(big_inputs, tmp_path):
    """SIGTERM, then SIGHUP, sent by another process to `python data.py` once its staging directory holds
    the tokenizer (the documents being encoded, then written): each run ends with one line and 128 + N
    (or, where the signal came after the directory went into place, with it complete), never a staging
    directory left behind."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        out = tmp_path / sig.name
        argv = [sys.executable, str(DATA_PY), "--input", str(big_inputs / "text"), "--workers", "1",
                "--tokenizer", str(big_inputs / "tokenizer.json"), "--out", sig.name]
        process = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = tmp_path / f"{sig.name}.tmp-{process.pid}" / "tokenizer.json"
        deadline = time.monotonic() + 120
        while not first.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=120)
        print(sig.name, "after the commit" if out.exists() else "before the commit")
        if out.exists():  # the signal came once the directory was in place: it is complete
            assert stderr == stop_lines(sig, sig.name)["after"] and shards.verify(out)[0] == []
        else:
            assert (stdout, stderr) == ("", stop_lines(sig, sig.name)["before"])
        assert process.returncode == 128 + sig
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(sig.name)] == [sig.name] * out.exists()


# ------------------------------------------------------------------------------------------------
# Where the output must not go, and writes that fail: one line, nothing lost, nothing left behind


def writer_argv(kind: str, inputs: pathlib.Path, out, *extra) -> list[str]:
    """data.py's arguments preparing `inputs` (big_inputs) into `out` as text or as prompt/completion pairs."""
    given = ["--tokenizer", str(inputs / "tokenizer.json"), "--out", str(out), *extra]
    if kind == "text":
        return ["--input", str(inputs / "text"), "--workers", "1", *given]
    return ["--format", "prompt_completion", "--input", str(inputs / "pairs.jsonl"), "--seq-len", "64", *given]


@pytest.fixture(scope="module")
def big_inputs(tmp_path_factory, prepared):
    """Text and prompt/completion pairs of about 600 kB each (more than the full disk's 256 KiB once
    tokenized), with a small tokenizer, so nothing is trained."""
    root = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(14)
    (root / "text").mkdir()
    for i in range(6):
        (root / "text" / f"{i}.txt").write_text(" ".join(rng.choice(WORDS, 20_000)))
    pairs = [{"in_text": " ".join(rng.choice(WORDS, 20)), "out_text": " ".join(rng.choice(WORDS, 10))}
             for _ in range(5000)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    shutil.copyfile(prepared[0] / "tokenizer.json", root / "tokenizer.json")
    return root


def one_error_line(capsys, status: int, *words: str) -> str:
    captured = capsys.readouterr()
    assert status == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in captured.err, captured.err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("kind", ["text", "prompt_completion"])
@pytest.mark.parametrize("out", ["", ".", "..", "/", "HOME"])
def test_an_out_holding_the_working_or_home_directory_is_refused(big_inputs, tmp_path, monkeypatch, capsys, kind,
                                                                 out):
    """`--out .` (or '', an ancestor, /, ~) with --overwrite would replace the directory the user is in.
    Here that is itself a data directory, as when one runs data.py inside one: still refused."""
    here = tmp_path / "work" / "data"
    prep([big_inputs / "text"], here, tokenizer=str(big_inputs / "tokenizer.json"))
    (tmp_path / "work" / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    monkeypatch.setenv("HOME", str(here))
    before = tree(tmp_path)
    status = data.cli(writer_argv(kind, big_inputs, here if out == "HOME" else out, "--overwrite"))
    reason = {"": "--out is empty", ".": "is the current directory", "..": "contains the current directory",
              "/": "contains the current directory", "HOME": "is the current directory"}[out]
    one_error_line(capsys, status, reason)
    assert tree(tmp_path) == before
    monkeypatch.chdir(tmp_path)  # elsewhere, the home directory is still never replaced
    assert data.cli(writer_argv(kind, big_inputs, here, "--overwrite")) == 2
    one_error_line(capsys, 2, f"--out {here} is the home directory")
    assert tree(tmp_path) == before


def tree(root) -> dict:
    """Every file under root and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(pathlib.Path(root).rglob("*")) if p.is_file()}


def test_overwrite_replaces_only_a_data_directory_or_an_empty_one(big_inputs, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (mine / "figures").mkdir()
    status = data.cli(writer_argv("text", big_inputs, mine, "--overwrite"))
    one_error_line(capsys, status, f"--out {mine} holds figures/, thesis.tex and is not a data directory")
    assert (mine / "thesis.tex").read_text() == "years of work"
    # a data directory that also holds something else (notes, a second data directory inside): refused, naming it
    assert data.cli(writer_argv("text", big_inputs, tmp_path / "prepared")) == 0
    assert data.cli(writer_argv("text", big_inputs, tmp_path / "prepared" / "inner")) == 0
    (tmp_path / "prepared" / "NOTES.txt").write_text("where the corpus came from")
    before = tree(tmp_path / "prepared")
    one_error_line(capsys, data.cli(writer_argv("text", big_inputs, tmp_path / "prepared", "--overwrite")),
                   f"--out {tmp_path / 'prepared'} is a data directory (one with index.json) but also holds NOTES.txt, "
                   "inner/, which --overwrite would delete")
    assert tree(tmp_path / "prepared") == before
    (tmp_path / "file").write_text("a file")
    one_error_line(capsys, data.cli(writer_argv("text", big_inputs, tmp_path / "file", "--overwrite")),
                   "is a file, not a directory")
    (tmp_path / "empty").mkdir()
    assert data.cli(writer_argv("prompt_completion", big_inputs, tmp_path / "empty", "--overwrite")) == 0
    assert data.cli(writer_argv("text", big_inputs, tmp_path / "empty", "--overwrite")) == 0  # a data directory
    assert shards.open_data(tmp_path / "empty").index.get("kind") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "mine", "prepared"]


PLACES = {  # where --out goes: (out, extra arguments, the words its one error line holds)
    "read-only": lambda tmp, ro, full: (ro / "out", [], ["Read-only file system"]),
    "read-only-overwrite": lambda tmp, ro, full: (ro, ["--overwrite"], ["holds kept.txt and is not"]),
    "proc": lambda tmp, ro, full: (pathlib.Path("/proc/gpt-jax-test-out"), [], ["No such file or directory"]),
    "under-a-file": lambda tmp, ro, full: (tmp / "f.txt" / "sub", [], [f"{tmp / 'f.txt'} is a file, not a directory"]),
    "full-disk": lambda tmp, ro, full: (full / "a" / "out", [], ["No space left on device"]),
    "not-utf8": lambda tmp, ro, full: (tmp / os.fsdecode(b"out\xff"), [], ["is not UTF-8 text (byte 0xff at"]),
}


def bad_place(request, tmp_path, place: str):
    """(out, extra arguments, words of the error line, what must be left as it was) for a PLACES entry;
    the read-only and full disks are mounted only where needed."""
    (tmp_path / "f.txt").write_text("a file")
    ro = request.getfixturevalue("read_only_dir") if place.startswith("read-only") else None
    full = request.getfixturevalue("full_disk") if place == "full-disk" else None
    out, extra, words = PLACES[place](tmp_path, ro, full)
    return out, extra, [os.fsencode(out).decode("utf-8", "backslashreplace")] + words  # a byte no UTF-8 as \xff


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("kind", ["text", "prompt_completion"])
def test_writing_onto_a_bad_place_is_one_line_and_leaves_nothing(big_inputs, tmp_path, request, capsys, kind,
                                                                place):
    out, extra, words = bad_place(request, tmp_path, place)
    before = tree(tmp_path)
    one_error_line(capsys, data.cli(writer_argv(kind, big_inputs, out, *extra)), *words)
    assert tree(tmp_path) == before  # the read-only and full disks are mounted under tmp_path
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["f.txt"] + {"read-only": ["ro", "kept.txt"], "read-only-overwrite": ["ro", "kept.txt"],
                     "full-disk": ["full"]}.get(place, []))  # no staging directory, no parent made for it


DATA_MISTAKES = {  # id: (format, data.py's arguments after --input/--out, the words of its one error line)
    "vocab 2**33": ("text", ["--vocab-size", str(2**33)], "--vocab-size must be between 258 (256 byte symbols"),
    "vocab 2**24 + 1": ("text", ["--vocab-size", str(2**24 + 1)], "and 16,777,216 (2**24) for a byte-level BPE, "
                                                                  "got 16,777,217"),
    "vocab 2**33 pairs": ("prompt_completion", ["--vocab-size", str(2**33)], "--vocab-size must be between 258"),
    "workers -3": ("text", ["--workers", "-3"], "--workers must be >= 1"),
    "workers 0": ("text", ["--workers", "0"], "--workers must be >= 1"),
    "seq-len on text": ("text", ["--seq-len", "64"], "--seq-len is for --format prompt_completion"),
}


@pytest.mark.parametrize("case", list(DATA_MISTAKES))
def test_a_bad_size_is_one_line_before_anything_is_written(big_inputs, tmp_path, capsys, case):
    """Sizes past what the tokenizer library (an abort inside it) or the machine takes, or that would be
    taken as something else (--workers -3 as 1), and --seq-len where it means nothing: one line, nothing made."""
    kind, extra, words = DATA_MISTAKES[case]
    inputs = ["--input", str(big_inputs / "text")] if kind == "text" else [
        "--format", "prompt_completion", "--input", str(big_inputs / "pairs.jsonl"), "--seq-len", "64"]
    one_error_line(capsys, data.cli([*inputs, "--out", str(tmp_path / "out"), *extra]), words)
    assert list(tmp_path.iterdir()) == []


def test_more_workers_than_cpus_use_the_cpus(big_inputs, tmp_path, capsys, monkeypatch):
    """--workers 1000000 (which ran a million threads until killed): one line says so, and the pool has
    as many threads as this process has CPUs; the directory is the one --workers 1 makes."""
    pools = []
    real = data.ThreadPoolExecutor
    monkeypatch.setattr(data, "ThreadPoolExecutor", lambda n: pools.append(n) or real(n))
    args = ["--input", str(big_inputs / "text"), "--tokenizer", str(big_inputs / "tokenizer.json")]
    assert data.cli([*args, "--out", str(tmp_path / "many"), "--workers", "1000000"]) == 0
    cpus = len(os.sched_getaffinity(0))
    assert set(pools) == {cpus}  # (a build or two: corpus.held_out_extra)
    assert capsys.readouterr().out.startswith(f"note: --workers 1000000 is more than the {cpus} CPUs this process "
                                              f"may use: {cpus} tokenizer threads")
    assert data.cli([*args, "--out", str(tmp_path / "one"), "--workers", "1"]) == 0
    assert pools[-1] == 1
    assert tree(tmp_path / "many") == tree(tmp_path / "one")


# ------------------------------------------------------------------------------------------------
# Damaged prepared data: the loaders and train.py name the shard; --verify lists every damaged file

def test_an_id_outside_the_vocabulary_stops_the_loaders_naming_shard_and_position(prepared, tmp_path):
    import re
    import shutil
    out = tmp_path / "d"
    shutil.copytree(prepared[0], out)
    vocab = json.loads((out / "index.json").read_text())["vocab_size"]
    shard = shard_path(out, "train", 2)
    overwrite_token(shard, 5, 65535)
    message = rf"{shard.name}: token 5 \(at byte 10\) is id 65535, outside the vocabulary of {vocab}"
    with pytest.raises(data.DataError, match=message):
        list(loader.eval_windows(shards.open_data(out), "train", 16, 4))
    # the training loader meets it within an epoch, in its prefetch thread; the consumer gets the DataError
    # (pulled on a helper thread, so that a loader that hangs fails the test instead of stalling it)
    train_loader = loader.TextLoader(shards.open_data(out), "train", 16, 4, seed=3)
    outcome = []

    def consume() -> None:
        try:
            for _ in zip(range(-(-train_loader.num_windows // 4)), train_loader.iterate(0, prefetch=2)):
                pass
            outcome.append("no error")
        except BaseException as e:  # noqa: B036  (whatever it is, the test reports it)
            outcome.append(e)
    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(60)
    assert not consumer.is_alive() and len(outcome) == 1
    assert isinstance(outcome[0], data.DataError) and re.search(message, str(outcome[0])), repr(outcome[0])
    assert prefetchers() == []


def test_train_stops_on_a_corrupt_shard_with_one_error_line(corpus, tmp_path, capsys):  # noqa: F811
    """Every byte of the train shard flipped (its size unchanged): exit 2 and one line naming the shard."""
    import shutil
    out = tmp_path / "d"
    shutil.copytree(corpus, out)
    shard = shard_path(out, "train", 0)
    (np.fromfile(shard, np.uint8) ^ 0xFF).tofile(shard)
    assert train.cli(tiny(tmp_path / "run", out)) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the progress bar, then the error
    assert err[-1].startswith("error: ") and shard.name in err[-1] and "outside the vocabulary" in err[-1]
    assert not any(line.startswith("error") or "Traceback" in line for line in err[:-1])


def flip_bit(path: pathlib.Path, byte: int) -> None:
    with open(path, "r+b") as f:
        f.seek(byte)
        value = f.read(1)[0]
        f.seek(byte)
        f.write(bytes([value ^ 1]))


def test_verify_lists_every_damaged_file(prepared, tmp_path):
    import hashlib
    import shutil
    out = tmp_path / "d"
    shutil.copytree(prepared[0], out)
    index = json.loads((out / "index.json").read_text())
    files = 1 + sum(len(split["shards"]) for split in index["splits"].values())  # and the tokenizer
    intact = run_cli("--verify", out, cwd=tmp_path)
    assert intact.returncode == 0 and intact.stderr == "", intact.stderr
    assert f"intact, {files} files" in intact.stdout and "sha256 match" in intact.stdout

    extended, flipped, gone, truncated = (shard_path(out, "train", 0), shard_path(out, "train", 1),
                                          shard_path(out, "train", 3), shard_path(out, "val", 0))
    sizes = {p: p.stat().st_size for p in (extended, gone, truncated)}
    extended.write_bytes(extended.read_bytes() + b"\1\0")
    flip_bit(flipped, 3)
    gone.unlink()
    truncated.write_bytes(truncated.read_bytes()[:-2])
    result = run_cli("--verify", out, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout.splitlines() == [  # in index order: train shards, then val
        f"{extended}: expected {sizes[extended]} bytes ({sizes[extended] // 2} uint16 tokens), "
        f"found {sizes[extended] + 2} bytes",
        f"{flipped}: sha256 {hashlib.sha256(flipped.read_bytes()).hexdigest()[:16]}..., index.json records "
        f"{index['splits']['train']['shards'][1]['sha256'][:16]}...: changed",
        f"{gone}: expected {sizes[gone]} bytes ({sizes[gone] // 2} uint16 tokens), found none: missing",
        f"{truncated}: expected {sizes[truncated]} bytes ({sizes[truncated] // 2} uint16 tokens), "
        f"found {sizes[truncated] - 2} bytes",
    ]
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out}: 4 of {files} files damaged or missing")


def test_verify_an_index_without_hashes_checks_sizes_and_ids(prepared, tmp_path):
    import shutil
    out = tmp_path / "d"
    shutil.copytree(prepared[0], out)
    index = json.loads((out / "index.json").read_text())
    for split in index["splits"].values():
        for shard in split["shards"]:
            del shard["sha256"]  # as an index written before shards had hashes
    (out / "index.json").write_text(json.dumps(index))
    problems, summary = shards.verify(out)
    assert problems == [] and "intact" in summary and "no sha256" in summary
    assert "token ids (loss-mask values) checked only" in summary
    overwrite_token(shard_path(out, "val", 0), 4, 65535)
    problems, summary = shards.verify(out)
    assert problems == [f"{shard_path(out, 'val', 0)}: token 4 is id 65535, outside the vocabulary of "
                        f"{index['vocab_size']}"]
    assert "1 of" in summary


def test_verify_given_a_run_directory_names_the_data_directory_it_checks(tmp_path, capsys):
    """--verify checks a prepared data directory; given a run directory (one train.py wrote, kept in
    fixtures/) it says so in one line, with the data directory the run's data.json records; a run
    without data.json (an import) is said to record none."""
    run = sorted((DATA_PY.parent / "fixtures" / "runs").iterdir())[-1] / "run"
    recorded = json.loads((run / "data.json").read_text())["dir"]
    line = one_error_line(capsys, data.cli(["--verify", str(run)]), f"{run} is a run directory",
                          "--verify checks a prepared data directory", f"python data.py --verify {recorded}")
    assert "prepare the data" not in line
    shutil.copytree(run, tmp_path / "imported", ignore=shutil.ignore_patterns("data.json", "checkpoints"))
    one_error_line(capsys, data.cli(["--verify", str(tmp_path / "imported")]), "is a run directory",
                   "records no data directory (no data.json)")


@pytest.fixture(scope="module")
def pairs_data(tmp_path_factory, prepared):
    """A small prompt/completion directory, with the `prepared` tokenizer (nothing trained)."""
    root = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(5)
    pairs = [{"in_text": " ".join(rng.choice(WORDS, 4)), "out_text": " ".join(rng.choice(WORDS, 3))} for _ in range(60)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    from tokendata import finetune_data
    finetune_data.prepare([str(root / "pairs.jsonl")], root / "data", seq_len=64, val_fraction=0.2, progress=False,
                          tokenizer=str(prepared[0] / "tokenizer.json"))
    return root / "data"


def _set(key, value):
    return lambda index: index.__setitem__(key, value)


def _in_split(split, key, value):
    return lambda index: index["splits"][split].__setitem__(key, value)


BAD_INDEXES = {  # id: (text or prompt/completion data, the change to its index.json, the error after PATH/index.json: )
    "kind deleted": ("pairs", lambda index: index.pop("kind"),
                     "split 'train' has loss-mask shards (mask_shards) but the index names no kind"),
    "kind unknown": ("pairs", _set("kind", "chat"), "unknown kind 'chat': this data.py reads 'prompt_completion'"),
    "kind null": ("pairs", _set("kind", None), "unknown kind None"),
    "text called prompt/completion": ("text", _set("kind", "prompt_completion"),
                                      "kind 'prompt_completion', but split 'train' has no mask_shards"),
    "mask shards gone": ("pairs", lambda index: index["splits"]["val"].pop("mask_shards"),
                         "kind 'prompt_completion', but split 'val' has no mask_shards"),
    "mask counts": ("pairs", lambda index: index["splits"]["train"]["mask_shards"][0].__setitem__("tokens", 1),
                    "split 'train' loss-mask shard counts do not add up"),
    "entropy a string": ("pairs", _set("loss_unigram_entropy", "abc"),
                         "loss_unigram_entropy must be a number >= 0 (nats per token) or absent, got 'abc'"),
    "entropy NaN": ("text", _set("unigram_entropy", float("nan")), "unigram_entropy must be a number >= 0"),
    "split entropy negative": ("text", _in_split("val", "unigram_entropy", -1.0),
                               "split 'val' unigram_entropy must be a number >= 0"),
    "vocab 0": ("text", _set("vocab_size", 0), "vocab_size must be a positive integer, got 0"),
    "vocab -1": ("pairs", _set("vocab_size", -1), "vocab_size must be a positive integer, got -1"),
    "vocab 2.5": ("text", _set("vocab_size", 2.5), "vocab_size must be a positive integer, got 2.5"),
    "vocab true": ("text", _set("vocab_size", True), "vocab_size must be a positive integer, got True"),
    "eot outside": ("text", lambda index: index.__setitem__("eot_id", index["vocab_size"]),
                    "eot_id must be a token id below vocab_size"),
}


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_a_damaged_index_is_refused_alike_by_loading_and_verify(case, prepared, pairs_data, tmp_path, capsys):
    """An index.json whose kind disagrees with its files (prompt/completion data would be trained as text,
    its prompts in the loss) or whose fields have the wrong type or range: the loader, train.py's first
    opening it (open_data) and `data.py --verify` each refuse it in the same one line."""
    base, change, message = BAD_INDEXES[case]
    out = tmp_path / "d"
    shutil.copytree(pairs_data if base == "pairs" else prepared[0], out)
    index = json.loads((out / "index.json").read_text())
    change(index)
    (out / "index.json").write_text(json.dumps(index))
    expected = f"{out / 'index.json'}: {message}"
    for read in (shards.open_data, lambda d: loader.open_loader(shards.open_data(d), "train", 8, 2), shards.verify):
        with pytest.raises(data.DataError) as e:
            read(out)
        assert str(e.value).startswith(expected), str(e.value)
    assert one_error_line(capsys, data.cli(["--verify", str(out)])) == f"error: {e.value}"  # as verify raised it


def test_an_index_of_every_earlier_version_is_read(prepared, pairs_data, tmp_path):
    """Text data has never had a kind (nor prompt/completion data a missing one): a text index without one
    reads as text; prompt/completion data without loss_unigram_entropy (written before it was kept) reads."""
    assert "kind" not in json.loads((prepared[0] / "index.json").read_text())
    assert isinstance(loader.open_loader(shards.open_data(prepared[0]), "train", 8, 2), loader.TextLoader)
    out = tmp_path / "d"
    shutil.copytree(pairs_data, out)
    index = json.loads((out / "index.json").read_text())
    for fields in (index, *index["splits"].values()):
        fields.pop("loss_unigram_entropy")
    (out / "index.json").write_text(json.dumps(index))
    assert isinstance(loader.open_loader(shards.open_data(out), "train", 64, 2), loader.PromptCompletionLoader)
    assert shards.verify(out)[0] == []


def test_loss_masks_that_end_no_example_are_refused(pairs_data, tmp_path, capsys):
    """Loss-mask shards that are all prompt (no example ever ends): the loader names the shard in one
    line; `--verify` lists both splits' shards (their sha256 changed, or, in an index without hashes,
    the last byte that ends no example); train.py stops in one line and makes no run directory."""
    out = tmp_path / "d"
    shutil.copytree(pairs_data, out)
    masks = {split: shard_path(out, split, 0, "mask_shards") for split in ("train", "val")}
    for mask in masks.values():
        mask.write_bytes(bytes(mask.stat().st_size))  # every byte shards.PROMPT
    for split, mask in masks.items():
        with pytest.raises(data.DataError, match=rf"{mask}: the split's last loss-mask byte is not 2 .*0 examples"):
            loader.open_loader(shards.open_data(out), split, 64, 2)
    assert [line.split(": ")[0] for line in shards.verify(out)[0]] == [str(m) for m in masks.values()]
    index = json.loads((out / "index.json").read_text())
    for split in index["splits"].values():
        for shard in split["mask_shards"]:
            del shard["sha256"]  # as an index written before shards had hashes
    (out / "index.json").write_text(json.dumps(index))
    assert shards.verify(out)[0] == [f"{m}: the last byte is 0, not 2: the split's last example never ends"
                                     for m in masks.values()]
    assert masks["train"].name in one_error_line(capsys, train.cli(tiny(tmp_path / "run", out, "training.seq_len=64")))
    assert not (tmp_path / "run").exists()
