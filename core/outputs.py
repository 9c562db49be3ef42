"""An output directory written whole (a data directory, an export, an imported run): checked, staged
beside its place, swapped into place; the leftovers of killed writers settled.

`check_out` refuses an --out that must not be replaced, and `StagedDir` builds the directory beside its
place and swaps it in at once (see there), so an interrupted or failed write leaves the old output as it
was, or the new one complete, and never loses one; a write that fails (a full disk, a read-only one) is
one StorageError line. An output at a URL (gs://bucket/dir) is checked by the same rules where an object
store has them (`check_out_url`), built on the local disk and uploaded with the file that marks it
complete last (StagedDir says what a kill leaves).

A command that writes such an output runs its work through `stoppable`, for Ctrl-C, SIGTERM and SIGHUP
(`Stops`): one before the commit stops it with one line and nothing written, one after the commit lets it
finish and say so, never a traceback.

Knows nothing of the data format or of models; imports nothing of the project but errors.py and
storage.py.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import gc
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import threading
from typing import Callable, Iterable

from core.errors import STOP_SIGNALS, StorageError, UserError, detach_from_terminal
from core.storage import check_writable, filesystem, is_url, one_line, os_problem, process_alive

# Beside OUT (".OUT..." where the caller hides them), process PID leaves only these names:
#     OUT.tmp-PID         being built; never complete
#     OUT.tmp-PID-ready   complete (renamed so once its last file is written), about to go into place
#     OUT.tmp-PID-old     the old OUT moved aside (only where the swap below is unavailable)
# A process that dies (a kill, the OOM killer) leaves some of them; the next write into OUT settles those
# of processes no longer running: with OUT missing, a ready copy goes into place, else the old one goes
# back; then the rest are deleted. Those of a live process are left alone. (Nothing is fsynced: this
# guards against a process's death, not the machine's power cut.)

AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
_LEFTOVER = r"\.tmp-(\d+)(-ready|-old)?"


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+, musl 1.2.4+
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange(a, b) -> bool:
    """Swap what the paths a and b name in one step (Linux renameat2 with RENAME_EXCHANGE): at every
    moment each name holds one of the two, whole. False, with nothing changed, where the system or the
    file system cannot (another OS, an old kernel or C library, a file system without it)."""
    function = _renameat2()
    if function is None:
        return False
    if function(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


def _remove(path: pathlib.Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _settle(out: pathlib.Path, names: dict[str, pathlib.Path]) -> None:
    """One process's leftovers {state: path}: with `out` missing, its ready copy, else its old one, goes
    into place; then the others are deleted, except an old copy that could not be put back."""
    if not os.path.lexists(out):
        for state in ("-ready", "-old"):
            if state in names:
                try:
                    os.rename(names[state], out)
                    del names[state]
                    break
                except OSError:
                    continue
    if not os.path.lexists(out):
        names.pop("-old", None)  # never lose the one copy of the old directory
    for path in names.values():
        _remove(path)


def settle_leftovers(out, hidden: bool = False) -> None:
    """Resolve the staging directories that writers into `out` left when they died (see above); those of
    live processes are left alone. `hidden`: the names start with a dot (convert_torch.py's)."""
    out = pathlib.Path(os.path.abspath(out))
    pattern = re.compile(re.escape(("." if hidden else "") + out.name) + _LEFTOVER)
    try:
        entries = os.listdir(out.parent)
    except OSError:  # no such directory, or not readable: nothing can be built there either (said then)
        return
    groups: dict[int, dict[str, pathlib.Path]] = {}
    for name in entries:
        found = pattern.fullmatch(name)
        if found:
            groups.setdefault(int(found.group(1)), {})[found.group(2) or ""] = out.parent / name
    for pid in sorted(groups):
        if not process_alive(pid):
            _settle(out, groups[pid])


def _file_in_the_way(path: pathlib.Path) -> pathlib.Path | None:
    """The nearest existing ancestor of `path` if it is not a directory (a regular file), else None."""
    for parent in path.parents:
        if os.path.lexists(parent):
            return None if parent.is_dir() else parent
    return None


def _listing(entries: Iterable[pathlib.Path], shown: int = 3) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in entries)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_out(out, overwrite: bool, *, ours: Callable[[pathlib.Path], bool], what: str, hidden: bool = False,
              error: type[UserError] = StorageError,
              made: Callable[[pathlib.Path], bool] | None = None) -> pathlib.Path:
    """Whether a writer may put a directory at --out `out`, before anything is written; raises `error`.

    Never: an empty --out, a path that is not UTF-8 text, the current directory or a directory holding it
    (`/` included), the home directory, a path under a regular file, a file or a symbolic link. With
    --overwrite an existing --out is replaced only if it is empty or `ours(out)` (the writer's own kind of
    output, `what`: "a data directory (one with index.json)"); otherwise the error names what is in it. With
    `made` (a local --out; whether an entry of such an output is one its writer makes), an output that also
    holds anything else (a user's notes, a second data directory, a trained run's checkpoints) is refused
    too, naming those entries: replacing it would delete them.
    Leftovers of dead writers into `out` are settled first (settle_leftovers). Whether an existing --out
    needs --overwrite is the caller's rule.

    A URL (gs://bucket/dir) is checked by the same rules, as far as an object store has them (check_out_url)."""
    if not str(out).strip():
        raise error("--out is empty; name the directory to write")
    if is_url(out):
        return check_out_url(str(out), overwrite, ours=ours, what=what, error=error)
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError as e:  # bytes that are no UTF-8, which Python keeps as lone surrogates
        shown = os.fsencode(str(out)).decode("utf-8", "backslashreplace")
        raise error(f"--out {shown} is not UTF-8 text (byte 0x{ord(str(out)[e.start]) & 0xFF:02x} at {e.start}): "
                    f"the libraries that write it (safetensors, orbax) take only UTF-8 paths; choose another --out") \
            from None
    shown, out = str(out), pathlib.Path(out)
    untouched = "choose another --out (nothing was written or deleted)"
    try:
        place, cwd = out.resolve(), pathlib.Path.cwd().resolve()
        if place == cwd or place in cwd.parents:
            relation = "is the current directory" if place == cwd else f"contains the current directory {cwd}"
            raise error(f"--out {shown} {relation}, which is never replaced; {untouched}")
        try:
            home = pathlib.Path.home().resolve()
        except (RuntimeError, KeyError):  # no HOME and no user entry
            home = None
        if place == home:
            raise error(f"--out {shown} is the home directory, which is never replaced; {untouched}")
        blocker = _file_in_the_way(pathlib.Path(os.path.abspath(out)))
        if blocker is not None:
            raise error(f"--out {shown} cannot be made: {blocker} is a file, not a directory")
        if out.is_symlink():
            raise error(f"--out {shown} is a symbolic link (to {os.readlink(out)}); name the directory itself")
        if out.exists() and not out.is_dir():
            raise error(f"--out {shown} is a file, not a directory; {untouched}")
        settle_leftovers(out, hidden)
        if overwrite and out.is_dir() and any(out.iterdir()) and not ours(out):
            raise error(f"--out {shown} holds {_listing(out.iterdir())} and is not {what}; --overwrite replaces "
                        f"only such a directory or an empty one: {untouched}")
        others = [e for e in out.iterdir() if not made(e)] if overwrite and made and out.is_dir() else []
        if others:
            raise error(f"--out {shown} is {what} but also holds {_listing(others)}, which --overwrite would "
                        f"delete: move {'it' if len(others) == 1 else 'them'} out first, or {untouched}")
    except OSError as e:  # a directory on the way that cannot be read
        raise error(f"--out {shown}: {e.strerror or one_line(e)}" + (f" ({e.filename})" if e.filename else "")) \
            from None
    return out


INCOMPLETE = ".incomplete"  # in an output directory in an object store while StagedDir uploads it


def check_out_url(out: str, overwrite: bool, *, ours, what: str, error: type[UserError] = StorageError):
    """check_out for a URL: its bucket must exist, and it is never a whole bucket or an object (a file);
    with --overwrite an existing one is replaced only if it is empty, `ours(out)`, or an upload of
    StagedDir's that stopped (it holds INCOMPLETE). Returns the URL as an etils.epath.Path (orbax's
    path layer, over fsspec), which answers exists(), is_dir(), iterdir() and `/` as pathlib.Path does."""
    from etils import epath

    url = out.rstrip("/")
    check_writable(url, "--out", error)
    fs, root = filesystem(url, error)
    untouched = "choose another --out (nothing was written or deleted)"
    if "/" not in root.strip("/"):
        raise error(f"--out {out} is a whole bucket; name a directory in it ({url}/DIR)")
    try:
        if fs.isfile(root):
            raise error(f"--out {out} is a file, not a directory; {untouched}")
        entries = fs.ls(root, detail=True) if fs.isdir(root) else []
    except UserError:
        raise
    except Exception as e:  # no access, no network
        raise error(f"--out {out}: {one_line(e)}") from None
    names = sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] + ("/" if e["type"] == "directory" else "")
                   for e in entries if e["name"].rstrip("/") != root.rstrip("/"))  # not its own folder object
    if overwrite and names and INCOMPLETE not in names and not ours(epath.Path(url)):
        listing = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise error(f"--out {out} holds {listing} and is not {what}; --overwrite replaces only such a "
                    f"directory or an empty one: {untouched}")
    return epath.Path(url)


def upload_file(fs, local: pathlib.Path, remote: str) -> None:
    """One file of a StagedDir to its place in the object store."""
    fs.put_file(str(local), remote)


class StagedDir:
    """A local directory built in a sibling and swapped into place whole, when complete.

        with outputs.StagedDir(out, replace=overwrite) as staged:  # staged.path: fresh and empty
            ... write the files into staged.path ...
            staged.commit()          # into place; with replace=True an existing `out` is swapped out at once

    commit renames OUT.tmp-PID to OUT.tmp-PID-ready (complete), then exchanges it with an existing OUT in
    one step (renameat2 RENAME_EXCHANGE) and deletes what it got back, the old directory. Where the system
    cannot exchange, it renames OUT to OUT.tmp-PID-old, the ready copy to OUT, and deletes the old copy;
    a kill between those two renames leaves no OUT, and the next write into OUT (settle_leftovers, called
    on entry) puts the ready copy into place. Without replace an existing OUT is never replaced: only a
    missing or empty one is (a plain rename, which fails on a non-empty directory).

    Leaving the block without commit (an error, Ctrl-C) removes the staging directory, and the parent
    directories made for it, and leaves OUT as it was. An operating-system failure while writing (a full
    disk, a read-only file system, no permission), raised as OSError or inside a library's error, becomes
    one StorageError line naming `out` and the system's reason.

    A URL `out` (gs://bucket/dir) is built in a local temporary directory (under $TMPDIR) and uploaded by
    commit, since an object store has no rename. In order: OUT/.incomplete (INCOMPLETE) is written; the
    old OUT's `last` file goes (index.json for a data directory: the file that marks it complete), then
    the rest of the old OUT but its dot-names; every new file is uploaded, `last` the final one; then
    .incomplete goes. A reader never takes a partial OUT for complete: until the new `last` is there, OUT
    has none. A kill or a lost connection during the upload leaves OUT without `last` (with replace=True
    the old OUT is gone by then) and with .incomplete, which check_out_url lets the next write with
    --overwrite replace; the local temporary directory of a killed process stays in $TMPDIR. A failed
    upload is one StorageError line; a Ctrl-C says what it left (exit status 130)."""

    def __init__(self, out, *, replace: bool = False, hidden: bool = False, last: str | None = None):
        self.shown = str(out)
        self.remote, self.last = is_url(out), last
        if self.remote:
            self.url, self.replace, self.path, self.committed = str(out).rstrip("/"), replace, None, False
            return
        self.out = pathlib.Path(os.path.abspath(out))
        self.replace, self.hidden = replace, hidden
        self.prefix = f"{'.' if hidden else ''}{self.out.name}.tmp-"
        self.path = self._name("")
        self.made: list[pathlib.Path] = []  # parent directories this made
        self.committed = False

    def _name(self, state: str) -> pathlib.Path:
        return self.out.parent / f"{self.prefix}{os.getpid()}{state}"

    def __enter__(self) -> "StagedDir":
        if self.remote:
            self.fs, self.root = filesystem(self.url)
            self.path = pathlib.Path(tempfile.mkdtemp(prefix="gpt-upload-"))
            return self
        try:
            blocker = _file_in_the_way(self.out)
            if blocker is not None:
                raise StorageError(f"cannot write {self.shown}: {blocker} is a file, not a directory")
            for parent in reversed(self.out.parents):
                if not parent.is_dir():
                    parent.mkdir()
                    self.made.append(parent)
            settle_leftovers(self.out, self.hidden)
            self.reset()
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def reset(self) -> None:
        """Empty the staging directory, to build it again."""
        _remove(self.path)
        self.path.mkdir()

    def commit(self) -> None:
        if self.remote:  # an upload: interruptible, and _upload says what a stop in it leaves
            if _stops is not None and _stops.noted:
                raise KeyboardInterrupt
            self._upload()
            self.committed = True
            if _stops is not None:
                _stops.holding = True
            return
        if _stops is not None:
            _stops.hold()  # from here on the new directory goes into place whatever comes
        ready = self._name("-ready")
        os.rename(self.path, ready)  # complete: from here on a next run may put it into place
        if self.replace and os.path.lexists(self.out):
            if not exchange(ready, self.out):
                os.rename(self.out, self._name("-old"))
                os.rename(ready, self.out)
        else:
            os.rename(ready, self.out)
        self.committed = True
        self._settle_mine()  # the old directory goes

    def _settle_mine(self) -> None:
        mine = re.compile(re.escape(self.prefix) + str(os.getpid()) + r"(-ready|-old)?")
        names = {}
        for name in os.listdir(self.out.parent):
            found = mine.fullmatch(name)
            if found:
                names[found.group(1) or ""] = self.out.parent / name
        _settle(self.out, names)

    def _upload(self) -> None:
        """The remote commit (see the class docstring)."""
        local = {p.relative_to(self.path).as_posix(): p for p in sorted(self.path.rglob("*")) if p.is_file()}
        order = sorted(local, key=lambda name: name == self.last)  # `last` last
        fs, root = self.fs, self.root.rstrip("/")
        try:
            fs.pipe_file(f"{root}/{INCOMPLETE}", f"being written by pid {os.getpid()}\n".encode())
            # the old files the new ones do not replace go, the old `last` first; dot-names stay (INCOMPLETE,
            # a run directory's lock, held by the caller while it replaces the run)
            new, last = {f"{root}/{name}" for name in local}, f"{root}/{self.last}"
            stale = [p for p in (fs.find(root) if self.replace else []) if p.startswith(f"{root}/")
                     and not p[len(root) + 1:].startswith(".") and (p not in new or p == last)]
            for path in sorted(stale, key=lambda p: p != last):
                fs.rm_file(path)
            for name in order:
                upload_file(fs, local[name], f"{root}/{name}")
            fs.rm_file(f"{root}/{INCOMPLETE}")
        except Exception as e:  # a lost connection, no permission, a full quota
            raise StorageError(f"cannot write {self.shown}: {os_problem(e) or one_line(e)}") from None
        except KeyboardInterrupt:  # Ctrl-C: said as such (status 130), with what it leaves
            stopped = StorageError(f"interrupted while uploading {self.shown}, which is left incomplete; write it "
                                   f"again with --overwrite")
            stopped.exit_status = 130
            raise stopped from None

    def __exit__(self, kind, e, tb) -> None:
        if self.remote:
            if self.path is not None:
                shutil.rmtree(self.path, ignore_errors=True)
        elif not self.committed:
            try:
                self._settle_mine()  # as a next run would: an old copy moved aside goes back, the rest goes
            except OSError:
                pass
            for parent in reversed(self.made):
                try:
                    parent.rmdir()
                except OSError:
                    break
            self.made = []
        if e is not None and not isinstance(e, UserError):
            reason = os_problem(e)
            if reason is not None:
                where = getattr(e, "filename", None)  # named only where it is not `out` or its staging
                staging = str(self.path) if self.remote else str(self.out.parent / self.prefix)
                ours = where is None or os.path.abspath(where).startswith(staging) or \
                    (not self.remote and os.path.abspath(where) == str(self.out))
                raise StorageError(f"cannot write {self.shown}: {reason}" + ("" if ours else f" ({where})")) \
                    from None


# ---------------------------------------------------------------------------------------------
# Stop signals


class Stops:
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP while a command writes its output (the handler `stoppable`
    installs).

    Until the output is committed (`hold`, just before StagedDir.commit swaps a local directory into place;
    after an upload to an object store, which stays interruptible and says what it left) a stop ends the
    command at once: a KeyboardInterrupt, so the staging directory goes and an --out that was there stays
    as it was. From the commit on a stop is only noted: the output goes into place whole, the command says
    what it wrote, and then that the stop came after. A stop that arrives inside a garbage collector's
    callback (JAX has one), where a KeyboardInterrupt would be printed and dropped, is sent again once out
    of it; and any stop noted but swallowed still stops the command at the commit, before anything is
    written."""

    def __init__(self):
        self.noted: list[int] = []
        self.holding = False

    def __call__(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            detach_from_terminal()
        self.noted.append(signum)
        if self.holding:
            return
        if self.in_gc_callback(frame):
            timer = threading.Timer(GC_RETRY_S, os.kill, (os.getpid(), signum))
            timer.daemon = True
            timer.start()
            return
        raise KeyboardInterrupt

    @staticmethod
    def in_gc_callback(frame) -> bool:
        """Whether `frame` runs inside a garbage collector callback, which drops what it raises."""
        codes = {getattr(callback, "__code__", None) for callback in gc.callbacks}
        while frame is not None:
            if frame.f_code in codes:
                return True
            frame = frame.f_back
        return False

    def hold(self) -> None:
        """From here on a stop is only noted; one noted already (and swallowed) stops the command now."""
        self.holding = True
        if self.noted:
            raise KeyboardInterrupt

    def name(self) -> str:
        return signal.Signals(self.noted[0]).name if self.noted else "SIGINT"

    def status(self) -> int:
        return 128 + (self.noted[0] if self.noted else signal.SIGINT)


_stops: Stops | None = None  # while `stoppable` runs a command in the main thread
GC_RETRY_S = 0.05  # a stop that arrived in a garbage collector's callback is sent again this much later


def stoppable(main: Callable, argv, out, *, error: type[UserError] = StorageError, restore: bool = True) -> int:
    """main(argv), a command that writes the output `out` through StagedDir, with the stop signals handled
    as Stops says: a stop before the commit raises `error` (exit status 128 + N) saying that nothing was
    written; one after it is said on stderr after main's own output, and the status is 128 + N. `out` None:
    the command writes no output (data.py --verify), and the line says only that nothing was written.
    `restore`: put the previous handlers back afterwards (False for a process that ends with the command,
    where a stop from then on is only noted). Outside the main thread (no signals there) it is main(argv)."""
    global _stops
    if _stops is not None or threading.current_thread() is not threading.main_thread():
        return main(argv)
    stops = _stops = Stops()
    previous = {s: signal.signal(s, stops) for s in STOP_SIGNALS}
    try:
        status = main(argv)
    except KeyboardInterrupt:  # before the commit (Stops.hold): nothing was written
        stops.holding = True  # the line is said whatever comes now
        kept = "" if out is None else f" (--out {out} is as it was)"
        stopped = error(f"stopped by {stops.name()}; nothing was written{kept}")
        stopped.exit_status = stops.status()
        raise stopped from None
    except BaseException:
        stops.holding = True
        raise
    finally:
        if restore:
            _stops = None
            for s, handler in previous.items():
                signal.signal(s, handler)
    if stops.noted:
        print(f"stopped by {stops.name()} after {out} was complete: it is written whole", file=sys.stderr)
        return stops.status()
    return status
