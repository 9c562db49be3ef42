"""Tests of plot.py: several runs' loss curves in one PNG, what it draws against the metrics the runs
logged, its default name, the files it will not replace, and its mistakes as one line.

The runs are metrics.jsonl files written here, row by row as train.py writes them (a run's other files
play no part); one run lies in a bucket (conftest.py's GCS server).
"""
import json
import pathlib
import subprocess
import sys

import fsspec
import pytest

import plot
from training import plots

REPO = pathlib.Path(__file__).resolve().parent


def write_run(directory: pathlib.Path, steps: int, batch_tokens: int, loss0: float, torn: bool = False) -> list[dict]:
    """A run directory holding only metrics.jsonl: a row per step with its loss and tokens, a validation
    loss every 3 steps; `torn`: a last line cut off, as a kill during its write leaves it. Returns the rows."""
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "loss": loss0 - 0.1 * s, "lr": 1e-3, "tokens": s * batch_tokens}
        if s % 3 == 0:
            row.update(val_loss=loss0 - 0.08 * s, val_ppl=2.0)
        rows.append(row)
    directory.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + ('{"step": 99, "lo' if torn else "")
    (directory / "metrics.jsonl").write_text(text)
    return rows


@pytest.fixture
def drawn(monkeypatch):
    """The lines of each figure plots.py draws, read from matplotlib's own line data: a list, per figure,
    of (label, x, y)."""
    figures = []
    original = plots.png

    def png(ax, title):
        figures.append([(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()])
        return original(ax, title)

    monkeypatch.setattr(plots, "png", png)
    return figures


def expected_lines(name: str, rows: list[dict], x: str) -> list[tuple]:
    """What a run's rows draw, written out: its training loss at every row, its validation loss where logged."""
    val = [r for r in rows if "val_loss" in r]
    return [(f"{name}: train loss", [r[x] for r in rows], [r["loss"] for r in rows]),
            (f"{name}: validation loss", [r[x] for r in val], [r["val_loss"] for r in val])]


def test_two_runs_are_drawn_in_one_picture(tmp_path, monkeypatch, capsys, drawn):
    """Two runs' training and validation loss, by step and by tokens: the lines are the logged values (a
    last line cut off left out), labelled by run, in a PNG named after the runs in the current directory."""
    import matplotlib.image

    a = write_run(tmp_path / "runs" / "small-lr", 7, 256, 6.0, torn=True)
    b = write_run(tmp_path / "runs" / "big-batch", 5, 1024, 5.5)
    monkeypatch.chdir(tmp_path)
    assert plot.cli(["runs/small-lr", "runs/big-batch"]) == 0
    out = capsys.readouterr().out
    assert out == ("small-lr: 7 logged steps to step 7, 2 evaluations\nbig-batch: 5 logged steps to step 5, "
                   "1 evaluation\n-> loss-small-lr-vs-big-batch.png (by step)\n")
    picture = tmp_path / "loss-small-lr-vs-big-batch.png"
    assert matplotlib.image.imread(picture).shape[:2] == (600, 960)  # 8 x 5 inches at 120 dpi
    assert drawn[-1] == expected_lines("small-lr", a, "step") + expected_lines("big-batch", b, "step")

    assert plot.cli(["runs/small-lr", "runs/big-batch", "--x", "tokens", "--out", "by-tokens.png"]) == 0
    assert capsys.readouterr().out.endswith("-> by-tokens.png (by tokens)\n")
    assert drawn[-1] == expected_lines("small-lr", a, "tokens") + expected_lines("big-batch", b, "tokens")
    assert (tmp_path / "by-tokens.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    # drawn again: an existing picture is replaced only with --overwrite, and then whole
    before = picture.read_bytes()
    assert plot.cli(["runs/small-lr", "runs/big-batch"]) == 2
    assert capsys.readouterr().err == ("error: loss-small-lr-vs-big-batch.png already exists; choose another --out or "
                                       "pass --overwrite to replace it\n")
    assert picture.read_bytes() == before
    assert plot.cli(["runs/small-lr", "--overwrite", "--out", str(picture)]) == 0
    assert drawn[-1] == expected_lines("small-lr", a, "step") and picture.read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["by-tokens.png", "loss-small-lr-vs-big-batch.png", "runs"]


def test_runs_of_one_name_are_labelled_by_where_they_are(tmp_path, monkeypatch, capsys, drawn):
    """Two runs named alike (each experiment's `run`) are told apart by their locations as given."""
    write_run(tmp_path / "exp1" / "run", 3, 256, 6.0)
    write_run(tmp_path / "exp2" / "run", 3, 256, 5.0)
    monkeypatch.chdir(tmp_path)
    assert plot.cli(["exp1/run", "exp2/run/"]) == 0
    assert [label for label, _, _ in drawn[-1]] == ["exp1/run: train loss", "exp1/run: validation loss",
                                                   "exp2/run/: train loss", "exp2/run/: validation loss"]
    assert capsys.readouterr().out.endswith("-> loss-exp1_run-vs-exp2_run.png (by step)\n")


def test_a_run_in_a_bucket_is_drawn_beside_a_local_one(tmp_path, gcs_bucket, capsys, drawn):
    """A run directory at a gs:// URL is read in place, and the picture may go into the bucket too."""
    local = write_run(tmp_path / "run", 4, 256, 6.0)
    remote = [{**row, "loss": row["loss"] + 1} for row in local]
    fs = fsspec.filesystem("gs", skip_instance_cache=True)
    fs.pipe_file(f"{gcs_bucket}/runs/run/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in remote).encode())
    out = f"{gcs_bucket}/figures/both.png"
    assert plot.cli([f"{gcs_bucket}/runs/run", str(tmp_path / "run"), "--out", out]) == 0
    assert drawn[-1] == (expected_lines(f"{gcs_bucket}/runs/run", remote, "step")
                         + expected_lines(str(tmp_path / "run"), local, "step"))
    assert fs.cat_file(out).startswith(b"\x89PNG\r\n\x1a\n")
    assert plot.cli([str(tmp_path / "run"), "--out", out]) == 2
    assert capsys.readouterr().err == (f"error: {out} already exists; choose another --out or pass --overwrite to "
                                       f"replace it\n")


def test_what_cannot_be_drawn_is_one_line(tmp_path, monkeypatch, capsys):
    """A run that is not there or has no log, a log train.py did not write, a run named twice, --x tokens
    without tokens, an --out that is no .png or is another kind of file: one line each, nothing written."""
    write_run(tmp_path / "a", 3, 256, 6.0)
    (tmp_path / "empty").mkdir()
    write_run(tmp_path / "damaged", 3, 256, 6.0)
    lines = (tmp_path / "damaged" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "damaged" / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", lines[2]]) + "\n")
    (tmp_path / "old").mkdir()  # rows without tokens
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1, "loss": 6.0}\n')
    (tmp_path / "nan").mkdir()  # a run that diverged at once
    (tmp_path / "nan" / "metrics.jsonl").write_text('{"step": 1, "loss": NaN, "tokens": 8}\n{"step": 2, "loss": Infinity, '
                                                    '"tokens": 16}\n')
    (tmp_path / "notes.png").write_text("my notes\n")
    (tmp_path / "folder.png").mkdir()
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, said in [
        (["a", "missing"], "run directory missing not found"),
        (["a", "empty"], "empty has no metrics.jsonl: not a run directory, or a run stopped before its first logged "
                         "step"),
        (["damaged"], "damaged/metrics.jsonl: line 2 is not JSON; repair or remove it"),
        (["a", "./a"], "./a is given twice; name each run once"),
        (["a", "old", "--x", "tokens"], "--x tokens: old/metrics.jsonl has rows without tokens; draw it by step (--x)"),
        (["a", "nan"], "nan/metrics.jsonl: every logged loss is NaN or infinite (a run that diverged from its first "
                       "step): nothing to draw"),
        (["a", "--out", "a.jpg"], "--out must name a .png file, got 'a.jpg'"),
        (["a", "--out", "notes.png"], "notes.png already exists; choose another --out or pass --overwrite to replace it"),
        (["a", "--out", "notes.png", "--overwrite"], "--out notes.png is not a PNG file; --overwrite replaces only a "
                                                     "PNG file"),
        (["a", "--out", "folder.png", "--overwrite"], "--out folder.png is not a regular file; --overwrite replaces "
                                                      "only a PNG file"),
        (["a", "--out", "nowhere/a.png"], f"--out nowhere/a.png: the directory {tmp_path / 'nowhere'} does not exist"),
        (["a", "--x", "time"], "argument --x: invalid choice: 'time' (choose from 'step', 'tokens') (usage: python "
                               "plot.py RUN_DIR [RUN_DIR ...] [--x step|tokens] [--out FILE.png] [--overwrite])"),
    ]:
        assert plot.cli(args) == 2, args
        assert capsys.readouterr().err == f"error: {said}\n", args
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "notes.png").read_text() == "my notes\n"


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path, full_disk, capsys):
    """--out on a file system with no room: one line saying so, and no OUT.png.tmp-PID left beside it."""
    write_run(tmp_path / "a", 30, 256, 6.0)
    (full_disk / "filler").write_bytes(b"\0" * (252 * 1024))  # the disk all but full
    assert plot.cli([str(tmp_path / "a"), "--out", str(full_disk / "loss.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "space" in err.lower(), err
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def test_the_command_says_a_mistake_in_one_line(tmp_path):
    """`python plot.py` itself: one line on stderr and status 2, no traceback."""
    done = subprocess.run([sys.executable, str(REPO / "plot.py"), str(tmp_path / "none")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"error: run directory {tmp_path / 'none'} not found\n")
    assert not any(tmp_path.iterdir())
