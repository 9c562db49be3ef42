"""Train a GPT: the flat training loop.

    python train.py                                   # the default job (conf/config.yaml)
    python train.py --config conf/760m.yaml data.dir=data/my_corpus training.lr=2e-4
    python train.py --resume                          # continue the configured run from its last checkpoint
    python train.py --plan --device H100              # memory, FLOPs and step time of the config (plan.py)

Sections of run(): config and run directory, mesh, data, model and optimizer (placed and jitted
by step.build), run directory, checkpoint, logging, loop, summary. The state is one pytree
{params, opt_state, step, rng}; the batch at step s is a pure function of (seed, s) (loader.py),
so resuming from a checkpoint at step s replays steps s+1.. exactly (bit for bit on the CPU). What
happens around each step (metrics read one step late, the NaN check, tokens/s and MFU, the progress
bar, when to evaluate and save, signals) is progress.py's.

The run directory (rundir.py) holds config.yaml (the effective config), data.json and
tokenizer.json (the data it trained on), metrics.jsonl (one JSON object per logged step),
summary.json, and checkpoints/ (orbax, one directory per step; checkpoints.py). It may be a URL
(run_dir=gs://bucket/runs/x): process 0 writes those files there, orbax the checkpoints; data.dir
may be a URL too.
"""
from __future__ import annotations

from core import errors  # light: nothing but the standard library

if __name__ == "__main__":  # a Ctrl-C while the modules load: one line, no traceback; kept until it is known
    errors.stop_at_once_while_loading(defer=True)  # whether several processes run, which stop all together

from training import multihost  # light too: JAX loads when a distributed start needs it

if __name__ == "__main__" and not multihost.launched_several():
    errors.stop_at_once_while_loading()  # alone: a signal (one kept so far too) ends it at once


def parse_args(argv):
    parser = errors.ArgumentParser(
        description="Train a GPT. Without --resume, run_dir must not exist yet (or be empty); with --resume, "
        "the run continues from its last checkpoint with its own config.yaml, plus any key=value given.",
        allow_abbrev=False, error=errors.ConfigError,
        hint="usage: python train.py [--config FILE] [key=value ...] [--resume] | --plan [--device NAME] [--devices N]",
    )
    parser.add_argument("--config", default=None, help="YAML config (default: conf/config.yaml beside train.py)")
    parser.add_argument("--resume", action="store_true", help="continue the run in run_dir from its last checkpoint")
    parser.add_argument("--plan", action="store_true",
                        help="print the memory per device, FLOPs and step time of this config on --device and stop: "
                             "nothing is read, made or run")
    parser.add_argument("--device", default="H100", help="--plan's target: H100, H200, A100-40, A100-80, a TPU "
                        "generation or slice (v3, v4-32, v5e-16, v5p-128, v6e-8), a GPU's memory (24GiB), or cpu "
                        "(this machine's CPU devices and memory)")
    parser.add_argument("--devices", type=int, default=None,
                        help="--plan's device count (default: the TPU slice's, else 1)")
    parser.add_argument("--mfu", type=float, default=0.4, help="--plan's model FLOP utilisation for the step time")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides of the config file's keys, e.g. training.lr=1e-3 model=124m; every "
                             "key, with its default and meaning, is in conf/config.yaml")
    return parser.parse_args(argv)


if __name__ == "__main__":
    errors.parse_before_loading(parse_args)  # --help and argument mistakes: at once, before JAX loads

import contextlib
import dataclasses
import os
import sys
import time

import jax
import numpy as np

import data
import model as model_lib
import sharding as sharding_lib
from core import chat, storage
from core.errors import DataError, RunError
from layers import attention as attention_lib
from store import record, rundir
from tokendata import loader, mixture, shards
from training import config as config_lib
from training import devices, plan, progress
from training import dpo_reference
from training import step as step_lib


def main(argv=None) -> int:
    """Train; 0 once trained to training.steps, 128 + N when signal N (SIGTERM, SIGINT, SIGHUP) stopped it.

    The handlers are installed first, so a signal during start-up (data, compilation) stops the run
    cleanly too: before the first step with nothing saved, after it with a checkpoint of the last step.
    A second signal stops the process at once (progress.Stop)."""
    args = parse_args(argv)
    args.config = args.config or config_lib.DEFAULT_CONFIG
    if args.plan:  # before any device, data or run directory
        return plan.run(args, rundir.new_config)
    with progress.Stop(expect_several=multihost.launched_several()) as stop:
        try:
            with contextlib.ExitStack() as held:  # the run directory's lock and checkpoints, however run() ends
                with multihost.ends_every_process(passes=progress.Interrupted):  # several processes: one line each
                    return run(args, stop, held)
        except progress.Interrupted as e:
            print(stop.stopped_line(e.signum), flush=True)
            return 128 + e.signum
        except Exception:  # a start refused or failed after making its run directory leaves nothing behind
            if stop.starting:
                for line in stop.undo_quietly():
                    print(f"warning: {line}", file=sys.stderr)
            raise


def run(args, stop: progress.Stop, held: contextlib.ExitStack) -> int:
    """main() without the signal handlers, for the parsed command line `args`: `stop.signal` is set when
    one arrives; the run directory's lock, its checkpoints and its log go into `held`."""
    t_start = time.perf_counter()
    stop.joining = True  # a signal while the processes join ends this one at once (the join cannot be left)
    joined = multihost.initialize()
    stop.joining = False
    if joined:  # before any other JAX call; a no-op for a single process
        stop.several()  # a stop is agreed between the processes from here on,
        multihost.watch()  # and a failure on any one ends them all
        multihost.at_end(stop.undo_start)
    stop.check()  # a signal that came before the processes joined
    is_main = jax.process_index() == 0  # only process 0 writes files and logs
    say = print if is_main else (lambda *args, **kwargs: None)

    # ------------------------------------------------------------------------------------------
    # Config and run directory: a resume reads the run's own config (command-line overrides still
    # apply, e.g. training.steps); a new run needs an empty directory. Process 0 holds the lock.
    if args.resume:  # the overrides apply to the run's own config.yaml, read below, not to --config's
        location = config_lib.run_dir_of(args.config, args.overrides)
    else:
        cfg = rundir.new_config(args.config, args.overrides)
        if cfg.training.init_from and not config_lib.names_model(args.overrides):
            say(f"model {cfg.model_name}: training.init_from's ({cfg.training.init_from})")
        location = cfg.run_dir
    try:
        run_dir = rundir.Run(location)  # a local path or a URL (gs://...); str(run_dir) as given
        run_dir.dir.checkpoint_dir()  # where its checkpoints go: a store orbax writes, before anything is made
    except storage.StorageError as e:
        raise RunError(f"run_dir: {e}") from None
    stopped = f"stopped before training in {run_dir} (its error says why)"
    writer = "train.py --resume" if args.resume else "train.py"
    if args.resume:
        if not run_dir.dir.is_file(record.CONFIG):
            raise RunError(f"nothing to resume: {run_dir} is not a run directory (no {record.CONFIG})")
        run_dir.record.resume_config(args.overrides)  # refused overrides are refused before the lock is written
        multihost.on_process_zero(lambda: held.enter_context(run_dir.writer(writer)), stopped)
        cfg = run_dir.record.resume_config(args.overrides)  # as it is now that no other writer can change it
    else:
        run_dir.check_new()
    t, ck, sh = cfg.training, cfg.checkpoint, cfg.sharding
    if t.warmup_steps > t.steps:  # the schedule never reaches training.lr: legal, but never what was meant
        say(f"warning: training.warmup_steps ({t.warmup_steps}) exceeds training.steps ({t.steps}): the learning "
            f"rate peaks at {t.steps / t.warmup_steps:.0%} of training.lr; set training.warmup_steps below "
            f"{t.steps} to reach it")
    multihost.on_process_zero(lambda: rundir.check_wandb(cfg), stopped)  # before anything is written
    try:
        attention_lib.check_attention_backend(cfg.model)  # e.g. attention=cudnn without a GPU, before any work
    except ValueError as e:
        raise RunError(str(e)) from None
    if note := attention_lib.attention_note(cfg.model, cfg.seq_len):  # e.g. pallas on a CPU: interpret mode
        say(note)
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
    # and a resume checks that it has not changed), or several mixed by weight (data.mixture: one
    # tokenizer, one kind), the model's vocabulary from its tokenizer, and a fixed validation sample of
    # each source in whole batches (text windows, or prompt/completion rows with the loss on completions)
    stages = config_lib.mixture_stages(cfg.data) if cfg.data.mixture else None

    def read_data():  # on every process (each may read its own copy); a failure on one stops them all
        if stages is None:
            cfg.data.dir = data.resolve_dir(cfg.data.dir, progress=is_main)
            sources = {"": shards.open_data(cfg.data.dir)}  # index.json and the tokenizer read once, here
        else:
            for source in cfg.data.mixture.values():
                source.dir = data.resolve_dir(source.dir, progress=is_main)
            sources = {name: shards.open_data(source.dir) for name, source in cfg.data.mixture.items()}
            mixture.check_sources(sources)
        corpus = next(iter(sources.values()))  # the tokenizer, vocabulary and kind of every source
        check_objective(cfg, corpus, stages)
        if args.resume:
            run_dir.record.check_data(corpus) if stages is None else run_dir.record.check_mixture(sources)
        if cfg.model.vocab_size != corpus.vocab_size:
            say(f"model.vocab_size {cfg.model.vocab_size} -> {corpus.vocab_size}, the vocabulary of {corpus}")
            cfg.model = dataclasses.replace(cfg.model, vocab_size=corpus.vocab_size)
        rows = dict(process_index=rows_index, process_count=rows_count, batching=cfg.data.batching)
        if stages is None:
            train_loader = loader.open_loader(corpus, "train", cfg.seq_len, t.batch_size, seed=cfg.seed, **rows)
        else:
            train_loader = mixture.open_mixture(sources, stages, cfg.seq_len, t.batch_size, seed=cfg.seed, **rows)
            epochs = train_loader.epochs(t.steps)
            if cfg.data.max_epochs is not None and max(epochs.values()) > cfg.data.max_epochs:
                name = max(epochs, key=epochs.get)
                raise DataError(f"data.mixture.{name}: {t.steps} steps go through it {epochs[name]:.3g} times, more "
                                f"than data.max_epochs ({cfg.data.max_epochs:.3g}); lower its weight or the steps, or "
                                f"raise data.max_epochs")
        for name, source in sources.items():
            if source.remote:
                group = train_loader.group
                say(f"data {source}: read in place, this process's rows only, {group} batch{'es' * (group > 1)} "
                    f"a request, {train_loader.prefetch} ahead (nothing copied)")
        val = {}
        for name, source in sources.items():
            try:
                val[name] = loader.validation_sample(source, cfg.seq_len, t.batch_size // t.micro_batches,
                                                     t.eval_windows, cfg.data.batching)
            except DataError as e:
                if not name:
                    raise
                raise DataError(f"data.mixture.{name}: {e}") from None
        # its model must be this one: checked before anything is written, unless a full fine-tune's resume
        # restores a checkpoint (init_from is read no more: it may have moved or gone)
        reads_init = t.lora is not None or (t.objective == "dpo" and not t.dpo_settings.precompute_reference)
        if t.init_from and not (args.resume and not reads_init and run_dir.checkpoints.steps()):
            rundir.check_init_from(t.init_from, cfg.model, corpus, resume=args.resume)
        return sources, train_loader, val

    sources, train_loader, val = multihost.on_every_process(read_data, "stopped before training (its error says why)")
    corpus = next(iter(sources.values()))
    if stages is not None:
        for line in mixture.describe(train_loader, stages, t.steps):
            say(line)
    mcfg, seq_len = cfg.model, cfg.seq_len
    plan.check_fits(cfg, devices.here())  # a config this machine cannot hold: refused now, with what fits
    stop.check()  # a signal before the first step: nothing to save

    # ------------------------------------------------------------------------------------------
    # Model, optimizer and placement (step.py): shapes first, shardings from sharding.py's rules for
    # the ZeRO stage, then the jitted init, step and evaluation
    fns = step_lib.build(mcfg, t, mesh, sh.zero_stage, cfg.seed)
    say(fns.description, flush=True)
    frozen = ()  # LoRA: the frozen base, an argument of every step beside the adapters' state
    reference = None  # DPO with training.dpo.precompute_reference: the reference's log-probabilities of every pair
    if t.lora is not None:  # loaded once; a resume checks that it is the base the run records
        base_params, base_record = run_dir.weights.frozen_base(t.init_from, check=args.resume,
                                                               point_at="--resume training.init_from=DIR")
        frozen = (fns.place_base(base_params),)
        del base_params
        adapters = sum(a.size for a in jax.tree.leaves(fns.abstract_state["params"]))
        say(f"base {t.init_from} (checkpoint {base_record['step']}) frozen; {adapters / 1e6:.3f}M adapter "
            f"parameters trained" + (" with AdamW (training.optimizer=muon trains a full run's block matrices; "
                                     "adapters are not those)" if t.optimizer == "muon" else ""))

    if fns.frozen_kind == "reference":  # DPO: the reference model, init_from's, frozen beside the policy
        frozen = (rundir.load_init_params(t.init_from, fns.state_sharding["params"]),)
        say(f"reference {t.init_from}: frozen, its log-probabilities computed in each step "
            f"(training.dpo.precompute_reference=true computes them once, at the start)")

    # ------------------------------------------------------------------------------------------
    # Run directory: the effective config and a reference to the data, once every check has passed.
    # A resumed run's config.yaml is rewritten only once its checkpoint has been restored.
    if not args.resume:  # a stop before the first step removes it again (progress.Stop.undo), under stop.writing
        with stop.writing:
            if is_main:
                stop.undo.append(run_dir.dir.begin_new())
            multihost.on_process_zero(lambda: held.enter_context(run_dir.writer(writer, new=True)), stopped)
            if is_main:
                run_dir.record.save_config(cfg)
                if stages is None:
                    run_dir.record.save_data(corpus)
                else:
                    run_dir.record.save_mixture(sources, mixture.shares(train_loader.names, train_loader.schedule,
                                                                        stages))
                if t.lora is not None:
                    run_dir.weights.save_lora_base(base_record)
                if t.init_from:  # the model's chat template (an import's) goes on with it: serve.py reads it
                    source = storage.RunDir(t.init_from)
                    if source.is_file(chat.CHAT_TEMPLATE):
                        run_dir.dir.write_bytes(chat.CHAT_TEMPLATE, source.read_bytes(chat.CHAT_TEMPLATE))

    def place_batch(local_rows):
        """A batch (an array, or a dict of arrays with rows first) onto the devices; a pair batch's pair ids stay
        here (with a precomputed reference, its log-probabilities of those pairs go instead)."""
        if isinstance(local_rows, dict) and "pairs" in local_rows:
            local_rows = dict(local_rows)
            pairs = local_rows.pop("pairs")
            if reference is not None and "ref" not in local_rows:
                local_rows["ref"] = reference.of(pairs)
        return jax.tree.map(lambda x: sharding_lib.place_batch(x, mesh, x.shape[0] * rows_count), local_rows)

    def process_slice(global_rows: np.ndarray) -> np.ndarray:
        """This process's rows of a batch every process holds whole (the validation sample)."""
        n = global_rows.shape[0] // rows_count
        return global_rows[rows_index * n:(rows_index + 1) * n]

    def evaluate(params) -> dict:
        """The validation loss and perplexity; a mixture's of each source (its own sample) too, with their
        token-weighted (val_loss) and plain (val_loss_mean) averages."""
        totals = {}
        for name, (sample, *_) in val.items():
            sums = [fns.eval_step(params, place_batch(jax.tree.map(process_slice, batch)), *frozen) for batch in sample]
            totals[name] = np.sum(np.asarray(jax.device_get(sums), np.float64), axis=0)  # (loss sum, tokens[, ...])
        loss = float(sum(s[0] for s in totals.values()) / sum(s[1] for s in totals.values()))
        if t.objective == "dpo":  # the pairs' DPO loss and reward accuracy (no perplexity: not a token loss)
            (loss_sum, pairs, right), = totals.values()
            return {"val_loss": loss, "val_rewards/accuracies": float(right / pairs)}
        out = {"val_loss": loss, "val_ppl": progress.perplexity(loss)}
        if stages is not None:
            for name, (loss_sum, n) in totals.items():
                out[f"val_loss/{name}"] = float(loss_sum / n)
                out[f"val_ppl/{name}"] = progress.perplexity(out[f"val_loss/{name}"])
            out["val_loss_mean"] = float(np.mean([out[f"val_loss/{name}"] for name in totals]))
        return out

    # ------------------------------------------------------------------------------------------
    # Checkpoint (checkpoints.py): orbax, asynchronous; a resume restores the newest intact checkpoint
    ckpts = held.enter_context(run_dir.checkpoints.write(ck.keep, ck.async_save))
    last_ckpt = (ckpts.steps() or [None])[-1]
    if args.resume and last_ckpt is not None:
        saved = run_dir.record.config()  # as the run was last configured
        state, last_ckpt = ckpts.restore(fns.abstract_state, say, run_dir.tokens_per_step(saved))
        start_step = int(state["step"])
        tokens_before = ckpts.tokens(last_ckpt)  # (None: saved before tokens were kept)
        if tokens_before is None:
            tokens_before = start_step * saved.tokens_per_step
        if problem := config_lib.mixture_change(saved.data, cfg.data, start_step):
            raise RunError(problem)
        if changes := run_dir.record.resume_changes(saved, cfg):
            say(changes)
        # the learning rate from here on is the resume's schedule at this step (past the warm-up: no second one);
        # when a key it depends on changed, the rate of the next step is said before and after
        if start_step < t.steps and any(getattr(saved.training, k) != getattr(t, k) for k in step_lib.SCHEDULE_KEYS):
            before, after = (f"{float(schedule(start_step)):.3g}" for schedule in
                             (step_lib.lr_schedule(saved.training), fns.schedule))
            say((f"training.steps {saved.training.steps} -> {t.steps}: " if saved.training.steps != t.steps else "")
                + f"{step_lib.schedule_words(t)}, so the learning rate of step {start_step + 1} "
                + (f"goes from {before} to {after}" if before != after else f"stays {after}"))
        if start_step >= t.steps:
            say(f"{run_dir} is already trained to step {start_step}; to train further: "
                f"python train.py --resume run_dir={run_dir} training.steps=N")
            return 0
    else:
        if args.resume:  # the run stopped before its first checkpoint: it starts again, as configured
            say(f"no checkpoint in {ckpts.dir} yet: the run starts from step 0 with its saved config")
        state = fns.init()
        if t.init_from and t.lora is None:  # fine-tuning: the optimizer state (zero moments) and step stay fresh
            state["params"] = rundir.load_init_params(t.init_from, fns.state_sharding["params"])
            say(rundir.init_from_line(t.init_from))
        start_step, tokens_before = 0, 0
    stop.check()  # before the first step: nothing to save
    if t.objective == "dpo" and t.dpo_settings.precompute_reference:
        reference = dpo_reference.Precomputed.for_run(
            run_dir, fns, train_loader, corpus, frozen=frozen, init_params=None if start_step or t.lora is not None
            else state["params"], place_batch=place_batch,
            load_reference=lambda: rundir.load_init_params(t.init_from, fns.state_sharding["params"]), process_slice=process_slice,
            batch_size=t.batch_size, seq_len=seq_len, batching=cfg.data.batching, say=say, stop=stop,
            is_main=is_main)
        val = {name: (reference.fill(sample), *rest) for name, (sample, *rest) in val.items()}
    stop.check()

    # ------------------------------------------------------------------------------------------
    # Logging: metrics.jsonl continues after the restored step; W&B keeps its run id in the run dir
    metrics_file = None
    if is_main:
        with stop.writing:
            metrics_file = held.enter_context(contextlib.closing(run_dir.metrics(start_step)))
            if args.resume:  # restored and its log read: the effective config (with this command's overrides) is the run's
                run_dir.record.save_config(cfg, start_step)
                if t.lora is not None:  # the base as loaded now (where it lies, if it moved)
                    run_dir.weights.save_lora_base(base_record)
        if metrics_file.torn is not None:
            say(f"{run_dir.dir.show(rundir.METRICS)}: its last line was cut off (a stop during its write); dropped it")
        logged = metrics_file.rows[-1]["step"] if metrics_file.rows else 0
        if args.resume and last_ckpt is not None and logged < start_step and (row := ckpts.row(start_step)):
            metrics_file.append(row)  # the restored step's row, lost from the log (cut off, or the log lost)
            metrics_file.rows.append(row)
            say(f"{run_dir.dir.show(rundir.METRICS)}: step {start_step}'s row was missing; put back from its "
                f"checkpoint")
    wandb_run = run_dir.start_wandb(cfg) if is_main and cfg.wandb.mode != "disabled" else None
    n_params = model_lib.param_count(mcfg)
    say(f"model {cfg.model_name}: {n_params / 1e6:.2f}M parameters, context {seq_len}; "
        f"{t.steps} steps of {cfg.tokens_per_step} tokens"
        + (f" ({t.batch_size} rows of preference pairs, chosen and rejected)" if t.objective == "dpo" else "")
        + f"; run dir {run_dir}"
        + (f"; resuming from step {start_step}" if args.resume else ""), flush=True)

    # ------------------------------------------------------------------------------------------
    # Loop (the bookkeeping around each step: progress.Steps); before a checkpoint everything is checked
    per_source = None
    if stages is not None:  # each source's sequences so far: tokens and epochs in every logged row
        def per_source(step: int) -> dict:
            taken, epochs = train_loader.taken(step), train_loader.epochs(step)
            return {**{f"tokens/{n}": k * seq_len for n, k in taken.items()},
                    **{f"epochs/{n}": e for n, e in epochs.items()}}
    steps = progress.Steps(cfg, stop, start_step=start_step, tokens_before=tokens_before,
                           t_start=t_start, metrics_file=metrics_file, wandb_run=wandb_run, last_ckpt=last_ckpt,
                           run_dir=run_dir, per_source=per_source)
    batches = train_loader.iterate(start_step)

    def save() -> None:
        """A checkpoint of the step just trained, its row logged first: everything checked before it."""
        if steps.pending is not None:  # its metrics not read yet (a stop on a step that logs nothing)
            steps.log(steps.read())
        steps.check_finite(fns.all_finite(state["params"]))
        steps.flush()  # the log holds this step's row before its checkpoint can exist
        row = steps.last_row if steps.last_row.get("step") == steps.step else None  # (process 0's; None elsewhere)
        ckpts.save(steps.step, state, tokens=steps.tokens(steps.step), row=row)
        steps.saved()

    # closed in reverse: the last save completes, even on an error (but one of one process among several)
    with steps, contextlib.closing(batches), ckpts, multihost.ends_every_process():
        while steps.step < t.steps:
            state, metrics = fns.train_step(state, place_batch(next(batches)), *frozen)
            stop.starting = False  # compiled and dispatched: from here a signal saves a checkpoint
            evaluate_now, save_now = steps.dispatched(metrics)
            if evaluate_now or save_now:
                row = steps.read()
                if evaluate_now:
                    steps.evaluated(row, evaluate(state["params"]))
                steps.log(row)
                if save_now:
                    save()
                steps.paused()
            if steps.stopping:  # decided here, after all of the step's work: a stop that came at any moment of
                if not steps.is_saved():  # it (its evaluation, its log, its plot) still saves the step
                    save()
                    steps.paused()
                break
        steps.finish()

    # ------------------------------------------------------------------------------------------
    # Summary
    if steps.stopping and steps.step < t.steps:
        # the line names a checkpoint only once it is there and reads as saved (on every process: orbax's
        # reader is opened by all together)
        run_dir.checkpoints.check_saved(steps.step, fns.abstract_state)
        where = os.path.join(ckpts.dir, str(steps.step))
        print(f"stopped by {stop.name} after step {steps.step}; checkpoint saved in {where}" if is_main else
              f"process {jax.process_index()} stopped by {stop.name} after step {steps.step} with every process; "
              f"checkpoint saved in {where}", flush=True)  # each process its own line
        say(f"continue with: python train.py --resume run_dir={run_dir}")
        if wandb_run is not None:
            wandb_run.finish()
        return 128 + stop.number  # not 0: `python train.py && python eval.py` must not go on
    if came := stop.ended():  # from here a signal changes nothing: the run is complete
        say(came)
    val_windows, val_tokens, val_of = (sum(v[i] for v in val.values()) for i in (1, 2, 3))
    summary = steps.summary(corpus.index if stages is None else {}, n_params, val_windows, val_tokens, val_of,
                            ckpts.dir)
    summary["sample_prompt"] = progress.sample_prompt(corpus.tokenizer(), next(iter(val.values()))[0][0],
                                                      corpus.eot_id)  # for the next commands
    if is_main:
        run_dir.save_summary(summary)
        if wandb_run is not None:
            wandb_run.summary.update(summary)
            wandb_run.finish()
    say(progress.report(summary))
    multihost.finished()
    return 0


def check_objective(cfg, corpus, stages) -> None:
    """training.objective against the data: DPO trains on preference pairs (one directory), and only DPO does."""
    t = cfg.training
    if t.objective == "dpo":
        if stages is not None:
            raise DataError("training.objective=dpo reads one directory of preference pairs (data.dir), not a "
                            "data.mixture")
        if not corpus.is_preference:
            raise DataError(f"training.objective=dpo trains on preference pairs, and {corpus} is "
                            f"{corpus.kind.replace('_', '/')} data: prepare prompt/chosen/rejected pairs with "
                            f"python data.py --format preference --tokenizer {t.init_from} ... and set data.dir")
    elif corpus.is_preference:
        raise DataError(f"{corpus} holds preference pairs (prompt, chosen, rejected): train on them with "
                        f"training.objective=dpo training.init_from=RUN_DIR (the model they tune)")


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr: exit 2 for bad input, 1 for divergence,
    128 + N for signal N."""
    return errors.run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
