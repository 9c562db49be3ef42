"""A process of several that is gone or not answering, told to the others within moments (gone) or after a
limit the user sets (not answering), for multihost.py, which ends the run on it.

    Links             a TCP link between process 0 and each other process, with a heartbeat each way every
                      second from a thread of its own: a link closed without a farewell is a process gone
                      (killed, crashed: its system closes its connections), told at once; a link silent is
                      a process stopped, hung or cut off (SIGSTOP, a VM stall, a network cut), said once
                      after SAY_AFTER seconds and lost after GPT_PEER_TIMEOUT seconds (`peer_timeout`)
    Service           JAX's coordination service run in a child process of process 0 that outlives it by a
                      few seconds, so that where process 0 is killed the others end with their own line,
                      instead of JAX aborting each the moment the service goes (`service_elsewhere`)

JAX's own heartbeat check, the only one otherwise, aborts every process with a stack trace after 100 s
without a heartbeat; it is set to wait past the limit (`jax_heartbeat`), so that the links end the run
first. Imports errors.py only of the project.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Callable

from core.errors import ShardingError

TIMEOUT_ENV = "GPT_PEER_TIMEOUT"  # seconds, instead of TIMEOUT
TIMEOUT = 1200.0  # seconds a process may go without answering before every process ends: 20 min, far past any
# pause of a working process (its links answer from a thread of their own, through a save or a compilation)
SAY_AFTER = 30.0  # seconds without an answer before a process says so, once (at most half the limit)
BEAT = 1.0  # seconds between two heartbeats on a link
JAX_SPARE = 60  # seconds JAX's own heartbeat check (an abort) waits past the limit
LINK = "gpt_alibi/link"  # the key of process 0's link port in the coordination service


def peer_timeout() -> float:
    """The seconds a process may go without answering before every process ends (TIMEOUT, or
    GPT_PEER_TIMEOUT=SECONDS); a ShardingError for a value that is no number of at least 3."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return TIMEOUT
    try:
        limit = float(text)
    except ValueError:
        limit = math.nan
    if not (math.isfinite(limit) and limit >= 3 * BEAT):
        raise ShardingError(f"{TIMEOUT_ENV}={text}: the seconds a process of several may go without answering "
                            f"before every process ends, a number of at least 3; unset, {TIMEOUT:.0f}")
    return limit


JOIN_TIMEOUT_ENV = "GPT_JOIN_TIMEOUT"  # seconds, instead of JOIN_TIMEOUT
JOIN_TIMEOUT = 300  # seconds every process waits for the others to join (JAX's default): a pod's workers boot apart


def join_timeout() -> int:
    """The seconds a process waits for the others (and the coordinator) to join before it ends with one line
    (JOIN_TIMEOUT, or GPT_JOIN_TIMEOUT=SECONDS); a ShardingError for a value that is no whole number >= 1."""
    text = os.environ.get(JOIN_TIMEOUT_ENV, "").strip()
    if not text:
        return JOIN_TIMEOUT
    if not (text.isdigit() and int(text) >= 1):
        raise ShardingError(f"{JOIN_TIMEOUT_ENV}={text}: the seconds a process waits for the others to join, a "
                            f"whole number of at least 1; unset, {JOIN_TIMEOUT}")
    return int(text)


def jax_heartbeat(limit: float) -> int:
    """JAX's heartbeat timeout for a `limit`: its default, 100 s, or longer than the limit."""
    return max(100, math.ceil(limit) + JAX_SPARE)


# ----------------------------------------------------------------------------------------------
# The links

class Links:
    """A TCP link between process 0 and every other process (a star, as process 0 holds the coordination
    service anyway), each side sending a heartbeat every BEAT seconds from a thread of its own, and a
    farewell when it ends on purpose (with the run's end, where it ends the run). A link closed without
    a farewell: the process at its other end is gone (killed, crashed: its system closed the connection),
    told at once (`lost`). A link silent: that process is stopped, hung or cut off, said once after
    SAY_AFTER seconds (and again when it answers), and `lost` after `limit` seconds. Process 0 watches
    every process, the others process 0. Where a link cannot be made (a firewall), JAX's own heartbeat
    check is all that is left."""

    def __init__(self, me: int, limit: float, ending: threading.Event, lost: Callable[[int, str], None],
                 ended: Callable[[dict, int], None]):
        """`ending`: set when this process ends (the links stand down); `lost(process, words)`: that process
        is gone or not answering, `words` say which; `ended(end, process)`: that process ended the run
        as `end` says (its farewell)."""
        self.me, self.limit, self.say_after = me, limit, min(SAY_AFTER, limit / 2)
        self.ending, self.lost, self.ended = ending, lost, ended
        self.selector = selectors.DefaultSelector()
        self.peers: dict[int, socket.socket] = {}
        self.heard: dict[int, tuple[float, float]] = {}  # process -> (monotonic, wall) time last heard
        self.said: set[int] = set()  # processes said not to answer
        self.farewells: dict[int, bytes] = {}  # process -> its farewell so far
        self.left = False  # this process has said its farewell
        self.guard = threading.Lock()

    def start(self, client, coordinator_host: str) -> None:
        try:
            if self.me == 0:
                server = socket.create_server(("", 0))
                self.selector.register(server, selectors.EVENT_READ)
                client.key_value_set(LINK, str(server.getsockname()[1]))
            else:
                port = int(client.blocking_key_value_get(LINK, 60_000))
                peer = socket.create_connection((coordinator_host, port), timeout=10)
                peer.sendall(struct.pack(">I", self.me))
                self.add(0, peer)
        except Exception as e:  # (an error from the client, a refused connection)
            print(f"warning: process {self.me} has no link to process 0 ({str(e).splitlines()[0][:200]}): a process "
                  f"gone is noticed only by JAX's heartbeat check", file=sys.stderr, flush=True)
            return
        threading.Thread(target=self.run, name="run-links", daemon=True).start()

    def add(self, process: int, peer: socket.socket) -> None:
        peer.setblocking(False)
        with self.guard:
            self.peers[process] = peer
            self.heard[process] = (time.monotonic(), time.time())
        self.selector.register(peer, selectors.EVENT_READ, process)

    def run(self) -> None:
        sent = 0.0
        while not self.ending.is_set():
            self.receive(BEAT / 2)
            now = time.monotonic()
            if now - sent >= BEAT:
                sent = now
                self.send(b".")
            for process, (then, wall) in list(self.heard.items()):
                silent = now - then
                if process in self.farewells or silent < (self.limit if process in self.said else self.say_after):
                    continue
                self.receive(0)  # what came meanwhile first (this process may be the one that was stopped)
                if self.heard[process][0] != then or process in self.farewells:
                    continue
                since = time.strftime("%H:%M:%S", time.localtime(wall))
                if silent >= self.limit:
                    self.lost(process, f"has not answered for {silent:.0f} s (since {since}; {TIMEOUT_ENV}="
                                       f"{self.limit:g}): it is stopped, hung or cut off")
                else:
                    self.said.add(process)
                    print(f"warning: process {process} has not answered for {silent:.0f} s (since {since}): it may be "
                          f"stopped, hung or cut off; every process ends if it has not answered in {self.limit:g} s "
                          f"({TIMEOUT_ENV})", file=sys.stderr, flush=True)

    def receive(self, timeout: float) -> None:
        """What came on the links within `timeout` seconds: a process linking up (process 0), heartbeats,
        farewells, links closed."""
        for key, _ in self.selector.select(timeout):
            if key.data is not None:
                self.received(key.data, key.fileobj)
                continue
            peer, _ = key.fileobj.accept()  # process 0: another process links up
            peer.settimeout(10)
            with contextlib.suppress(OSError, struct.error):
                self.add(struct.unpack(">I", peer.recv(4, socket.MSG_WAITALL))[0], peer)

    def received(self, process: int, peer: socket.socket) -> None:
        """What `process` sent: heartbeats, a farewell (with the run's end, which this process then takes),
        or the end of its link."""
        try:
            got = peer.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            got = b""
        if not got:  # closed: after a farewell, on purpose; without, that process is gone
            self.selector.unregister(peer)
            if process not in self.farewells:
                self.lost(process, "is gone (its link closed without a word: killed, crashed, or its machine lost)")
            return
        if process in self.said:
            print(f"process {process} answers again, after {time.monotonic() - self.heard[process][0]:.0f} s",
                  file=sys.stderr, flush=True)
            self.said.discard(process)
        self.heard[process] = (time.monotonic(), time.time())
        if b"B" in got or process in self.farewells:  # B, then the end as JSON on one line
            farewell = self.farewells.get(process, b"")
            farewell += got if process in self.farewells else got[got.find(b"B") + 1:]
            self.farewells[process] = farewell
            if b"\n" in farewell and (ended := json.loads(farewell.split(b"\n")[0])):
                self.ended(ended, process)

    def send(self, what: bytes, last: bool = False) -> None:
        with self.guard:  # nothing after the farewell
            if self.left:
                return
            self.left = last
            for peer in self.peers.values():
                with contextlib.suppress(OSError):  # (a full buffer: the other end is not reading; a closed link)
                    peer.send(what)

    def leave(self, ended: dict | None) -> None:
        """This process ends on purpose (`ended`: the run's end, as posted, that it ends with): its
        farewell, before its links close with it."""
        self.send(b"B" + json.dumps(ended or {}).encode() + b"\n", last=True)


# ----------------------------------------------------------------------------------------------
# The coordination service, in a process of its own

SERVICE = """
import json, os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # it ends with process 0, not on a signal to the job
    signal.signal(s, signal.SIG_IGN)
from jaxlib import _jax
try:
    service = _jax.get_distributed_runtime_service(sys.argv[1], int(sys.argv[2]), **json.loads(sys.argv[3]))
except Exception as e:
    print(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, flush=True)
    os._exit(1)
print("ready", flush=True)
if sys.stdin.readline() == "shutdown\\n":
    service.shutdown()
else:  # process 0 ended without JAX's shutdown (killed, or ending the run): the others' moments to end
    time.sleep(float(sys.argv[4]))
os._exit(0)
"""


class Service:
    """JAX's coordination service (process 0's), run in a child process of process 0 that outlives it by
    `linger` seconds: where process 0 is killed, the others then end with one line each (their links say it
    is gone) instead of JAX aborting each the moment the service goes. Made by jax.distributed.initialize,
    in place of its own (`service_elsewhere`); shut down by JAX at a normal end."""

    def __init__(self, address: str, num_nodes: int, *, linger: float, **options):
        import subprocess

        self.child = subprocess.Popen([sys.executable, "-c", SERVICE, address, str(num_nodes), json.dumps(options),
                                       str(linger)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        said = self.child.stdout.readline().decode().strip()
        if said != "ready":
            raise RuntimeError(said or f"the coordination service's process ended ({self.child.wait()})")

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.child.stdin.write(b"shutdown\n")
            self.child.stdin.flush()
        self.child.wait()


def internals_here() -> bool:
    """Whether this JAX has the internals service_elsewhere uses (else JAX's own service runs, in process 0)."""
    try:
        from jax._src import distributed
        from jaxlib import _jax
    except ImportError:
        return False
    return (hasattr(getattr(distributed, "_jax", None), "get_distributed_runtime_service")
            and hasattr(_jax, "get_distributed_runtime_service"))


@contextlib.contextmanager
def service_elsewhere(linger: float):
    """While jax.distributed.initialize runs: process 0 starts its coordination service as a `Service` that
    outlives it by `linger` seconds. This reaches into JAX's internals (jax._src.distributed's `_jax`, and
    jaxlib's get_distributed_runtime_service in the child); a JAX without them starts its own service, in
    process 0 (`internals_here` says which: the suite runs both): every ending still has its one line,
    except that a process 0 killed outright takes the service with it, and JAX aborts the others."""
    if not internals_here():
        yield
        return
    from jax._src import distributed

    jaxlib = distributed._jax

    class WithService:
        get_distributed_runtime_service = functools.partial(Service, linger=linger)

        def __getattr__(self, name):
            return getattr(jaxlib, name)

    distributed._jax = WithService()
    try:
        yield
    finally:
        distributed._jax = jaxlib
