"""Train a GPT: the flat training loop.

    python train.py                                   # the default job (conf/config.yaml)
    python train.py --config conf/760m.yaml data.dir=data/my_corpus training.lr=2e-4
    python train.py --resume                          # continue the configured run from its last checkpoint

Sections of run(): config and run directory, mesh, data, model and optimizer (placed and jitted
by step.build), run directory, checkpoint, logging, loop, summary. The state is one pytree
{params, opt_state, step, rng}; the batch at step s is a pure function of (seed, s) (loader.py),
so resuming from a checkpoint at step s replays steps s+1.. exactly (bit for bit on the CPU).

The run directory (rundir.py) holds config.yaml (the effective config), data.json and
tokenizer.json (the data it trained on), metrics.jsonl (one JSON object per logged step),
summary.json, and checkpoints/ (orbax, one directory per step). It may be a URL
(run_dir=gs://bucket/runs/x): process 0 writes those files there, orbax the checkpoints; data.dir
may be a URL too.
"""
from __future__ import annotations

import errors  # light: nothing but the standard library

if __name__ == "__main__":
    errors.stop_at_once_while_loading()  # a Ctrl-C while JAX and the rest load: one line, no traceback

import collections
import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
import typing
import uuid

import jax
import numpy as np
from tqdm import tqdm

import config as config_lib
import data
import loader
import model as model_lib
import rundir
import shards
import sharding as sharding_lib
import step as step_lib
import storage
from errors import Diverged
from rundir import RunError


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived before the first training step: nothing was trained or saved."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(700) so that a huge but finite loss still gives a number (JSON has no inf)."""
    return math.exp(min(loss, 700.0))


def start_wandb(cfg, run_dir: rundir.Run):
    """The run's W&B run: a resume (and eval.py) continues the one whose id the run directory keeps."""
    import wandb

    return wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or run_dir.name,
                      id=run_dir.wandb_id(new=uuid.uuid4().hex[:8]), resume="allow", mode=cfg.wandb.mode,
                      dir=None if run_dir.remote else str(run_dir), config=config_lib.to_dict(cfg))


def check_wandb(cfg) -> None:
    """wandb.mode=online needs a W&B login (an API key from `wandb login` or WANDB_API_KEY), checked
    without reaching the server; without a terminal to ask on, a missing one is a RunError."""
    if cfg.wandb.mode != "online":
        return
    import wandb

    try:
        found = wandb.login(verify=False)  # False: no key, and none given at a prompt
    except Exception:  # wandb's UsageError (no key, no terminal), or whatever its settings raise
        found = False
    if not found:
        raise RunError("wandb.mode=online needs a W&B login: run `wandb login` (or set WANDB_API_KEY) first, "
                       "or log with wandb.mode=offline and upload later with `wandb sync`") from None


def report(summary: dict) -> str:
    """The lines train.py ends with, from its summary.json."""
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    gap = summary.get("val_loss_below_unigram")
    return (
        f"done: {summary['steps']} steps, {summary['tokens'] / 1e6:.2f}M tokens in {summary['wall_time_s']:.0f}s\n"
        f"  train loss {fmt(summary['train_loss'], '.4f')} (ppl {fmt(summary['train_ppl'], '.2f')}), "
        f"val loss {fmt(summary['val_loss'], '.4f')} (ppl {fmt(summary['val_ppl'], '.2f')}) on a fixed sample of "
        f"{summary['val_sample_windows']} windows, {summary['val_sample_tokens']:,} tokens "
        f"(python eval.py measures the whole split)\n"
        f"  unigram entropy of {summary.get('unigram_entropy_of', 'the corpus')} "
        f"{fmt(summary['unigram_entropy'], '.4f')} nats/token"
        + (f"; the val loss is {abs(gap):.3f} nats {'below' if gap >= 0 else 'above'} it" if gap is not None else "")
        + f"\n  checkpoint {summary['checkpoint']}"
    )


def parse_args(argv):
    parser = errors.ArgumentParser(
        description="Train a GPT. Without --resume, run_dir must not exist yet (or be empty); with --resume, "
        "the run continues from its last checkpoint with its own config.yaml, plus any key=value given.",
        allow_abbrev=False, error=config_lib.ConfigError,
        hint="usage: python train.py [--config FILE] [key=value ...] [--resume] | --plan [--device NAME] [--devices N]",
    )
    parser.add_argument("--config", default=str(config_lib.DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue the run in run_dir from its last checkpoint")
    parser.add_argument("--plan", action="store_true",
                        help="print the memory per device, FLOPs and step time of this config on --device and stop: "
                             "nothing is read, made or run")
    parser.add_argument("--device", default="H100", help="--plan's target: H100, H200, A100-40, A100-80, a TPU "
                        "generation or slice (v3, v4-32, v5e-16, v5p-128, v6e-8), or a GPU's memory (24GiB)")
    parser.add_argument("--devices", type=int, default=None,
                        help="--plan's device count (default: the TPU slice's, else 1)")
    parser.add_argument("--mfu", type=float, default=0.4, help="--plan's model FLOP utilisation for the step time")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides of the config file's keys, e.g. training.lr=1e-3 model=124m; every "
                             "key, with its default and meaning, is in conf/config.yaml")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Train; 0 once trained to training.steps, 128 + N when signal N (SIGTERM, SIGINT) stopped it.

    The handlers are installed first, so a signal during start-up (data, compilation) stops the run
    cleanly too: before the first step with nothing saved, after it with a checkpoint of the last step.
    A second signal stops the process at once, with 128 + N: the newest complete checkpoint is the
    one to resume from (a save in flight never appears as a step), and the run directory's lock
    goes with the process."""
    args = parse_args(argv)
    if args.plan:  # before any device, data or run directory
        return plan_run(args)
    stop = {"signal": None}

    def on_signal(signum, frame):
        if stop["signal"] is not None:  # a second signal: stop now, not through orbax's and the loader's threads
            sys.stdout.flush()
            os.write(2, f"\nerror: stopped at once by a second {signal.Signals(signum).name}; resume from the "
                        f"newest checkpoint with --resume\n".encode())
            os._exit(128 + signum)
        stop["signal"] = signum

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with contextlib.ExitStack() as held:  # the run directory's lock, released however run() ends
            return run(args, stop, held)
    except Interrupted as e:
        print(f"stopped by {e} during start-up: nothing trained, nothing saved", flush=True)
        return 128 + e.signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def new_config(args) -> config_lib.Config:
    """The config of a new run: --config with the overrides; fine-tuning (training.init_from) without
    `model=NAME` takes init_from's model, the command line's model.FIELD=VALUE on top."""
    cfg = config_lib.load_config(args.config, args.overrides)
    if cfg.training.init_from and not config_lib.names_model(args.overrides):
        cfg = config_lib.load_config(args.config, args.overrides, model=rundir.init_model(cfg.training.init_from))
    return cfg


def plan_run(args) -> int:
    """--plan: the configured run's memory per device, tokens, FLOPs and step time on --device (plan.py).
    JAX runs on the CPU alone here, so that planning never takes an accelerator a run is using."""
    import plan

    if args.resume:
        raise config_lib.ConfigError("--plan plans a config (--config and key=value overrides), not --resume")
    if not 0 < args.mfu <= 1:
        raise config_lib.ConfigError(f"--mfu must be in (0, 1], got {args.mfu}")
    jax.config.update("jax_platforms", "cpu")
    print(plan.report(new_config(args), plan.target(args.device, args.devices), mfu=args.mfu))
    return 0


def run(args, stop: dict, held: contextlib.ExitStack) -> int:
    """main() without the signal handlers, for the parsed command line `args`: `stop["signal"]` is set
    when one arrives; the run directory's lock goes into `held`."""
    t_start = time.perf_counter()
    sharding_lib.initialize_distributed()  # before any other JAX call; a no-op for a single process
    is_main = jax.process_index() == 0  # only process 0 writes files and logs
    say = print if is_main else (lambda *args, **kwargs: None)

    # ------------------------------------------------------------------------------------------
    # Config and run directory: a resume reads the run's own config (command-line overrides still
    # apply, e.g. training.steps); a new run needs an empty directory
    if args.resume:  # the overrides apply to the run's own config.yaml, read below, not to --config's
        location = config_lib.run_dir_of(args.config, args.overrides)
    else:
        cfg = new_config(args)
        if cfg.training.init_from and not config_lib.names_model(args.overrides):
            say(f"model {cfg.model_name}: training.init_from's ({cfg.training.init_from})")
        location = cfg.run_dir
    try:
        run_dir = rundir.Run(location)  # a local path or a URL (gs://...); str(run_dir) as given
    except storage.StorageError as e:
        raise RunError(f"run_dir: {e}") from None

    def on_main(check: typing.Callable[[], None]) -> None:
        """Process 0 runs `check` (its lock, its W&B login); every process stops if it fails."""
        error = None
        if is_main:
            try:
                check()
            except RunError as e:
                error = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if multihost_utils.broadcast_one_to_all(np.int32(error is not None)) and error is None:
                error = RunError(f"process 0 stopped before training in {run_dir} (its error says why)")
        if error is not None:
            raise error

    def take_lock(new: bool) -> None:
        """Process 0 holds the run directory's lock (a second writer gets one line naming the first)."""
        def lock():
            held.enter_context(run_dir.writer("train.py --resume" if args.resume else "train.py"))
            if new:
                run_dir.check_new()  # under the lock: no other run started here in the meantime
        on_main(lock)

    if args.resume:
        if not run_dir.is_file(rundir.CONFIG):
            raise RunError(f"nothing to resume: {run_dir} is not a run directory (no {rundir.CONFIG})")
        take_lock(new=False)
        cfg = run_dir.config(args.overrides)
    else:
        run_dir.check_new()
    t, ck, sh = cfg.training, cfg.checkpoint, cfg.sharding
    on_main(lambda: check_wandb(cfg))  # before anything is written
    try:
        model_lib.check_attention_backend(cfg.model)  # e.g. attention=cudnn without a GPU, before any work
    except ValueError as e:
        raise RunError(str(e)) from None
    if jax.process_count() > 1:  # every process has checked run_dir before process 0 writes into it
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("run_dir checked")

    # ------------------------------------------------------------------------------------------
    # Mesh: every device of every process; the batch must split evenly over it
    mesh = sharding_lib.make_mesh(sh.data, sh.fsdp, sh.tensor)
    sharding_lib.check_batch(mesh, t.batch_size, t.micro_batches)
    rows_index, rows_count = sharding_lib.process_rows(mesh, t.batch_size)

    # ------------------------------------------------------------------------------------------
    # Data: the prepared corpus (the default one is prepared on first use; a URL is read by ranges,
    # and a resume checks that it has not changed), the model's vocabulary from its tokenizer, and a fixed validation
    # sample in whole batches (text windows, or prompt/completion rows with the loss on completions)
    cfg.data.dir = data.resolve_dir(cfg.data.dir, progress=is_main)
    index = shards.load_index(cfg.data.dir)
    if args.resume:
        run_dir.check_data(cfg.data.dir)
    if cfg.model.vocab_size != index["vocab_size"]:
        say(f"model.vocab_size {cfg.model.vocab_size} -> {index['vocab_size']}, the vocabulary of {cfg.data.dir}")
        cfg.model = dataclasses.replace(cfg.model, vocab_size=index["vocab_size"])
    mcfg, seq_len = cfg.model, cfg.seq_len
    train_loader = loader.open_loader(cfg.data.dir, "train", seq_len, t.batch_size, seed=cfg.seed,
                                      process_index=rows_index, process_count=rows_count, batching=cfg.data.batching)
    if storage.is_url(cfg.data.dir):
        group = train_loader.group
        say(f"data {cfg.data.dir}: read in place, this process's rows only, {group} batch{'es' * (group > 1)} "
            f"a request, {train_loader.prefetch} ahead (nothing copied)")
    val_sample, val_windows, val_tokens = loader.validation_sample(
        cfg.data.dir, seq_len, t.batch_size // t.micro_batches, t.eval_windows, cfg.data.batching)
    if t.init_from:  # its model must be this one: checked before anything is written
        rundir.check_init_from(t.init_from, mcfg)
    if stop["signal"] is not None:  # a signal before the first step: nothing to save
        raise Interrupted(stop["signal"])

    # ------------------------------------------------------------------------------------------
    # Model, optimizer and placement (step.py): shapes first, shardings from sharding.py's rules for
    # the ZeRO stage, then the jitted init, step and evaluation
    fns = step_lib.build(mcfg, t, mesh, sh.zero_stage, cfg.seed)
    say(fns.description, flush=True)

    # ------------------------------------------------------------------------------------------
    # Run directory: the effective config and a reference to the data, once every check has passed.
    # A resumed run's config.yaml is rewritten only once its checkpoint has been restored.
    if not args.resume:
        if is_main:
            run_dir.mkdir()
        take_lock(new=True)
        if is_main:
            run_dir.save_config(cfg)
            run_dir.save_data(cfg.data.dir, index)

    def place_batch(local_rows):
        """A batch (an array, or a dict of arrays with rows first) onto the devices."""
        return jax.tree.map(lambda x: sharding_lib.place_batch(x, mesh, x.shape[0] * rows_count), local_rows)

    def process_slice(global_rows: np.ndarray) -> np.ndarray:
        """This process's rows of a batch every process holds whole (the validation sample)."""
        n = global_rows.shape[0] // rows_count
        return global_rows[rows_index * n:(rows_index + 1) * n]

    def evaluate(params) -> dict:
        sums = [fns.eval_step(params, place_batch(jax.tree.map(process_slice, batch))) for batch in val_sample]
        loss_sum, n = np.sum(np.asarray(jax.device_get(sums), np.float64), axis=0)
        loss = float(loss_sum / n)
        return {"val_loss": loss, "val_ppl": perplexity(loss)}

    # ------------------------------------------------------------------------------------------
    # Checkpoint: orbax, asynchronous; a resume restores the newest intact checkpoint
    ckpts = held.enter_context(run_dir.checkpoints(ck.keep, ck.async_save, write=True))  # closed last
    ckpt_dir = ckpts.dir  # a resolved local path, or the URL (orbax writes gs:// itself)
    saved_steps = ckpts.steps()
    last_ckpt = saved_steps[-1] if saved_steps else None
    if args.resume and last_ckpt is not None:
        state, last_ckpt = ckpts.restore(fns.abstract_state, say)
        start_step = int(state["step"])
        saved = run_dir.config()  # as the run was last configured
        saved_steps = saved.training.steps
        tokens_before = ckpts.tokens(last_ckpt)  # (None: saved before tokens were kept)
        if tokens_before is None:
            tokens_before = start_step * saved.training.batch_size * saved.seq_len
        if saved_steps != t.steps and start_step < t.steps:
            before = float(step_lib.lr_schedule(dataclasses.replace(t, steps=saved_steps))(start_step))
            say(f"training.steps {saved_steps} -> {t.steps}: the warm-up and cosine schedule now spans {t.steps} "
                f"steps, so the learning rate of step {start_step + 1} goes from {before:.3g} to "
                f"{float(fns.schedule(start_step)):.3g}")
        if start_step >= t.steps:
            say(f"{run_dir} is already trained to step {start_step}; to train further: "
                f"python train.py --resume run_dir={run_dir} training.steps=N")
            return 0
    else:
        if args.resume:  # the run stopped before its first checkpoint: it starts again, as configured
            say(f"no checkpoint in {ckpt_dir} yet: the run starts from step 0 with its saved config")
        state = fns.init()
        if t.init_from:  # fine-tuning: the optimizer state (zero moments) and step stay fresh
            state["params"] = rundir.load_init_params(t.init_from, fns.state_sharding["params"])
            say(f"parameters from {t.init_from}")
        start_step, tokens_before = 0, 0
    if stop["signal"] is not None:  # before the first step: nothing to save
        raise Interrupted(stop["signal"])

    # ------------------------------------------------------------------------------------------
    # Logging: metrics.jsonl continues after the restored step; W&B keeps its run id in the run dir
    metrics_file, clock = None, 0.0  # clock: the run's time before this start (its rows' time_s go on from it)
    if is_main:
        metrics_file = run_dir.metrics(start_step)
        if metrics_file.torn is not None:
            say(f"{run_dir.show(rundir.METRICS)}: its last line was cut off (a stop during its write); dropped it")
        if metrics_file.rows:
            clock = float(metrics_file.rows[-1].get("time_s", 0.0))
        if args.resume:  # restored and its log read: the effective config (with this command's overrides) is the run's
            run_dir.save_config(cfg)
    wandb_run = start_wandb(cfg, run_dir) if is_main and cfg.wandb.mode != "disabled" else None

    n_params = model_lib.param_count(mcfg)
    tokens_per_step = t.batch_size * seq_len
    peak = step_lib.peak_flops(jax.local_devices()[0].device_kind)
    flops_per_step = model_lib.flops_per_token(mcfg, seq_len) * tokens_per_step
    say(
        f"model {cfg.model_name}: {n_params / 1e6:.2f}M parameters, context {seq_len}; "
        f"{t.steps} steps of {tokens_per_step} tokens; run dir {run_dir}"
        + (f"; resuming from step {start_step}" if args.resume else ""),
        flush=True,
    )

    # ------------------------------------------------------------------------------------------
    # Loop. A step's metrics are read when the next step has been dispatched, so reading them
    # (and the NaN check) never stalls the device; before a checkpoint everything is checked.
    step = start_step
    recent_losses = collections.deque(maxlen=max(t.log_every, 20))
    mark = (step, t_start)  # (step, time) of the last logged step, for tokens/s
    last_row, pending, val = {}, None, {}

    def trained(s) -> int:
        """Tokens trained up to step s: this start's steps at its context and batch, on top of the restored."""
        return tokens_before + (s - start_step) * tokens_per_step

    def read_step(s, metrics) -> dict:
        """A dispatched step's metrics as a row, after checking that they are finite."""
        nonlocal mark
        metrics = jax.device_get(metrics)
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
            raise Diverged(f"{what} at step {s}; last good checkpoint: {last_ckpt} ({run_dir})")
        recent_losses.append(loss)
        now = time.perf_counter()
        if s == start_step + 1:
            mark = (s, now)  # leave start-up and compilation out of tokens/s
        return {"step": s, "loss": loss, "lr": float(fns.schedule(s - 1)), "grad_norm": grad_norm,
                "tokens": trained(s), "time_s": clock + now - t_start}

    def log(row):
        """One line of metrics.jsonl (and W&B), with tokens/s and MFU since the last logged step."""
        nonlocal mark, last_row
        s, now = row["step"], row["time_s"] - clock + t_start
        if s > mark[0]:
            row["tokens_per_s"] = (s - mark[0]) * tokens_per_step / (now - mark[1])
            if peak:
                row["mfu"] = row["tokens_per_s"] * flops_per_step / tokens_per_step / (peak * jax.device_count())
        mark, last_row = (s, now), row
        if is_main:
            metrics_file.append(row)
            if wandb_run is not None:
                wandb_run.log(row, step=s)
        postfix = {"loss": f"{row['loss']:.3f}"}
        if "tokens_per_s" in row:
            postfix["tok/s"] = f"{row['tokens_per_s']:.0f}"
        if "mfu" in row:
            postfix["mfu"] = f"{row['mfu']:.1%}"
        bar.set_postfix(postfix)

    bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step", disable=not is_main, dynamic_ncols=True)
    batches = train_loader.iterate(start_step)
    try:
        while step < t.steps:
            state, metrics = fns.train_step(state, place_batch(next(batches)))
            step += 1
            bar.update(1)
            if pending is not None:  # the previous step: finished, or about to be
                row = read_step(*pending)
                if row["step"] % t.log_every == 0:
                    log(row)
            pending = (step, metrics)
            stopping = stop["signal"] is not None
            do_eval = step % t.eval_every == 0 or step == t.steps
            do_save = step % ck.every == 0 or step == t.steps or stopping
            if not (do_eval or do_save):
                continue
            row, pending = read_step(*pending), None
            if do_eval:
                val = evaluate(state["params"])
                row.update(val)
                bar.write(f"step {step}: val loss {val['val_loss']:.4f}, val ppl {val['val_ppl']:.2f}")
            log(row)
            if do_save:
                if not bool(fns.all_finite(state["params"])):
                    raise Diverged(f"parameters are not finite after step {step}; "
                                   f"last good checkpoint: {last_ckpt} ({run_dir})")
                ckpts.save(step, state, tokens=trained(step))
                last_ckpt = step
            if is_main:
                metrics_file.flush()  # a remote metrics.jsonl is uploaded whole; locally a no-op
            mark = (step, time.perf_counter())  # leave evaluation and saving out of tokens/s
            if stopping:
                break
        if pending is not None:
            log(read_step(*pending))
    finally:
        bar.close()
        batches.close()  # stops the loader's prefetch thread
        try:
            ckpts.close()  # the last started save completes, even on an error (or a RunError)
        finally:
            if metrics_file is not None:
                metrics_file.close()

    # ------------------------------------------------------------------------------------------
    # Summary
    if stop["signal"] is not None and step < t.steps:
        name = signal.Signals(stop["signal"]).name
        say(f"stopped by {name} after step {step}; checkpoint saved in {os.path.join(ckpt_dir, str(step))}")
        say(f"continue with: python train.py --resume run_dir={run_dir}")
        if wandb_run is not None:
            wandb_run.finish()
        return 128 + stop["signal"]  # not 0: `python train.py && python eval.py` must not go on
    # the unigram baseline of the tokens the loss counts: with prompt/completion data, the completions alone
    completions = shards.is_prompt_completion(index)
    entropy = index.get("loss_unigram_entropy" if completions else "unigram_entropy")
    train_loss = float(np.mean(recent_losses)) if recent_losses else None
    summary = {
        "steps": step,
        "tokens": trained(step),
        "wall_time_s": clock + time.perf_counter() - t_start,  # across resumes
        "parameters": n_params,
        "train_loss": train_loss,  # mean over the last steps
        "train_ppl": perplexity(train_loss) if train_loss is not None else None,
        # on the fixed validation sample (training.eval_windows windows), not the whole split eval.py reads
        "val_loss": val.get("val_loss", last_row.get("val_loss")),
        "val_ppl": val.get("val_ppl", last_row.get("val_ppl")),
        "val_sample_windows": val_windows,
        "val_sample_tokens": val_tokens,
        "unigram_entropy": entropy,
        "unigram_entropy_of": "the completions (the tokens in the loss)" if completions else "the corpus",
        "checkpoint": os.path.join(ckpt_dir, str(last_ckpt)) if last_ckpt is not None else None,
    }
    if entropy is not None and summary["val_loss"] is not None:
        summary["val_loss_below_unigram"] = entropy - summary["val_loss"]
    if is_main:
        run_dir.save_summary(summary)
        if wandb_run is not None:
            wandb_run.summary.update(summary)
            wandb_run.finish()
    say(report(summary))
    return 0


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr: exit 2 for bad input, 1 for divergence,
    128 + N for signal N."""
    return errors.run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
