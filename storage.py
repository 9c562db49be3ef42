"""Run directories and data directories on a local disk or in an object store (gs://, s3://, any fsspec URL).

    run directory RUN   config.yaml, data.json, tokenizer.json, metrics.jsonl, summary.json: through RunDir
                        (fsspec; a local path stays a local path). RUN/checkpoints goes to orbax as it is,
                        which reaches gs:// itself (etils.epath for its files, tensorstore for the arrays).
    data directory DIR  a local path is used in place. A URL is copied once into a local cache, every file
                        checked against DIR/index.json (shard sizes and sha256, the tokenizer's sha256),
                        and the loader memory-maps the local copy: local_copy(DIR, ...), which
                        shards.local_dir calls with the files the index names.

The cache is $GPT_DATA_CACHE (default ~/.cache/gpt-jax/data, or under $XDG_CACHE_HOME), one
subdirectory per URL. A file is
copied to NAME.part-PID and renamed to NAME only once its size and hash match, so a half-copied shard
is never read; a later run reuses the files it verified and copies again those missing or damaged.
gs:// needs `pip install gcsfs` (prepareTPUVM.sh installs it), s3:// `pip install s3fs`.

Knows nothing of the data format or of models; imports nothing of the project but errors.py's base class
and corpus.DataError.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import time

import fsspec
from tqdm import tqdm

from errors import UserError
from corpus import DataError

CACHE_ENV = "GPT_DATA_CACHE"
DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "gpt-jax", "data")
COPY_CHUNK = 1 << 24  # bytes per read while copying a remote file
FLUSH_SECONDS = 30.0  # a remote metrics.jsonl is uploaded at least this often while training logs
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class StorageError(UserError):
    """A run directory's storage cannot be reached (no filesystem package, no access); str(e) is one line."""


def _one_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def is_url(location) -> bool:
    """True for `gs://bucket/dir` and other URLs; False for local paths (and file://, used as a local path)."""
    text = str(location)
    return bool(_URL.match(text)) and not text.startswith("file://")


def _local(location) -> str:
    text = str(location)
    return text[len("file://"):] if text.startswith("file://") else text


def _filesystem(url: str, error=StorageError):
    """(fsspec filesystem, path inside it) of a URL; a missing package or bad URL is one line."""
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # fsspec names the package: "Please install gcsfs to access Google Storage"
        raise error(f"{url}: {e}") from None
    except Exception as e:  # an unknown protocol, a malformed URL, missing credentials
        raise error(f"{url}: {_one_line(e)}") from None


# ----------------------------------------------------------------------------------------------
# Run directories


class RunDir:
    """The files of a run directory by name, wherever it is. Writes replace a whole file at once.

    In an object store, a failure (no access, no network) is a StorageError naming the file."""

    def __init__(self, location):
        self.remote = is_url(location)
        self.location = str(location).rstrip("/") if self.remote else _local(location)
        self.fs, self.root = _filesystem(self.location if self.remote else os.path.abspath(self.location))

    def __str__(self) -> str:
        return self.location

    @property
    def name(self) -> str:
        return self.location.rstrip("/").rsplit("/", 1)[-1]

    def _path(self, name: str = "") -> str:
        return f"{self.root}/{name}" if name else self.root

    def show(self, name: str) -> str:
        """How a file of the run is named in messages: RUN/name (the path as given, or the URL)."""
        return f"{self.location}/{name}" if self.remote else str(pathlib.Path(self.location) / name)

    def _do(self, name: str, action, *args):
        try:
            return action(*args)
        except OSError as e:  # a local path under a file, without permission, on a full disk
            if self.remote:
                raise StorageError(f"{self.show(name) if name else self.location}: {_one_line(e)}") from None
            raise StorageError(f"{self.show(name) if name else self.location}: {e.strerror or _one_line(e)}") from None
        except Exception as e:
            if not self.remote:
                raise
            raise StorageError(f"{self.show(name) if name else self.location}: {_one_line(e)}") from None

    def is_file(self, name: str) -> bool:
        return self._do(name, self.fs.isfile, self._path(name))

    def names(self) -> list[str]:
        """The names in the directory ([] when there is none)."""
        return self._do("", lambda: [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
                        if self.fs.isdir(self.root) else [])

    def delete(self, name: str) -> None:
        """Remove RUN/name (a file); nothing when it is not there."""
        if self.is_file(name):
            self._do(name, self.fs.rm_file, self._path(name))

    def mkdir(self) -> None:
        """Create the directory (and its parents); a place where none can be made is a StorageError."""
        try:
            self._do("", self.fs.makedirs, self.root, True)  # object stores have no directories: a no-op there
        except StorageError as e:
            raise StorageError(f"cannot create the run directory {e}") from None

    def read_bytes(self, name: str) -> bytes:
        return self._do(name, self.fs.cat_file, self._path(name))

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode()

    def write_bytes(self, name: str, content: bytes) -> None:
        """Replace RUN/name at once: an object store writes whole objects; locally a temporary file is renamed."""
        if self.remote:
            self._do(name, self.fs.pipe_file, self._path(name), content)
            return
        path = pathlib.Path(self.root) / name
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")

        def write():
            tmp.write_bytes(content)
            tmp.replace(path)

        self._do(name, write)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def checkpoint_dir(self):
        """RUN/checkpoints for orbax: a resolved local path, or the URL (orbax opens gs:// itself)."""
        if self.remote:
            return f"{self.location}/checkpoints"
        return (pathlib.Path(self.location) / "checkpoints").resolve()


class JsonLines:
    """A run's JSON Lines log (metrics.jsonl), restarted with the rows `keep` accepts.

    Locally each row is appended and flushed at once. An object store has no appends: the rows are
    kept in memory and the whole file is uploaded by flush() (train.py calls it at each evaluation and
    checkpoint), at least every FLUSH_SECONDS while rows come in, and by close().
    """

    def __init__(self, run: RunDir, name: str, keep=lambda row: True):
        self.run, self.name = run, name
        old = [line for line in (run.read_text(name).splitlines() if run.is_file(name) else []) if line.strip()]
        parsed = []  # (row, its line as written)
        self.torn = None  # a last line cut off by a kill during its write: dropped, and said by the caller
        for number, line in enumerate(old, 1):
            try:
                parsed.append((json.loads(line), line))
            except json.JSONDecodeError:
                if number < len(old):
                    raise StorageError(f"{run.show(name)}: line {number} is not JSON; repair or remove it") from None
                self.torn = line
        kept = [(row, line) for row, line in parsed if keep(row)]
        self.rows = [row for row, _ in kept]  # the rows kept, in order
        self.lines = [line + "\n" for _, line in kept]
        run.write_text(name, "".join(self.lines))
        self.uploaded = time.monotonic()
        self.file = None if run.remote else open(pathlib.Path(run.root) / name, "a")

    def append(self, row: dict) -> None:
        line = json.dumps(row) + "\n"
        if self.file is not None:
            self.file.write(line)
            self.file.flush()
            return
        self.lines.append(line)
        if time.monotonic() - self.uploaded > FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self.file is None:
            self.run.write_text(self.name, "".join(self.lines))
            self.uploaded = time.monotonic()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        else:
            self.flush()


# ----------------------------------------------------------------------------------------------
# Data directories: a verified local copy of a remote one

verified: dict[str, pathlib.Path] = {}  # URL -> its cache directory, checked in this process


def cache_dir_for(url: str, cache: str | os.PathLike | None = None) -> pathlib.Path:
    """Where the copy of a data directory URL lives: CACHE/<first 16 hex digits of sha256(URL)>."""
    root = pathlib.Path(cache or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()
    return root / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def local_copy(location, list_files, cache: str | os.PathLike | None = None) -> pathlib.Path:
    """A data directory on the local disk: `location` itself, or for a URL its verified copy in the cache.

    index.json is read from the URL each time (once per process); `list_files(index)` names the files
    it records, [(name, bytes or None, sha256 or None)] (shards.py knows the format). They are copied
    when the cache lacks them or holds a copy that does not match. Raises DataError.
    """
    if not is_url(location):
        return pathlib.Path(_local(location))
    url = str(location).rstrip("/")
    if url in verified and cache is None:
        return verified[url]
    fs, root = _filesystem(url, DataError)
    try:
        raw = fs.cat_file(f"{root}/index.json")
    except FileNotFoundError:
        raise DataError(f"{url}/index.json not found; prepare the data with `python data.py` and copy "
                        f"the directory there") from None
    except Exception as e:  # no access, no network
        raise DataError(f"{url}/index.json cannot be read: {_one_line(e)}") from None
    try:
        files = list_files(json.loads(raw))
        bad = [name for name, _, _ in files if not isinstance(name, str) or "/" in name or name in ("", ".", "..")]
        if bad:
            raise ValueError(f"file name {bad[0]!r} outside the directory")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"{url}/index.json is corrupt ({type(e).__name__}: {e})") from None
    local = cache_dir_for(url, cache)
    local.mkdir(parents=True, exist_ok=True)
    _remove_stale_parts(local)
    stamps = _read_stamps(local)
    todo = [(name, size, sha) for name, size, sha in files if not _cached(local / name, size, sha, stamps)]
    _write_stamps(local, stamps)
    total = sum(size or 0 for _, size, _ in todo)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"copying {url}", disable=not todo, leave=False) as bar:
        for name, size, sha in todo:
            stamps[name] = copy_file(fs, f"{root}/{name}", f"{url}/{name}", local / name, size, sha, bar)
            _write_stamps(local, stamps)
    tmp = local / f"index.json.part-{os.getpid()}"
    tmp.write_bytes(raw)
    tmp.replace(local / "index.json")  # last: the copy's index names only verified files
    verified[url] = local
    return local


def _cached(path: pathlib.Path, size: int | None, sha: str | None, stamps: dict) -> bool:
    """A cached file is good if it has the recorded size and hash; a stamp of (size, mtime, hash) written
    when it was verified saves hashing it again on every start."""
    if not path.is_file():
        return False
    st = path.stat()
    if size is not None and st.st_size != size:
        return False
    stamp = stamps.get(path.name)
    if stamp == [st.st_size, st.st_mtime_ns, sha]:
        return True
    if sha is not None:
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != sha:
                return False
    stamps[path.name] = [st.st_size, st.st_mtime_ns, sha]
    return True


def copy_file(fs, remote: str, url: str, path: pathlib.Path, size: int | None, sha: str | None, bar) -> list:
    """Copy one file into the cache through NAME.part-PID, hashing as it goes; rename only if it checks out."""
    tmp = path.with_name(f"{path.name}.part-{os.getpid()}")
    digest, copied = hashlib.sha256(), 0
    try:
        with fs.open(remote, "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(COPY_CHUNK):
                dst.write(chunk)
                digest.update(chunk)
                copied += len(chunk)
                bar.update(len(chunk))
    except FileNotFoundError:
        tmp.unlink(missing_ok=True)
        raise DataError(f"{url} is missing (index.json lists it)") from None
    except Exception as e:  # a dropped connection, a full disk
        tmp.unlink(missing_ok=True)
        raise DataError(f"copying {url} failed ({_one_line(e)}); run again to finish the copy") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if size is not None and copied != size:
        tmp.unlink()
        raise DataError(f"{url}: {copied} bytes, index.json records {size}; the remote directory is damaged, "
                        f"prepare it again")
    if sha is not None and digest.hexdigest() != sha:
        tmp.unlink()
        raise DataError(f"{url}: sha256 {digest.hexdigest()[:12]}..., index.json records {sha[:12]}...; "
                        f"the remote directory is damaged, prepare it again")
    tmp.replace(path)
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, sha]


def _read_stamps(local: pathlib.Path) -> dict:
    try:
        stamps = json.loads((local / "verified.json").read_text())
        return stamps if isinstance(stamps, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_stamps(local: pathlib.Path, stamps: dict) -> None:
    tmp = local / f"verified.json.part-{os.getpid()}"
    tmp.write_text(json.dumps(stamps, indent=1))
    tmp.replace(local / "verified.json")


def _remove_stale_parts(local: pathlib.Path) -> None:
    """Partial copies left by processes that no longer run (killed mid-copy); live ones are left alone."""
    for part in local.glob("*.part-*"):
        pid = part.name.rsplit(".part-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            part.unlink(missing_ok=True)
        except PermissionError:  # a live process of another user
            pass
