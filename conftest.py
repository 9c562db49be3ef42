"""pytest set-up shared by every test file.

Multi-device code is tested on 8 simulated CPU devices. XLA reads this flag once, when JAX
initialises its CPU backend, so it is set here, before any test module imports JAX.
"""
import os
import subprocess
import sys
import tempfile

# The suite's programs are compiled without LLVM's optimisations (XLA's own passes, which fix the
# program, its fusions and its buffers, still run): tests run small shapes for few steps, where
# compiling takes most of the time, and ~35% of it goes. And with XLA's older CPU fusion emitters
# where this XLA still has them: its MLIR fusion emitters (the default) take half as long again to
# compile these small programs (the initial state, training and validation steps of three test-size
# configs: 16-17 s against 11-12 s), whose code runs as fast either way at this level. The commands
# tests start inherit the flags.

_OWN = ("--xla_backend_optimization_level=", "--xla_force_host_platform_device_count=",
        "--xla_cpu_use_fusion_emitters=")
# the user's own flags, less those set here (a worker inherits them from the controller)
_USER_XLA_FLAGS = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_OWN))
_OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _has_older_emitters() -> bool:
    """Whether this XLA takes _OLDER_EMITTERS (it stops a process at once on a flag it does not know): asked
    once, by the session's controller, whose answer its workers inherit."""
    said = os.environ.get("GPT_TEST_OLDER_EMITTERS")
    if said is None:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                               env={**os.environ, "XLA_FLAGS": _OLDER_EMITTERS, "JAX_PLATFORMS": "cpu"},
                               capture_output=True)
        said = os.environ["GPT_TEST_OLDER_EMITTERS"] = str(probe.returncode == 0)
    return said == "True"


def xla_flags(devices: int = 8, optimised: bool = False) -> str:
    """XLA_FLAGS for a process of the suite: `devices` CPU devices, compiled as users' programs are if
    `optimised` (LLVM's optimisations, XLA's default emitters), else for compile time."""
    quick = [] if optimised else ["--xla_backend_optimization_level=0",
                                  _OLDER_EMITTERS if _has_older_emitters() else ""]
    return " ".join(filter(None, [*quick, _USER_XLA_FLAGS, f"--xla_force_host_platform_device_count={devices}"]))


os.environ["XLA_FLAGS"] = xla_flags()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, shared by both workers and every command a test
# starts: a program compiled once (the same model, config and shapes, in any process) is loaded after.
# An entry is keyed by the program, the compile options and the platform, so it is the same code.
# Tests that stop a run while its first step compiles take it out (uncached_env).
_CACHE = None  # the directory this process made (the workers inherit the controller's)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-compilation-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Tests never reach the network: Weights & Biases stays off, Hugging Face libraries stay offline.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# lm-eval's local test tasks are built by `datasets`, whose cache goes to a throwaway directory.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="hf-datasets-"))
# gcsfs reads this when it is imported: without it, it asks the storage control API (which the tests'
# GCS server below has not) about every bucket.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def uncached_env(**extra) -> dict:
    """os.environ without the compilation cache, plus `extra`: for a command whose first step must compile
    (a test that stops it then)."""
    return {**{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}, **extra}


def pytest_unconfigure(config):
    if _CACHE is not None:  # the session's controller, once the workers are done
        import shutil

        shutil.rmtree(_CACHE, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Disks that fail as a user's do: a small full one and a read-only one, real tmpfs mounts (the
# suite runs as root, as CI does, where a chmod alone does not stop a write).

import contextlib  # noqa: E402
import pathlib  # noqa: E402
import socket  # noqa: E402

import pytest  # noqa: E402


@contextlib.contextmanager
def _tmpfs(path: pathlib.Path, options: str):
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the disk tests (they need root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def full_disk(tmp_path):
    """A directory on a 256 KiB file system: anything larger than that fails with ENOSPC."""
    with _tmpfs(tmp_path / "full", "size=256k") as path:
        yield path


@pytest.fixture
def small_disk(tmp_path):
    """A directory on a file system of `size` (e.g. "1m"): small_disk("1m"), and later
    small_disk.grow(path, "16m") to free space under a running test, as a user would."""
    with contextlib.ExitStack() as mounts:
        def make(size: str) -> pathlib.Path:
            return mounts.enter_context(_tmpfs(tmp_path / f"disk-{size}", f"size={size}"))

        make.grow = lambda path, size: subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)
        yield make


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only file system, holding one file `kept.txt` (every write is EROFS)."""
    path = tmp_path / "ro"
    with _tmpfs(path, "size=64k") as mounted:
        (mounted / "kept.txt").write_text("kept\n")
        subprocess.run(["mount", "-o", "remount,ro", str(mounted)], check=True)
        yield mounted


# ------------------------------------------------------------------------------------------------
# A user without network


@pytest.fixture
def offline_user(tmp_path):
    """The environment of a command run by a user without network: the Hugging Face Hub (HF_ENDPOINT)
    is a local port that refuses every connection, the Hugging Face cache (HF_HOME) is tmp_path/hf,
    and no HF_* setting is inherited, offline mode included (the suite sets it for itself), so the
    libraries try the Hub as they would for the user."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: a connection to it is refused
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
        env.update(HF_ENDPOINT=f"http://127.0.0.1:{sock.getsockname()[1]}", HF_HOME=str(tmp_path / "hf"))
        yield env

# A Google Cloud Storage server on 127.0.0.1 (gcs_emulator.py, in memory): gs:// paths in the tests
# reach it, in this process and in the commands the tests start (the settings are environment
# variables, which child processes inherit). One server per test process; a fresh bucket per test.

import uuid  # noqa: E402


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The server's URL, http://127.0.0.1:PORT, with the clients pointed at it; stopped at the end."""
    log = tmp_path_factory.mktemp("gcs") / "server.log"
    with open(log, "w") as err:
        server = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).with_name("gcs_emulator.py")), "--bucket", ""],
                                  stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        port = server.stdout.readline().strip()  # printed once it listens
        if not port.isdigit():
            server.wait(10)
            pytest.fail(f"the GCS server did not start (pip install -r requirements-test.txt): {log.read_text()}")
        url = f"http://127.0.0.1:{port}"
        from gcs_emulator import ENVIRONMENT  # what points each client at the server, as a user's shell does

        with pytest.MonkeyPatch.context() as env:
            for name, value in ENVIRONMENT.items():
                env.setenv(name, value.format(url=url))
            yield url
    finally:
        server.kill()
        server.wait(10)


@contextlib.contextmanager
def _new_bucket():
    """gs://BUCKET, a bucket of its own on the server, removed afterwards."""
    import fsspec

    fs = fsspec.filesystem("gs")
    name = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    try:
        yield f"gs://{name}"
    finally:
        fs.invalidate_cache()
        if fs.exists(name):
            fs.rm(name, recursive=True)


@pytest.fixture
def gcs_bucket(gcs_server, tmp_path, monkeypatch):
    """gs://BUCKET, a fresh bucket on the test GCS server."""
    with _new_bucket() as bucket:
        yield bucket


@pytest.fixture(scope="module")
def gcs_module_bucket(gcs_server, tmp_path_factory):
    """gs://BUCKET for a whole test module (a journey several tests look at)."""
    with _new_bucket() as bucket:
        yield bucket


@pytest.fixture
def gcs_refusals(gcs_server):
    """refuse(url, status=403): the server refuses every write and delete of an object under url
    (gs://BUCKET/prefix) with that status, as the service does when a bucket's permissions change under a
    job (403) or it is overloaded (503, which clients retry); refuse.refused(): how many requests it
    has refused so far. Lifted at the end of the test, or by refuse.lift()."""
    import json
    import urllib.request

    def post(rules):
        request = urllib.request.Request(f"{gcs_server}/_emulator/refusals", data=json.dumps(rules).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(request, timeout=10).read()

    def refuse(url: str, status: int = 403) -> None:
        bucket, _, prefix = url.removeprefix("gs://").partition("/")
        post([{"bucket": bucket, "prefix": prefix, "status": status}])

    def refused() -> int:
        with urllib.request.urlopen(f"{gcs_server}/_emulator/refusals", timeout=10) as answer:
            return sum(rule["refused"] for rule in json.loads(answer.read()))

    refuse.refused, refuse.lift = refused, lambda: post([])
    try:
        yield refuse
    finally:
        post([])
