"""Tests of multihost.py: several train.py processes as one run, joined however they were launched (JAX's
variables, a Cloud TPU VM pod's GCE metadata on 127.0.0.1), training and saving together, and ending
together, each with one line, whatever happens on one of them: a user error, an exception, a lost lease,
a signal at any moment from launch on. Two processes with gloo collectives on the CPU.
"""
import contextlib
import http.server
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import train
from conftest import xla_flags
from store import rundir, runlock
from test_train import corpus, rows, tiny  # noqa: F401  (corpus is a fixture)
from training import multihost, peers

REPO = pathlib.Path(__file__).resolve().parent


def run_subprocess(args, devices, env_extra=None, timeout=240, python=("train.py",)):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(devices), **(env_extra or {})}
    return subprocess.Popen([sys.executable, *python, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def killed_at_exit(procs):
    """`procs`, each killed at the block's exit if still running (a failed test leaves no process behind)."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def finish(procs, timeout=300):
    with killed_at_exit(procs):
        outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


def two_processes(train_args, devices=2, env=None, failing=None, every=None):
    """Two train.py processes joined as one job (JAX_COORDINATOR_ADDRESS on a free port), `devices` CPU
    devices each; `train_args`: their arguments, or a function of the process index giving them; `env`:
    more variables, or a function of the index giving them. `failing`: (index, code) runs `code` in that
    process before train.py (see `injected`); `every`: code run so in both."""
    if every is not None:
        python = lambda i: injected(every)  # noqa: E731
    else:
        python = lambda i: injected(failing[1]) if failing and failing[0] == i else ("train.py",)  # noqa: E731
    port = free_port()
    launch = lambda i: {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",  # noqa: E731
                        "JAX_PROCESS_ID": str(i)}
    return [run_subprocess(train_args(i) if callable(train_args) else train_args, devices,
                           env_extra=env(i) if callable(env) else {**launch(i), **(env or {})}, python=python(i))
            for i in range(2)]


def training(run, procs, steps: int = 3) -> None:
    """Waits until the processes have logged `steps` steps of `run`, all still running."""
    deadline = time.time() + 180
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if (run / "metrics.jsonl").exists() and len(rows(run)) >= steps:
            break
        time.sleep(0.2)
    assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]


def injected(code: str) -> tuple[str, ...]:
    """The python arguments that run `code` (a patch of a project module: the failure under test), then
    train.py as the command line does."""
    return ("-c", f"import runpy, sys\n{code}\nsys.argv[0] = 'train.py'\nrunpy.run_path('train.py', run_name='__main__')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("env, words", [
    ({"SLURM_NTASKS": "4"}, "error: SLURM_NTASKS=4 says several processes run, but JAX cannot join them ("),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "error: OMPI_COMM_WORLD_SIZE=2 says several processes run, but JAX cannot "),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}, "error: JAX_COORDINATOR_ADDRESS is set: JAX_NUM_PROCESSES and "),
], ids=["sbatch-without-srun", "mpi-size-alone", "coordinator-alone"])
def test_a_launcher_half_seen_is_one_line(corpus, tmp_path, env, words):  # noqa: F811
    """train.py run where a launcher's variables say several processes but not how to join them (inside an
    sbatch script or an salloc shell without srun): one line naming the variable, exit 2, nothing made."""
    run = tmp_path / "run"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR"))}
    done = subprocess.run([sys.executable, "train.py", *tiny(run, corpus)], cwd=REPO, capture_output=True, text=True,
                          env={**clean, "JAX_PLATFORMS": "cpu", **env}, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(words) and "Traceback" not in done.stderr, done.stderr
    assert not run.exists()


def test_bad_data_on_one_process_stops_every_process_with_one_line(corpus, tmp_path):  # noqa: F811
    """Each process reads its own data directory (a copy on each node); one of them missing: that process
    names it, the other says which process stopped, both in one line with exit 2, within moments, and
    nothing is left (they used to wait for each other for ever, process 0 in a Gloo traceback)."""
    run = tmp_path / "run"
    with killed_at_exit(two_processes(lambda i: tiny(run, corpus if i == 0 else tmp_path / "nodata"))) as procs:
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    last = [err.strip().splitlines()[-1] for _, err in outs]
    assert last == ["error: process 1 stopped before training (its error says why)",
                    f"error: {tmp_path / 'nodata' / 'index.json'} not found; prepare the data with `python data.py`"]
    assert not any("Traceback" in err for _, err in outs) and not run.exists()


def test_a_signal_to_one_process_during_start_up_ends_every_process(corpus, tmp_path):  # noqa: F811
    """Ctrl-C reaching one process of two while they start (reading data, compiling): every process ends
    the start together at its next start-up check, with the one line of a stopped start and 130, and the
    new run directory is removed (one process ending alone left the other waiting for it)."""
    run = tmp_path / "run"
    with killed_at_exit(two_processes(tiny(run, corpus), env={"PYTHONUNBUFFERED": "1"})) as procs:
        seen = []
        for line in procs[0].stdout:  # the first line train.py prints once jax.distributed has started
            seen.append(line)
            if line.startswith(("model.vocab_size", "sharding: mesh")):
                break
        procs[1].send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [128 + signal.SIGINT] * 2, (seen, outs)
    for out, _ in outs:
        assert "stopped by SIGINT during start-up: nothing trained, nothing saved" in out
    assert not run.exists()


@pytest.mark.parametrize("service", ["JAX's internals", "the fallback"])
def test_a_signal_to_one_process_stops_every_process_at_one_step_with_a_checkpoint(corpus, tmp_path,  # noqa: F811
                                                                                  service):
    """Ctrl-C reaching one process of two (a pod's workers signalled unevenly): both stop after the same
    step, which all agreed on through JAX's preemption sync, with one checkpoint of it, instead of the
    other process waiting for ever in the collective save. The signalled process ends with 130, the other
    with 143 (the preemption notice it was sent), and process 0 says where the checkpoint is. The same with
    the fallback for a JAX without the internals peers.service_elsewhere uses (peers told so in both
    processes): JAX's own coordination service, in process 0."""
    run = tmp_path / "run"
    long_run = tiny(run, corpus, "training.steps=100000", "checkpoint.every=100000", "training.eval_every=100000")
    fallback = "from training import peers\npeers.internals_here = lambda: False" if service == "the fallback" else None
    with killed_at_exit(two_processes(long_run, every=fallback)) as procs:
        training(run, procs)
        procs[1].send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM, 128 + signal.SIGINT], outs
    [saved] = os.listdir(run / "checkpoints")
    assert f"stopped by SIGTERM after step {saved}; checkpoint saved in {run / 'checkpoints' / saved}" in outs[0][0]
    # the signalled process says its own line too (its only line was JAX's preemption notifier's warning)
    assert f"process 1 stopped by SIGINT after step {saved} with every process; checkpoint saved in " in outs[1][0]
    assert [r["step"] for r in rows(run)] == list(range(1, int(saved) + 1))  # every step logged, once


@pytest.mark.parametrize("optimizer", ["muon"])
def test_two_processes_match_one(corpus, tmp_path, optimizer):  # noqa: F811
    """2 processes x 4 CPU devices (gloo) train, save and resume with the losses of 1 process x 8 devices, with
    Muon, the default optimizer (its momentum and the AdamW moments of the embeddings, head, norms and biases
    sharded over both processes' devices at ZeRO stage 3: AdamW's state is in the same step; test_dpo.py and the
    signal tests run AdamW across two processes too)."""
    args = ("training.steps=5", "checkpoint.every=5", "training.eval_every=5", "sharding.zero_stage=3",
            "sharding.fsdp=2", "training.batch_size=16", f"training.optimizer={optimizer}")
    single, multi = tmp_path / "single", tmp_path / "multi"
    # the reference: the same save at 5 and resume to 7 (the schedule's length changes with steps)
    assert train.main(tiny(single, corpus, *args)) == 0
    assert train.main(["--resume", f"run_dir={single}", "training.steps=7"]) == 0

    outs = finish(two_processes(tiny(multi, corpus, *args), devices=4))
    assert "2 process(es)" in outs[0][0] and "model test" not in outs[1][0]  # only process 0 reports
    assert "step 5: val loss" in outs[0][0] and "val loss" not in outs[1][0] + outs[1][1]
    assert sorted(p.name for p in (multi / "checkpoints").iterdir()) == ["5"]
    finish(two_processes(["--resume", f"run_dir={multi}", "training.steps=7"], devices=4))
    a, b = rows(single), rows(multi)
    assert [r["step"] for r in b] == list(range(1, 8))
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-5)
    np.testing.assert_allclose([r["val_loss"] for r in b if "val_loss" in r],
                               [r["val_loss"] for r in a if "val_loss" in r], rtol=1e-5)


@pytest.mark.parametrize("env, words", [
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     "JAX_NUM_PROCESSES=2 and JAX_PROCESS_ID=1 set without JAX_COORDINATOR_ADDRESS"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "JAX_NUM_PROCESSES=2 and JAX_PROCESS_ID=2: the count must be at least 1 and the index from 0 to the count - 1"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "-1", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES=-1 and JAX_PROCESS_ID=0: the count must be at least 1"),
    ({"JAX_COORDINATOR_ADDRESS": "nohost.invalid:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "JAX_COORDINATOR_ADDRESS=nohost.invalid:1234: the host nohost.invalid cannot be found"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "JAX_COORDINATOR_ADDRESS=127.0.0.1: not HOST:PORT"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
      "GPT_PEER_TIMEOUT": "2"}, "GPT_PEER_TIMEOUT=2: the seconds a process of several may go without answering"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
      "GPT_JOIN_TIMEOUT": "soon"}, "GPT_JOIN_TIMEOUT=soon: the seconds a process waits for the others to join"),
    ({"SLURM_NTASKS": "abc"}, "SLURM_NTASKS=abc: a launcher's count of processes is a whole number of at least 1"),
    ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS=0: a launcher's count of processes is a whole number of at least 1"),
    ({"OMPI_COMM_WORLD_SIZE": "-2"}, "OMPI_COMM_WORLD_SIZE=-2: a launcher's count of processes is a whole number"),
    ({"TPU_WORKER_HOSTNAMES": ","}, "TPU_WORKER_HOSTNAMES=,: an empty host name among the workers'"),
], ids=["no-coordinator", "index-past-count", "negative-count", "unknown-host", "no-port", "peer-timeout",
        "join-timeout", "slurm-abc", "slurm-0", "mpi-negative", "tpu-hosts-empty"])
def test_launcher_variables_that_cannot_work_are_one_line(corpus, tmp_path, env, words, monkeypatch, capsys):  # noqa: F811
    """JAX's launch variables half set or impossible: one line naming them before anything is made (a
    process that trained alone, or a JaxRuntimeError traceback, before)."""
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = tmp_path / "run"
    assert train.cli(tiny(run, corpus)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {words}") and err.count("\n") == 1, err
    assert not run.exists()


class Metadata(http.server.BaseHTTPRequestHandler):
    """A GCE metadata server's instance attributes for one TPU VM worker (`attributes`), answering only
    requests that carry Metadata-Flavor: Google, as the real one does."""

    attributes: dict = {}

    def do_GET(self):
        prefix = "/computeMetadata/v1/instance/attributes/"
        key = self.path[len(prefix):] if self.path.startswith(prefix) else None
        if self.headers.get("Metadata-Flavor") != "Google" or key not in self.attributes:
            self.send_error(403 if key in self.attributes else 404)
            return
        body = self.attributes[key].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def metadata_servers(workers: int):
    """One metadata server on 127.0.0.1 per TPU VM worker of a pod: GCE_METADATA_IP for each."""
    servers = []
    for i in range(workers):
        handler = type("Worker", (Metadata,), {"attributes": {
            "agent-worker-number": str(i), "worker-network-endpoints": ",".join(["127.0.0.1"] * workers),
            "tpu-env": "ACCELERATOR_TYPE: 'v4-16'\n"}})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        yield [f"127.0.0.1:{server.server_address[1]}" for server in servers]
    finally:
        for server in servers:
            server.shutdown()


def test_a_tpu_vm_pod_joins_through_its_metadata_and_stops_together(corpus, tmp_path, monkeypatch):  # noqa: F811
    """A Cloud TPU VM pod made with gcloud has no launcher variables: each worker reads its index and the
    workers' addresses from the GCE metadata server, worker 0 coordinating. Two train.py processes, each
    with its own metadata server on 127.0.0.1 answering as worker 0 and 1, join, train, and on a SIGTERM
    to both (a preemption notice) stop after the same step with one checkpoint of it."""
    run = tmp_path / "run"
    with metadata_servers(2) as hosts:
        monkeypatch.setenv("GCE_METADATA_IP", hosts[1])
        assert multihost.launch() == multihost.Launch(
            {"coordinator_address": "127.0.0.1:8482", "num_processes": 2, "process_id": 1},
            "a Cloud TPU VM pod (worker 1 of 2, from the GCE metadata)")
        monkeypatch.delenv("GCE_METADATA_IP")
        port = free_port()
        long_run = tiny(run, corpus, "training.steps=100000", "checkpoint.every=100000", "training.eval_every=100000")
        env = lambda i: {"GCE_METADATA_IP": hosts[i], multihost.PORT_ENV: str(port)}  # noqa: E731
        with killed_at_exit(two_processes(long_run, env=env)) as procs:
            training(run, procs)
            for p in procs:
                p.send_signal(signal.SIGTERM)
            outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, outs
    assert "(4 devices, 2 process(es))" in outs[0][0]
    [saved] = os.listdir(run / "checkpoints")
    assert f"stopped by SIGTERM after step {saved}" in outs[0][0]
    assert f"process 1 stopped by SIGTERM after step {saved} with every process" in outs[1][0]  # its own line
    assert [r["step"] for r in rows(run)] == list(range(1, int(saved) + 1))


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("where, patch, why", [
    ("mid-training", "from training import progress\n"
     "dispatched = progress.Steps.dispatched\n"
     "def failing(self, metrics):\n"
     "    if self.step == 4: raise ValueError('injected failure after step 4')\n"
     "    return dispatched(self, metrics)\n"
     "progress.Steps.dispatched = failing", "ValueError: injected failure after step 4"),
    ("during restore", "from store import checkpoints\n"
     "def failing(self, *args, **kwargs):\n"
     "    raise RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB')\n"
     "checkpoints.Saver.restore = failing",
     "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB"),
])
def test_an_exception_on_one_process_ends_every_process_within_seconds(corpus, tmp_path, where, patch, why):  # noqa: F811
    """Any exception on process 1 alone (a bug, an out-of-memory), mid-training or while restoring: process
    1 ends with its traceback and one line, process 0 within seconds with one line naming process 1 and
    why; the last checkpoint stays intact and the run's lock is free (a resume starts at once)."""
    run = tmp_path / "run"
    args = tiny(run, corpus, "training.steps=100000", "checkpoint.every=2", "training.eval_every=100000")
    if where == "during restore":
        assert train.main(tiny(run, corpus, "training.steps=2", "checkpoint.every=2")) == 0
        args = ["--resume", f"run_dir={run}", "training.steps=100000"]
    with killed_at_exit(two_processes(args, failing=(1, patch))) as procs:
        procs[1].wait(timeout=240)
        failed = time.monotonic()
        procs[0].wait(timeout=60)
        took = time.monotonic() - failed
        outs = [p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs
    assert last_line(outs[1][1]) == f"error: {why}" and "Traceback" in outs[1][1]
    assert last_line(outs[0][1]) == f"error: process 1 failed: {why}; process 0 stops too"
    assert "Traceback" not in outs[0][1] and took < 15, (took, outs[0][1][-2000:])
    assert rundir.Run(run).lock.held_by() is None
    params, step = rundir.Run(run).weights.load_params()  # the newest checkpoint reads, its fingerprints checked
    assert step % 2 == 0 and step >= 2


def test_a_signal_right_after_launch_ends_every_process(corpus, tmp_path):  # noqa: F811
    """SIGTERM to one of two processes while Python and JAX are still loading, before they have joined:
    it is kept, and once they have joined every process ends its start, with one line and 143 each, and
    nothing made (the signalled process used to end alone and the other waited for it)."""
    run = tmp_path / "run"
    with killed_at_exit(two_processes(tiny(run, corpus))) as procs:
        time.sleep(0.6)  # the command's first lines have run; JAX is loading (once it has joined the others,
        # JAX's preemption service takes SIGTERM: a stop agreed after the first step, as in training)
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, outs
    assert "stopped by SIGTERM during start-up: nothing trained, nothing saved" in outs[1][0], outs
    assert "process 1 stopped by SIGTERM during start-up" in outs[0][0] and "process 0 stops too" in outs[0][0]
    assert not run.exists()


def test_a_lost_lease_ends_every_process(corpus, tmp_path, gcs_bucket):  # noqa: F811
    """A run in a bucket whose lease process 0 loses (another writer took the run: the lock replaced under
    it) while two processes train, at the worst moment: process 0 waits for its save in flight, its own
    fence passed, and the save's commit (slow, as in a bucket under load) then meets the fence. Process 0
    ends with its one line, and process 1 with one naming process 0 and why; the new holder's lock stays
    (the two used to wait in orbax's barriers for each other's commit, 20 minutes, when the lease was lost
    during that wait, as a loaded machine made it often)."""
    import fsspec

    fs = fsspec.filesystem("gs")
    run, waiting = f"{gcs_bucket}/run", tmp_path / "waiting"
    args = tiny(run, corpus, "training.steps=100000", "checkpoint.every=2", "training.eval_every=100000")
    slow_commit = ("import pathlib, threading, time\n"  # the first save's commit waits for the next save to wait
                   "from store import checkpoints\n"
                   "in_wait, wait, fenced = threading.Event(), checkpoints.Saver.wait, checkpoints.fenced_commit\n"
                   "def waiting(self):\n"
                   "    if self.pending is not None: in_wait.set()\n"
                   "    return wait(self)\n"
                   "held = []\n"
                   "def slow(fence):\n"
                   "    if held: return fence()\n"
                   "    held.append(True)\n"
                   "    in_wait.wait()\n"
                   f"    pathlib.Path({str(waiting)!r}).touch()\n"
                   "    while True: fence(); time.sleep(0.1)\n"
                   "checkpoints.Saver.wait = waiting\n"
                   "checkpoints.fenced_commit = lambda fence: fenced(lambda: slow(fence))")
    with killed_at_exit(two_processes(args, env={runlock.LEASE_TTL_ENV: "6"}, failing=(0, slow_commit))) as procs:
        deadline = time.time() + 180
        while time.time() < deadline and all(p.poll() is None for p in procs) and not waiting.exists():
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        assert waiting.exists(), "the first save's commit was not held"
        taker = {"host": "elsewhere", "pid": 1, "purpose": "train.py --resume", "since": "now", "token": "taker",
                 "heartbeat": time.time() + 3600}
        fs.pipe(f"{run}/{runlock.LOCK}", json.dumps(taker).encode())
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    lost = last_line(outs[0][1])
    assert lost.startswith(f"error: this process lost the lease on {run} (train.py --resume (pid 1 on elsewhere"), lost
    assert last_line(outs[1][1]) == f"error: process 0 failed: {lost.removeprefix('error: ')}; process 1 stops too"
    assert json.loads(fs.cat_file(f"{run}/{runlock.LOCK}"))["token"] == "taker"


def only_line(err: str) -> str:
    """The one line a process said on stderr, besides the progress lines of its steps."""
    said = [line for line in err.strip().splitlines() if not line.startswith("step ")]
    assert len(said) == 1 and "Traceback" not in err, err[-3000:]
    return said[0]


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_process_is_named_by_the_others(corpus, tmp_path, killed):  # noqa: F811
    """SIGKILL of one of two training processes (the out-of-memory killer, a machine lost), process 0 with
    the coordination service or the other: the survivor ends within moments with one line naming the
    process gone, and 1 (it used to end in a Gloo traceback, wait for JAX's heartbeat check to abort it
    after 100 s, or, process 0 gone, be aborted by JAX at once with a C++ stack trace)."""
    run = tmp_path / "run"
    long_run = tiny(run, corpus, "training.steps=100000", "checkpoint.every=100000", "training.eval_every=100000")
    with killed_at_exit(two_processes(long_run)) as procs:
        training(run, procs)
        procs[killed].kill()
        survivor = procs[1 - killed]
        _, err = survivor.communicate(timeout=60)
    assert survivor.returncode == 1, err[-3000:]
    assert only_line(err) == (f"error: process {killed} is gone (its link closed without a word: killed, crashed, or "
                              f"its machine lost); process {1 - killed} stops too")


def test_a_stopped_process_is_said_then_ends_the_run_at_the_limit(corpus, tmp_path):  # noqa: F811
    """One of two training processes stopped (SIGSTOP: a VM stall, a debugger, ^Z): the other says once
    which process has not answered, and since when, and once it has not for GPT_PEER_TIMEOUT seconds
    ends with one line and 1 (it used to wait with no word until JAX's heartbeat check aborted it). The
    stopped process, continued, ends too, with the run's line."""
    run = tmp_path / "run"
    long_run = tiny(run, corpus, "training.steps=100000", "checkpoint.every=100000", "training.eval_every=100000")
    limit = 6
    with killed_at_exit(two_processes(long_run, env={peers.TIMEOUT_ENV: str(limit)})) as procs:
        training(run, procs)
        procs[1].send_signal(signal.SIGSTOP)
        stopped = time.time()
        _, err = procs[0].communicate(timeout=120)
        took = time.time() - stopped
        procs[1].send_signal(signal.SIGCONT)
        _, err1 = procs[1].communicate(timeout=60)
    said = [line for line in err.strip().splitlines() if not line.startswith("step ")]
    assert len(said) == 2 and "Traceback" not in err, err[-3000:]
    warned = re.fullmatch(r"warning: process 1 has not answered for (\d+) s \(since (\d\d:\d\d:\d\d)\): it may be "
                          rf"stopped, hung or cut off; every process ends if it has not answered in {limit} s "
                          rf"\({peers.TIMEOUT_ENV}\)", said[0])
    assert warned and limit / 2 <= int(warned[1]) + 0.5 < limit, said
    since = warned[2]
    assert -1 <= seconds_before(stopped, since) <= limit, (since, time.strftime("%H:%M:%S", time.localtime(stopped)))
    ended = re.fullmatch(rf"error: (process 1 has not answered for (\d+) s \(since {since}; {peers.TIMEOUT_ENV}="
                         rf"{limit}\): it is stopped, hung or cut off); process 0 stops too", said[1])
    assert ended and int(ended[2]) + 0.5 >= limit and took > limit - 2 * peers.BEAT, (said, took)
    assert procs[0].returncode == 1 and procs[1].returncode == 1
    assert only_line(err1) == f"error: {ended[1]}; process 1 stops too"


def seconds_before(t: float, hms: str) -> int:
    """How many seconds the time of day `hms` (HH:MM:SS, local) lies before the time `t`."""
    h, m, s = map(int, hms.split(":"))
    day = time.localtime(t)
    return (day.tm_hour * 3600 + day.tm_min * 60 + day.tm_sec - (h * 3600 + m * 60 + s) + 43200) % 86400 - 43200


def test_a_signal_during_an_evaluation_on_one_process_stops_both_with_a_checkpoint_resumed_exactly(corpus, tmp_path):  # noqa: F811
    """Ctrl-C reaching process 1 of two while the first evaluation runs (no checkpoint yet): the stop is agreed
    at one step, both processes save it together and say their line (process 0 names the checkpoint, which is
    there), and the two processes resumed from it end bit for bit where two processes never stopped end."""
    # the stop is agreed through JAX's preemption notice some steps after the signal: room for it before the end
    args = ("training.steps=40", "training.eval_every=20", "checkpoint.every=30", "model.dropout=0.1")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    finish(two_processes(tiny(straight, corpus, *args)))
    hook = ("import os, signal, dataclasses\n"
            "from training import step\n"
            "build = step.build\n"
            "def hooked(*a, **k):\n"
            "    fns = build(*a, **k)\n"
            "    sent = []\n"
            "    def eval_step(*args):\n"
            "        if not sent:\n"
            "            sent.append(os.kill(os.getpid(), signal.SIGINT))\n"
            "        return fns.eval_step(*args)\n"
            "    return dataclasses.replace(fns, eval_step=eval_step)\n"
            "step.build = hooked")
    with killed_at_exit(two_processes(tiny(stopped, corpus, *args), failing=(1, hook))) as procs:
        outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM, 128 + signal.SIGINT], outs
    [saved] = os.listdir(stopped / "checkpoints")
    assert 20 <= int(saved) < 30, saved
    assert f"stopped by SIGTERM after step {saved}; checkpoint saved in {stopped / 'checkpoints' / saved}" in outs[0][0]
    assert f"process 1 stopped by SIGINT after step {saved} with every process; checkpoint saved in " in outs[1][0]
    assert [r["step"] for r in rows(stopped)] == list(range(1, int(saved) + 1))
    outs = finish(two_processes(["--resume", f"run_dir={stopped}"]))
    assert f"resuming from step {saved}" in outs[0][0]
    assert [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "time_s")} for r in rows(stopped)] == \
        [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "time_s")} for r in rows(straight)]
    a, b = (rundir.Run(run).weights.load_params() for run in (straight, stopped))
    assert a[1] == b[1] == 40
    jax.tree.map(np.testing.assert_array_equal, a[0], b[0])


@pytest.mark.parametrize("ending", ["the limit", "SIGTERM"])
def test_a_join_whose_coordinator_never_answers_ends_at_its_limit_or_a_signal(corpus, tmp_path, ending):  # noqa: F811
    """Process 1 of two whose coordinator accepts its connection and never answers (a hung process 0): at
    GPT_JOIN_TIMEOUT it ends with one line and status 2, or, sent SIGTERM while it waits in the join, at once
    with the line of a stopped start and 143 (it waited past both, then JAX aborted it with a C++ stack)."""
    run = tmp_path / "run"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{silent.getsockname()[1]}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": "1", "GPT_JOIN_TIMEOUT": "4" if ending == "the limit" else "120"}
        with killed_at_exit([run_subprocess(tiny(run, corpus), 1, env_extra=env)]) as (p,):
            silent.settimeout(120)
            connection, _ = silent.accept()  # the process is joining now
            started = time.monotonic()
            if ending == "SIGTERM":
                p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=120)
            took = time.monotonic() - started
            connection.close()
    assert "Traceback" not in err and "Check failure" not in err, err[-2000:]
    if ending == "the limit":
        assert p.returncode == 2 and took < 30, (took, err[-2000:])
        assert last_line(err).startswith("error: JAX_COORDINATOR_ADDRESS=") and last_line(err).endswith(
            "(process 1 of 2): the processes did not all join within 4 s (the coordinator, process 0, never answered, "
            "or a process never started): start every process, or allow longer with GPT_JOIN_TIMEOUT=SECONDS"), err
    else:
        assert p.returncode == 128 + signal.SIGTERM and took < 15, (took, err[-2000:])
        assert "stopped by SIGTERM during start-up: nothing trained, nothing saved; nothing was written" in out
    assert not run.exists()


def test_the_jax_internals_the_coordination_service_uses_are_there():
    """peers.service_elsewhere reaches into JAX (jax._src.distributed._jax and jaxlib's
    get_distributed_runtime_service): this fails when a JAX moves them, so that the fallback (JAX's own
    service, in process 0; run by the signal test above) is then known to be what runs."""
    assert peers.internals_here()
