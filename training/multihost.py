"""Several processes as one run: how this process was launched, starting jax.distributed, and the one
agreement between the processes, that a failure or a stop on any of them ends every one.

    launch()          which launcher started this process, from its environment (nothing waits for a
                      network on a machine of its own): JAX's variables, SLURM, Open MPI, a TPU pod on
                      GKE, a Cloud TPU VM pod made with gcloud (its workers read from the GCE metadata
                      server); None for a single process
    initialize()      jax.distributed from that; a launch half seen is one line naming the variable
    on_every_process  a start-up check run by every process: a user error on any one stops them all at
                      that point, each with one line
    watch / fail      any other failure on one process (an exception of any kind, a lost lease, a
                      signal during start-up) is posted in the coordination service's key-value store;
                      every other process sees it within a second, runs its `at_end` callbacks (a
                      lease released, a new run directory removed), says in one line which process
                      ended the run and why, and exits at once (waiting in a collective for a process
                      that is gone would last until JAX's heartbeat timeout, then abort)
    lost              a process gone (killed, crashed) or not answering for GPT_PEER_TIMEOUT seconds
                      (stopped, hung, cut off), told by peers.py's links: every process ends, each with
                      one line naming it

Imports errors.py and peers.py only of the project; JAX is imported when a distributed start is needed
(the launch is read with the standard library, before JAX loads).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, NamedTuple

from core import errors
from core.errors import RunError, ShardingError, UserError
from training import peers

TPU_COORDINATOR_PORT = 8482  # the port JAX's own Cloud TPU detection uses for the coordinator
PORT_ENV = "GPT_COORDINATOR_PORT"  # instead of TPU_COORDINATOR_PORT on a TPU VM pod
METADATA_TIMEOUT = 2.0  # seconds for one answer of the GCE metadata server (it answers in milliseconds)


class Launch(NamedTuple):
    """How this process joins the others: jax.distributed.initialize's arguments (None: JAX's own
    detection reads the launcher's environment) and the launcher, in words."""

    kwargs: dict
    source: str


# ----------------------------------------------------------------------------------------------
# Which launcher started this process


def launch() -> Launch | None:
    """How this process was launched as one of several, or None for a single process; a ShardingError
    (one line naming the variable) for a launch half seen: JAX's variables without the coordinator, a
    process index past the count, SLURM's or Open MPI's count without their launcher."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return explicit(env["JAX_COORDINATOR_ADDRESS"], env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID"))
    half = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if env.get(k, "").strip()]
    if half and not (half == ["JAX_NUM_PROCESSES"] and env["JAX_NUM_PROCESSES"].strip() == "1"):
        raise ShardingError(f"{' and '.join(f'{k}={env[k]}' for k in half)} set without JAX_COORDINATOR_ADDRESS: "
                            f"several processes join through a coordinator; set JAX_COORDINATOR_ADDRESS=HOST:PORT "
                            f"(process 0's host), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process, or unset "
                            f"{' and '.join(half)} for a single process")
    for variable in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):  # SLURM, Open MPI: JAX reads the rest
        count = env.get(variable, "").strip()
        if count and not (count.isdigit() and int(count) >= 1):
            raise ShardingError(f"{variable}={env[variable]}: a launcher's count of processes is a whole number of at "
                                f"least 1; this is no launcher's setting: unset {variable} for a single process")
        if count.isdigit() and int(count) > 1:
            return Launch({}, f"{variable}={count}")
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if env.get("TPU_WORKER_HOSTNAMES", "").strip() and not all(h.strip() for h in env["TPU_WORKER_HOSTNAMES"].split(",")):
        raise ShardingError(f"TPU_WORKER_HOSTNAMES={env['TPU_WORKER_HOSTNAMES']}: an empty host name among the "
                            f"workers' (comma-separated, one a worker); unset it for a single process")
    if len(hosts) > 1:
        return Launch({}, f"TPU_WORKER_HOSTNAMES (a TPU pod on GKE, {len(hosts)} hosts)")
    return gce_tpu_pod()


def explicit(address: str, count: str | None, index: str | None) -> Launch:
    """JAX_COORDINATOR_ADDRESS=HOST:PORT with JAX_NUM_PROCESSES and JAX_PROCESS_ID, checked."""
    try:
        count_, index_ = int(count), int(index)
    except (TypeError, ValueError):
        raise ShardingError("JAX_COORDINATOR_ADDRESS is set: JAX_NUM_PROCESSES and JAX_PROCESS_ID must be set to "
                            f"integers too (got {count!r} and {index!r})") from None
    if count_ < 1 or not 0 <= index_ < count_:
        raise ShardingError(f"JAX_NUM_PROCESSES={count} and JAX_PROCESS_ID={index}: the count must be at least 1 and "
                            f"the index from 0 to the count - 1")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShardingError(f"JAX_COORDINATOR_ADDRESS={address}: not HOST:PORT (process 0's host and a free port)")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except OSError as e:
        raise ShardingError(f"JAX_COORDINATOR_ADDRESS={address}: the host {host} cannot be found ({e.strerror or e}); "
                            f"give process 0's host name or IP address") from None
    return Launch({"coordinator_address": address, "num_processes": count_, "process_id": index_},
                  f"JAX_COORDINATOR_ADDRESS={address} (process {index_} of {count_})")


def on_gce() -> bool:
    """Whether this machine is a Google Compute Engine VM (a Cloud TPU VM is one), read from the system
    without a network request."""
    try:
        with open("/sys/class/dmi/id/product_name") as f:
            return f.read().strip().startswith("Google")
    except OSError:
        return False


def metadata(key: str) -> str | None:
    """The GCE metadata server's instance attribute `key` (None when it has none, or answers nothing)."""
    host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/instance/attributes/{key}",
                                     headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=METADATA_TIMEOUT) as answer:
            return answer.read().decode()
    except (urllib.error.URLError, OSError, UnicodeDecodeError):
        return None


def gce_tpu_pod() -> Launch | None:
    """A Cloud TPU VM pod made with `gcloud compute tpus tpu-vm create`: each worker finds its index
    (agent-worker-number) and every worker's address (worker-network-endpoints) in the GCE metadata, as
    JAX's own Cloud TPU detection does; worker 0 is the coordinator. None off GCE, on a VM that is no TPU
    worker, and on a TPU VM of one host. A multislice pod (MEGASCALE_* in tpu-env) is left to JAX's own
    detection."""
    # JAX sets TPU_SKIP_MDS_QUERY where it finds no TPU chips; an explicit GCE_METADATA_IP is still read
    if not os.environ.get("GCE_METADATA_IP") and (os.environ.get("TPU_SKIP_MDS_QUERY") or not on_gce()):
        return None
    number = metadata("agent-worker-number")
    if number is None or not number.strip().isdigit():
        return None
    endpoints = metadata("worker-network-endpoints") or ""
    workers = []
    for worker in filter(None, endpoints.split(",")):  # host names, or name:id:ip triples (older pods)
        parts = worker.split(":")
        workers.append(parts[2] if len(parts) == 3 else parts[0])
    if len(workers) < 2:
        return None
    if "MEGASCALE_NUM_SLICES" in (metadata("tpu-env") or "") + " ".join(os.environ):
        return Launch({}, f"a multislice Cloud TPU pod (worker {number.strip()})")
    port = os.environ.get(PORT_ENV, str(TPU_COORDINATOR_PORT))
    if not port.isdigit():
        raise ShardingError(f"{PORT_ENV}={port}: the coordinator's port, a number")
    index = int(number)
    if index >= len(workers):
        raise ShardingError(f"the GCE metadata names this TPU worker {index}, but lists {len(workers)} workers")
    return Launch({"coordinator_address": f"{workers[0]}:{port}", "num_processes": len(workers),
                   "process_id": index},
                  f"a Cloud TPU VM pod (worker {index} of {len(workers)}, from the GCE metadata)")


def launched_several() -> bool:
    """Whether the environment says this process is one of several, read without any network request
    (for the first moments of a command, while modules load): a signal then waits for the processes to
    agree instead of ending this one alone. On any GCE VM it may be (a TPU pod is told by its metadata,
    read later): a signal there ends the start once JAX has loaded, a few seconds later."""
    env = os.environ
    counts = [env.get("SLURM_NTASKS", ""), env.get("OMPI_COMM_WORLD_SIZE", ""), env.get("JAX_NUM_PROCESSES", "")]
    return (bool(env.get("JAX_COORDINATOR_ADDRESS")) or any(c.isdigit() and int(c) > 1 for c in counts)
            or len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1
            or bool(env.get("GCE_METADATA_IP")) or on_gce())  # (a TPU VM pod's workers are GCE VMs)


def initialize() -> bool:
    """Start jax.distributed when this process is one of several (see `launch`); True if it is. Call it
    before any other JAX call. A single process: nothing starts, nothing waits for a network."""
    import jax

    if jax.distributed.is_initialized():
        return True
    how = launch()
    if how is None:
        return False
    global _limit
    _limit = peers.peer_timeout()  # (a bad value: one line, before joining)
    join = peers.join_timeout()
    joined = threading.Event()

    def join_limit():  # JAX's own limit aborts the process with a C++ stack trace: this one ends it first
        if not joined.wait(join):
            sys.stdout.flush()
            os.write(2, (f"error: {how.source}: the processes did not all join within {join} s (the coordinator, "
                         f"process 0, never answered, or a process never started): start every process, or "
                         f"allow longer with {peers.JOIN_TIMEOUT_ENV}=SECONDS\n").encode())
            os._exit(2)

    threading.Thread(target=join_limit, name="join-limit", daemon=True).start()
    try:  # JAX's own heartbeat check (which aborts every process) waits past the limit, which ends the run first
        with peers.service_elsewhere(linger=WAIT_FOR_OTHERS + 2 * LAST_LEAVES):
            jax.distributed.initialize(**how.kwargs, heartbeat_timeout_seconds=peers.jax_heartbeat(_limit),
                                       initialization_timeout=join + peers.JAX_SPARE)
    except (ValueError, RuntimeError) as e:  # JAX's detection not seeing the launcher, a coordinator unreachable
        what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShardingError(f"{how.source} says several processes run, but JAX cannot join them ({what[:300]}): "
                            f"start one train.py per process with the launcher (srun, mpirun), or set "
                            f"JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID") from None
    finally:
        joined.set()
    return True


# ----------------------------------------------------------------------------------------------
# Agreement at start-up checks


def on_process_zero(check, stopped: str) -> None:
    """Process 0 runs `check` (e.g. taking a run directory's lock); if it fails with a user error, every
    process stops: process 0 with that error, the others with a RunError "process 0 `stopped`"."""
    import jax

    on_every_process(lambda: check() if jax.process_index() == 0 else None, stopped)


def on_every_process(check, stopped: str):
    """Every process runs `check` (e.g. reading its data) and returns its result; if it fails with a user
    error (one line) on any process, every process stops at this point: that one with its error, the
    others with a RunError "process K `stopped`", K the first that failed. Errors raised here are `agreed`:
    every process meets them together, so none needs to end the others (`fail`)."""
    import jax
    import numpy as np

    error, result = None, None
    try:
        result = check()
    except UserError as e:
        error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None))).reshape(-1)
        if error is None and failed.any():
            error = RunError(f"process {int(np.argmax(failed))} {stopped}")
        if error is not None:
            error.agreed = True
    if error is not None:
        raise error
    return result


# ----------------------------------------------------------------------------------------------
# A failure anywhere ends every process

ENDED = "gpt_alibi/ended"  # the key the first process to end the run writes: {said, status, out}
SEEN = "gpt_alibi/seen/"  # + process index: that process has seen it and is ending
POLL_MS = 500  # how long one wait of the watcher for the end lasts, in milliseconds (it then looks again)
WAIT_FOR_OTHERS = 5.0  # seconds an ending process waits for every other to have seen the end
LAST_LEAVES = 0.5  # seconds process 0, whose exit takes the coordination service with it, leaves after the others
LINK_GRACE = 3.0  # seconds a failed collective waits for the links to name a process that is gone (its cause)

_at_end: list[Callable[[], None]] = []
_ending = threading.Event()  # this process is ending (failing, or seen another's end): the watcher stands down
_end_lock = threading.Lock()
_watching = threading.Event()
_links: peers.Links | None = None
_limit = peers.TIMEOUT  # seconds a process may go without answering (peers.peer_timeout)


def at_end(callback: Callable[[], None]) -> Callable[[], None]:
    """Run `callback` before this process exits because the run ended elsewhere or here (a lease to release,
    a new run directory to remove); returns its removal, for when what it undoes is done normally."""
    _at_end.append(callback)
    return lambda: _at_end.remove(callback) if callback in _at_end else None


def _client():
    from jax._src import distributed  # the coordination service's client (orbax uses it the same way)

    return distributed.global_state.client


def _begin_end() -> bool:
    """Whether this thread is the one to end this process (no other has begun to); from now on it is."""
    with _end_lock:
        if _ending.is_set():
            return False
        _ending.set()
        return True


def watch() -> None:
    """With several processes: a thread that ends this process when another posts the run's end (`fail`,
    `lost`): it runs the at_end callbacks, says in one line which process ended the run and why, and
    exits with that process's status; and the links (`Links`) that tell a process gone or not answering."""
    import jax
    from jax._src import distributed

    global _links
    if jax.process_count() < 2 or _watching.is_set():
        return
    _watching.set()
    client = _client()

    def loop():
        while not _ending.is_set():
            try:
                raw = client.blocking_key_value_get(ENDED, POLL_MS)
            except Exception:  # not posted meanwhile (or the service shut down at a normal end)
                continue
            ended_elsewhere(json.loads(raw))

    thread = threading.Thread(target=loop, name="run-ended-elsewhere", daemon=True)
    thread.start()
    _links = peers.Links(jax.process_index(), _limit, _ending, lost, ended_elsewhere)
    _links.start(client, distributed.global_state.coordinator_address.rpartition(":")[0].strip("[]"))

    def stand_down():  # before JAX's own shutdown (registered earlier, so run later): a thread still inside
        _ending.set()  # the client's call when the interpreter finalizes aborts the process
        _links.leave(None)  # the others are told that this process ends on purpose
        thread.join()

    atexit.register(stand_down)


def ended_elsewhere(ended: dict, by: int | None = None) -> None:
    """Another process ended the run, and posted `ended` (or sent it on its link as its farewell, `by` that
    process, which this one then does not wait for): this one ends too, saying so."""
    if not _begin_end():
        return
    import jax

    me = jax.process_index()
    prefix = "" if ended["out"] == 1 else "error: "  # a stop is said on stdout, without "error:"
    end_here(_client(), me, f"{prefix}{ended['said']}; process {me} stops too", ended, gone=by)


def end_here(client, me: int, line: str, ended: dict, gone: int | None = None) -> None:
    """This process ends now, as `ended` says (its status, and `out`: the file descriptor of `line`): it
    runs the at_end callbacks, writes `line`, tells its links why (`Links.leave`), says it has seen the
    end, waits (a few seconds at most) until every process has but `gone` (gone, or not answering: with
    process 0, the coordination service is too), and exits; process 0 last, since the others'
    coordination service goes with it."""
    import jax

    for callback in list(_at_end):
        try:
            callback()
        except Exception:  # the process is ending: what a callback could not do stays as it was
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(ended["out"], (line + "\n").encode())
    null = os.open(os.devnull, os.O_WRONLY)  # the line is the last: what the main thread still prints is not
    for fd in (1, 2):
        os.dup2(null, fd)
    if _links is not None:
        _links.leave(ended)
    status = ended["status"]
    timer = threading.Timer(WAIT_FOR_OTHERS + 2 * LAST_LEAVES, os._exit, (status,))  # whatever the service does
    timer.daemon = True
    timer.start()
    deadline = time.monotonic() + WAIT_FOR_OTHERS
    try:
        if gone != 0:
            client.key_value_set(f"{SEEN}{me}", "1", allow_overwrite=True)
            while time.monotonic() < deadline and len(client.key_value_dir_get(SEEN)) < jax.process_count() - (
                    gone is not None):
                time.sleep(0.05)
    except Exception:  # the service is gone: nobody is left to wait for
        pass
    if me == 0:
        time.sleep(LAST_LEAVES)
    os._exit(status)


def fail(error: BaseException, line: str, status: int, out: int = 2, traceback: bool = False,
         wait: bool = True) -> None:
    """This process failed (`error`, said as `line`, exit `status`; `traceback`: print the error's first),
    or was stopped during start-up (`out` 1: a stop, said on stdout), while others run: post it for them
    (see `watch`), then end this process at once (orderly unwinding could wait in a collective for
    processes that are leaving). Where the run is ending already (another process's failure, which may
    be what broke a collective here, or a process gone), this process waits for that end instead. A
    single process or an error every process met together (`agreed`): nothing happens, and the caller
    goes on as usual (so too, `wait` False, where the run is ending already)."""
    import jax

    if not _watching.is_set() or getattr(error, "agreed", False):
        return
    if isinstance(error, jax.errors.JaxRuntimeError):  # a collective that failed: a process gone, which the
        _ending.wait(LINK_GRACE)  # links tell in a moment, is its cause
    if not _begin_end():
        if not wait:
            return
        threading.Event().wait()  # the watcher, or the links, end this process
    if traceback:
        import traceback as tb

        tb.print_exception(error)
    me, said = jax.process_index(), line.removeprefix("error: ")
    ended = post({"said": f"process {me} {said}" if out == 1 else f"process {me} failed: {said}", "status": status,
                  "out": out})
    end_here(_client(), me, line, ended)


def fail_now(error: UserError) -> None:
    """A failure met outside the main thread (a lease lost, seen by its renewal thread): with several
    processes every process ends now (`fail`), where the main thread might meet it only after a wait in
    a collective that the others wait for in vain. One process, or the run ending already: nothing (the
    main thread meets it)."""
    fail(error, f"error: {error}", error.exit_status, wait=False)


def lost(process: int, words: str) -> None:
    """Process `process` is gone or not answering (`words` say which, and since when): this process ends
    with a line saying so, and status 1; process 0, which holds the coordination service, ends every
    other too; a process that loses process 0 ends alone (each does)."""
    import jax

    if not _begin_end():
        return
    me, said = jax.process_index(), f"process {process} {words}"
    ended = {"said": said, "status": 1, "out": 2}
    if me == 0:
        post(ended)
    end_here(_client(), me, f"error: {said}; process {me} stops too", ended, gone=process)


def post(ended: dict) -> dict:
    """`ended` posted as the run's end, for every process's watcher; returns it."""
    try:
        _client().key_value_set(ENDED, json.dumps(ended))
    except Exception:  # another process ended the run first: its end stands, this one says its own
        pass
    return ended


@contextlib.contextmanager
def ends_every_process(passes: type | tuple = ()):
    """With several processes, an exception inside (but of the `passes` types: stops all processes agreed
    on) ends every process at once (`fail`), before anything of the block unwinds: closing a checkpoint
    saver, say, would wait in a collective for processes that are leaving. One process: nothing."""
    try:
        yield
    except Exception as e:
        if isinstance(e, passes):
            raise
        said = errors.describe(e)
        fail(e, *(said or (f"error: {type(e).__name__}: {e}".splitlines()[0], 1)), traceback=said is None)
        raise


def finished() -> None:
    """The run ended normally on every process: the watcher stands down (the service shuts down next)."""
    _ending.set()
