"""pytest set-up shared by every test file.

Multi-device code is tested on 8 simulated CPU devices. XLA reads this flag once, when JAX
initialises its CPU backend, so it is set here, before any test module imports JAX.
"""
import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests never reach the network: Weights & Biases stays off, Hugging Face libraries stay offline.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# lm-eval's local test tasks are built by `datasets`, whose cache goes to a throwaway directory.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="hf-datasets-"))


# ------------------------------------------------------------------------------------------------
# Disks that fail as a user's do: a small full one and a read-only one, real tmpfs mounts (the
# suite runs as root, as CI does, where a chmod alone does not stop a write).

import contextlib  # noqa: E402
import pathlib  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402

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
