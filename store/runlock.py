"""The writer's lock of a run directory: one process writes a run at a time.

    RUN/.lock    who writes the run now (train.py, an import), with a heartbeat where it is a lease

On a local disk the lock is an flock, which the system drops when its process ends however it ends, so
a killed run never blocks its resume; its file names the holder while it is held and is put back as
it was on release. In an object store, which has no locks, it is a lease (`Lease`): RUN/.lock names
its holder and a heartbeat a thread renews; in Google Cloud Storage each write of it is conditional on
the generation its holder wrote last (storage.Versions), and the run's fence (`Lease.check`, called
before every write of the run, and before a checkpoint's commit) stops a holder that lost it. The lease
is released, too, when another process of a multi-process run ends the run (multihost.at_end).

`Lock` is rundir.Run's `lock` (`run.lock.writer`, `run.lock.held_by`), made on the run's directory; it
knows nothing of configs, data or models.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import socket
import threading
import time
import typing

from core import storage
from core.errors import RunError
from training import multihost

LOCK = ".lock"
LEASE_RENEW = 10.0  # seconds between a lease's heartbeats (a run directory in an object store)
LEASE_TTL = 60.0  # a lease whose heartbeat is older than this is free: its holder is gone
LEASE_TTL_ENV = "GPT_LEASE_TTL"  # seconds, instead of LEASE_TTL; the lease is then renewed every sixth of it
LEASE_SETTLE = 1.0  # seconds between writing a lease and reading it back


def lease_times() -> tuple[float, float]:
    """(seconds a lease lasts, seconds between its heartbeats): LEASE_TTL and LEASE_RENEW, or with
    GPT_LEASE_TTL=SECONDS set that and a sixth of it. A shorter lease lets a resume after a kill go ahead
    sooner; at least 6 s, as a bucket takes about one write of an object per second."""
    text = os.environ.get(LEASE_TTL_ENV, "").strip()
    if not text:
        return LEASE_TTL, LEASE_RENEW
    try:
        ttl = float(text)
    except ValueError:
        ttl = math.nan
    if not (math.isfinite(ttl) and ttl >= 6):
        raise RunError(f"{LEASE_TTL_ENV}={text}: the seconds a run directory's lease in a bucket lasts, a number "
                       f"of at least 6 (it is renewed every sixth of them); unset, {LEASE_TTL:.0f}")
    return ttl, ttl / 6


class Lease:
    """A held lease on RUN/.lock in an object store: renewed every `every` seconds by a thread, each
    renewal conditional on the generation written last (where the store has generations). `check`
    (the run's fence) raises a RunError once the lease is lost: a renewal refused because another
    process holds the lock now, or, when no renewal has gone through for two periods (this process
    was paused), a look at the lock that finds another generation there. With several processes, a lease
    that its renewal thread finds lost ends every process at once (multihost.fail_now)."""

    def __init__(self, run: Lock, holder: dict, generation: int | None, every: float, taken: float):
        self.run, self.holder, self.generation, self.every = run, holder, generation, every
        self.confirmed = taken  # when the lease was last known to be ours: when its last write was sent
        self.lost: str | None = None  # why it was lost
        self.guard = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._renew_loop, name="run-dir-lease", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not threading.current_thread():  # (the thread itself, ending the run: multihost.fail)
            self.thread.join()

    def _content(self) -> bytes:
        return (json.dumps({**self.holder, "heartbeat": time.time()}) + "\n").encode()

    def _renew_loop(self) -> None:
        while not self.stopping.wait(self.every) and not self.lost:
            try:
                self.renew()
            except storage.StorageError:
                pass  # the store unreachable: the next renewal tries again (check() looks if it drags on)
        if self.lost:  # several processes end now: the fence may next be met only after a wait for a save in
            multihost.fail_now(self.error())  # flight, whose fenced commit the others' barriers wait for

    def renew(self) -> None:
        with self.guard:
            if self.lost:
                return
            sent = time.monotonic()  # the lease holds from when the renewal was sent, not from its answer,
            try:  # which a process paused meanwhile (past the lease) reads only once it is taken
                generation = storage.Versions(self.run.dir).write_if(LOCK, self._content(), self.generation)
            except storage.Conflict:
                self._lost_to_whoever_holds_it()
                return
            self.generation, self.confirmed = generation, sent

    def _lost_to_whoever_holds_it(self) -> None:
        """A conditional renewal failed: lost, unless the lock holds our own token (our last write went
        through but its answer did not reach us), whose generation is then adopted; the lease is then still
        counted from the renewal before (the heartbeat there dates from a send we did not time)."""
        try:
            generation, raw = storage.Versions(self.run.dir).versioned(LOCK)
        except storage.StorageError:
            generation, raw = None, b""
        lock = self.run._parse_lock(raw) or {}
        if lock.get("token") == self.holder["token"]:
            self.generation = generation
            return
        self.lost = f"{self.run._holder(raw)} holds it now" if lock else "its lock was deleted"

    def check(self) -> None:
        """The run's fence: called before every write of the run."""
        if not self.lost and self.generation is not None and time.monotonic() - self.confirmed > 2 * self.every:
            self.renew()  # renewals stopped for a while (this process paused?): is the lease still ours?
        if self.lost:
            raise self.error()

    def error(self) -> RunError:
        return RunError(f"this process lost the lease on {self.run} ({self.lost}: it was paused or cut off longer "
                        f"than the lease lasts); it stops without writing anything more into the run")


class Lock:
    """A run directory's lock (see the module docstring): `writer` holds it while a process writes the run,
    `held_by` says who holds it now."""

    def __init__(self, directory: storage.RunDir):
        self.dir = directory

    def __str__(self) -> str:
        return str(self.dir)

    @contextlib.contextmanager
    def writer(self, purpose: str, check_new: typing.Callable[[], None] | None = None):
        """Hold RUN/.lock while writing the run (`purpose` names the writer to a second one, which gets
        a RunError naming the first). The directory must exist. `check_new`: a new run starts here, and this
        checks, under the lock, that the directory holds nothing else (no other run started meanwhile).

        On a local disk it is an flock, which the system drops when its process ends however it ends,
        so a killed run never blocks its resume. In an object store, which has no locks, it is a lease:
        RUN/.lock names its holder and a heartbeat renewed every LEASE_RENEW seconds, and is taken by
        writing it and reading it back; a holder whose heartbeat has stopped (a killed process) is
        waited out for at most LEASE_TTL seconds, a live one is refused (see lease_times)."""
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "purpose": purpose,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        release = self._lease(holder) if self.dir.remote else self._flock(holder)
        try:
            if check_new is not None:
                check_new()
            yield
        finally:
            release()

    def _flock(self, holder: dict):
        import fcntl

        path = pathlib.Path(self.dir.root) / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # less the umask, as every other file
        except OSError as e:
            raise RunError(f"cannot lock the run directory {self}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = self._holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise RunError(f"run directory {self} is in use by {other}; one process writes a run at a time "
                           f"(wait for it to end, or stop it first)") from None
        before = os.pread(fd, 4096, 0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)

        def release():  # the flock goes with the descriptor; the file stays (no unlink race), as it was before
            if before:  # (its content names the holder only while the flock is held)
                os.ftruncate(fd, 0)
                os.pwrite(fd, before, 0)
            os.close(fd)
        return release

    def _lease(self, holder: dict):
        """Take the run's lease in an object store (see `writer`); returns its release. In Google Cloud
        Storage the lease is fenced: taking it is one conditional write (ifGenerationMatch: absent, or the
        expired generation that was read), every renewal replaces only the generation this process wrote
        last, and before every write of the run (`fence`) a holder whose renewals stopped for a while (a
        paused process: SIGSTOP, a VM stall, a closed laptop lid) checks that the lease is still its own.
        One that lost it stops with a RunError before writing anything more."""
        ttl, every = lease_times()
        holder = {**holder, "token": os.urandom(8).hex()}
        waited = 0.0
        while True:
            try:
                generation, raw = storage.Versions(self.dir).versioned(LOCK)
            except storage.StorageError:
                generation, raw = None, b""  # deleted meanwhile by its holder: free
            other = self._parse_lock(raw)
            if other and other.get("token") != holder["token"]:
                age = time.time() - float(other.get("heartbeat", 0))
                if age < ttl:
                    if age < 2 * every or waited >= ttl:  # alive: it renews its heartbeat
                        raise RunError(f"run directory {self} is in use by {self._holder(raw)}; one process writes "
                                       f"a run at a time (wait for it to end, or stop it first)")
                    print(f"{self.dir.show(LOCK)}: held by {self._holder(raw)}, whose heartbeat stopped "
                          f"{age:.0f}s ago; waiting up to {ttl - age:.0f}s for it to expire", flush=True)
                    time.sleep(min(every, ttl - age + 0.1))
                    waited += min(every, ttl - age + 0.1)
                    continue
            content = (json.dumps({**holder, "heartbeat": time.time()}) + "\n").encode()
            taken = time.monotonic()
            try:
                mine = storage.Versions(self.dir).write_if(LOCK, content, generation)
            except storage.Conflict:
                continue  # another writer took or renewed it between our read and our write: look again
            if mine is not None:
                break  # the store made the write conditional: the lease is ours, atomically
            time.sleep(LEASE_SETTLE)  # no generations here: a writer racing us has written by now, the last wins
            if (self._parse_lock(self.dir.read_bytes(LOCK)) or {}).get("token") == holder["token"]:
                break
        lease = Lease(self, holder, mine, every, taken)
        self.dir.fence = lease.check
        lease.start()

        def release():
            forget()
            self.dir.fence = None
            lease.stop()
            try:
                if not lease.lost:
                    storage.Versions(self.dir).delete_if(LOCK, lease.generation)
            except (storage.StorageError, storage.Conflict):
                pass  # taken meanwhile, or it expires by itself
        forget = multihost.at_end(release)  # also when another process ends the run: a resume need not wait
        return release

    def held_by(self) -> str | None:
        """Who holds the run's lock now, in words (see _holder), or None when no live process does: a
        local flock that can be taken, or a lease whose heartbeat is older than the lease lasts."""
        if not self.dir.is_file(LOCK):
            return None
        if self.dir.remote:
            raw = self.dir.read_bytes(LOCK)
            lock = self._parse_lock(raw) or {}
            ttl, _ = lease_times()
            return self._holder(raw) if lock and time.time() - float(lock.get("heartbeat", 0)) < ttl else None
        import fcntl

        fd = os.open(pathlib.Path(self.dir.root) / LOCK, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return self._holder(os.pread(fd, 4096, 0))
        finally:
            os.close(fd)  # a shared lock taken here goes with the descriptor
        return None

    @staticmethod
    def _parse_lock(raw: bytes) -> dict | None:
        try:
            lock = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        return lock if isinstance(lock, dict) else None

    def _holder(self, raw: bytes) -> str:
        """The holder of a lock, in words, from the lock file's content."""
        lock = self._parse_lock(raw) or {}
        if not lock:
            return "another process"
        return (f"{lock.get('purpose', 'a process')} (pid {lock.get('pid')} on {lock.get('host')}, "
                f"since {lock.get('since')})")
