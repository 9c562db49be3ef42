"""Run directories and data directories on a local disk or in an object store (gs://, s3://, any fsspec URL).

    run directory RUN   config.yaml, data.json, tokenizer.json, metrics.jsonl, summary.json: through RunDir
                        (fsspec; a local path stays a local path). RUN/checkpoints goes to orbax as it is,
                        which reaches gs:// itself (etils.epath for its files, tensorstore for the arrays).
    data directory DIR  read where it is, by shards.Source: a local path memory-mapped, a URL by byte
                        ranges (nothing copied); `filesystem` gives the fsspec filesystem of a URL.

gs:// needs `pip install gcsfs` (prepareTPUVM.sh installs it), s3:// `pip install s3fs`.

A gs:// URL whose bucket does not exist is one line naming the bucket (`filesystem`). A failed write
names the operating system's reason (`os_problem`). Output directories written whole (a data
directory, an export, an imported run) are outputs.py's; a run's JSON Lines log (metrics.jsonl),
read and appended to, is json_log.py's.

Knows nothing of the data format or of models; imports nothing of the project but errors.py.
"""
from __future__ import annotations

import errno
import glob
import json
import logging
import os
import pathlib
import re
import shutil
import socket

from core.errors import RunError, StorageError

COPY_CHUNK = 1 << 24  # bytes per read while streaming a file (RunDir.chunks)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def one_line(e: BaseException) -> str:
    """An error's first line, at most 200 characters (its type's name where it has no text): for a message
    that quotes a library's error, which may run to many lines."""
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (this process counts as gone: what an earlier, failed write of its own
    left is settled like a dead writer's)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a live process of another user
        return True
    except (OverflowError, ValueError):  # no such pid can exist
        return False
    return True


def is_url(location) -> bool:
    """True for `gs://bucket/dir` and other URLs; False for local paths (and file://, used as a local path)."""
    text = str(location)
    return bool(_URL.match(text)) and not text.startswith("file://")


def local_path(location) -> str:
    """A file:// URL as the local path it names; anything else as it is."""
    text = str(location)
    return text[len("file://"):] if text.startswith("file://") else text


def link_loop(path) -> bool:
    """Whether a local `path` (it, or a folder on the way to it) is a symbolic link that leads back into
    itself: the system then says neither that it exists nor that it does not, and every use of it fails."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    except ValueError:  # a NUL in the name: not this question
        return False
    return False


LINK_LOOP = "a symbolic link on that path points back into itself (a loop of links)"


def filesystem(url: str, error=StorageError):
    """(fsspec filesystem, path inside it) of a URL; a missing package, a bad URL or a gs:// bucket that
    does not exist is one line."""
    if is_url(url) or str(url).endswith(":"):  # "gs:" is what a trailing-slash strip leaves of "gs://"
        _check_names_a_place(url, error)
    _quiet_credential_search()
    try:
        import fsspec  # here: a local run never needs it

        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as e:  # fsspec names the package: "Please install gcsfs to access Google Storage"
        raise error(f"{url}: {e}") from None
    except Exception as e:  # an unknown protocol, a malformed URL, missing credentials
        raise error(f"{url}: {one_line(e)}") from None
    _check_bucket(fs, url, path, error)
    return fs, path


REACH_SECONDS = 10  # how long a store's endpoint may take to accept a connection before it counts as unreachable
_REACHED: set[tuple[str, int]] = set()


def _check_reachable(fs, url: str, error) -> None:
    """A store whose endpoint does not accept a connection (no network, a wrong emulator address, a host that
    cannot be found) is one line within REACH_SECONDS, where the client would retry each request for half a
    minute with backoff, several requests in turn."""
    import urllib.parse

    location = getattr(fs, "_location", None) or os.environ.get("STORAGE_EMULATOR_HOST") or \
        "https://storage.googleapis.com"
    parsed = urllib.parse.urlparse(location if "://" in location else f"http://{location}")
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    if not host or (host, port) in _REACHED:
        return
    try:
        socket.create_connection((host, port), timeout=REACH_SECONDS).close()
    except OSError as e:
        reason = "no answer" if isinstance(e, TimeoutError) else (e.strerror or one_line(e))
        raise error(f"{url}: cannot reach the store at {host}:{port} ({reason}); check the network, or where "
                    f"STORAGE_EMULATOR_HOST points") from None
    _REACHED.add((host, port))


class _RetryTracebacks(logging.Filter):
    """gcsfs's own record of a request that failed for good ("... out of retries on exception", "non-retriable
    exception"), logged with its traceback before the exception reaches the caller, who says it in one line."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        return not ("out of retries on exception" in message or "non-retriable exception" in message)


class _CredentialSearchNotes(logging.Filter):
    """google-auth's notes on its search for default credentials, which gcsfs (and etils, for orbax's files)
    makes when it opens gs:// without a token: "Authentication failed using Compute Engine authentication due
    to unavailable metadata server" where there is none to ask, "No project ID could be determined". gcsfs
    goes on to the next way, anonymous access last; a bucket that then refuses it answers 401 or 403, which
    the operation's own error says. The notes were a `WARNING:google.auth._default:...` line on stderr of
    every command on gs:// (its root logger set up by orbax's import); nothing else of that logger is held."""

    NOTES = ("Authentication failed using Compute Engine authentication", "No project ID could be determined")

    def filter(self, record) -> bool:
        return record.levelno >= logging.ERROR or not record.getMessage().startswith(self.NOTES)


def _quiet_credential_search() -> None:
    """Keep google-auth's notes of a credential search (_CredentialSearchNotes) off stderr, once a process."""
    searched = logging.getLogger("google.auth._default")  # named without importing google.auth
    if not any(isinstance(f, _CredentialSearchNotes) for f in searched.filters):
        searched.addFilter(_CredentialSearchNotes())
    retries = logging.getLogger("gcsfs")
    if not any(isinstance(f, _RetryTracebacks) for f in retries.filters):
        retries.addFilter(_RetryTracebacks())


def _check_names_a_place(url, error=StorageError) -> None:
    """A URL with nothing after its scheme (gs://) is one line, not fsspec's ValueError; so is one with a
    `.` or `..` part, which an object store keeps as a name of its own (gs://b/x/../y is not gs://b/y)."""
    scheme, _, rest = str(url).partition(":")
    if not rest.strip("/"):
        raise error(f"{url}: names no bucket or host; give one, e.g. {scheme}://my-bucket/runs/exp1")
    if any(part in (".", "..") for part in rest.lstrip("/").split("/")):
        raise error(f"{url}: a bucket has no relative paths ('.' and '..' are names of their own there); "
                    f"write the path out in full")


WRITABLE = ("gs", "s3", "az")  # the object stores whose URLs orbax (checkpoints) and etils (outputs) write


def check_writable(url: str, what: str, error=StorageError) -> None:
    """A URL that a run's checkpoints or an output directory can be written to: a bucket of WRITABLE's
    stores (an fsspec store such as memory:// is in this process only, or is read-only)."""
    scheme = str(url).partition("://")[0]
    if scheme not in WRITABLE:
        raise error(f"{what} {url}: {scheme}:// cannot hold it (checkpoints and outputs are written to a local "
                    f"path or a bucket: {', '.join(f'{s}://' for s in WRITABLE)})")


_BUCKETS_FOUND: set[str] = set()  # gs:// buckets this process has seen to exist


def _check_bucket(fs, url: str, path: str, error) -> None:
    """A gs:// URL whose bucket does not exist is one line naming the bucket (the store's own error names
    only the request that failed, an upload or download URL). The bucket counts as missing only when
    listing it says so (404); without the permission to list, or without a network, the operation that
    follows says why it fails."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    bucket = path.split("/", 1)[0]
    if "gs" not in protocols or not bucket or bucket in _BUCKETS_FOUND:
        return
    _check_reachable(fs, url, error)
    try:
        fs.ls(bucket, detail=False, max_results=1)  # one request, whatever the bucket holds
    except FileNotFoundError:
        raise error(f"{url}: bucket '{bucket}' does not exist") from None
    except Exception:
        return
    _BUCKETS_FOUND.add(bucket)


# ----------------------------------------------------------------------------------------------
# Run directories


class Conflict(Exception):
    """A conditional write or delete whose condition failed: the object is not the generation it named."""


class RunDir:
    """The files of a run directory by name, wherever it is. Writes replace a whole file at once.

    In an object store, a failure (no access, no network) is a StorageError naming the file.

    `fence`, when set (by the holder of the run's lease in an object store), is called before every
    write, move and delete: it raises when this process no longer holds the run."""

    fence = None

    def __init__(self, location):
        self.remote = is_url(location)
        try:
            str(location).encode("utf-8")
        except UnicodeEncodeError as e:  # bytes that are no UTF-8, carried as surrogates: orbax cannot save there
            bad = str(location)[e.start:e.end].encode("utf-8", "surrogateescape")
            raise StorageError(f"{str(location).encode('utf-8', 'surrogateescape')!r}: a run directory's path must "
                               f"be UTF-8 text (it holds the byte {bad[:1]!r}), which the checkpoints' storage "
                               f"needs; choose or rename it") from None
        if self.remote:
            _check_names_a_place(location)
        self.location = str(location).rstrip("/") if self.remote else local_path(location)
        if not self.remote and link_loop(self.location):
            raise StorageError(f"{self.location}: {LINK_LOOP}: mend or remove the link, or give another path")
        self.fs, self.root = filesystem(self.location if self.remote else os.path.abspath(self.location))

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
                raise StorageError(f"{self.show(name) if name else self.location}: {one_line(e)}") from None
            raise StorageError(f"{self.show(name) if name else self.location}: {e.strerror or one_line(e)}") from None
        except Exception as e:
            if not self.remote:
                raise
            raise StorageError(f"{self.show(name) if name else self.location}: {one_line(e)}") from None

    def is_file(self, name: str) -> bool:
        return self._do(name, self.fs.isfile, self._path(name))

    def names(self, sub: str = "") -> list[str]:
        """The names in the directory, or in RUN/sub ([] when there is none)."""
        path = self._path(sub)
        self.fs.invalidate_cache(path)  # what others wrote meanwhile (orbax, tensorstore) is listed too
        return self._do(sub, lambda: [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False)]
                        if self.fs.isdir(path) else [])

    def move(self, src: str, dst: str) -> None:
        """Move the directory RUN/src whole to RUN/dst. Locally one rename; an object store, which has no
        folders and no rename, gets a copy of every object under src (made by the store itself), then the
        originals are deleted: a stop in between leaves both, never neither."""
        self.check_fence()
        if not self.remote:
            def move():
                target = pathlib.Path(self.root) / dst
                target.parent.mkdir(parents=True, exist_ok=True)
                (pathlib.Path(self.root) / src).rename(target)

            self._do(dst, move)
            return
        objects = self._do(src, self.fs.find, self._path(src))
        for path in objects:
            self._do(dst, self.fs.copy, path, self._path(dst) + path[len(self._path(src)):])
        self._do(src, self.fs.rm, objects)
        self.fs.invalidate_cache(self.root)

    def delete(self, name: str) -> None:
        """Remove RUN/name (a file); nothing when it is not there."""
        self.check_fence()
        if self.is_file(name):
            self._do(name, self.fs.rm_file, self._path(name))

    def begin_new(self):
        """mkdir for a new run, returning the undo of its start (progress.Stop.undo): () -> (whether it was
        undone, a line saying what it did); it removes every file written into the run since, and the
        directory itself if this made it."""
        existed = not self.remote and os.path.isdir(self.root)
        self.mkdir()

        def undo() -> tuple[bool, str]:
            try:
                if self.remote:
                    if self.fs.exists(self.root):
                        self.fs.rm(self.root, recursive=True)
                elif existed:
                    for child in pathlib.Path(self.root).iterdir():
                        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
                else:
                    shutil.rmtree(self.root)
            except Exception as e:  # said rather than raised: the process is ending
                return False, f"could not remove what it wrote in {self} ({one_line(e)}): remove it by hand"
            return True, (f"removed what it wrote in {self}, as it was before" if existed
                          else f"removed the run directory {self} it had made")
        return undo

    def mkdir(self) -> None:
        """Create the directory (and its parents); a place where none can be made is a StorageError."""
        try:
            self._do("", self.fs.makedirs, self.root, True)  # object stores have no directories: a no-op there
        except StorageError as e:
            raise StorageError(f"cannot create the run directory {e}") from None

    def read_bytes(self, name: str) -> bytes:
        return self._do(name, self.fs.cat_file, self._path(name))

    def check_fence(self) -> None:
        """Raise (the fence's error) when this process may no longer write the run; see `fence`."""
        if self.fence is not None:
            self.fence()

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode()

    def json_object(self, name: str) -> dict | None:
        """RUN/name, a JSON object, as a dict (None where there is no such file); anything else is a RunError
        in one line."""
        if not self.is_file(name):
            if self._do(name, self.fs.exists, self._path(name)):  # a directory, a device (a link to /dev/zero)
                raise RunError(f"{self.show(name)} is there but is not a file: it is damaged; remove it (or put the "
                               f"file back) to read the run")
            return None
        try:
            recorded = json.loads(self.read_text(name))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunError(f"{self.show(name)} is not JSON ({e})") from None
        if not isinstance(recorded, dict):
            raise RunError(f"{self.show(name)} is not a JSON object")
        return recorded

    def size(self, name: str) -> int | None:
        """The bytes in RUN/name; None when it is not a file."""
        def size():
            try:
                info = self.fs.info(self._path(name))
            except FileNotFoundError:
                return None
            return info["size"] if info["type"] == "file" else None

        return self._do(name, size)

    def chunks(self, name: str):
        """RUN/name's bytes in pieces of at most COPY_CHUNK, streamed (an object store's through fsspec)."""
        with self._do(name, self.fs.open, self._path(name), "rb") as f:
            while chunk := self._do(name, f.read, COPY_CHUNK):
                yield chunk

    def write_bytes(self, name: str, content: bytes) -> None:
        """Replace RUN/name at once: an object store writes whole objects; locally a temporary file
        NAME.tmp-PID is renamed, and those that killed writers left (their process gone) are deleted first."""
        self.check_fence()
        if self.remote:
            self._do(name, self.fs.pipe_file, self._path(name), content)
            return
        path = pathlib.Path(self.root) / name
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")

        def write():
            for stale in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):
                pid = stale.name.rsplit("-", 1)[-1]
                if pid.isdigit() and not process_alive(int(pid)):
                    stale.unlink(missing_ok=True)
            try:
                tmp.write_bytes(content)
                tmp.replace(path)
            except BaseException:  # a full disk, no access: no NAME.tmp-PID left behind (a Ctrl-C neither)
                tmp.unlink(missing_ok=True)
                raise

        self._do(name, write)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def checkpoint_dir(self):
        """RUN/checkpoints for orbax: a resolved local path, or the URL (orbax opens gs:// itself)."""
        if self.remote:
            check_writable(self.location, "run directory")
            return f"{self.location}/checkpoints"
        return (pathlib.Path(self.location) / "checkpoints").resolve()


class Versions:
    """Conditional operations on one file of a run directory in an object store, for the lease of the run
    (runlock.py) and its log (json_log.JsonLines). Google Cloud Storage answers generation preconditions
    (ifGenerationMatch: 0 creates only an absent object, G replaces or deletes only generation G), which
    make taking, renewing and releasing the lease atomic. Other stores have no generations (None): there each operation is unconditional, and the
    lease falls back to write-then-read."""

    def __init__(self, run: RunDir):
        self.run = run

    def _gcs(self, name: str):
        """(filesystem, bucket, key) of RUN/name when the store is Google Cloud Storage (gcsfs), else None."""
        fs = self.run.fs
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        if not self.run.remote or "gs" not in protocols or not hasattr(fs, "call"):
            return None
        bucket, key = self.run._path(name).split("/", 1)
        return fs, bucket, key

    def versioned(self, name: str) -> tuple[int | None, bytes]:
        """(generation, content) of RUN/name read together ((None, b"") when absent); the generation is
        None too where the store has none (not GCS)."""
        gcs = self._gcs(name)
        if gcs is None:
            return None, (self.run.read_bytes(name) if self.run.is_file(name) else b"")
        fs, bucket, key = gcs
        from urllib.parse import quote

        media = f"{fs._location}/download/storage/v1/b/{quote(bucket, safe='')}/o/{quote(key, safe='')}"
        while True:
            try:
                generation = int(fs.call("GET", "b/{}/o/{}", bucket, key, json_out=True)["generation"])
                _, content = fs.call("GET", media, alt="media", ifGenerationMatch=str(generation))
            except FileNotFoundError:  # absent (or deleted between the two requests)
                return None, b""
            except FileExistsError:  # 412: replaced between the two requests: read the new one
                continue
            except Exception as e:
                raise StorageError(f"{self.run.show(name)}: {one_line(e)}") from None
            return generation, content

    def write_if(self, name: str, content: bytes, generation: int | None) -> int | None:
        """Write RUN/name only if it is still `generation` (None: only if absent): its new generation, or
        Conflict. Where the store has no generations (not GCS) it writes unconditionally (None back)."""
        gcs = self._gcs(name)
        if gcs is None:
            self.run._do(name, self.run.fs.pipe_file, self.run._path(name), content)
            return None
        fs, bucket, key = gcs
        from urllib.parse import quote

        try:
            out = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o", uploadType="media",
                          name=key, ifGenerationMatch=str(generation or 0), data=content, json_out=True)
        except FileExistsError:  # 412: another writer's generation is there now
            raise Conflict(name) from None
        except Exception as e:
            raise StorageError(f"{self.run.show(name)}: {one_line(e)}") from None
        fs.invalidate_cache(self.run._path(name))
        return int(out["generation"])

    def delete_if(self, name: str, generation: int | None) -> None:
        """Delete RUN/name only if it is still `generation` (Conflict otherwise); unconditionally where the
        store has no generations."""
        gcs = self._gcs(name)
        if gcs is None or generation is None:
            if self.run.is_file(name):
                self.run._do(name, self.run.fs.rm_file, self.run._path(name))
            return
        fs, bucket, key = gcs
        try:
            fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=str(generation))
        except FileExistsError:
            raise Conflict(name) from None
        except FileNotFoundError:
            return
        except Exception as e:
            raise StorageError(f"{self.run.show(name)}: {one_line(e)}") from None
        fs.invalidate_cache(self.run._path(name))


# ----------------------------------------------------------------------------------------------
# Writing files: why a write failed, the mode of a new file, whether a path lies in a directory

_OS_ERROR_CODE = re.compile(r"os error (\d+)|os_error_code='?(\d+)")  # Rust's io::Error, tensorstore's status
_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG)


def os_problem(e: BaseException | None) -> str | None:
    """The operating system's reason a write failed ("No space left on device"), from an OSError, from a
    library's error that carries its code (tokenizers', safetensors', tensorstore's), or from one that
    spells out the reason of a failed write (a failed checkpoint save, checkpoints.py); else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e.strerror or os.strerror(e.errno)
        text = str(e)
        found = _OS_ERROR_CODE.search(text)
        if found:
            return os.strerror(int(found.group(1) or found.group(2)))
        named = [os.strerror(code) for code in _WRITE_ERRORS if os.strerror(code) in text]
        if named:
            return named[0]
        e = e.__cause__ or e.__context__
    return None


def umask() -> int:
    """The process's file-mode creation mask, read without changing it where the system shows it
    (os.umask only swaps it, for every thread at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def plain_mode(path) -> None:
    """Give a file the mode open() gives a new one, 0o666 less the umask: for a library that writes its
    files owner-only (safetensors' save_file makes them 0600)."""
    os.chmod(path, 0o666 & ~umask())


def inside(path, directory) -> bool:
    """Whether `path` lies inside `directory` (local paths resolved; URLs compared as written)."""
    if is_url(path) or is_url(directory):
        return is_url(path) and is_url(directory) and str(path).startswith(str(directory).rstrip("/") + "/")
    return pathlib.Path(directory).resolve() in pathlib.Path(path).resolve().parents
