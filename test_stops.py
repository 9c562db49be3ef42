"""Tests of a stop's promise: SIGINT, SIGTERM or SIGHUP at any moment of a training step saves a checkpoint of
that step, the line after it names that checkpoint, and `--resume` from it ends exactly where a run that was
never stopped ends.

The moments are reached by hooks, not by timing: the function that runs each phase of a step (the step
itself, the metrics read, the log, an evaluation compiling and running, the loss curve, the check before a
save, the save, the log's flush, the wait for an asynchronous save, the summary) is wrapped so that it sends
the signal to its own process as it starts, on the step chosen. Python runs the handler right then, so the
signal arrives during that phase, as a real one would. Every stop is then resumed and compared with an
uninterrupted run, bit for bit: parameters, optimizer state, step, RNG and every metrics row.
"""
import dataclasses
import json
import os
import pathlib
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import train
from store import checkpoints, rundir
from test_train import corpus, deterministic, tiny  # noqa: F401  (corpus is a fixture)
from training import progress
from training import step as step_lib

STEPS = 12  # evaluations at 3, 6, 9 and 12, checkpoints at 5, 10 and 12: phases before and after a checkpoint


def stop_args(run_dir, corpus, *extra):  # noqa: F811
    return tiny(run_dir, corpus, f"training.steps={STEPS}", "training.eval_every=3", "checkpoint.every=5",
                "model.dropout=0.1", *extra)


def saved_state(run_dir, step: int) -> dict:
    """Checkpoint `step` as orbax reads it, with none of this project's code (a local path or a bucket URL)."""
    where = str(run_dir) if str(run_dir).startswith("gs://") else pathlib.Path(run_dir).resolve()
    with ocp.CheckpointManager(f"{where}/checkpoints" if isinstance(where, str) else where / "checkpoints") as mngr:
        return mngr.restore(step, args=ocp.args.StandardRestore())


def metrics_rows(run_dir) -> list[dict]:
    return [deterministic(r) for r in rundir.Run(str(run_dir)).logged()]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):  # noqa: F811
    """The run never stopped: its last checkpoint and its metrics, for every stopped one to end at."""
    run_dir = tmp_path_factory.mktemp("stops") / "straight"
    assert train.main(stop_args(run_dir, corpus)) == 0
    return saved_state(run_dir, STEPS), metrics_rows(run_dir)


class Hook:
    """Sends `sig` to this process when the wrapped function is entered at the chosen moment (`when`, given
    the call's arguments and the count of calls so far); once."""

    def __init__(self, sig: int, when):
        self.sig, self.when, self.calls, self.fired = sig, when, 0, None

    def wrap(self, fn, *, method: bool = True):
        def hooked(*args, **kwargs):
            self.calls += 1
            if self.fired is None and self.when(self.calls, *args):
                self.fired = self.calls
                os.kill(os.getpid(), self.sig)  # the handler runs before the next line: the signal lands here
            return fn(*args, **kwargs)
        return hooked


def at_step(n):  # a Steps method on step n
    return lambda calls, steps, *args: steps.step == n


def hook_fns(monkeypatch, hook, name):
    """`name` of the jitted functions step.build returns (train_step, eval_step, all_finite), hooked."""
    build = step_lib.build

    def hooked_build(*args, **kwargs):
        fns = build(*args, **kwargs)
        return dataclasses.replace(fns, **{name: hook.wrap(getattr(fns, name))})
    monkeypatch.setattr(step_lib, "build", hooked_build)


# (phase, what is hooked, on which call, the step the stop saves); steps 1-4 have no checkpoint before them,
# steps 6-11 have checkpoint 5
PHASES = {
    "the step, before any checkpoint": ("fns.train_step", lambda calls, *a: calls == 2, 2),
    "the step, after a checkpoint": ("fns.train_step", lambda calls, *a: calls == 7, 7),
    "the metrics read": (progress.Steps.read, lambda calls, steps: steps.pending[0] == 2, 3),
    "the log's write": (progress.Steps.log, lambda calls, steps, row: row["step"] == 4, 5),  # (logged a step late)
    "the first evaluation, compiling": ("fns.eval_step", lambda calls, *a: calls == 1, 3),
    "the first evaluation, running": ("fns.eval_step", lambda calls, *a: calls == 2, 3),
    "a later evaluation": ("fns.eval_step", lambda calls, *a: calls == 5, 9),
    "the loss curve after an evaluation": (progress.Steps.plot, at_step(6), 6),
    "the check before the first save": ("fns.all_finite", lambda calls, *a: calls == 1, 5),
    "the log's flush before a save": (progress.Steps.flush, at_step(5), 5),
    "the first save": (checkpoints.Saver.save, lambda calls, saver, step, *a: step == 5, 5),
    "the pause after a save": (progress.Steps.paused, at_step(5), 5),
    "a later save": (checkpoints.Saver.save, lambda calls, saver, step, *a: step == 10, 10),
    "the wait for the save before": (checkpoints.Saver.wait, lambda calls, saver: saver.pending == 5, 10),
}
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


def stopped_and_resumed(monkeypatch, capsys, run_dir, args, phase, sig, straight):
    """Runs `args` with `sig` sent at `phase`, checks the stop's line and checkpoint, resumes, and checks the
    resumed run against the straight one. Returns the stop's output."""
    target, when, expected = PHASES[phase]
    hook = Hook(sig, when)
    with monkeypatch.context() as patched:
        if isinstance(target, str):
            hook_fns(patched, hook, target.split(".")[1])
        else:
            owner = progress.Steps if target.__qualname__.startswith("Steps.") else checkpoints.Saver
            patched.setattr(owner, target.__name__, hook.wrap(target))
        capsys.readouterr()
        code = train.main(args)
        out = capsys.readouterr().out
    assert hook.fired, f"{phase}: never reached"
    assert code == 128 + sig, out
    where = f"{run_dir}/checkpoints/{expected}" if str(run_dir).startswith("gs://") else \
        os.path.join(rundir.Run(str(run_dir)).dir.checkpoint_dir(), str(expected))
    assert f"stopped by {sig.name} after step {expected}; checkpoint saved in {where}" in out, (phase, out)
    assert int(saved_state(run_dir, expected)["step"]) == expected  # there, as the line says
    assert train.main(["--resume", f"run_dir={run_dir}"]) == 0
    resumed = capsys.readouterr().out
    assert f"resuming from step {expected}" in resumed and "starts from step 0" not in resumed, resumed
    state, rows = straight
    jax.tree.map(np.testing.assert_array_equal, saved_state(run_dir, STEPS), state)  # params, opt_state, step, rng
    assert metrics_rows(run_dir) == rows
    return out


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_stop_at_any_phase_of_a_step_saves_that_step(phase, corpus, straight, tmp_path, monkeypatch,  # noqa: F811
                                                       capsys):
    """Each phase of a step, each of the three signals in turn, synchronous saves for half of the phases and
    asynchronous ones for the other half: the line names the step's checkpoint, which is there, and the run
    resumed from it ends as the straight run does."""
    i = list(PHASES).index(phase)
    sig = SIGNALS[i % 3]
    run_dir = tmp_path / "run"
    stopped_and_resumed(monkeypatch, capsys, run_dir, stop_args(run_dir, corpus, f"checkpoint.async_save={i % 2 == 0}"),
                        phase, sig, straight)


def test_a_stop_during_the_summary_changes_nothing(corpus, straight, tmp_path, monkeypatch, capfd):  # noqa: F811
    """SIGTERM while the summary is written, the last step trained and saved: the run is complete (status 0),
    it says the signal came as it ended, and its last checkpoint is the straight run's."""
    run_dir = tmp_path / "run"
    hook = Hook(signal.SIGTERM, lambda calls, steps, *a: True)
    monkeypatch.setattr(progress.Steps, "summary", hook.wrap(progress.Steps.summary))
    assert train.main(stop_args(run_dir, corpus)) == 0
    err = capfd.readouterr().err
    assert hook.fired and "SIGTERM after the run ended: nothing more to stop" in err
    jax.tree.map(np.testing.assert_array_equal, saved_state(run_dir, STEPS), straight[0])
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS


def test_a_stop_whose_checkpoint_does_not_read_back_says_so(corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    """A stop whose save completed but whose checkpoint then does not read back (its metadata lost between the
    save and the check, as on a store that dropped a write): no line says it was saved; one error line names
    the checkpoint and what to do, and the status is not 0."""
    run_dir = tmp_path / "run"
    save = checkpoints.Saver.save

    def save_then_lose(self, step, *args, **kwargs):
        save(self, step, *args, **kwargs)
        self.wait()
        (pathlib.Path(self.dir) / str(step) / checkpoints.STEP_METADATA).unlink()
    hook = Hook(signal.SIGINT, lambda calls, *a: calls == 2)
    hook_fns(monkeypatch, hook, "train_step")
    monkeypatch.setattr(checkpoints.Saver, "save", save_then_lose)
    assert train.cli(stop_args(run_dir, corpus)) == 2
    captured = capsys.readouterr()
    assert "checkpoint saved" not in captured.out
    said = [line for line in captured.err.strip().splitlines() if not line.startswith("step ")]  # (progress lines)
    assert len(said) == 1, captured.err
    line = said[0]
    assert line.startswith("error: checkpoint 2 in ") and "was saved but does not read back (its metadata" in line
    assert line.endswith("there is no other checkpoint: --resume starts the run again from step 0"), line


@pytest.mark.parametrize("phase", ["the first evaluation, running", "the first save"])
def test_a_stop_of_a_run_in_a_bucket_saves_that_step(phase, corpus, straight, gcs_bucket, monkeypatch,  # noqa: F811
                                                     capsys):
    """The same with the run directory in a bucket (the GCS server on 127.0.0.1): the stop's checkpoint is
    committed there before the line names it, and the resume ends as the straight run does."""
    run_dir = f"{gcs_bucket}/run"
    stopped_and_resumed(monkeypatch, capsys, run_dir, stop_args(run_dir, corpus, "checkpoint.async_save=true"),
                        phase, signal.SIGTERM, straight)
