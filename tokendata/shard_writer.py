"""Writing a prepared data directory in shards.py's format: the tokenizer (a given tokenizer.json, or a
byte-level BPE trained on the train documents), the documents encoded in chunks, the shards, and the
staged directory they are written in.

`ShardWriter` cuts a split's tokens into shards, hashing each; `Staged` is the sibling DIR.tmp-<pid> a
directory is built in, swapped into place only when complete (outputs.StagedDir), so an interrupted
preparation never leaves an index naming missing or partial shards, nor loses the old DIR; `check_out`
says before anything is written whether DIR may be written at all.

Used by data.py, data_beam.py and finetune_data.py (and bench.py's remote-data benchmark); loading reads
the result through shards.py alone.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
from typing import Callable, Iterable, Iterator

import numpy as np

from core import outputs, storage
from core.errors import DataError
from tokendata import shards
from tokendata.shards import EOT_TOKEN, eot_id_of, load_tokenizer_file

CHUNK_BYTES = 1 << 20  # text per encode_batch call: large enough to amortise, small enough to bound memory
# the largest BPE vocabulary trained here: the tokenizers library reserves ~66 bytes an entry up front (2**30
# entries: 70 GB, an abort), and the largest vocabularies in use are near 2**18
MAX_TRAINED_VOCAB = 2**24


# ---------------------------------------------------------------------------------------------
# Tokenizer: a given tokenizer.json, or a byte-level BPE trained on the train documents

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


def check_trained_vocab(vocab_size: int, what: str = "vocab size") -> None:
    """A BPE vocabulary size train_tokenizer can take, or a DataError (before anything is written)."""
    if not 258 <= vocab_size <= MAX_TRAINED_VOCAB:
        raise DataError(f"{what} must be between 258 (256 byte symbols and the end-of-text token) and "
                        f"{MAX_TRAINED_VOCAB:,} (2**24) for a byte-level BPE, got {vocab_size:,}")


def tokenizer_path(tokenizer) -> pathlib.Path:
    """--tokenizer: a tokenizer.json, or a run or data directory holding one."""
    path = pathlib.Path(tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer {tokenizer} not found (give a tokenizer.json or a run/data directory with one)")
    return path


def install_tokenizer(tokenizer, directory: pathlib.Path):
    """The tokenizer of `tokenizer` (a tokenizer.json, or a run or data directory holding one), copied
    into directory/tokenizer.json (as it is, or saved with an end-of-text token added where it lacks one)."""
    path = tokenizer_path(tokenizer)
    tok = load_tokenizer_file(path)
    if eot_id_of(tok) is None:
        tok.add_special_tokens([EOT_TOKEN])
        tok.save(str(directory / "tokenizer.json"))
    else:
        shutil.copyfile(path, directory / "tokenizer.json")
    return tok



# ---------------------------------------------------------------------------------------------
# Encoding

def chunks(documents: Iterable[tuple[str, str]], is_val: Callable[[str], bool]) -> Iterator[tuple[str, list[str]]]:
    """(split, texts): the (key, text) documents in order, split by is_val(key) and gathered per split into
    chunks of CHUNK_BYTES of text or more (one encode_texts call each); each split's last chunk comes at the end."""
    pending = {"train": ([], 0), "val": ([], 0)}
    for key, text in documents:
        split = "val" if is_val(key) else "train"
        texts, size = pending[split]
        texts.append(text)
        if size + len(text) >= CHUNK_BYTES:
            yield split, texts
            pending[split] = ([], 0)
        else:
            pending[split] = (texts, size + len(text))
    for split, (texts, _) in pending.items():
        if texts:
            yield split, texts


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


# ---------------------------------------------------------------------------------------------
# Writing

def sampled_sha256(path: pathlib.Path) -> str:
    """shards.sampled_sha256 of a local file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        blocks = []
        for start in shards.sample_starts(size):
            f.seek(start)
            blocks.append(f.read(shards.SAMPLE_BYTES))
    return shards.sampled_sha256(blocks)


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
            # a few of its blocks' hash, which a start checks cheaply (a resume, eval.py: shards.changed_samples)
            self.shards[-1]["sampled"] = sampled_sha256(self.directory / self.shards[-1]["file"])

    def summary(self) -> dict:
        return split_summary(self.shards, self.counts, self.bytes)


def split_summary(shards: list[dict], counts: np.ndarray, nbytes: int) -> dict:
    """A split's entry in the index, from its shards in order and its token frequencies."""
    return {"tokens": int(counts.sum()), "documents": sum(s["documents"] for s in shards), "bytes": nbytes,
            "unigram_entropy": unigram_entropy(counts), "shards": shards}


def unigram_entropy(counts: np.ndarray) -> float:
    """Unigram entropy in nats per token: H = -sum p log p over the observed token frequencies."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def made_here(entry: pathlib.Path) -> bool:
    """Whether an entry of a data directory is one data.py writes: index.json, tokenizer.json and the shards
    (SPLIT_00000.bin, SPLIT_mask_00000.bin)."""
    return entry.is_file() and (entry.name in ("index.json", "tokenizer.json")
                                or re.fullmatch(r"[a-z]+(_mask)?_\d{5,}\.bin", entry.name) is not None)


def check_out(out, overwrite: bool, inputs: list[str]) -> pathlib.Path:
    """A data directory may be written at `out` (outputs.check_out's rules): new, or with --overwrite an
    existing data directory (one with index.json) or empty directory, holding no input (--overwrite must
    never delete one), and its path UTF-8 text (the tokenizer library and index.json take no other). Raises
    DataError, before anything is written."""
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError as e:  # bytes that are no UTF-8, which Python keeps as lone surrogates
        shown = os.fsencode(str(out)).decode("utf-8", "backslashreplace")
        raise DataError(f"--out {shown} is not UTF-8 text (byte 0x{ord(str(out)[e.start]) & 0xFF:02x} at "
                        f"{e.start}): the tokenizer library writes only UTF-8 paths; choose another --out") from None
    out = outputs.check_out(out, overwrite, ours=lambda d: (d / "index.json").is_file(),
                            what="a data directory (one with index.json)", error=DataError, made=made_here)
    if out.exists() and not overwrite:
        raise DataError(f"{out} exists; pass --overwrite to replace it")
    for location in inputs:
        if storage.inside(location, out):
            raise DataError(f"input {location} lies inside the output directory {out}")
    return out


class Staged(outputs.StagedDir):
    """The sibling directory DIR.tmp-<pid> a data directory is built in, swapped into place when complete
    (outputs.StagedDir: the old DIR is replaced in one step, and only with overwrite=True).

        with shard_writer.Staged(out, overwrite) as staged:   # a fresh, empty staged.path (dead runs' leftovers settled)
            ... write staged.path / files ...
            staged.commit(index)                         # index.json written last, then the swap into place

    Leaving the block without commit (an error, Ctrl-C) removes the staged directory and leaves DIR as it
    was; a failed write (a full disk) is one StorageError line naming DIR. A URL DIR (gs://bucket/dir) is
    built on the local disk and uploaded with index.json last (outputs.StagedDir says what a kill leaves)."""

    def __init__(self, out, overwrite: bool = False):
        super().__init__(out, replace=overwrite, last="index.json")

    def commit(self, index: dict) -> None:
        (self.path / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        super().commit()
