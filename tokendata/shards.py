"""The on-disk token format of a prepared data directory: everything preparation and loading share.

A data directory DIR (FORMAT_VERSION 1):

    DIR/tokenizer.json        the `tokenizers` tokenizer that produced the ids (a copy, so DIR describes itself)
    DIR/train_00000.bin ...   raw little-endian uint16 token ids (uint32 if the vocabulary needs it), no header
    DIR/val_00000.bin ...
    DIR/index.json            written last: format_version, tokenizer, tokenizer_sha256, vocab_size (the
                              tokenizer's, which sizes the model), vocab_size_requested (of a BPE trained here,
                              which a small corpus leaves short of it; null for a given tokenizer), eot_id,
                              dtype, tokens, documents, bytes_per_token, unigram_entropy (nats per token of
                              the train split), skipped inputs, the inputs, and per split its tokens,
                              documents, bytes, unigram_entropy and shards [{file, tokens, documents, sha256}]

Every document is followed by the end-of-text id. A split is one logical token stream: its shards
concatenated in order. Prompt/completion data (finetune_data.py) is the same format with
`kind: "prompt_completion"` and `seq_len` in the index and, per split, `mask_shards`: parallel uint8
files {split}_mask_NNNNN.bin, one byte per token (PROMPT, COMPLETION, or END for the end-of-text
token that closes an example). Preference data (preference_data.py) is that format too, with `kind:
"preference"`: each pair is two examples one after the other, the prompt with its chosen response, then
the prompt with its rejected one.

Writing is shard_writer.py's (the tokenizer, ShardWriter, the staged directory swapped into place).
Reading: `open_data` opens a directory once, as a `DataDir` that every reader in the process is handed:
it checks the index (its fields' types and ranges, and its kind against its files: loss-mask shards in
every split with `kind: "prompt_completion"`, none without a kind), the tokenizer's sha256 and every
shard's size (truncated, extended, missing), reading index.json and the tokenizer once each; `verify`
reads every file against its sha256. `Source` reads a directory's files where they are: memory-mapped
on a local disk, by byte ranges from a URL (gs://...), nothing copied; at a URL one listing of the
directory gives every file's size and version (the object store's generation and checksum), so that a
resume can refuse data that changed underneath.

Knows nothing of models or of how documents are found (corpus.py) or batched (loader.py).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import shlex
from typing import NamedTuple

import numpy as np

from core import storage
from core.errors import DataError, MissingFile

FORMAT_VERSION = 1
EOT_TOKEN = "<|endoftext|>"
EOT_CANDIDATES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[EOS]")
PROMPT_COMPLETION = "prompt_completion"  # index["kind"] of prompt/completion data; text data has no kind
PREFERENCE = "preference"  # index["kind"] of preference pairs (prompt, chosen, rejected), with loss masks too
MASKED_KINDS = (PROMPT_COMPLETION, PREFERENCE)  # the kinds whose splits have loss-mask shards
ENTROPY_FIELDS = ("unigram_entropy", "loss_unigram_entropy")  # of the index and of each split: numbers or absent
PROMPT, COMPLETION, END = 0, 1, 2  # loss-mask byte values of prompt/completion data
BATCHING = ("packing", "padding")  # how the loader fills rows with prompt/completion examples (data.batching)


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
# Reading: the index and the files it names


def is_prompt_completion(index: dict) -> bool:
    return index.get("kind") == PROMPT_COMPLETION


def is_preference(index: dict) -> bool:
    return index.get("kind") == PREFERENCE


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_kind(index: dict, path: str) -> None:
    """A directory's kind agrees with its files: `kind: prompt_completion` and loss-mask shards in every
    split, or no kind (text, as every data.py wrote it) and no loss-mask shards. Anything else is refused:
    prompt/completion data read as text would train on its prompts, and the masks be ignored."""
    kind, splits = index.get("kind"), index["splits"]
    masked = [name for name, split in splits.items() if "mask_shards" in split]
    if "kind" in index and kind not in MASKED_KINDS:
        raise DataError(f"{path}: unknown kind {kind!r}: this data.py reads {PROMPT_COMPLETION!r} (prompt/completion "
                        f"data), {PREFERENCE!r} (preference pairs) or no kind at all (text); prepare the directory "
                        f"again")
    if kind in MASKED_KINDS and len(masked) < len(splits):
        unmasked = next(name for name in splits if name not in masked)
        raise DataError(f"{path}: kind {kind!r}, but split {unmasked!r} has no mask_shards (its loss "
                        f"masks); prepare the directory again")
    if kind is None and masked:
        raise DataError(f"{path}: split {masked[0]!r} has loss-mask shards (mask_shards) but the index names no "
                        f"kind: prompt/completion data would be read as text; restore its \"kind\": "
                        f"\"{PROMPT_COMPLETION}\" or prepare the directory again")


VERSION_FIELDS = ("generation", "md5Hash", "crc32c", "ETag", "etag")  # what an object store says of an object
LOCAL_VERSION_FIELDS = ("mtime", "created", "LastModified")  # where it says none of those


class Source:
    """A data directory's files by name, read where they are: memory-mapped on a local disk; at a URL
    (gs://..., through fsspec) by byte ranges, a batch's ranges in one concurrent request. A failed
    read is a DataError naming the file."""

    def __init__(self, location):
        location = storage.local_path(str(location))
        self.remote = storage.is_url(location)
        self.location = location.rstrip("/") if self.remote else location
        if self.remote:
            self.fs, self.root = storage.filesystem(self.location, DataError)

    def __str__(self) -> str:
        return self.location

    def show(self, name: str) -> str:
        """How a file of the directory is named in messages."""
        return f"{self.location}/{name}" if self.remote else str(pathlib.Path(self.location) / name)

    def _failed(self, name: str, e: BaseException) -> DataError:
        if isinstance(e, FileNotFoundError):
            return MissingFile(f"{self.show(name)} not found")
        return DataError(f"reading {self.show(name)} failed ({storage.os_problem(e) or type(e).__name__}: "
                         f"{storage.one_line(e)})")

    def read_bytes(self, name: str) -> bytes:
        try:
            if self.remote:
                return self.fs.cat_file(f"{self.root}/{name}")
            return (pathlib.Path(self.location) / name).read_bytes()
        except Exception as e:
            raise self._failed(name, e) from None

    def is_file(self) -> bool:
        """Whether the location itself is a file (or, at a URL, an object), which a directory never is."""
        try:
            return self.fs.isfile(self.root) if self.remote else os.path.isfile(self.location)
        except Exception:  # no access, no network: the read that follows says so
            return False

    def read_head(self, n: int) -> bytes:
        """The first `n` bytes of the location itself, when it is a file."""
        try:
            if self.remote:
                return self.fs.cat_file(self.root, start=0, end=n)
            with open(self.location, "rb") as f:
                return f.read(n)
        except Exception as e:
            raise self._failed("", e) from None

    def listing(self) -> dict[str, dict]:
        """{name: {"size": bytes, "version": {field: value}}} of the files directly in the directory, in one
        listing; a version is the object store's generation and checksums (or its modification time)."""
        if not self.remote:
            root = pathlib.Path(self.location)
            return {p.name: {"size": p.stat().st_size, "version": {"mtime": str(p.stat().st_mtime_ns)}}
                    for p in (root.iterdir() if root.is_dir() else []) if p.is_file()}
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:
            raise self._failed("", e) from None
        files = {}
        for info in entries:
            if info.get("type") == "directory":
                continue
            fields = [k for k in VERSION_FIELDS if info.get(k)] or [k for k in LOCAL_VERSION_FIELDS if info.get(k)]
            files[info["name"].rstrip("/").rsplit("/", 1)[-1]] = {
                "size": int(info["size"]), "version": {k: str(info[k]) for k in fields}}
        return files

    def memmap(self, name: str, dtype, count: int) -> np.ndarray:
        """A local file as an array of `count` items (a plain ndarray view: cheaper to slice than a memmap)."""
        return np.asarray(np.memmap(pathlib.Path(self.location) / name, dtype, "r", shape=(count,)))

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """The bytes [start, end) of each (name, start, end) of a URL's files, in one concurrent request."""
        if not ranges:
            return []
        try:
            return self.fs.cat_ranges([f"{self.root}/{name}" for name, _, _ in ranges],
                                      [a for _, a, _ in ranges], [b for _, _, b in ranges], on_error="raise")
        except Exception as e:
            names = sorted({name for name, _, _ in ranges})
            what = names[0] if len(names) == 1 else f"{{{','.join(names)}}}"  # one file, or the set: {a,b}
            raise self._failed(what, e) from None


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


SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 4096  # a shard's sampled fingerprint: this many blocks of this many bytes


def sample_starts(size: int) -> list[int]:
    """Where a file of `size` bytes is sampled: SAMPLE_BLOCKS blocks spread evenly from its first byte to its
    last (fewer, overlapping none, in a small file)."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return list(range(0, size, SAMPLE_BYTES))
    last = size - SAMPLE_BYTES
    return [last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]


def sampled_sha256(blocks: list[bytes]) -> str:
    """16 hex digits of the sha256 of a file's sampled blocks (sample_starts), each with its length."""
    h = hashlib.sha256()
    for block in blocks:
        h.update(len(block).to_bytes(8, "little"))
        h.update(block)
    return h.hexdigest()[:16]


def changed_samples(data: DataDir) -> list[str]:
    """The shard files of a local data directory whose sampled blocks no longer give the fingerprint index.json
    records (`sampled`, written at preparation): bytes changed in place since (the sizes are checked when the
    directory opens). A change outside the sampled blocks goes unseen: `data.py --verify` reads every byte.
    A URL's files are not read here: their object-store versions say more, and are checked instead."""
    if data.remote:
        return []
    changed = []
    for split in data.splits.values():
        for shard in split["shards"] + split.get("mask_shards", []):
            if isinstance(shard.get("sampled"), str):
                path = pathlib.Path(data.location) / shard["file"]
                size = path.stat().st_size
                with open(path, "rb") as f:
                    blocks = []
                    for start in sample_starts(size):
                        f.seek(start)
                        blocks.append(f.read(SAMPLE_BYTES))
                if sampled_sha256(blocks) != shard["sampled"]:
                    changed.append(shard["file"])
    return changed


def content_sha256(index: dict) -> str:
    """A fingerprint of what a data directory holds, from its index: the tokenizer's sha256, the token
    type, and every split's counts and shards (their sizes, token counts and sha256s). Two directories
    with the same fingerprint give a run the same batches; preparing again with another tokenizer or
    other documents changes it. Where the directory is (its path or URL) is not part of it."""
    content = {key: index.get(key) for key in ("tokenizer_sha256", "vocab_size", "eot_id", "dtype", "kind")}
    content["splits"] = index.get("splits")
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def not_prepared(source: Source) -> DataError:
    """The error for a data directory given as a file (a corpus file, prompt/completion pairs): data.py
    prepares it, in the command that does (--format prompt_completion for records without a `text` field,
    as its first line shows)."""
    name = source.location.rstrip("/").rsplit("/", 1)[-1]
    out = f"data/{name.split('.')[0] or 'prepared'}"
    try:  # the first line: prompt/completion records have no `text` (a compressed file: read as text)
        head = source.read_head(1 << 16)
        first = json.loads(head.split(b"\n", 1)[0]) if head[:1] == b"{" else None
    except (DataError, ValueError):
        first = None
    pairs = isinstance(first, dict) and "text" not in first
    given = shlex.quote(source.location)
    command = (f"python data.py --format prompt_completion --input {given} --out {out} --tokenizer RUN_DIR --seq-len T"
               if pairs else f"python data.py --input {given} --out {out}")
    return DataError(f"{source.location} is a file, not a prepared data directory: data.py prepares it into one "
                     f"(`{command}`" + (": RUN_DIR the run it fine-tunes, whose tokenizer the pairs need, T the "
                                        "context it trains at" if pairs else "")
                     + f"); then give that directory ({out}) instead")


def read_index(data_dir) -> tuple[Source, dict, list[IndexedFile]]:
    """(its Source, index, the files it names) of a data directory, the index's own fields checked but
    not the files."""
    source = Source(data_dir)
    path = source.show("index.json")
    if not source.remote and os.path.isfile(source.location):
        raise not_prepared(source)
    try:
        raw = source.read_bytes("index.json")
    except MissingFile:
        if source.remote and source.is_file():
            raise not_prepared(source) from None
        raise DataError(f"{path} not found; prepare the data with `python data.py`") from None
    try:
        index = json.loads(raw)
        version = index["format_version"]
        if version != FORMAT_VERSION:
            raise DataError(f"{path}: format version {version}, this data.py reads {FORMAT_VERSION}")
        dtype, vocab = index["dtype"], index["vocab_size"]
        if not _is_int(vocab) or vocab < 1:
            raise DataError(f"{path}: vocab_size must be a positive integer, got {vocab!r}; re-run data.py")
        if dtype not in ("uint16", "uint32") or vocab > np.iinfo(dtype).max + 1:
            raise DataError(f"{path}: dtype {dtype!r} cannot hold vocabulary size {vocab}")
        if not _is_int(index["eot_id"]) or not 0 <= index["eot_id"] < vocab:
            raise DataError(f"{path}: eot_id must be a token id below vocab_size {vocab}, got {index['eot_id']!r}")
        _check_kind(index, path)
        for name, split in index["splits"].items():
            if sum(int(s["tokens"]) for s in split["shards"]) != int(split["tokens"]):
                raise DataError(f"{path}: split {name!r} shard token counts do not add up to {split['tokens']}")
            if "mask_shards" in split and sum(int(s["tokens"]) for s in split["mask_shards"]) != int(split["tokens"]):
                raise DataError(f"{path}: split {name!r} loss-mask shard counts do not add up to {split['tokens']}")
        for where, fields in [("", index), *((f"split {name!r} ", split) for name, split in index["splits"].items())]:
            for key in ENTROPY_FIELDS:  # read back as numbers (train.py's summary compares the loss with them)
                value = fields.get(key)
                if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                              and math.isfinite(value) and value >= 0):
                    raise DataError(f"{path}: {where}{key} must be a number >= 0 (nats per token) or absent, "
                                    f"got {value!r}")
        files = index_files(index)
        bad = [f.file for f in files if not isinstance(f.file, str) or "/" in f.file or f.file in ("", ".", "..")]
        if bad:
            raise ValueError(f"file name {bad[0]!r} outside the directory")
        return source, index, files
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise DataError(f"{path} is corrupt ({type(e).__name__}: {e}); re-run data.py with --overwrite") from None


def _size(path: pathlib.Path) -> int | None:
    return path.stat().st_size if path.is_file() else None


def _size_problem(path, size: int | None, entry: IndexedFile) -> str | None:
    """A shard whose size (None: no such file) is not the recorded one: missing, truncated or extended."""
    if size == entry.size:
        return None
    return f"{path}: expected {entry.size} bytes ({entry.what}), found " + ("none: missing" if size is None
                                                                          else f"{size} bytes")


class DataDir:
    """A prepared data directory, opened once (`open_data`) and handed to whatever reads it: where it is
    (`source`: a local path, or a URL read by byte ranges), its checked `index`, the tokenizer's bytes
    (`tokenizer_json`) and sha256, its kind and splits, and at a URL the object store's version of each
    file as listed when it was opened (`versions`; None for a local directory), which a run records and
    a resume compares. str() is its location as given (a resolved path, or the URL)."""

    def __init__(self, source: Source, index: dict, tokenizer_json: bytes, versions: dict[str, dict] | None):
        self.source, self.index, self.tokenizer_json, self.versions = source, index, tokenizer_json, versions
        self.tokenizer_sha256: str = index["tokenizer_sha256"]
        self.vocab_size, self.eot_id, self.dtype = int(index["vocab_size"]), int(index["eot_id"]), index["dtype"]
        self.kind = index.get("kind", "text")
        self.splits: dict[str, dict] = index["splits"]

    def __str__(self) -> str:
        return str(self.source)

    def __repr__(self) -> str:
        return f"DataDir({str(self)!r})"

    @property
    def location(self) -> str:
        return self.source.location

    @property
    def remote(self) -> bool:
        return self.source.remote

    @property
    def is_prompt_completion(self) -> bool:
        return self.kind == PROMPT_COMPLETION

    @property
    def is_preference(self) -> bool:
        return self.kind == PREFERENCE

    @property
    def has_masks(self) -> bool:
        """Examples with loss masks (prompt/completion data or preference pairs), not a text stream."""
        return self.kind in MASKED_KINDS

    def show(self, name: str) -> str:
        """How a file of the directory is named in messages."""
        return self.source.show(name)

    def tokenizer(self):
        """Its tokenizers.Tokenizer, made from the bytes read when the directory was opened."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.tokenizer_json.decode())


def open_data(location) -> DataDir:
    """A prepared data directory, checked: its index (fields, kind against its files), the tokenizer
    against its recorded sha256, and every shard (loss-mask shards included) present with its recorded
    size; the shards' hashes are `verify`'s to check. index.json and the tokenizer are each read once;
    the sizes come from the file system, or at a URL from one listing of the directory (no shard byte
    is read). Anything wrong is one DataError line."""
    source, index, files = read_index(location)
    tokenizer = files[0]
    if source.remote:
        listing = source.listing()
        sizes = {name: entry["size"] for name, entry in listing.items()}
    else:
        root = pathlib.Path(source.location)
        sizes = {f.file: _size(root / f.file) for f in files}
    if sizes.get(tokenizer.file) is None:
        raise DataError(f"{source.show('index.json')}: tokenizer {source.show(tokenizer.file)} is missing")
    tokenizer_json = source.read_bytes(tokenizer.file)
    if hashlib.sha256(tokenizer_json).hexdigest() != tokenizer.sha256:
        raise DataError(f"{source.show('index.json')}: {source.show(tokenizer.file)} does not match the recorded "
                        f"sha256; prepare the directory again")
    for entry in files[1:]:
        problem = _size_problem(source.show(entry.file), sizes.get(entry.file), entry)
        if problem:
            raise DataError(problem)
    versions = {f.file: listing[f.file]["version"] for f in files if f.file in listing} if source.remote else None
    return DataDir(source, index, tokenizer_json, versions)


def verify(data_dir) -> tuple[list[str], str]:
    """Checks every file of a data directory against its index.json, reading each whole: the size and
    sha256 of every token and loss-mask shard and of the tokenizer. A shard for which the index records
    no sha256 (an index written before shards had hashes) gets its size checked, and for a token shard
    its ids against the vocabulary, for a loss-mask shard its bytes against the mask values (a split's
    last one ending in END). A URL is read where it is, each file streamed and hashed (no local
    copy). Returns (one line per problem, a one-line summary)."""
    source, index, files = read_index(data_dir)
    directory = storage.RunDir(source.location)  # its files by name, through fsspec at a URL
    problems, nbytes, unhashed = [], 0, 0
    # each split's last loss-mask shard, whose last byte closes the split's last example (END)
    closing = {split["mask_shards"][-1]["file"] for split in index["splits"].values() if split.get("mask_shards")}
    for entry in files:
        path, size = directory.show(entry.file), directory.size(entry.file)
        if entry.size is not None:
            problem = _size_problem(path, size, entry)
        else:
            problem = None if size is not None else f"{path}: missing"
        if problem is None and entry.sha256 is not None:
            digest = hashlib.sha256()
            for chunk in directory.chunks(entry.file):
                digest.update(chunk)
            if digest.hexdigest() != entry.sha256:
                problem = (f"{path}: sha256 {digest.hexdigest()[:16]}..., index.json records "
                           f"{entry.sha256[:16]}...: changed")
        elif problem is None:
            unhashed += 1
            if entry.kind == "tokens" and entry.size:
                problem = _id_problem(directory, entry.file, index)
            elif entry.kind == "mask" and entry.size:
                problem = _mask_problem(directory, entry.file, entry.file in closing)
        if problem is None:
            nbytes += size
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
                    f"their sizes and token ids (loss-mask values) checked only")
    return [], f"{directory}: intact, {len(files)} files ({kinds}, the tokenizer), {nbytes / 1e6:.1f} MB; {checked}"


def _id_problem(directory: storage.RunDir, name: str, index: dict) -> str | None:
    """The first token id of a shard that is outside the vocabulary, if any (read as it streams)."""
    vocab, dtype = int(index["vocab_size"]), np.dtype(index["dtype"]).newbyteorder("<")
    done, rest = 0, b""  # tokens before this piece, and the bytes of a token split between two pieces
    for chunk in directory.chunks(name):
        chunk = rest + chunk
        whole = len(chunk) - len(chunk) % dtype.itemsize
        tokens, rest = np.frombuffer(chunk[:whole], dtype), chunk[whole:]
        if len(tokens) and int(tokens.max()) >= vocab:
            at = int(np.flatnonzero(tokens >= vocab)[0])
            return (f"{directory.show(name)}: token {done + at} is id {int(tokens[at])}, outside the vocabulary "
                    f"of {vocab}")
        done += len(tokens)
    return None


def _mask_problem(directory: storage.RunDir, name: str, closing: bool) -> str | None:
    """The first byte of a loss-mask shard that is no mask value, or (`closing`: the split's last shard) a
    last byte that does not end an example, if any (read as it streams)."""
    done, last = 0, None
    for chunk in directory.chunks(name):
        mask = np.frombuffer(chunk, np.uint8)
        if len(mask) and int(mask.max()) > END:
            at = int(np.flatnonzero(mask > END)[0])
            return (f"{directory.show(name)}: byte {done + at} is {int(mask[at])}, not a loss-mask value "
                    f"({PROMPT}, {COMPLETION} or {END})")
        done += len(mask)
        last = int(mask[-1]) if len(mask) else last
    if closing and last is not None and last != END:
        return f"{directory.show(name)}: the last byte is {last}, not {END}: the split's last example never ends"
    return None
