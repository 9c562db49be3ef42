"""Corpus preparation (CLI) and the memory-mapped batch loader (library).

    python data.py                                  # the default corpus: this Python's stdlib sources
    python data.py --input 'web/*.jsonl.zst' --out data/web --vocab-size 32768 --workers 16
    python data.py --runner beam --beam-option runner=FlinkRunner ... --input ... --out ... --tokenizer tok.json
    python data.py --format prompt_completion --input pairs.jsonl --out data/pairs --tokenizer RUN_DIR --seq-len 1024
                                                    # fine-tuning pairs with a loss mask: see finetune_data.py
    python data.py --verify data/web                # every file's size and sha256 against index.json

On-disk format of a data directory DIR (FORMAT_VERSION 1):

    DIR/tokenizer.json        the `tokenizers` tokenizer that produced the ids (a copy, so DIR describes itself)
    DIR/train_00000.bin ...   raw little-endian uint16 token ids (uint32 if the vocabulary needs it), no header
    DIR/val_00000.bin ...
    DIR/index.json            written last: format_version, tokenizer, tokenizer_sha256, vocab_size, eot_id,
                              dtype, tokens, documents, bytes_per_token, unigram_entropy (nats per token of
                              the train split), skipped inputs, the inputs, and per split its tokens,
                              documents, bytes, unigram_entropy and shards [{file, tokens, documents, sha256}]

Every document is followed by the end-of-text id. A split is one logical token stream: its shards
concatenated in order. Training window i covers stream[i*T : i*T + T + 1] (inputs and targets overlap
by one token, so every token after the first is a target exactly once per epoch); windows cross
document and shard boundaries, as in GPT-2 style pre-training.

Documents come from corpus.py (globs, directories, hf:NAME[/CONFIG]:SPLIT; plain text, JSON Lines,
Parquet; unreadable inputs skipped and counted), which also names each document and decides by a
hash of its name whether it is held out for validation. Text that spells the end-of-text token
itself is encoded as that token, as the `tokenizers` library does.

A directory is built in the sibling DIR.tmp-<pid> and renamed into place when complete, so an
interrupted run never leaves an index naming missing or partial shards.

`--runner beam` (data_beam.py, needs apache-beam) runs the tokenizing and shard writing as an Apache
Beam pipeline, with Beam's options given as `--beam-option KEY=VALUE`; the directory it writes is the
default runner's, byte for byte (same tokenizer, encoding, shard writer, document order).

Damaged data stops with one line naming the file: opening a directory checks every shard's size
(truncated, extended, missing), and every batch the loaders make is checked against the vocabulary
(one max per batch), so a flipped byte that turns into an out-of-range id is named by shard, position
and id instead of indexing the embedding out of range. `--verify DIR` reads every file and checks its
size and sha256 against index.json, listing each damaged one.

The loader also reads a directory at a URL (gs://bucket/dir, after `gcloud storage cp -r DIR`): storage.py
copies it to a local cache first and checks every shard against the index's sizes and hashes.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import functools
import glob
import hashlib
import json
import os
import pathlib
import queue
import shutil
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np

import corpus
import storage
from corpus import DataError, default_corpus_files  # re-exported: data.DataError is corpus.DataError

FORMAT_VERSION = 1
DEFAULT_DATA_DIR = pathlib.Path(__file__).resolve().parent / "data" / "pystdlib"
EOT_TOKEN = "<|endoftext|>"
EOT_CANDIDATES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[EOS]")
CHUNK_BYTES = 1 << 20  # text per encode_batch call: large enough to amortise, small enough to bound memory


# ---------------------------------------------------------------------------------------------
# Tokenizer: a given tokenizer.json, or a byte-level BPE trained on the train documents.

def train_tokenizer(docs: Iterator[str], vocab_size: int):
    """A byte-level BPE of vocab_size (EOT_TOKEN its one special token) trained on the documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # exact round trip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    return tokenizer


def load_tokenizer_file(path: str | os.PathLike):
    """A tokenizers Tokenizer from tokenizer.json; a missing or malformed file is a DataError."""
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for both missing and malformed files
        reason = "file not found" if not os.path.exists(path) else str(e).splitlines()[0][:200]
        raise DataError(f"cannot load tokenizer {path}: {reason}")


def eot_id_of(tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token (the first of EOT_CANDIDATES it has), or None."""
    vocab = tokenizer.get_vocab()
    return next((vocab[t] for t in EOT_CANDIDATES if t in vocab), None)


def file_sha256(path: pathlib.Path) -> str:
    """The hex sha256 of a file's bytes, as index.json records it."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def dtype_for(vocab_size: int) -> str:
    """The smallest shard dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


# ---------------------------------------------------------------------------------------------
# Preparation

class ShardWriter:
    """Appends tokens of one split to fixed-size shards, counting the documents that end in each.

    Shards are numbered from `first_shard` (0 for a whole split; data_beam.py writes one shard a task)."""

    def __init__(self, directory: pathlib.Path, split: str, dtype: str, shard_tokens: int, vocab_size: int,
                 first_shard: int = 0):
        self.directory, self.split, self.shard_tokens, self.first_shard = directory, split, shard_tokens, first_shard
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shards: list[dict] = []
        self.counts = np.zeros(vocab_size, np.int64)
        self.bytes = 0
        self.file, self.hash = None, None

    def write(self, tokens: np.ndarray, doc_ends: np.ndarray) -> None:
        self.counts += np.bincount(tokens, minlength=len(self.counts))
        pos = 0
        while pos < len(tokens):
            if self.file is None:
                name = f"{self.split}_{self.first_shard + len(self.shards):05d}.bin"
                self.file = open(self.directory / name, "wb")
                self.hash = hashlib.sha256()
                self.shards.append({"file": name, "tokens": 0, "documents": 0})
            shard = self.shards[-1]
            piece = tokens[pos:pos + self.shard_tokens - shard["tokens"]]
            raw = piece.astype(self.dtype, copy=False).tobytes()
            self.file.write(raw)
            self.hash.update(raw)
            # documents whose end-of-text token lands in this piece: ends in (pos, pos + len(piece)]
            shard["documents"] += int(np.searchsorted(doc_ends, pos + len(piece), "right")
                                      - np.searchsorted(doc_ends, pos, "right"))
            shard["tokens"] += len(piece)
            pos += len(piece)
            if shard["tokens"] == self.shard_tokens:
                self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            self.shards[-1]["sha256"] = self.hash.hexdigest()  # checked when a remote copy is fetched

    def summary(self) -> dict:
        return split_summary(self.shards, self.counts, self.bytes)


def split_summary(shards: list[dict], counts: np.ndarray, nbytes: int) -> dict:
    """A split's entry in the index, from its shards in order and its token frequencies."""
    return {"tokens": int(counts.sum()), "documents": sum(s["documents"] for s in shards), "bytes": nbytes,
            "unigram_entropy": _entropy(counts), "shards": shards}


def swap_into_place(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """Rename the finished directory tmp to out; with --overwrite the old out goes only once tmp is complete."""
    if out.exists():
        old = out.parent / f"{out.name}.tmp-{os.getpid()}-old"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def _entropy(counts: np.ndarray) -> float:
    """Unigram entropy in nats per token: H = -sum p log p over the observed token frequencies."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def encode_texts(tokenizer, texts: list[str], eot: int, vocab_size: int, dtype: str):
    """One chunk of documents to (ids with an end-of-text after each document, document ends, bytes)."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: faster
    flat: list[int] = []
    ends = np.empty(len(texts), np.int64)
    for i, encoding in enumerate(encode(texts, add_special_tokens=False)):
        flat += encoding.ids
        flat.append(eot)
        ends[i] = len(flat)
    ids = np.array(flat, np.int64)
    top = int(ids.max())
    if top >= vocab_size or top > np.iinfo(dtype).max:
        raise DataError(f"token id {top} does not fit: vocabulary size {vocab_size}, dtype {dtype}")
    return ids, ends, sum(len(t.encode("utf-8")) for t in texts)


def _empty(sources: list, tally: corpus.Tally) -> str:
    skipped = tally.skipped_files + tally.skipped_records
    skipped = f", {skipped} unreadable skipped ({tally.skipped_names()})" if skipped else ""
    return f"empty corpus: no text in {len(sources)} input file(s){skipped}: {sources[0][1]}" + \
        (", ..." if len(sources) > 1 else "")


def clean_leftovers(out: pathlib.Path) -> None:
    """Removes DIR.tmp-<pid> directories of earlier runs that are no longer running."""
    for tmp in out.parent.glob(glob.escape(out.name) + ".tmp-*"):
        pid = tmp.name[len(out.name) + len(".tmp-"):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                continue  # still running: another prepare into the same DIR owns it
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        shutil.rmtree(tmp, ignore_errors=True)


def _prepare(sources, out, *, description: list[str], tokenizer, vocab_size, is_val: Callable[[str], bool],
             val_fraction: float, workers, shard_tokens, text_field, overwrite, strict, progress,
             runner: str = "local", beam_options: list[str] | None = None) -> dict:
    """Prepares `sources` into `out`, documents held out by is_val (which holds out about val_fraction of
    them), plus the one of corpus.held_out_extra where is_val held out none."""
    out = pathlib.Path(out)
    if shard_tokens < 1:
        raise DataError(f"shard tokens must be positive, got {shard_tokens}")
    if tokenizer is None and vocab_size < 258:  # 256 byte symbols and the end-of-text token
        raise DataError(f"vocab size must be at least 258 for a byte-level BPE, got {vocab_size}")
    if out.exists() and not overwrite:
        raise DataError(f"{out} exists; pass --overwrite to replace it")
    for kind, location, _ in sources:  # --overwrite must never delete an input
        if kind != "hf" and out.resolve() in pathlib.Path(location).resolve().parents:
            raise DataError(f"input {location} lies inside the output directory {out}")
    if runner not in ("local", "beam"):
        raise DataError(f"unknown runner {runner!r} (choose local or beam)")
    if runner == "beam":
        try:
            import data_beam  # apache-beam is optional: imported only for this runner
        except ImportError as e:
            raise DataError(f"--runner beam needs apache-beam ({e}); pip install apache-beam")
    workers = max(1, workers or os.cpu_count() or 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    saved_env = {k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")}
    # bars only on a terminal, and erased when done, so an error stays the one line on stderr
    bars = dict(disable=None if progress else True, leave=False, file=sys.stderr, dynamic_ncols=True)
    def build(is_val):
        """Tokenizer and shards into tmp, documents split by is_val: ({vocab_size, eot_id, dtype}, splits, tally)."""
        tok = _obtain_tokenizer(sources, tmp, tokenizer, vocab_size, is_val, text_field, strict, workers, bars)
        vocab = max(tok.get_vocab().values()) + 1
        options = dict(eot=eot_id_of(tok), vocab_size=vocab, dtype=dtype_for(vocab), is_val=is_val,
                       shard_tokens=shard_tokens, text_field=text_field, strict=strict)
        if runner == "beam":
            splits, tally = data_beam.tokenize(sources, tmp, tok, options=beam_options or [], **options)
        else:
            splits, tally = _tokenize_local(sources, tmp, tok, workers=workers, bars=bars, **options)
        if sum(s["tokens"] for s in splits.values()) == 0:
            raise DataError(_empty(sources, tally))
        return {"vocab_size": vocab, "eot_id": options["eot"], "dtype": options["dtype"]}, splits, tally

    try:
        # tokenizer: the tokenizers library's thread pool honours RAYON_NUM_THREADS until it first starts
        os.environ.setdefault("RAYON_NUM_THREADS", str(workers))
        vocab_fields, splits, tally = build(is_val)
        extra = corpus.held_out_extra(tally, splits["train"]["documents"], splits["val"]["documents"], val_fraction)
        if extra is not None:  # no document fell below the fraction: again, with the lowest-ranked one held out
            shutil.rmtree(tmp)
            tmp.mkdir()
            vocab_fields, splits, tally = build(lambda key: key == extra or is_val(key))
        tokens = sum(s["tokens"] for s in splits.values())
        index = {
            "format_version": FORMAT_VERSION,
            "tokenizer": "tokenizer.json",
            "tokenizer_sha256": file_sha256(tmp / "tokenizer.json"),
            **vocab_fields,  # vocab_size, eot_id, dtype
            "tokens": tokens,
            "documents": sum(s["documents"] for s in splits.values()),
            "bytes_per_token": sum(s["bytes"] for s in splits.values()) / tokens,  # end-of-text included
            "unigram_entropy": splits["train"]["unigram_entropy"],
            "skipped_files": tally.skipped_files, "skipped_records": tally.skipped_records,
            "skipped_inputs": tally.skipped,  # the first corpus.LISTED, with the reason
            "val_extra": extra,  # the document held out because none fell below the fraction, if one was
            "inputs": description, "splits": splits,
        }
        (tmp / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        swap_into_place(tmp, out)
        return index
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _obtain_tokenizer(sources, tmp: pathlib.Path, tokenizer, vocab_size, is_val, text_field, strict, workers,
                      bars):
    """The given tokenizer (an end-of-text token added if it lacks one), or a BPE trained on the train
    documents; either way saved as tmp/tokenizer.json. Both runners get theirs here."""
    from tqdm import tqdm
    if tokenizer is not None:
        tok = load_tokenizer_file(tokenizer)
        if eot_id_of(tok) is None:
            tok.add_special_tokens([EOT_TOKEN])
            tok.save(str(tmp / "tokenizer.json"))
        else:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        return tok
    if workers == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    reader = corpus.Reader(sources, text_field, strict)
    seen = 0
    with tqdm(total=len(sources), desc="training tokenizer", unit="file", **bars) as bar:
        def train_docs() -> Iterator[str]:
            nonlocal seen
            for key, text in reader:
                seen += 1
                bar.update(reader.tally.files - bar.n)
                if not is_val(key):  # held-out text stays unseen by the tokenizer too
                    yield text
        tok = train_tokenizer(train_docs(), vocab_size)
    if not seen:
        raise DataError(_empty(sources, reader.tally))
    tok.save(str(tmp / "tokenizer.json"))
    return tok


def _tokenize_local(sources, tmp: pathlib.Path, tok, *, eot, vocab_size, dtype, is_val, shard_tokens, text_field,
                    strict, workers, bars) -> tuple[dict, corpus.Tally]:
    """The in-process runner: documents in input order, encoded by a thread pool, written in order.
    Returns ({split: summary}, what the reading came to)."""
    from tqdm import tqdm
    writers = {s: ShardWriter(tmp, s, dtype, shard_tokens, vocab_size) for s in ("train", "val")}
    # chunks of documents go to `workers` threads (encode_batch releases the GIL), each encoding
    # single-threaded; results are written in order, at most 2 * workers chunks in flight
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    reader = corpus.Reader(sources, text_field, strict)
    pending: collections.deque = collections.deque()
    done_bytes, start = 0, time.perf_counter()
    with ThreadPoolExecutor(workers) as pool, \
            tqdm(total=len(sources), desc="tokenizing", unit="file", **bars) as bar:
        def drain(limit: int) -> None:
            nonlocal done_bytes
            while len(pending) > limit:
                split, future = pending.popleft()
                ids, ends, nbytes = future.result()
                writers[split].write(ids, ends)
                writers[split].bytes += nbytes
                done_bytes += nbytes
                tokens = sum(int(w.counts.sum()) for w in writers.values())
                bar.update(reader.tally.files - bar.n)
                bar.set_postfix_str(f"{tokens / 1e6:.1f}M tokens, "
                                    f"{done_bytes / 1e6 / (time.perf_counter() - start):.1f} MB/s")

        chunks = {"train": ([], 0), "val": ([], 0)}
        try:
            for key, text in reader:
                split = "val" if is_val(key) else "train"
                texts, size = chunks[split]
                texts.append(text)
                chunks[split] = (texts, size + len(text))
                if size + len(text) >= CHUNK_BYTES:
                    pending.append((split, pool.submit(encode_texts, tok, texts, eot, vocab_size, dtype)))
                    chunks[split] = ([], 0)
                    drain(2 * workers)
            for split, (texts, _) in chunks.items():
                if texts:
                    pending.append((split, pool.submit(encode_texts, tok, texts, eot, vocab_size, dtype)))
            drain(0)
        except BaseException:  # stop at once: chunks not yet started are dropped
            for _, future in pending:
                future.cancel()
            raise
    for writer in writers.values():
        writer.close()
    return {s: w.summary() for s, w in writers.items()}, reader.tally


def prepare(inputs: list[str], out, *, tokenizer: str | None = None, vocab_size: int = 8192,
            val_fraction: float = 0.005, workers: int | None = None, shard_tokens: int = 2**27,
            text_field: str = "text", overwrite: bool = False, strict: bool = False,
            progress: bool = True, runner: str = "local", beam_options: list[str] | None = None) -> dict:
    """Tokenizes the files matching `inputs` (or hf:NAME[/CONFIG]:SPLIT) into DIR `out`; returns its index.

    runner "beam" runs the tokenizing and shard writing as an Apache Beam pipeline (data_beam.py) with
    the pipeline options `beam_options` (["--runner=DataflowRunner", ...]); the result is the same."""
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else [str(i) for i in inputs]
    if not inputs:
        raise DataError("no input given")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val fraction must be in [0, 1), got {val_fraction}")
    return _prepare(corpus.expand(inputs), out, description=inputs, tokenizer=tokenizer, vocab_size=vocab_size,
                    is_val=lambda key: corpus.in_val(key, val_fraction), val_fraction=val_fraction, workers=workers,
                    shard_tokens=shard_tokens, text_field=text_field, overwrite=overwrite, strict=strict,
                    progress=progress, runner=runner, beam_options=beam_options)


def prepare_default(out=DEFAULT_DATA_DIR, *, vocab_size: int = 4096, overwrite: bool = False,
                    progress: bool = True, tokenizer: str | None = None, workers: int | None = None,
                    stdlib_dir: str | os.PathLike | None = None, runner: str = "local",
                    beam_options: list[str] | None = None) -> dict:
    """Prepares the embedded default corpus: the running interpreter's stdlib sources."""
    root = pathlib.Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = default_corpus_files(root)
    if not files:
        raise DataError(f"empty corpus: no .py files under {root}")
    # documents are named relative to the stdlib; a byte-balanced set of them is held out
    held = corpus.default_held_out(root, files)
    sources = [("text", str(p), p.relative_to(root).as_posix()) for p in files]
    description = [f"Python {sys.version.split()[0]} standard library: {root}/**/*.py"]
    return _prepare(sources, out, description=description, tokenizer=tokenizer, vocab_size=vocab_size,
                    is_val=held.__contains__, val_fraction=corpus.DEFAULT_VAL_FRACTION, workers=workers,
                    shard_tokens=2**27, text_field="text",
                    overwrite=overwrite, strict=False, progress=progress, runner=runner,
                    beam_options=beam_options)


# ---------------------------------------------------------------------------------------------
# Index

class IndexedFile(NamedTuple):
    """A file that index.json names, with what it records about it."""
    file: str  # its name inside the directory
    kind: str  # "tokenizer", "tokens" (a token shard) or "mask" (a prompt/completion loss-mask shard)
    size: int | None  # bytes; None for the tokenizer, whose sha256 is always recorded
    sha256: str | None  # None in an index written before shards had hashes
    what: str  # its recorded content, for messages: "257 uint16 tokens", "257 loss-mask bytes", "tokenizer"


def index_files(index: dict) -> list[IndexedFile]:
    """The tokenizer, then every split's token shards and (prompt/completion data) loss-mask shards."""
    dtype = index["dtype"]
    itemsize = np.dtype(dtype).itemsize
    files = [IndexedFile(index["tokenizer"], "tokenizer", None, index["tokenizer_sha256"], "tokenizer")]
    for split in index["splits"].values():
        files += [IndexedFile(s["file"], "tokens", int(s["tokens"]) * itemsize, s.get("sha256"),
                              f"{s['tokens']} {dtype} tokens") for s in split["shards"]]
        files += [IndexedFile(s["file"], "mask", int(s["tokens"]), s.get("sha256"), f"{s['tokens']} loss-mask bytes")
                  for s in split.get("mask_shards", [])]
    return files


def read_index(data_dir) -> tuple[pathlib.Path, dict, list[IndexedFile]]:
    """(local directory, index, the files it names) of a data directory, the index's own fields checked
    but not the files. A URL is first copied into the local cache and verified (storage.local_data_dir)."""
    data_dir = storage.local_data_dir(data_dir)
    path = data_dir / "index.json"
    if not path.is_file():
        raise DataError(f"{path} not found; prepare the data with `python data.py`")
    try:
        index = json.loads(path.read_text())
        version = index["format_version"]
        if version != FORMAT_VERSION:
            raise DataError(f"{path}: format version {version}, this data.py reads {FORMAT_VERSION}")
        dtype, vocab = index["dtype"], int(index["vocab_size"])
        if dtype not in ("uint16", "uint32") or vocab > np.iinfo(dtype).max + 1:
            raise DataError(f"{path}: dtype {dtype!r} cannot hold vocabulary size {vocab}")
        for name, split in index["splits"].items():
            if sum(int(s["tokens"]) for s in split["shards"]) != int(split["tokens"]):
                raise DataError(f"{path}: split {name!r} shard token counts do not add up to {split['tokens']}")
        return data_dir, index, index_files(index)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"{path} is corrupt ({type(e).__name__}: {e}); re-run data.py with --overwrite")


def _size(path: pathlib.Path) -> int | None:
    return path.stat().st_size if path.is_file() else None


def _size_problem(path: pathlib.Path, entry: IndexedFile) -> str | None:
    """A shard whose size is not the recorded one: missing, truncated or extended."""
    size = _size(path)
    if size == entry.size:
        return None
    return f"{path}: expected {entry.size} bytes ({entry.what}), found " + ("none: missing" if size is None
                                                                          else f"{size} bytes")


def load_index(data_dir) -> dict:
    """The validated index of a data directory: the tokenizer matches its sha256, and every shard (loss-mask
    shards included) exists with the recorded size; hashes of the shards are `verify`'s to check.

    A URL (gs://...) is first copied into the local cache and verified there (storage.local_data_dir)."""
    data_dir, index, files = read_index(data_dir)
    tokenizer = data_dir / files[0].file
    if not tokenizer.is_file():
        raise DataError(f"{data_dir / 'index.json'}: tokenizer {tokenizer} is missing")
    if file_sha256(tokenizer) != files[0].sha256:
        raise DataError(f"{data_dir / 'index.json'}: {tokenizer} does not match the recorded sha256; re-run data.py")
    for entry in files[1:]:
        problem = _size_problem(data_dir / entry.file, entry)
        if problem:
            raise DataError(problem)
    return index


def verify(data_dir) -> tuple[list[str], str]:
    """Checks every file of a data directory against its index.json, reading each whole: the size and
    sha256 of every token and loss-mask shard and of the tokenizer. A shard for which the index records
    no sha256 (an index written before shards had hashes) gets its size checked, and for a token shard
    its ids against the vocabulary. Returns (one line per problem, a one-line summary)."""
    directory, index, files = read_index(data_dir)
    problems, nbytes, unhashed = [], 0, 0
    for entry in files:
        path = directory / entry.file
        if entry.size is not None:
            problem = _size_problem(path, entry)
        else:
            problem = None if path.is_file() else f"{path}: missing"
        if problem is None and entry.sha256 is not None:
            digest = file_sha256(path)
            if digest != entry.sha256:
                problem = f"{path}: sha256 {digest[:16]}..., index.json records {entry.sha256[:16]}...: changed"
        elif problem is None:
            unhashed += 1
            if entry.kind == "tokens" and entry.size:
                problem = _id_problem(path, index)
        if problem is None:
            nbytes += path.stat().st_size
        else:
            problems.append(problem)
    masks = sum(f.kind == "mask" for f in files)
    kinds = f"{len(files) - 1 - masks} token shards" + (f", {masks} loss-mask shards" if masks else "")
    if problems:
        return problems, (f"{directory}: {len(problems)} of {len(files)} files damaged or missing ({kinds}, "
                          f"the tokenizer); restore them or prepare the directory again")
    checked = "sizes and sha256 match index.json"
    if unhashed:
        checked += (f"; {unhashed} shards have no sha256 in index.json (written by an older data.py): "
                    f"their sizes and token ids checked only")
    return [], f"{directory}: intact, {len(files)} files ({kinds}, the tokenizer), {nbytes / 1e6:.1f} MB; {checked}"


def _id_problem(path: pathlib.Path, index: dict) -> str | None:
    """The first token id of a shard that is outside the vocabulary, if any."""
    vocab = int(index["vocab_size"])
    tokens = np.memmap(path, np.dtype(index["dtype"]).newbyteorder("<"), "r")
    if int(tokens.max()) < vocab:
        return None
    at = int(np.flatnonzero(tokens >= vocab)[0])
    return f"{path}: token {at} is id {int(tokens[at])}, outside the vocabulary of {vocab}"


def load_tokenizer(data_dir):
    """The tokenizer of a prepared data directory (for decoding samples)."""
    return load_tokenizer_file(storage.local_data_dir(data_dir) / load_index(data_dir)["tokenizer"])


# ---------------------------------------------------------------------------------------------
# Window permutation: a keyed Feistel network on [0, 2^bits) made a bijection on [0, n) by cycle
# walking. It maps index by index in O(1) memory, vectorised over a batch.

FEISTEL_ROUNDS = 6
_MASK64 = 2**64 - 1
_MIX1, _MIX2, _GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


def _u64(value: int) -> np.ndarray:
    """A 0-d uint64 array: numpy applies it to a small array about twice as fast as a np.uint64 scalar,
    which matters here, where a batch of 32 windows costs a few hundred tiny array operations."""
    return np.array(value & _MASK64, np.uint64)


_SHIFT30, _SHIFT27, _SHIFT31, _MUL1, _MUL2 = _u64(30), _u64(27), _u64(31), _u64(_MIX1), _u64(_MIX2)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast 64-bit hash (uint64 arithmetic wraps)."""
    x = (x ^ (x >> _SHIFT30)) * _MUL1
    x = (x ^ (x >> _SHIFT27)) * _MUL2
    return x ^ (x >> _SHIFT31)


def _mix64_int(x: int) -> int:
    """_mix64 on one Python int."""
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=256)
def _round_keys(seed: int, epoch: int) -> tuple[np.ndarray, ...]:
    """The Feistel round keys of the permutation chosen by (seed, epoch), computed once per epoch."""
    key = _mix64_int(_mix64_int(seed & _MASK64) ^ epoch)
    return tuple(_u64(_mix64_int((key + (r + 1) * _GOLDEN) & _MASK64)) for r in range(FEISTEL_ROUNDS))


def permute(indices: np.ndarray, n: int, seed: int, epoch) -> np.ndarray:
    """Position -> window under the permutation of [0, n) chosen by (seed, epoch); epoch may vary per element."""
    x = np.asarray(indices, np.uint64).copy()
    epoch = np.broadcast_to(np.asarray(epoch, np.uint64), x.shape)
    bits = max(1, (n - 1).bit_length())
    lo_bits = bits // 2
    shift, lo_mask, hi_mask = _u64(lo_bits), _u64((1 << lo_bits) - 1), _u64((1 << (bits - lo_bits)) - 1)
    limit = _u64(n)

    def rounds(v: np.ndarray, keys: tuple[np.ndarray, ...]) -> np.ndarray:
        hi, lo = v >> shift, v & lo_mask
        for r, round_key in enumerate(keys):  # each round xors one half with a keyed hash of the other: invertible
            if r % 2 == 0:
                hi = hi ^ (_mix64(lo ^ round_key) & hi_mask)
            else:
                lo = lo ^ (_mix64(hi ^ round_key) & lo_mask)
        return (hi << shift) | lo

    # a batch spans one epoch, or two at an epoch's end: one pass per epoch, with that epoch's keys
    first = int(epoch.flat[0]) if x.size else 0
    groups = [(first, None)] if (epoch == first).all() else \
        [(int(e), epoch == e) for e in np.unique(epoch)]
    for e, where in groups:
        keys = _round_keys(int(seed), e)
        y = x if where is None else x[where]
        y = rounds(y, keys)
        outside = y >= limit
        while outside.any():  # 2^bits < 2n, so on average fewer than two walks
            y[outside] = rounds(y[outside], keys)
            outside = y >= limit
        if where is None:
            x = y
        else:
            x[where] = y
    return x.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Reading

class Stream:
    """One split's shards as a single logical token stream, read through numpy.memmap.

    `check` tests a batch read from it against the vocabulary: a flipped byte in a shard gives an id
    that would index the embedding out of range, so it is caught here and named, not met as a NaN loss."""

    def __init__(self, data_dir, split: str):
        self.index = load_index(data_dir)
        splits = self.index["splits"]
        if split not in splits:
            raise DataError(f"{data_dir}: no split {split!r} (has: {', '.join(splits)})")
        self.split, self.vocab_size = split, int(self.index["vocab_size"])
        dtype, self.directory = np.dtype(self.index["dtype"]).newbyteorder("<"), storage.local_data_dir(data_dir)
        self.shards, self.files, self.itemsize = [], [], dtype.itemsize
        for shard in splits[split]["shards"]:
            if int(shard["tokens"]):
                mapped = np.memmap(self.directory / shard["file"], dtype, "r", shape=(int(shard["tokens"]),))
                self.shards.append(np.asarray(mapped))  # a plain ndarray view: cheaper to slice than a memmap
                self.files.append(self.directory / shard["file"])
        self.starts = [0]
        for shard in self.shards:
            self.starts.append(self.starts[-1] + len(shard))
        self.tokens = self.starts[-1]

    def windows(self, seq_len: int, what: str) -> int:
        n = (self.tokens - 1) // seq_len if self.tokens else 0
        if n < 1:
            hint = "; prepare it with a larger --val-fraction" if self.split == "val" else ""
            raise DataError(f"{what}: a window of {seq_len + 1} tokens is longer than the split "
                            f"({self.tokens} tokens){hint}")
        return n

    def read(self, start: int, out: np.ndarray) -> None:
        """out[:] = stream[start : start + len(out)], across shard boundaries."""
        i = bisect.bisect_right(self.starts, start) - 1
        pos, n = start - self.starts[i], len(out)
        done = 0
        while done < n:
            piece = self.shards[i][pos:pos + n - done]
            out[done:done + len(piece)] = piece
            done += len(piece)
            i, pos = i + 1, 0

    def check(self, tokens: np.ndarray, spans: Callable[[], Iterable[tuple[int, int]]]) -> None:
        """Raises DataError if an id in `tokens` (int32, read from this stream) is outside the vocabulary.

        One max over the batch (and for uint32 shards one min: an id past 2^31 is a negative int32); only
        then are the stream spans (start, length) the batch was read from searched, to name the shard
        file, the token's position in it and the id."""
        if not tokens.size or tokens.max() < self.vocab_size and (self.itemsize < 4 or tokens.min() >= 0):
            return
        for start, n in spans():
            span = np.empty(n, self.shards[0].dtype)  # the shards' own dtype: no id wraps
            self.read(start, span)
            bad = np.flatnonzero(span >= self.vocab_size)
            if len(bad):
                at = start + int(bad[0])  # in the stream, then in its shard
                i = bisect.bisect_right(self.starts, at) - 1
                offset = at - self.starts[i]
                raise DataError(f"{self.files[i]}: token {offset} (at byte {offset * span.dtype.itemsize}) is id "
                                f"{int(span[bad[0]])}, outside the vocabulary of {self.vocab_size}: the shard is "
                                f"corrupt; `python data.py --verify {self.directory}` checks every file")
        raise DataError(f"{self.directory} split {self.split!r}: a batch holds token ids outside the vocabulary "
                        f"of {self.vocab_size} (from {int(tokens.min())} to {int(tokens.max())})")


class Loader:
    """Batches of training windows; the batch at a step is a pure function of (seed, step, shape, process).

    Global sample g = step * batch_size + row falls in epoch g // num_windows, where it is window
    permute(g % num_windows, seed, epoch). Process p computes only rows [p*B/P, (p+1)*B/P).
    """

    def __init__(self, data_dir, split: str, seq_len: int, batch_size: int, *, seed: int = 0,
                 process_index: int = 0, process_count: int = 1):
        if seq_len < 1 or batch_size < 1:
            raise DataError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise DataError(f"process index {process_index} is outside process count {process_count}")
        if batch_size % process_count:
            raise DataError(f"global batch size {batch_size} does not divide by {process_count} processes")
        self.stream = Stream(data_dir, split)
        self.index = self.stream.index
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.local_batch_size = batch_size // process_count
        self.num_windows = self.stream.windows(seq_len, f"{data_dir} split {split!r}")
        self.rows = np.arange(process_index * self.local_batch_size,
                              (process_index + 1) * self.local_batch_size, dtype=np.int64)

    def get_batch(self, step: int) -> np.ndarray:
        """int32 [local_batch_size, seq_len + 1]: this process's rows of the global batch at `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        g = step * self.batch_size + self.rows
        windows = permute(g % self.num_windows, self.num_windows, self.seed, g // self.num_windows)
        batch = np.empty((self.local_batch_size, self.seq_len + 1), np.int32)
        for row, window in zip(batch, windows.tolist()):
            self.stream.read(window * self.seq_len, row)
        self.stream.check(batch, lambda: ((window * self.seq_len, self.seq_len + 1) for window in windows.tolist()))
        return batch

    def iterate(self, start_step: int = 0, prefetch: int = 2) -> Iterator[np.ndarray]:
        """get_batch(start_step), get_batch(start_step + 1), ...; prefetch > 0 fills a queue from a thread."""
        return self._prefetched(start_step, prefetch) if prefetch > 0 else self._plain(start_step)

    def _plain(self, step: int) -> Iterator[np.ndarray]:
        while True:
            yield self.get_batch(step)
            step += 1

    def _prefetched(self, step: int, depth: int) -> Iterator[np.ndarray]:
        batches: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def produce(step: int) -> None:
            while not stop.is_set():
                try:
                    item: object = self.get_batch(step)
                except BaseException as e:  # handed to the consumer, which re-raises it
                    item = e
                while not stop.is_set():  # a timed put, so a stopped consumer never leaves it blocked
                    try:
                        batches.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        pass
                if isinstance(item, BaseException):
                    return
                step += 1

        thread = threading.Thread(target=produce, args=(step,), name="data-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = batches.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:  # generator closed or collected: stop the producer and wait for it
            stop.set()
            thread.join()


def eval_batches(data_dir, split: str, seq_len: int, batch_size: int, *,
                 max_windows: int | None = None) -> Iterator[np.ndarray]:
    """Every non-overlapping window stream[i*T : i*T + T + 1] of the split once, in order, in batches."""
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
    stream = Stream(data_dir, split)
    n = stream.windows(seq_len, f"{data_dir} split {split!r}")
    n = n if max_windows is None else min(n, max_windows)
    for first in range(0, n, batch_size):
        batch = np.empty((min(batch_size, n - first), seq_len + 1), np.int32)
        for row, window in enumerate(range(first, first + len(batch))):
            stream.read(window * seq_len, batch[row])
        stream.check(batch, lambda: [(first * seq_len, len(batch) * seq_len + 1)])  # the rows' windows, in order
        yield batch


# ---------------------------------------------------------------------------------------------
# Command line

def _beam_flags(options: list[str], runner: str) -> list[str]:
    """--beam-option KEY=VALUE ... to Beam's own flags --KEY=VALUE."""
    if options and runner != "beam":
        raise DataError("--beam-option needs --runner beam")
    flags = []
    for option in options:
        key, eq, value = option.removeprefix("--").partition("=")
        if not eq or not key:
            raise DataError(f"--beam-option {option!r}: expected KEY=VALUE, e.g. runner=DataflowRunner")
        flags.append(f"--{key}={value}")
    return flags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tokenize a corpus into memory-mapped shards "
                                                 "(no --input: this Python's stdlib sources).")
    parser.add_argument("--input", action="append", default=[], metavar="PATTERN",
                        help="glob, directory, or hf:NAME[/CONFIG]:SPLIT; repeatable")
    parser.add_argument("--out", help=f"data directory (default with no --input: {DEFAULT_DATA_DIR})")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tokenizer", help="a tokenizers tokenizer.json to use instead of training a BPE")
    group.add_argument("--vocab-size", type=int, help="vocabulary of the BPE trained on the inputs "
                                                      "(default 8192, 4096 for the default corpus)")
    parser.add_argument("--val-fraction", type=float, help="share of documents held out "
                                                             "(default 0.005; 0.05 for prompt_completion)")
    parser.add_argument("--workers", type=int, help="tokenizer threads (default: all cores)")
    parser.add_argument("--shard-tokens", type=int, default=2**27, help="tokens per shard file")
    parser.add_argument("--text-field", default="text", help="JSON field / Parquet column holding the text")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    parser.add_argument("--strict", action="store_true", help="fail on unreadable input instead of skipping")
    parser.add_argument("--runner", choices=("local", "beam"), default="local",
                        help="local: this process (default); beam: an Apache Beam pipeline (data_beam.py)")
    parser.add_argument("--beam-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a Beam pipeline option, e.g. runner=DataflowRunner; repeatable")
    parser.add_argument("--verify", metavar="DIR", help="check every file of a prepared directory against its "
                                                        "index.json (sizes, sha256) and exit: 0 intact, 2 not")
    fine = parser.add_argument_group("prompt/completion fine-tuning data (--format prompt_completion, "
                                      "see finetune_data.py; --tokenizer may name a run directory)")
    fine.add_argument("--format", choices=("text", "prompt_completion"), default="text",
                      help="text: documents for pre-training; prompt_completion: JSON Lines pairs with a loss mask")
    fine.add_argument("--in-field", default="in_text", help="JSON field of the prompt")
    fine.add_argument("--out-field", default="out_text", help="JSON field of the completion")
    fine.add_argument("--seq-len", type=int, help="training context: longer examples lose prompt tokens "
                                                   "from the left (required with prompt_completion)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.verify:
            if args.input or args.out:
                raise DataError("--verify DIR checks a prepared directory; it takes no --input or --out")
            problems, summary = verify(args.verify)
            for line in problems:
                print(line)
            if problems:
                raise DataError(summary)
            print(summary)
            return 0
        if args.format == "prompt_completion":
            import finetune_data

            if args.runner != "local":
                raise DataError("--format prompt_completion runs in this process only (no --runner beam)")
            if not args.input or not args.out or not args.seq_len:
                raise DataError("--format prompt_completion needs --input, --out and --seq-len")
            val_fraction = 0.05 if args.val_fraction is None else args.val_fraction
            index = finetune_data.prepare(args.input, args.out, seq_len=args.seq_len, tokenizer=args.tokenizer,
                                          vocab_size=args.vocab_size or 8192, in_field=args.in_field,
                                          out_field=args.out_field, val_fraction=val_fraction,
                                          shard_tokens=args.shard_tokens, overwrite=args.overwrite)
            train_split, val_split = index["splits"]["train"], index["splits"]["val"]
            print(f"{index['examples']:,} examples (train {train_split['examples']:,}, val {val_split['examples']:,}"
                  f"{_extra(index)}), "
                  f"{index['tokens']:,} tokens, {train_split['completion_tokens'] + val_split['completion_tokens']:,} "
                  f"in the loss; {index['truncated']} prompts truncated from the left, {index['skipped']} examples "
                  f"skipped (completion longer than --seq-len {args.seq_len}), {index['skipped_records']} invalid "
                  f"records skipped{_skipped_names(index, args.out)}; vocab {index['vocab_size']}, "
                  f"{time.perf_counter() - start:.1f}s -> {args.out}")
            return 0
        if args.val_fraction is None:
            args.val_fraction = 0.005
        beam_options = _beam_flags(args.beam_option, args.runner)
        runner = dict(runner=args.runner, beam_options=beam_options)
        if args.input:
            if not args.out:
                raise DataError("--out is required with --input")
            out = pathlib.Path(args.out)
            index = prepare(args.input, out, tokenizer=args.tokenizer, vocab_size=args.vocab_size or 8192,
                            val_fraction=args.val_fraction, workers=args.workers,
                            shard_tokens=args.shard_tokens, text_field=args.text_field,
                            overwrite=args.overwrite, strict=args.strict, **runner)
        else:
            out = pathlib.Path(args.out or DEFAULT_DATA_DIR)
            index = prepare_default(out, vocab_size=args.vocab_size or 4096, overwrite=args.overwrite,
                                    tokenizer=args.tokenizer, workers=args.workers, **runner)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    splits, skipped = index["splits"], index["skipped_files"] + index["skipped_records"]
    print(f"{index['documents']:,} documents, {index['tokens']:,} tokens "
          f"(train {splits['train']['tokens']:,}, val {splits['val']['tokens']:,}{_extra(index)}), "
          f"{index['bytes_per_token']:.2f} bytes/token, unigram entropy {index['unigram_entropy']:.3f} "
          f"nats/token, vocab {index['vocab_size']}, {index['dtype']}"
          + (f", {skipped} unreadable or invalid inputs skipped{_skipped_names(index, out)}" if skipped else "")
          + f", {time.perf_counter() - start:.1f}s -> {out}")
    return 0


def _extra(index: dict) -> str:
    """Where the validation split holds a document only because none fell below the fraction, which one."""
    if index["val_extra"] is None:
        return ""
    return f": {index['val_extra']}, held out as none fell below --val-fraction"


def _skipped_names(index: dict, out) -> str:
    """" (a.txt, b.jsonl:3, ... and 1 more; listed in DIR/index.json)" when inputs were skipped, else ""."""
    tally = corpus.Tally(skipped_files=index.get("skipped_files", 0), skipped_records=index["skipped_records"],
                         skipped=index["skipped_inputs"])
    if not tally.skipped:
        return ""
    return f" ({tally.skipped_names()}; listed in {pathlib.Path(out) / 'index.json'})"


if __name__ == "__main__":
    sys.exit(main())
