"""Where documents come from: input patterns to sources, sources to (name, text) documents.

    sources = expand(["web/*.jsonl.zst", "books/", "hf:Salesforce/wikitext/wikitext-103-raw-v1:train"])
    reader = Reader(sources, text_field="text", strict=False)
    for name, text in reader: ...          # then reader.tally: files, skipped inputs (named), ...

Inputs: plain text (one document per file), JSON Lines (.jsonl/.ndjson, optionally .gz or .zst; one
document per record), Parquet (one per row), and hf:NAME[/CONFIG]:SPLIT through `datasets`. A
document's name is its path relative to the pattern's fixed leading directories, plus ":<record>" for
records; it decides whether the document is held out for validation (`in_val`, a hash of the name
below the validation fraction), so the split is stable and does not change when a corpus moves.
Before `datasets` is asked for an hf: dataset, the Hub is asked once (`hub_offline`): when it does
not answer, the Hugging Face libraries go offline, so a cached dataset loads and a missing one fails
at once, in one line.

An unreadable or undecodable file (a text file in UTF-16, or with NUL bytes, included: `text_problem`),
and a record that is not text, is skipped, counted and (the first LISTED of them, with the reason)
named, or with strict=True stops preparation. A document that is empty or only whitespace is no
document: it is counted as empty. The default corpus is
this Python's standard-library sources (`default_corpus_files`), with its own byte-balanced held-out
set (`default_held_out`).

Inputs may be URLs (gs://bucket/corpus/*.jsonl.zst), read through fsspec (storage.py). This module
imports nothing of the project but errors.py and storage.py; data.py tokenizes what it yields.
"""
from __future__ import annotations

import codecs
import dataclasses
import glob
import gzip
import hashlib
import io
import itertools
import json
import os
import pathlib
import sysconfig
from typing import Iterator

import fsspec

from core import storage
from core.errors import DataError

DEFAULT_VAL_FRACTION = 0.04  # of the stdlib's bytes: about 37 files, 150k tokens held out


# ---------------------------------------------------------------------------------------------
# The default corpus: the running interpreter's standard library

def default_corpus_files(stdlib_dir: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """The default corpus: the stdlib's .py files, sorted, without tests, vendored tools or non-UTF-8 files."""
    root = pathlib.Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = []
    for path in sorted(root.rglob("*.py")):
        if excluded & set(path.relative_to(root).parts[:-1]) or not path.is_file():
            continue
        try:
            path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        files.append(path)
    return files


def default_held_out(root: pathlib.Path, files: list[pathlib.Path]) -> set[str]:
    """Names (relative to root, '/'-separated) of the default corpus's validation files.

    Files are taken in the order of their names' hashes until they hold DEFAULT_VAL_FRACTION of the
    bytes: the same files on every run, and a validation split of predictable size although file
    sizes vary a hundredfold (a per-document hash test would make it swing with a few large files)."""
    names = {p.relative_to(root).as_posix(): p.stat().st_size for p in files}
    held, held_bytes, target = set(), 0, DEFAULT_VAL_FRACTION * sum(names.values())
    for name in sorted(names, key=lambda n: hashlib.blake2b(n.encode(), digest_size=8).digest()):
        if held_bytes >= target:
            break
        held.add(name)
        held_bytes += names[name]
    return held


# ---------------------------------------------------------------------------------------------
# Sources. A source is (kind, location, name): kind is text, jsonl, parquet or hf.

def _file_kind(path: str) -> str:
    name = path.lower().removesuffix(".gz").removesuffix(".zst")
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def expand(patterns: list[str]) -> list[tuple[str, str, str]]:
    """Glob patterns (a directory means every file under it) to sources, in order, without repeats.

    A document's name is its path relative to the pattern's fixed leading directories, so moving a
    corpus does not change which documents are held out."""
    sources, seen = [], set()
    for pattern in patterns:
        if pattern.startswith("hf:"):
            sources.append(("hf", pattern, pattern))
            continue
        if storage.is_url(pattern):  # gs://bucket/corpus/*.txt, or a directory there
            base, matches = _expand_url(pattern)
        elif os.path.isdir(pattern):
            base = pattern
            matches = sorted(str(p) for p in pathlib.Path(pattern).rglob("*") if p.is_file())
        else:
            parts = pattern.split(os.sep)
            fixed = list(itertools.takewhile(lambda part: not set("*?[") & set(part), parts))
            base = os.sep.join(fixed[:-1] if len(fixed) == len(parts) else fixed)
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not matches:
            raise DataError(f"no file matches {pattern!r}")
        for path in matches:
            if storage.is_url(path):
                key, name = path, path[len(base):].lstrip("/")
            else:
                key, name = os.path.realpath(path), os.path.relpath(path, base or ".")
            if key not in seen:
                seen.add(key)
                sources.append((_file_kind(path), path, name))
    return sources


def _expand_url(pattern: str) -> tuple[str, list[str]]:
    """(base, matching file URLs, sorted) of a URL pattern: a glob (fsspec's: *, ?, [...], ** across
    directories), or a directory meaning every file under it. Documents are named relative to the base,
    the pattern's fixed leading directories, as for local files: a corpus copied into a bucket keeps
    its names, so the same documents are held out."""
    fs, path = storage.filesystem(pattern, DataError)
    protocol = pattern.split("://", 1)[0]
    try:
        if not set("*?[") & set(path) and fs.isdir(path):
            base, found = pattern.rstrip("/"), fs.find(path, detail=True)
        else:
            parts = pattern.split("/")
            fixed = list(itertools.takewhile(lambda part: not set("*?[") & set(part), parts))
            base, found = "/".join(fixed[:-1] if len(fixed) == len(parts) else fixed), fs.glob(path, detail=True)
    except Exception as e:  # no access, no network
        raise DataError(f"{pattern}: {storage.one_line(e)}") from None
    return base, sorted(f"{protocol}://{name}" for name, info in found.items() if info.get("type") == "file")


def open_binary(path: str) -> io.BufferedIOBase:
    """A file (or a URL, through fsspec) opened for reading bytes, decompressed if it ends in .gz or .zst."""
    remote = storage.is_url(path)
    if path.lower().endswith(".gz"):
        return fsspec.open(path, "rb", compression="gzip").open() if remote else gzip.open(path, "rb")
    raw = fsspec.open(path, "rb").open() if remote else open(path, "rb")
    if path.lower().endswith(".zst"):
        import zstandard
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
    return raw


NOT_UTF8 = "not UTF-8"  # how json_lines begins the reason for a line with bytes that are not UTF-8


def json_lines(location: str) -> Iterator[tuple[int, object, str | None]]:
    """(line number, value, None) for each non-blank line of a JSON Lines file, or (line number, None,
    reason) for a line that is not UTF-8 or not JSON: a bad line costs only itself, never the rest of its
    file. Lines are split as text mode splits them (\\n, \\r\\n or \\r), so numbers match an editor's."""
    # undecodable bytes are kept as the lone surrogates U+DC80..U+DCFF, which no valid UTF-8 decodes to
    with io.TextIOWrapper(open_binary(location), encoding="utf-8", errors="surrogateescape") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not _encodable(line):
                at = next(i for i, ch in enumerate(line) if "\udc80" <= ch <= "\udcff")
                yield number, None, f"{NOT_UTF8}: byte 0x{ord(line[at]) - 0xDC00:02x} at character {at + 1}"
                continue
            try:
                yield number, json.loads(line), None
            except json.JSONDecodeError as e:
                yield number, None, f"not JSON: {e}"


def _records(kind: str, location: str, text_field: str) -> Iterator[tuple[int, object, str | None]]:
    """(record number, text value, None) of one jsonl/parquet/hf source; (record number, None, reason) for
    a record that cannot be read (a JSON Lines line that is not UTF-8 or not JSON)."""
    if kind == "jsonl":
        for number, record, problem in json_lines(location):
            if problem is not None:
                yield number, None, problem
                continue
            if not isinstance(record, dict) or text_field not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{location}:{number}: no field {text_field!r} (has: {keys}); "
                                f"choose one with --text-field")
            yield number, record[text_field], None
    elif kind == "parquet":
        import pyarrow.parquet as pq
        pf = pq.ParquetFile(open_binary(location) if storage.is_url(location) else location)
        if text_field not in pf.schema_arrow.names:
            raise DataError(f"{location}: no column {text_field!r} (has: {', '.join(pf.schema_arrow.names)}); "
                            f"choose one with --text-field")
        number = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                number += 1
                yield number, value, None
    else:  # hf:NAME[/CONFIG]:SPLIT, where NAME may be org/name, so a config follows a second '/'
        try:
            import datasets
        except ImportError:
            raise DataError(f"{location}: the `datasets` library is not installed (pip install datasets)")
        spec, _, split = location[3:].rpartition(":")
        parts = spec.split("/")
        name, config = ("/".join(parts[:2]), "/".join(parts[2:]) or None) if len(parts) > 2 else (spec, None)
        if not name or not split:
            raise DataError(f"{location}: expected hf:NAME[/CONFIG]:SPLIT")
        offline = hub_offline()
        try:
            rows = datasets.load_dataset(name, config, split=split, streaming=True)
            for number, row in enumerate(rows, 1):
                if text_field not in row:
                    raise DataError(f"{location}: no field {text_field!r} (has: {', '.join(row)})")
                yield number, row[text_field], None
        except DataError:
            raise
        except Exception as e:  # the hub's errors are many; the first line names the problem
            if offline and isinstance(e, ConnectionError):  # datasets offline, on a dataset it has not cached
                raise DataError(f"{location}: {name} is not in the datasets cache {datasets.config.HF_DATASETS_CACHE} "
                                f"and {offline}") from None
            raise DataError(f"{location}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                            + (f"; {offline}" if offline else "")) from None


# ---------------------------------------------------------------------------------------------
# The Hugging Face Hub, asked once before the `datasets` library is

HUB_TIMEOUT = 5.0  # seconds the Hub has to answer before its datasets come from the local cache only
_hub: dict[str, str | None] = {}  # "offline": the answer for this process, once the Hub was asked


def hub_offline(timeout: float = HUB_TIMEOUT) -> str | None:
    """Why Hugging Face Hub datasets can come only from the local cache now, or None when the Hub answers.

    Offline mode set by the user (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE) is kept. Otherwise the Hub
    (HF_ENDPOINT) is asked once, with a short timeout, and if it does not answer, huggingface_hub and
    datasets are switched to their offline mode for the rest of the process: a dataset in the local
    cache still loads, and one that is not fails at once, where the libraries would retry each request
    with back-off (half a minute of warnings for one dataset) before failing or falling back to the cache.
    """
    if "offline" in _hub:
        return _hub["offline"]
    try:
        import datasets.config as datasets_config
    except ImportError:
        datasets_config = None
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE or getattr(datasets_config, "HF_HUB_OFFLINE", False):
        return "offline mode is set (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE)"
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)  # any answer, an error status included, will do
        _hub["offline"] = None
        return None
    except Exception as e:  # no answer: refused, no name resolution, timed out, TLS failure
        reason = (str(e).splitlines() or [""])[0] or type(e).__name__
    _hub["offline"] = f"the Hugging Face Hub at {constants.ENDPOINT} does not answer ({reason})"
    # the libraries read the setting once, at import: set where they look now, and for what imports later
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True
    return _hub["offline"]


def _read_errors() -> tuple[type[Exception], ...]:
    """What an unreadable, undecodable or corrupt file raises (gzip's and pyarrow's derive from these)."""
    errors: tuple[type[Exception], ...] = (OSError, EOFError, UnicodeDecodeError, ValueError)
    try:
        import zstandard
        return errors + (zstandard.ZstdError,)
    except ImportError:
        return errors


def _encodable(text: str) -> bool:
    """False for text with lone surrogates (JSON can escape them), which no tokenizer accepts."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


LISTED = 100  # skipped inputs named (with the reason) in index.json; past these they are only counted
SHOWN = 5  # of those, named in the one-line summaries


@dataclasses.dataclass
class Tally:
    """What reading came to: files done, inputs skipped (the first LISTED named), and the document that
    ranks first for validation (the lowest `val_rank`), which is held out when the validation fraction
    holds out no document. Tallies of parts (data_beam.py's sources) add up in input order."""

    files: int = 0
    skipped_files: int = 0
    skipped_records: int = 0
    skipped: list[dict] = dataclasses.field(default_factory=list)  # {"input": PATH or PATH:RECORD, "reason": ...}
    lowest: tuple[int, str] | None = None  # (val_rank(name), name)
    empty: int = 0  # documents (files, records) that were empty or only whitespace: no document, not read on

    def skip(self, where: str, reason: str, record: bool) -> None:
        if record:
            self.skipped_records += 1
        else:
            self.skipped_files += 1
        if len(self.skipped) < LISTED:
            self.skipped.append({"input": where, "reason": reason})

    def saw(self, name: str) -> None:
        """A document was read (whichever split it goes to)."""
        rank = (val_rank(name), name)
        if self.lowest is None or rank < tuple(self.lowest):
            self.lowest = rank

    def add(self, other: Tally) -> None:
        """Appends the tally of the inputs that follow this one's."""
        self.files += other.files
        self.skipped_files += other.skipped_files
        self.skipped_records += other.skipped_records
        self.empty += other.empty
        self.skipped = (self.skipped + other.skipped)[:LISTED]
        if other.lowest is not None:
            self.saw(other.lowest[1])

    def skipped_names(self) -> str:
        """The first SHOWN skipped inputs by name, and how many more: "a.txt, b.jsonl:3 and 4 more"."""
        count = self.skipped_files + self.skipped_records
        names = ", ".join(entry["input"] for entry in self.skipped[:SHOWN])
        return names + (f" and {count - SHOWN} more" if count > SHOWN else "")


_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
         (codecs.BOM_UTF16_BE, "UTF-16"))  # UTF-32's first: its little-endian mark begins with UTF-16's


def text_problem(raw: bytes) -> str | None:
    """Why a plain-text file's bytes are no UTF-8 document though they might decode as one, or None: UTF-16
    (or UTF-32) text, with a byte-order mark or without one (its ASCII characters then alternate with NUL
    bytes, which are valid UTF-8 and would be tokenized), or NUL bytes elsewhere (a binary file, or a
    damaged one). Bytes that are not UTF-8 at all are the decoder's to refuse."""
    for bom, encoding in _BOMS:
        if raw.startswith(bom):
            return (f"{encoding} text (byte-order mark {bom.hex(' ').upper()}), not UTF-8: convert it, "
                    f"e.g. iconv -f {encoding} -t UTF-8")
    first = raw.find(b"\0")
    if first < 0:
        return None
    units = len(raw) // 2
    for offset, order in ((1, "LE"), (0, "BE")):  # ASCII in UTF-16LE: "a\0b\0", in UTF-16BE: "\0a\0b"
        if units and raw[offset::2].count(0) >= units / 2 > raw[1 - offset::2].count(0):
            return (f"UTF-16{order} text without a byte-order mark (NUL bytes at every other position), "
                    f"not UTF-8: convert it, e.g. iconv -f UTF-16{order} -t UTF-8")
    count = raw.count(0)
    return (f"{count} NUL byte{'s' * (count > 1)}, the first at byte {first}: not plain text (a binary or damaged "
            f"file); remove them or leave the file out")


class Reader:
    """Streams (name, text) documents from sources, keeping a Tally of what it read and skipped. A
    document that is empty or only whitespace is no document: counted (Tally.empty), not yielded."""

    def __init__(self, sources: list[tuple[str, str, str]], text_field: str, strict: bool):
        self.sources, self.text_field, self.strict = sources, text_field, strict
        self.tally = Tally()

    def _skip(self, where: str, reason: str, record: bool = False) -> None:
        if self.strict:
            raise DataError(f"{where}: {reason} (drop --strict to skip it)")
        self.tally.skip(where, reason, record)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for kind, location, name in self.sources:
            try:
                if kind == "text":
                    with open_binary(location) as f:
                        raw = f.read()
                    problem = text_problem(raw)
                    if problem is not None:
                        self._skip(location, problem)
                    elif (text := raw.decode("utf-8")) and not text.isspace():
                        self.tally.saw(name)
                        yield name, text
                    else:
                        self.tally.empty += 1
                else:
                    for number, value, problem in _records(kind, location, self.text_field):
                        if problem is not None:
                            self._skip(f"{location}:{number}", problem, record=True)
                        elif isinstance(value, str) and _encodable(value):
                            if value and not value.isspace():
                                self.tally.saw(f"{name}:{number}")
                                yield f"{name}:{number}", value
                            else:
                                self.tally.empty += 1
                        else:  # null included: a record without text is counted and named, never dropped unseen
                            self._skip(f"{location}:{number}", f"not a text record ({value!r:.80})", record=True)
            except DataError:
                raise
            except _read_errors() as e:
                self._skip(location, f"cannot read: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            self.tally.files += 1


def val_rank(name: str) -> int:
    """A document's rank for validation: a 64-bit hash of its name; the lowest ranks are held out first."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def in_val(name: str, fraction: float) -> bool:
    """Whether a document is held out: its val_rank (a 64-bit hash of its name) falls below fraction * 2^64."""
    return val_rank(name) < fraction * 2**64


def held_out_extra(tally: Tally, train_documents: int, val_documents: int, fraction: float) -> str | None:
    """The document to hold out besides those `in_val` chose, so that a corpus of two or more documents
    has a validation split whenever a fraction is asked for: none where the split has a document
    already (every such preparation stays as it was), else the one with the lowest val_rank, i.e. the
    first that a larger fraction would hold out. A corpus of one document, or one whose every document
    is held out, cannot be split: DataError naming --val-fraction."""
    if fraction > 0 and train_documents + val_documents == 1:
        raise DataError(f"the corpus has one document, so none can be held out for validation "
                        f"(--val-fraction {fraction:g}); add documents, or pass --val-fraction 0")
    if train_documents == 0:
        raise DataError(f"--val-fraction {fraction:g} holds out all {val_documents} documents, leaving none to "
                        f"train on; lower it")
    if fraction <= 0 or val_documents:
        return None
    return tally.lowest[1]
