"""Output directories swapped into place whole (outputs.StagedDir), killed at the worst moment, and the
leftovers of dead writers settled by the next write."""
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from core import outputs
from core.errors import StorageError

REPO = pathlib.Path(__file__).resolve().parent


def files(directory) -> dict:
    return {p.name: p.read_text() for p in sorted(pathlib.Path(directory).iterdir())}


def build(out, contents: dict, replace=True) -> None:
    with outputs.StagedDir(out, replace=replace) as staged:
        for name, text in contents.items():
            (staged.path / name).write_text(text)
        staged.commit()


def dead_pid() -> int:
    """The id of a process that has ended (and been reaped), so no longer running."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("from a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "y").write_text("from b")
    if not outputs.exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this system or file system cannot exchange two paths")
    assert files(tmp_path / "a") == {"y": "from b"} and files(tmp_path / "b") == {"x": "from a"}


@pytest.mark.parametrize("swap", ["exchange", "two renames"])
def test_a_staged_directory_replaces_the_old_one_whole(tmp_path, monkeypatch, swap):
    out = tmp_path / "out"
    build(out, {"index.json": "old", "only_old.bin": "o"}, replace=False)
    renames, real_rename = [], os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((pathlib.Path(a).name, pathlib.Path(b).name)),
                                                      real_rename(a, b))[1])
    if swap == "two renames":
        monkeypatch.setattr(outputs, "exchange", lambda a, b: False)  # as where renameat2 is unavailable
    build(out, {"index.json": "new", "only_new.bin": "n"})
    assert files(out) == {"index.json": "new", "only_new.bin": "n"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old copy and the staging gone
    pid = os.getpid()
    moved = [(f"out.tmp-{pid}", f"out.tmp-{pid}-ready")]  # marked complete, then swapped in
    if swap == "two renames":
        moved += [("out", f"out.tmp-{pid}-old"), (f"out.tmp-{pid}-ready", "out")]
    assert renames == moved  # with the exchange, `out` is never renamed away: at no moment is it missing
    # without replace, an existing directory is never replaced; the attempt leaves it and nothing else
    with pytest.raises(StorageError, match="cannot write .*out: Directory not empty"):
        build(out, {"index.json": "newer"}, replace=False)
    assert files(out) == {"index.json": "new", "only_new.bin": "n"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


KILLED_BETWEEN_RENAMES = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from core import outputs
outputs.exchange = lambda a, b: False  # the fallback: old -> aside, new -> place
print(os.getpid(), flush=True)
real_rename, calls = os.rename, []
def rename(a, b):
    if len(calls) == {after}:
        os.kill(os.getpid(), signal.SIGKILL)
    calls.append(1)
    real_rename(a, b)
os.rename = rename
with outputs.StagedDir(sys.argv[2], replace=True) as staged:
    (staged.path / "index.json").write_text("new")
    staged.commit()
"""


@pytest.mark.parametrize("after", [1, 2], ids=["before-the-old-moves-aside", "between-the-two-renames"])
def test_a_writer_killed_inside_the_fallback_swap_is_settled_by_the_next_write(tmp_path, after):
    out = tmp_path / "out"
    build(out, {"index.json": "old"}, replace=False)
    code = KILLED_BETWEEN_RENAMES.replace("{after}", str(after))
    killed = subprocess.run([sys.executable, "-c", code, str(REPO), str(out)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left, pid = sorted(p.name for p in tmp_path.iterdir()), killed.stdout.strip()
    if after == 1:  # the new copy was complete, the old one still in place
        assert left == ["out", f"out.tmp-{pid}-ready"] and files(out) == {"index.json": "old"}
    else:  # the old copy aside, the complete new one not yet in place: no `out` at all
        assert left == [f"out.tmp-{pid}-old", f"out.tmp-{pid}-ready"]
    # the next write into `out` settles them first, as it checks --out
    outputs.check_out(out, True, ours=lambda directory: True, what="a test directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert files(out) == {"index.json": "old" if after == 1 else "new"}


def test_leftovers_are_settled_only_for_dead_writers(tmp_path):
    out, dead = tmp_path / "out", dead_pid()
    build(out, {"index.json": "old"}, replace=False)
    # a dead writer's old copy aside with only an incomplete new one: the old one goes back
    os.rename(out, tmp_path / f"out.tmp-{dead}-old")
    (tmp_path / f"out.tmp-{dead}").mkdir()
    (tmp_path / f"out.tmp-{dead}" / "train_00000.bin").write_text("half")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in (f"out.tmp-{live.pid}", f".out.tmp-{live.pid}-ready", f"out.tmp-{live.pid}-old"):
            (tmp_path / name).mkdir()  # a live writer's, left alone whatever its state
        (tmp_path / "out.tmp-mine").mkdir()  # not a writer's name at all
        outputs.settle_leftovers(out)
        assert files(out) == {"index.json": "old"}
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["out", f"out.tmp-{live.pid}", f".out.tmp-{live.pid}-ready", f"out.tmp-{live.pid}-old", "out.tmp-mine"])
        live.kill()
        live.wait()
        outputs.settle_leftovers(out, hidden=True)  # convert_torch.py's .OUT.tmp-PID names
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["out", f"out.tmp-{live.pid}", f"out.tmp-{live.pid}-old", "out.tmp-mine"])
        outputs.settle_leftovers(out)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.tmp-mine"]
        assert files(out) == {"index.json": "old"}
    finally:
        live.kill()
        live.wait()
