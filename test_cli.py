"""What every command line does alike (core/errors.py): a Ctrl-C at any moment of its start and of its
work ends it with status 130 and its line, never a traceback or a crash; an abbreviated option is
refused in one line.

The Ctrl-Cs are real SIGINTs sent to real processes at moments spread over their first seconds (while
Python imports JAX and the rest, while the model loads and compiles, while they work); which phase a
moment lands in depends on the machine, and every phase must end the same way.
"""
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

import bench
import convert_torch
import data
import eval as E
import gcs_emulator
import plot
import sample
import train
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)

REPO = pathlib.Path(__file__).resolve().parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):  # noqa: F811
    """A 4-step run of the `test` size (block_size 64, trained at context 32)."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    assert train.main(tiny(run_dir, corpus, "training.steps=4", "checkpoint.every=4", "training.eval_every=4")) == 0
    return run_dir


def big_corpus(root: pathlib.Path) -> pathlib.Path:
    """About 2 MB of word salad: seconds of tokenizer training for data.py."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    root.mkdir()
    for i in range(2):
        (root / f"doc{i}.txt").write_text("\n".join(" ".join(rng.choices(words, k=12)) for _ in range(12000)))
    return root


def command(name: str, trained: pathlib.Path, corpus: pathlib.Path, big: pathlib.Path,  # noqa: F811
            tmp: pathlib.Path) -> list[str]:
    """A command line of `name` that works for longer than its moments, its own outputs under tmp."""
    if name == "train.py":
        return tiny(tmp / "run", corpus, "training.steps=100000")
    if name == "data.py":
        return ["--input", str(big / "*.txt"), "--out", str(tmp / "data"), "--vocab-size", "300"]
    if name == "eval.py":  # 30 lengths: a compilation each
        run = shutil.copytree(trained, tmp / "run")
        return ["--checkpoint", str(run), "--lengths", ",".join(str(32 + 8 * i) for i in range(30)),
                "--max-tokens", "300", "--batch-tokens", "256"]
    if name == "sample.py":  # minutes of generation (greedy, it never reaches an end-of-text token)
        return ["--checkpoint", str(trained), "--prompt", "the cat", "--max-new-tokens", "30000", "--temperature", "0"]
    return ["--checkpoint", str(trained), "--format", "hf", "--out", str(tmp / "hf")]


# (command, moments): how far into its work each Ctrl-C comes, in seconds of the process's own CPU time (a
# measure of its progress that a busy machine does not stretch), 0 being the moment its first line has put
# in its handlers: while Python imports JAX and the rest (about 3 s), while the run or model loads, while it
# compiles and works. data.py's and convert_torch.py's work on these small inputs is over in about 4 s.
MOMENTS = {"train.py": (0.0, 2.0, 4.5, 8.0), "data.py": (0.0, 1.0, 2.0), "eval.py": (0.0, 2.0, 4.5, 6.5, 9.0),
           "sample.py": (0.0, 2.0, 4.0, 7.0), "convert_torch.py": (0.0, 1.0, 2.0)}


def ready(pid: int) -> bool:
    """Whether the process has its first line's handlers in (core/errors.py's stop_at_once_while_loading:
    /proc says it catches SIGTERM, until the command's work begins). Before, Python itself is starting,
    which no command's code can reach."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def cpu_seconds(pid: int) -> float:
    """The CPU time the process has used (user and system), from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# eval.py and sample.py, which have nothing to undo, end the same way at a SIGTERM (a kill, a preemption) or a
# SIGHUP (a closed terminal): their moments take the three signals in turn (they were killed with no line)
SIGNALS = {"eval.py": (signal.SIGINT, signal.SIGTERM, signal.SIGHUP), "sample.py": (signal.SIGINT, signal.SIGTERM,
                                                                                      signal.SIGHUP)}


@pytest.mark.parametrize("name", list(MOMENTS))
def test_ctrl_c_at_any_moment_ends_with_130_and_one_line(name, trained, corpus, tmp_path):  # noqa: F811
    """One process per moment, all started together, each sent SIGINT at its moment: every one ends with
    status 130 (not a segmentation fault after the line, not 0 after a Ctrl-C that was dropped), says so
    in its line (`error: ...`, or train.py's and convert_torch.py's `stopped by SIGINT ...`), and prints
    no traceback and no exception Python ignored. sample.py's stderr, a pipe, shows no progress bar.
    eval.py's and sample.py's moments take SIGINT, SIGTERM and SIGHUP in turn: 128 + N and one line each."""
    big = big_corpus(tmp_path / "big") if name == "data.py" else None
    waiting = {}
    for i, moment in enumerate(MOMENTS[name]):
        tmp = tmp_path / str(i)
        tmp.mkdir()
        argv = [sys.executable, name, *command(name, trained, corpus, big, tmp)]
        waiting[moment] = subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True)
    started = list(waiting.items())
    turns = SIGNALS.get(name, (signal.SIGINT,))
    sent = {moment: turns[i % len(turns)] for i, moment in enumerate(MOMENTS[name])}
    try:
        deadline = time.monotonic() + 600
        while waiting and time.monotonic() < deadline:
            for moment, p in list(waiting.items()):
                assert p.poll() is None, (name, moment, p.communicate())  # still at work: the moment is a real one
                if ready(p.pid) if moment == 0 else cpu_seconds(p.pid) >= moment:
                    p.send_signal(sent[moment])
                    del waiting[moment]
            time.sleep(0.005)
        assert not waiting, list(waiting)
        ended = []
        for moment, p in started:
            out, err = p.communicate(timeout=120)
            ended.append((moment, p.returncode, out, err))
    finally:
        for _, p in started:
            p.kill()
            p.wait()
    for moment, status, out, err in ended:
        said, sig = (out + err).splitlines(), sent[moment]
        assert status == 128 + sig, (name, moment, sig, status, err[-2000:])
        assert "Traceback" not in out + err and "Exception ignored" not in err, (name, moment, err[-2000:])
        assert any(line.startswith("error: ") or f"stopped by {sig.name}" in line for line in said), (name, moment, said)
        if name == "sample.py":
            assert "\r" not in err and "token/s" not in err, err  # no progress bar but on a terminal


def test_a_ctrl_c_dropped_inside_a_garbage_collector_callback_still_stops_the_command(tmp_path):
    """A KeyboardInterrupt raised inside a callback of the garbage collector (JAX registers one) is one
    Python prints as ignored and drops: a Ctrl-C at that moment went unheeded and the command ran on to
    status 0. The command's runner delivers it again: one line, status 130."""
    script = tmp_path / "command.py"
    script.write_text(f"""import gc, os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
from core import errors
errors.stop_at_once_while_loading()

def callback(phase, info):
    if phase == "start":
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, its handler run at the next line of Python: in here
        for _ in range(1000):
            pass

def main(argv):
    gc.callbacks.append(callback)
    gc.collect()
    gc.callbacks.remove(callback)
    time.sleep(20)  # the rest of the command's work
    print("done")
    return 0

sys.exit(errors.run_cli(main))
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "error: interrupted\n")


def test_a_hangup_during_the_work_is_not_said_to_be_during_the_start(tmp_path):
    """While a command's modules load, SIGHUP (its terminal closed) ends it with "while starting; nothing was
    done"; once run_cli runs its work, that line would be wrong: the hangup ends it as it ends any program
    (killed by SIGHUP, nothing said), unless the command stops on it its own way."""
    script = tmp_path / "command.py"
    script.write_text(f"""import os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
from core import errors
errors.stop_at_once_while_loading()

def main(argv):
    print("working", flush=True)
    os.kill(os.getpid(), signal.SIGHUP)
    time.sleep(20)
    return 0

sys.exit(errors.run_cli(main))
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (-signal.SIGHUP, "working\n", "")


@pytest.mark.parametrize("cli, argv, abbreviated", [
    (train.cli, ["--pla"], "--pla"),  # --plan
    (data.cli, ["--inp", "x", "--out", "y"], "--inp"),  # --input
    (E.cli, ["--checkpoint", "run", "--task", "piqa"], "--task"),  # --tasks
    (sample.cli, ["--checkpoint", "run", "--prompt", "the", "--max-new", "x"], "--max-new"),  # --max-new-tokens
    (convert_torch.cli, ["--checkpoint", "run", "--out", "x", "--form", "hf"], "--form"),  # --format
    (bench.cli, ["attention", "--step", "x"], "--step"),  # --steps
    (plot.cli, ["runs/a", "--over"], "--over"),  # --overwrite
])
def test_an_abbreviated_option_is_refused_in_one_line(cli, argv, abbreviated, capsys):
    """argparse would take `--task piqa` as `--tasks piqa` (and eval.py would find out after its perplexity
    that the task was never meant); every command takes an option only as written in full."""
    assert cli(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: unrecognized arguments: {abbreviated}"), err


def test_the_storage_emulator_takes_no_abbreviation(capsys):
    with pytest.raises(SystemExit) as refused:
        gcs_emulator.parse_args(["--buck", "x"])  # --bucket
    assert refused.value.code == 2 and "unrecognized arguments: --buck" in capsys.readouterr().err
