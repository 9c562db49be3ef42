"""The training loop's bookkeeping, for train.py: what happens around each step, kept in small objects
so that train.run reads as the flat loop it is.

    Stop       SIGTERM, SIGINT and SIGHUP: the first stops the run cleanly (after a checkpoint of its step, or
               before the first step with nothing saved: Interrupted); a second ends the process at once
    Steps      per step: its metrics read one step late (so the device never waits on the host), checked
               for divergence, logged to metrics.jsonl and W&B with tokens/s and MFU, the progress bar;
               which steps evaluate and save; the summary at the end
    report     the lines train.py ends with, from the summary
"""
from __future__ import annotations

import collections
import math
import os
import pathlib
import shlex
import signal
import sys
import threading
import time

import jax
import numpy as np
from tqdm import tqdm

import model as model_lib
from core import errors
from core.errors import Diverged
from tokendata import shards
from training import devices, plots
from training import dpo as dpo_lib


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(700) so that a huge but finite loss still gives a number (JSON has no inf)."""
    return math.exp(min(loss, 700.0))


class Interrupted(Exception):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) arrived before the first training step: nothing trained or saved."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stop:
    """`with Stop() as stop`: SIGTERM, SIGINT and SIGHUP handlers (on the main thread only) for as long as
    the run lasts (SIGHUP, a closed terminal, also sends the output meant for that terminal to /dev/null).
    The first signal sets `stop.signal`: the loop saves a checkpoint of its step and ends, or
    before the first step `check()` raises Interrupted. A second one stops the process at once, with
    128 + N, not through orbax's and the loader's threads: the newest complete checkpoint is the one to
    resume from (a save in flight never appears as a step), and the run directory's lock goes with the
    process.

    With several processes (`several()`, once jax.distributed has started) every process must stop at the
    same step, since saving a checkpoint is collective: a process that stopped alone would leave the others
    waiting for it for ever. JAX's preemption service then owns SIGTERM (the notice it propagates to every
    process); a SIGINT here is handed to it as a SIGTERM; and `at_step`, called at every step, says when
    all processes have agreed on the step to stop at (the one after the furthest any of them had reached).

    During start-up (`starting`, until train.py's first step is compiled and dispatched) a signal ends
    the process within moments, whatever the main thread is doing (loading data, compiling: Python's
    handlers run only between its bytecodes, so a watcher thread reads the signal from the interpreter's
    wake-up pipe): the `undo` callbacks first remove what the start wrote (a new run directory), under
    `writing` so that no write is half done, then one line says what was left. With several processes
    (`expect_several`: the launch says so) a signal ends every process's start together, since one
    process gone alone would leave the others waiting for it: one that came before the processes joined
    is kept (also from errors.stop_at_once_while_loading) and ended at the first `check` after joining;
    once joined, the signalled process posts its stop (multihost.fail) and every process ends at once."""

    def __init__(self, expect_several: bool = False):
        self.expect_several = expect_several  # several processes are launched, not yet joined
        self.joining = False  # ... and are joining now (jax.distributed.initialize, which no signal interrupts)
        self.signal: int | None = None
        self.sync = False  # several processes: a stop is agreed through JAX's preemption sync (`several`)
        self.agreed = False  # ... and has been agreed, at this step
        self.handlers = {}
        self.starting = True
        self.done = False  # trained to the end (`ended`)
        self.undo: list = []  # callables () -> (undone, line): each removes what the start wrote, and says what
        self.writing = threading.RLock()  # held by the start's writes into the run directory
        self.pipe = None

    def __enter__(self) -> Stop:
        if threading.current_thread() is threading.main_thread():
            self.handlers = {s: signal.signal(s, self.arrived) for s in errors.STOP_SIGNALS}
            self.signal = errors.pending_signal()  # one that came while the modules loaded
            read, write = os.pipe()
            os.set_blocking(write, False)
            self.pipe = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(read,), name="start-up-signals", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for s in self.handlers:  # the run is over (trained, stopped or failed): a signal now ends nothing more
            signal.signal(s, self.after_the_end)
        if self.pipe is not None:
            read, write, previous = self.pipe
            signal.set_wakeup_fd(previous)
            os.close(write)  # the watcher's read ends

    def ended(self) -> str | None:
        """The run has trained its last step: a signal from now on is only said (after_the_end). Returns the
        line for one that came during the last step (the run completed all the same), else None."""
        self.done = True
        if self.signal is not None:
            return f"{signal.Signals(self.signal).name} arrived as the run ended: it is complete, nothing was lost"
        return None

    def _watch(self, read: int) -> None:
        while True:
            try:
                got = os.read(read, 64)
            except OSError:
                got = b""
            if not got:  # __exit__ closed the pipe
                os.close(read)
                return
            signums = [n for n in got if n in errors.STOP_SIGNALS]
            if signums and self.starting:
                if self.sync:  # joined: every process ends its start now
                    self.end_start_everywhere(signums[0])
                elif not self.expect_several or self.joining:  # alone; or joining, which cannot be left but by
                    self.end_start(signums[0])  # ending (the others' joins end at their limit); else `check` does

    def end_start(self, signum: int) -> None:
        """A signal during start-up: undo what the start wrote, say so in one line, end with 128 + N."""
        self.writing.acquire()  # held to the end: the main thread starts no other write of the run
        line = self.stopped_line(signum)
        sys.stdout.flush()
        os.write(1, (line + "\n").encode())
        os._exit(128 + signum)

    @staticmethod
    def after_the_end(signum, frame) -> None:
        """A stop signal once the run has ended (the process exits, its threads and JAX shut down): said,
        and the process exits as it was going to, with the run's own status."""
        os.write(2, f"{signal.Signals(signum).name} after the run ended: nothing more to stop\n".encode())

    def end_start_everywhere(self, signum: int) -> None:
        """A signal during start-up with several processes joined: every process ends its start, each
        undoing what it wrote, with one line and 128 + N (multihost.fail; the others through its watch)."""
        from training import multihost
        self.writing.acquire()  # held to the end: the main thread starts no other write of the run
        multihost.fail(Interrupted(signum), self.stopped_line(signum), 128 + signum, out=1)

    def undo_start(self) -> None:
        """Undo what the start wrote, if training has not begun: for multihost.at_end. `writing` is held to
        the end: the main thread, still starting until the process exits, writes nothing more."""
        if self.starting:
            self.writing.acquire()
            self.stopped_line(signal.SIGTERM)

    def undo_quietly(self) -> list[str]:
        """Runs the `undo` callbacks of a start that failed (its error is the line to say): what could not
        be undone, in lines; nothing when all was."""
        with self.writing:
            said = [line for undone, line in (undo() for undo in self.undo) if not undone]
            self.undo = []
        return said

    def stopped_line(self, signum: int) -> str:
        """Runs the `undo` callbacks and says, in one line, that the start was stopped and what it left."""
        said = [line for _, line in (undo() for undo in self.undo)]
        self.undo = []
        return (f"stopped by {signal.Signals(signum).name} during start-up: nothing trained, nothing saved; "
                + ("; ".join(said) if said else "nothing was written"))

    def arrived(self, signum, frame) -> None:
        if signum == signal.SIGHUP:  # the terminal is gone: the checkpoint still to save must not fail on it
            errors.detach_from_terminal()
        if self.done:
            self.after_the_end(signum, frame)
            return
        if self.signal is not None:
            sys.stdout.flush()
            os.write(2, f"\nerror: stopped at once by a second {signal.Signals(signum).name}; resume from the "
                        f"newest checkpoint with --resume\n".encode())
            os._exit(128 + signum)
        self.signal = signum
        if self.sync and signum != signal.SIGTERM:  # tell every process, through JAX's preemption notifier
            os.kill(os.getpid(), signal.SIGTERM)

    def several(self) -> None:
        """Several processes run (jax.distributed started, with JAX's preemption service, which catches
        SIGTERM from then on): stops are agreed between them from here on."""
        import jax

        self.expect_several = False
        self.sync = jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)

    def at_step(self, step: int) -> None:
        """Called by every process at every step: with several processes, whether all have agreed to stop
        at this one (then `stopping`)."""
        if self.sync and not self.agreed:
            from jax.experimental import multihost_utils

            try:
                self.agreed = multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # no preemption sync in this JAX after all: each process stops on its own
                self.sync = False

    @property
    def stopping(self) -> bool:
        return self.agreed if self.sync else self.signal is not None

    @property
    def number(self) -> int:
        """The stopping signal's number: this process's own, or SIGTERM where another process's stop (a
        preemption notice) was agreed on."""
        return self.signal or signal.SIGTERM

    def check(self) -> None:
        """Before the first step: a signal so far ends the start with Interrupted (nothing to save). With
        several processes, every process's start ends (end_start_everywhere)."""
        self.expect_several = False  # joined, or alone after all
        if self.signal is not None:
            if self.sync:
                self.end_start_everywhere(self.signal)
            raise Interrupted(self.signal)

    @property
    def name(self) -> str:
        return signal.Signals(self.number).name


class Steps:
    """The bookkeeping of train.py's step loop, from `start_step` on (`with Steps(...)`: the progress bar
    closes however the loop ends). A step's metrics are read when the next step has been dispatched, so
    reading them (and the NaN check) never stalls the device; `read()` reads the last one at once, before
    an evaluation or a checkpoint. `metrics_file` (process 0's metrics.jsonl, continued after
    start_step; None elsewhere) gives the run's time before this start; its rows' time_s go on from it."""

    def __init__(self, cfg, stop: Stop, *, start_step: int, tokens_before: int, t_start: float,
                 metrics_file, wandb_run, last_ckpt: int | None, run_dir, per_source=None):
        t = cfg.training
        self.t, self.every_save, self.stop = t, cfg.checkpoint.every, stop
        self.step = self.start_step = start_step
        self.tokens_before, self.tokens_per_step = tokens_before, cfg.tokens_per_step
        self.flops_per_token = model_lib.flops_per_token(cfg.model, cfg.seq_len)
        self.peak = devices.peak_flops(jax.local_devices()[0].device_kind)
        self.metrics_file, self.wandb_run = metrics_file, wandb_run
        self.history = list(metrics_file.rows) if metrics_file is not None else []  # for the loss curve
        self.last_ckpt, self.run_dir = last_ckpt, run_dir
        self.per_source = per_source  # a mixture: step -> each source's tokens and epochs so far
        rows = metrics_file.rows if metrics_file is not None else []
        self.clock = float(rows[-1].get("time_s", 0.0)) if rows else 0.0  # the run's time before this start
        self.t_start, self.mark = t_start, (start_step, t_start)  # (step, time) of the last logged step
        self.recent_losses = collections.deque(maxlen=max(t.log_every, 20))
        self.pending, self.last_row, self.val = None, {}, {}
        # a progress bar on a terminal; where stderr is a file or a pipe, a plain line per logged step instead
        self.plain = metrics_file is not None and not sys.stderr.isatty()
        self.bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step",
                        disable=metrics_file is None or self.plain, dynamic_ncols=True)

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    @property
    def stopping(self) -> bool:
        return self.stop.stopping

    def tokens(self, s: int) -> int:
        """Tokens trained up to step s: this start's steps at its context and batch, on top of the restored."""
        return self.tokens_before + (s - self.start_step) * self.tokens_per_step

    def dispatched(self, metrics) -> tuple[bool, bool]:
        """A step was dispatched with these (device) metrics: logs the step before it, and says whether
        this one is to be (evaluated, saved): every eval_every and checkpoint.every steps, and at the last
        step. A stop is not decided here: a signal may still come during the step's evaluation or save, so
        train.py asks `stopping` once the step's work is done, and saves the step then if `is_saved()` is not."""
        self.step += 1
        self.stop.at_step(self.step)
        self.bar.update(1)
        if self.pending is not None:  # the previous step: finished, or about to be
            row = self.read()
            if row["step"] % self.t.log_every == 0:
                self.log(row)
        self.pending = (self.step, metrics)
        last = self.step == self.t.steps
        return self.step % self.t.eval_every == 0 or last, self.step % self.every_save == 0 or last

    def read(self) -> dict:
        """The last dispatched step's metrics as a row, once it has finished, checked to be finite."""
        (s, metrics), self.pending = self.pending, None
        metrics = jax.device_get(metrics)
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
            raise Diverged(f"{what} at step {s}; {self.last_good()}")
        self.recent_losses.append(loss)
        now = time.perf_counter()
        if s == self.start_step + 1:
            self.mark = (s, now)  # leave start-up and compilation out of tokens/s
        return {"step": s, "loss": loss, "lr": float(metrics["lr"]), "grad_norm": grad_norm,
                **{k: float(v) for k, v in metrics.items() if k not in ("loss", "lr", "grad_norm")},  # e.g. DPO's
                "tokens": self.tokens(s), "time_s": self.clock + now - self.t_start,
                **(self.per_source(s) if self.per_source else {})}

    def evaluated(self, row: dict, val: dict) -> None:
        """The validation loss of the step of `row`, added to it and shown."""
        self.val = val
        row.update(val)
        if self.metrics_file is not None:  # process 0 reports; the others' logs stay quiet
            each = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in val.items() if k.startswith("val_loss/")]
            if "val_rewards/accuracies" in val:  # DPO
                self.bar.write(f"step {row['step']}: val DPO loss {val['val_loss']:.4f}, reward accuracy "
                               f"{val['val_rewards/accuracies']:.1%}")
                return
            self.bar.write(f"step {row['step']}: val loss {val['val_loss']:.4f}, val ppl {val['val_ppl']:.2f}"
                           + (f" (by source: {', '.join(each)})" if each else ""))

    def log(self, row: dict) -> None:
        """One line of metrics.jsonl (and W&B), with tokens/s and MFU since the last logged step."""
        s, now = row["step"], row["time_s"] - self.clock + self.t_start
        if s > self.mark[0]:
            row["tokens_per_s"] = (s - self.mark[0]) * self.tokens_per_step / (now - self.mark[1])
            if self.peak:
                row["mfu"] = row["tokens_per_s"] * self.flops_per_token / (self.peak * jax.device_count())
        self.mark, self.last_row = (s, now), row
        if self.metrics_file is not None:
            self.metrics_file.append(row)
            self.history.append(row)
            if "val_loss" in row:  # an evaluation: the loss curve drawn anew
                self.plot()
            if self.wandb_run is not None:
                self.wandb_run.log(row, step=s)
        postfix = {"loss": f"{row['loss']:.3f}"}
        if "rewards/accuracies" in row:  # DPO: how often the chosen response's reward is the higher
            postfix["acc"] = f"{row['rewards/accuracies']:.2f}"
        if "tokens_per_s" in row:
            postfix["tok/s"] = f"{row['tokens_per_s']:.0f}"
        if "mfu" in row:
            postfix["mfu"] = f"{row['mfu']:.1%}"
        self.bar.set_postfix(postfix)
        if self.plain:
            print(f"step {s}/{self.t.steps}: " + ", ".join(f"{k} {v}" for k, v in postfix.items()),
                  file=sys.stderr, flush=True)

    def check_finite(self, params_finite) -> None:
        """Before a save: parameters that are not all finite stop the run (Diverged), nothing saved."""
        if not bool(params_finite):
            raise Diverged(f"parameters are not finite after step {self.step}; {self.last_good()}")

    def last_good(self) -> str:
        """What a diverged run leaves to go on from, in words."""
        if self.last_ckpt is None:
            return (f"no checkpoint was saved before it: {self.run_dir} holds the run's config and metrics up to "
                    f"here; start again in another run_dir (or remove this one) with other settings, e.g. a lower "
                    f"training.lr or more training.warmup_steps")
        return (f"the last good checkpoint is step {self.last_ckpt} in {self.run_dir}: continue from it with "
                f"python train.py --resume run_dir={self.run_dir} and other settings, e.g. training.lr=...")

    def saved(self) -> None:
        self.last_ckpt = self.step

    def is_saved(self) -> bool:
        """Whether the step trained last has its checkpoint (saved by this start, or the one restored)."""
        return self.last_ckpt == self.step

    def flush(self) -> None:
        """Process 0: metrics.jsonl written out (a remote one uploaded whole). Before a checkpoint is saved,
        so that every checkpoint's step has its row: a resume continues the log after the checkpoint and
        would never write a row that was lost."""
        if self.metrics_file is not None:
            self.metrics_file.flush()

    def paused(self) -> None:
        """After an evaluation or a save: the metrics uploaded (a remote metrics.jsonl is uploaded whole),
        and the time it took left out of tokens/s."""
        if self.metrics_file is not None:
            self.metrics_file.flush()
        self.mark = (self.step, time.perf_counter())

    def finish(self) -> None:
        """The loop has ended: the last dispatched step, if not read yet, is logged, and the loss curve drawn."""
        if self.pending is not None:
            self.log(self.read())
        self.plot()

    def plot(self) -> None:
        """Process 0: RUN/loss.png, the training and validation loss so far (after each evaluation, and at
        the end of the loop)."""
        if self.metrics_file is not None and self.history:
            png = plots.losses(self.history, f"{self.run_dir.dir.name}: loss")
            self.run_dir.dir.write_bytes(self.run_dir.LOSS_PLOT, png)

    def summary(self, index: dict, n_params: int, val_windows: int, val_tokens: int, val_of: int, ckpt_dir) -> dict:
        """summary.json: where training ended, with the unigram baseline of the tokens the loss counts
        (with prompt/completion data, the completions alone)."""
        completions = shards.is_prompt_completion(index)
        preference = shards.is_preference(index)  # DPO: a preference loss, no token baseline to compare with
        entropy = None if preference else index.get("loss_unigram_entropy" if completions else "unigram_entropy")
        train_loss = float(np.mean(self.recent_losses)) if self.recent_losses else None
        summary = {
            "steps": self.step,
            "tokens": self.tokens(self.step),
            "wall_time_s": self.clock + time.perf_counter() - self.t_start,  # across resumes
            "parameters": n_params,
            "train_loss": train_loss,  # mean over the last steps
            "train_ppl": perplexity(train_loss) if train_loss is not None else None,
            # on the fixed validation sample: training.eval_windows windows (or rows of examples) spread evenly
            # over the split, or the whole split when it holds no more
            "val_loss": self.val.get("val_loss", self.last_row.get("val_loss")),
            "val_ppl": self.val.get("val_ppl", self.last_row.get("val_ppl")),
            "val_sample_windows": val_windows,
            "val_sample_tokens": val_tokens,
            "val_split_windows": val_of,
            "unigram_entropy": entropy,
            "unigram_entropy_of": "the completions (the tokens in the loss)" if completions else
            "preference pairs (DPO)" if preference else "the corpus",
            "checkpoint": os.path.join(ckpt_dir, str(self.last_ckpt)) if self.last_ckpt is not None else None,
            "run_dir": str(self.run_dir),
            "loss_plot": self.run_dir.dir.show(self.run_dir.LOSS_PLOT) if self.history else None,
        }
        if preference:  # the last logged step's DPO metrics, and the validation pairs' reward accuracy
            last = self.history[-1] if self.history else self.last_row
            summary["val_ppl"] = summary["train_ppl"] = None  # a preference loss has no perplexity
            summary["dpo"] = {k: last.get(k) for k in dpo_lib.METRICS}
            summary["dpo"]["val_rewards/accuracies"] = self.val.get("val_rewards/accuracies",
                                                                    self.last_row.get("val_rewards/accuracies"))
        if entropy is not None and summary["val_loss"] is not None:
            summary["val_loss_below_unigram"] = entropy - summary["val_loss"]
        if self.per_source:  # a mixture: each source's validation loss, tokens and epochs
            last = {**self.last_row, **self.val, **self.per_source(self.step)}
            names = [k.split("/", 1)[1] for k in last if k.startswith("tokens/")]
            summary["val_loss_mean"] = last.get("val_loss_mean")
            summary["sources"] = {n: {key: last.get(f"{key}/{n}") for key in ("val_loss", "val_ppl", "tokens", "epochs")}
                                  for n in names}
        return summary


def sample_prompt(tokenizer, batch: dict, eot_id: int, words: int = 4) -> str:
    """A prompt like the run's data, for the next commands, from the first row of the validation sample
    (`batch`): the first example's prompt (prompt/completion data), or the first `words` tokens of the
    first validation document (text: the sample's first window starts the split, and so a document)."""
    tokens, weights = np.asarray(batch["tokens"][0]), np.asarray(batch["weights"][0])
    if tokens.ndim == 2:  # a pair batch's first row: its chosen side
        tokens, weights = tokens[0], weights[0]
    if "segments" in batch:  # the first example's prompt: its tokens before the first completion target
        trained = np.flatnonzero(weights > 0)
        prompt = tokens[:trained[0] + 1] if len(trained) else tokens[:words]
    else:
        prompt = tokens[:words]
    text = tokenizer.decode([int(t) for t in prompt if t != eot_id]).strip()
    return text or "The"


def sample_words(summary: dict) -> str:
    """What the validation figures were measured on, in words: the whole split, or a sample spread over it."""
    of_what = summary.get("unigram_entropy_of", "")
    rows = ("rows of examples" if of_what.startswith("the completions") else "rows of pairs"
            if of_what.startswith("preference") else "windows")
    n, of, tokens = summary["val_sample_windows"], summary.get("val_split_windows"), summary["val_sample_tokens"]
    if n == of:
        return f"the whole validation split ({n:,} {rows}, {tokens:,} tokens)"
    return (f"{n:,} of the validation split's {of:,} {rows}, spread evenly over it ({tokens:,} tokens; "
            "python eval.py measures the whole split)")


def dpo_words(dpo: dict) -> str:
    """The summary's DPO line: the last step's rewards and the validation pairs' reward accuracy."""
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    return (f"  DPO (the loss above is the pairs' preference loss; log 2 = 0.6931 at the start): rewards chosen "
            f"{fmt(dpo['rewards/chosen'], '.4f')}, rejected {fmt(dpo['rewards/rejected'], '.4f')}, margin "
            f"{fmt(dpo['rewards/margins'], '.4f')}, accuracy {fmt(dpo['rewards/accuracies'], '.2f')} (val "
            f"{fmt(dpo['val_rewards/accuracies'], '.2f')})\n")


def report(summary: dict) -> str:
    """The lines train.py ends with, from its summary.json."""
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    gap = summary.get("val_loss_below_unigram")
    return (
        f"done: {summary['steps']} steps, {summary['tokens'] / 1e6:.2f}M tokens in {summary['wall_time_s']:.0f}s\n"
        f"  train loss {fmt(summary['train_loss'], '.4f')} (ppl {fmt(summary['train_ppl'], '.2f')}), "
        f"val loss {fmt(summary['val_loss'], '.4f')} (ppl {fmt(summary['val_ppl'], '.2f')}) on "
        + sample_words(summary) + "\n"
        + ("".join(f"  {name}: val loss {fmt(each['val_loss'], '.4f')} (ppl {fmt(each['val_ppl'], '.2f')}), "
                   f"{each['tokens'] / 1e6:.2f}M tokens, {each['epochs']:.2f} epochs\n"
                   for name, each in summary["sources"].items()) if summary.get("sources") else
           dpo_words(summary["dpo"]) if summary.get("dpo") else
           f"  unigram entropy of {summary.get('unigram_entropy_of', 'the corpus')} "
           f"{fmt(summary['unigram_entropy'], '.4f')} nats/token"
           + (f"; the val loss is {abs(gap):.3f} nats {'below' if gap >= 0 else 'above'} it" if gap is not None else "")
           + "\n")
        + f"  checkpoint {summary['checkpoint']}"
        + (f"\n  loss curve {summary['loss_plot']}" if summary.get("loss_plot") else "")
        + (("\nnext: " + (f"python eval.py --checkpoint {run} --tasks --no-perplexity    # zero-shot tasks (eval.py's "
                           f"perplexity is for running text; the loss on "
                           f"{'pairs' if summary.get('dpo') else 'completions'} is above)\n"
                           if summary.get("unigram_entropy_of", "").startswith(("the completions", "preference"))
                           else
                           f"python eval.py --checkpoint {run}    # perplexity on the validation split, at 1-8x the "
                           f"context\n"))
           + f"      python sample.py --checkpoint {run} --prompt {shlex.quote(summary.get('sample_prompt') or 'The')}\n"
           + f"      python convert_torch.py --checkpoint {run} --format hf "
           f"--out {shlex.quote('export/' + pathlib.PurePath(run.rstrip('/')).name + '-hf')}    # for transformers"
           if (run := summary.get("run_dir")) else "")
    )
