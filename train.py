"""Train a GPT: the flat training loop.

    python train.py                                   # the default job (conf/config.yaml)
    python train.py --config conf/760m.yaml data.dir=data/my_corpus training.lr=2e-4
    python train.py --resume                          # continue the configured run from its last checkpoint

Sections of main(): config, run directory, data, model and optimizer, placement, step,
checkpoint, logging, loop, summary. The state is one pytree {params, opt_state, step, rng}; the
batch at step s is a pure function of (seed, s), so resuming from a checkpoint at step s replays
steps s+1.. exactly (bit for bit on the CPU).

The run directory holds config.yaml (the effective config), data.json and tokenizer.json (the
data it trained on), metrics.jsonl (one JSON object per logged step), summary.json, and
checkpoints/ (orbax, one directory per step). It may be a URL (run_dir=gs://bucket/runs/x): process 0
writes those files there through storage.RunDir, orbax the checkpoints; data.dir may be a URL too.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import signal
import sys
import threading
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

import config as config_lib
import data
import finetune_data
import model as model_lib
import sharding as sharding_lib
import step as step_lib
import storage
from step import decay_mask, lr_schedule, peak_flops  # noqa: F401  (train.decay_mask etc. stay importable)


class RunError(Exception):
    """A user-caused problem with the run (its directory, its checkpoints); str(e) is one line."""


class Diverged(Exception):
    """The loss or the parameters stopped being finite."""


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived before the first training step: nothing was trained or saved."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def check_init_from(run_dir, mcfg: model_lib.GPTConfig) -> None:
    """training.init_from: a run directory with a checkpoint and this run's model, or a RunError (one line)."""
    src = str(run_dir)  # a local path or a URL
    try:
        src_model = config_lib.load_run_config(src).model
        has_checkpoint = bool(config_lib.checkpoint_steps(src))
    except config_lib.ConfigError as e:
        raise RunError(f"training.init_from: {e}") from None
    if not has_checkpoint:
        raise RunError(f"training.init_from={src}: no checkpoint in it to start from")
    # fields that change the parameters or what they compute; an ALiBi model may change its context
    fields = ("vocab_size", "block_size", "embedding_dim", "num_head", "N", "alibi_attn", "bias", "embed_norm",
              "gelu_approximate", "layer_norm_epsilon")
    diffs = [f"{f} {getattr(src_model, f)} there, {getattr(mcfg, f)} here" for f in fields
             if getattr(src_model, f) != getattr(mcfg, f) and not (f == "block_size" and mcfg.alibi_attn)]
    if diffs:
        raise RunError(f"training.init_from={src}: its model differs from this run's ({'; '.join(diffs)}); "
                       f"set the same model (and prepare the data with its tokenizer)")


def load_init_params(run_dir, shardings):
    """training.init_from: the parameters of a run directory's last checkpoint, placed with `shardings`."""
    try:
        params, _ = config_lib.load_run_params(str(run_dir))
    except config_lib.ConfigError as e:
        raise RunError(f"training.init_from: {e}") from None
    return jax.device_put(params, shardings)


def tree_mismatch(saved, abstract_state) -> str | None:
    """How a checkpoint's tree (its metadata) and this run's state differ: keys on one side only and
    arrays of another shape, the first few of each; None when they agree."""
    def shapes(tree) -> dict[str, tuple | None]:
        name = lambda k: getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))  # noqa: E731  (dict, list, attr)
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {"/".join(str(name(k)) for k in path): getattr(leaf, "shape", None) for path, leaf in flat}

    def show(names) -> str:  # the parameters first: they say what differs in the model
        first = sorted(names, key=lambda n: (not n.startswith("params/"), n))[:4]
        return ", ".join(first) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    there, here = shapes(saved), shapes(abstract_state)
    resized = [f"{k} {tuple(there[k])} there, {tuple(here[k])} here" for k in sorted(
        there.keys() & here.keys(), key=lambda n: (not n.startswith("params/"), n))
        if None not in (there[k], here[k]) and tuple(there[k]) != tuple(here[k])]
    parts = ([f"only in the checkpoint: {show(there.keys() - here.keys())}"] if there.keys() - here.keys() else []) + \
            ([f"only in this run: {show(here.keys() - there.keys())}"] if here.keys() - there.keys() else []) + \
            ([f"other shapes: {', '.join(resized[:3])}" + (f" and {len(resized) - 3} more" if len(resized) > 3 else "")]
             if resized else [])
    return "; ".join(parts) or None


def restore_newest(mngr, abstract_state, ckpt_dir, say):
    """(state, step) from the newest checkpoint that restores. Damaged newer ones are moved aside to
    checkpoints-damaged/ (never deleted), saying which and why; a checkpoint whose tree differs from
    this run's (another model or optimizer) is a RunError naming the differing keys."""
    from etils import epath

    steps = sorted(mngr.all_steps(), reverse=True)
    damaged = []
    for step in steps:
        try:
            saved = mngr.item_metadata(step)
            saved = getattr(saved, "tree", saved)  # the checkpoint's own description of its arrays
        except Exception as e:
            damaged.append((step, config_lib.checkpoint_problem(e)))
            continue
        if saved is None:
            damaged.append((step, "its description of the arrays (_METADATA) is missing or unreadable"))
            continue
        mismatch = tree_mismatch(saved, abstract_state)
        if mismatch:
            raise RunError(f"checkpoint {step} in {ckpt_dir} does not fit this run's model and optimizer "
                           f"({mismatch}); resume with the run's own model settings")
        try:
            state = mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except Exception as e:  # a damaged checkpoint: a file missing, an array unreadable
            damaged.append((step, config_lib.checkpoint_problem(e)))
            continue
        if damaged:
            aside = epath.Path(ckpt_dir).parent / "checkpoints-damaged"
            aside.mkdir(parents=True, exist_ok=True)
            for bad, _ in damaged:  # a new save at that step must not meet the damaged directory
                (epath.Path(ckpt_dir) / str(bad)).rename(aside / str(bad))
            mngr.reload()
            say(f"checkpoint {', '.join(str(d) for d, _ in damaged)} cannot be restored "
                f"({'; '.join(f'{d}: {why}' for d, why in damaged)}); moved to {aside}; "
                f"resuming from checkpoint {step}, the newest intact one")
        return state, step
    step, why = damaged[0]
    raise RunError(f"checkpoint {step} in {ckpt_dir} cannot be restored: {why}" +
                   (f"; nor can the {len(damaged) - 1} older one(s)" if len(damaged) > 1 else ""))


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(700) so that a huge but finite loss still gives a number (JSON has no inf)."""
    return math.exp(min(loss, 700.0))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Train a GPT. Without --resume, run_dir must not exist yet (or be empty); with --resume, "
        "the run continues from its last checkpoint with its own config.yaml, plus any key=value given.",
        allow_abbrev=False,
    )
    parser.add_argument("--config", default=str(config_lib.DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue the run in run_dir from its last checkpoint")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. training.lr=1e-3")

    def error(message):  # one line, no usage block
        raise config_lib.ConfigError(f"{message} (usage: python train.py [--config FILE] [key=value ...] [--resume])")

    parser.error = error
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Train; 0 once trained to training.steps, 128 + N when signal N (SIGTERM, SIGINT) stopped it.

    The handlers are installed first, so a signal during start-up (data, compilation) stops the run
    cleanly too: before the first step with nothing saved, after it with a checkpoint of the last step.
    A second signal stops at once (KeyboardInterrupt)."""
    stop = {"signal": None}

    def on_signal(signum, frame):
        if stop["signal"] is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        stop["signal"] = signum

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run(argv, stop)
    except Interrupted as e:
        print(f"stopped by {e} during start-up: nothing trained, nothing saved", flush=True)
        return 128 + e.signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def run(argv, stop: dict) -> int:
    """main() without the signal handlers: `stop["signal"]` is set when one arrives."""
    t_start = time.perf_counter()
    sharding_lib.initialize_distributed()  # before any other JAX call; a no-op for a single process
    is_main = jax.process_index() == 0  # only process 0 writes files and logs
    say = print if is_main else (lambda *args, **kwargs: None)

    # ------------------------------------------------------------------------------------------
    # Config
    args = parse_args(argv)
    cfg = config_lib.load_config(args.config, args.overrides)
    try:
        run_dir = storage.RunDir(cfg.run_dir)  # a local path or a URL (gs://...); str(run_dir) as given
    except storage.StorageError as e:
        raise RunError(f"run_dir: {e}") from None
    if args.resume:
        # The run's own effective config; command-line overrides still apply (e.g. training.steps).
        if not run_dir.is_file(config_lib.RUN_CONFIG_NAME):
            raise RunError(f"nothing to resume: {run_dir} is not a run directory (no {config_lib.RUN_CONFIG_NAME})")
        cfg = config_lib.load_run_config(run_dir, args.overrides)
    elif not run_dir.is_empty():
        if run_dir.is_file(config_lib.RUN_CONFIG_NAME) and not config_lib.checkpoint_steps(run_dir):
            raise RunError(f"run directory {run_dir} holds a run stopped before its first checkpoint; continue it "
                           f"with --resume (from step 0, with its saved config), or remove the directory to start anew")
        raise RunError(
            f"run directory {run_dir} already exists; continue it with --resume, "
            f"or start a new run elsewhere with run_dir=PATH"
        )
    t, ck, sh = cfg.training, cfg.checkpoint, cfg.sharding
    try:
        model_lib.check_attention_backend(cfg.model)  # e.g. attention=cudnn without a GPU, before any work
    except ValueError as e:
        raise RunError(str(e)) from None
    if jax.process_count() > 1:  # every process has checked run_dir before process 0 writes into it
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("run_dir checked")

    # ------------------------------------------------------------------------------------------
    # Mesh: every device of every process; the batch and the model must split evenly over it
    mesh = sharding_lib.make_mesh(sh.data, sh.fsdp, sh.tensor)
    sharding_lib.check_batch(mesh, t.batch_size, t.micro_batches)
    rows_index, rows_count = sharding_lib.process_rows(mesh, t.batch_size)

    # ------------------------------------------------------------------------------------------
    # Data: the prepared corpus (the default one is prepared on first use), its tokenizer's vocabulary
    remote_data = cfg.data.dir is not None and storage.is_url(cfg.data.dir)
    if remote_data:
        data_dir = cfg.data.dir  # a URL, kept as written: pathlib would fold its "//"
    else:
        data_dir = pathlib.Path(cfg.data.dir) if cfg.data.dir else data.DEFAULT_DATA_DIR
    if cfg.data.dir is None and not (data_dir / "index.json").is_file():
        print(f"preparing the default corpus in {data_dir} (once)", flush=True)
        data.prepare_default(data_dir, progress=is_main)
    index = data.load_index(data_dir)  # a URL: copied to the local cache and verified first
    local_data = storage.local_data_dir(data_dir)  # what the loader memory-maps
    cfg.data.dir = data_dir if remote_data else str(data_dir.resolve())
    if cfg.model.vocab_size != index["vocab_size"]:
        say(f"model.vocab_size {cfg.model.vocab_size} -> {index['vocab_size']}, the vocabulary of {data_dir}")
        cfg.model = dataclasses.replace(cfg.model, vocab_size=index["vocab_size"])
    seq_len = cfg.seq_len
    # a fixed validation sample, padded to whole batches so evaluation compiles once
    eval_bs = t.batch_size // t.micro_batches
    val_sample = []  # batches {tokens (b, T+1), weights (b, T)[, segments (b, T)]}
    finetune = finetune_data.is_prompt_completion(index)
    if finetune:  # prompt/completion pairs: the loss on completions only, examples packed or padded
        loader = finetune_data.Loader(data_dir, "train", seq_len, t.batch_size, seed=cfg.seed,
                                      process_index=rows_index, process_count=rows_count, batching=cfg.data.batching)
        for batch in finetune_data.eval_batches(data_dir, "val", seq_len, eval_bs, batching=cfg.data.batching,
                                                max_rows=t.eval_windows):
            padded = finetune_data.empty_batch(eval_bs, seq_len)  # zero weights on the rows that pad the batch
            for k, v in batch.items():
                padded[k][: len(v)] = v
            val_sample.append(padded)
    else:
        loader = data.Loader(
            data_dir, "train", seq_len, t.batch_size,
            seed=cfg.seed, process_index=rows_index, process_count=rows_count,
        )
        for tokens in data.eval_batches(data_dir, "val", seq_len, eval_bs, max_windows=t.eval_windows):
            weights = np.zeros((eval_bs, seq_len), np.float32)
            weights[: len(tokens)] = 1.0
            padded = np.zeros((eval_bs, seq_len + 1), np.int32)
            padded[: len(tokens)] = tokens
            val_sample.append({"tokens": padded, "weights": weights})

    # what the validation figures are over: windows (rows) and tokens that count
    val_windows = sum(int((batch["weights"].sum(axis=1) > 0).sum()) for batch in val_sample)
    val_tokens = int(sum(batch["weights"].sum() for batch in val_sample))

    sharding_lib.check_model(mesh, num_head=cfg.model.num_head, mlp_dim=4 * cfg.model.embedding_dim,
                             vocab=cfg.model.padded_vocab_size)  # tensor parallelism splits these evenly

    if t.init_from:  # its model must be this one: checked before anything is written
        check_init_from(t.init_from, cfg.model)
    if stop["signal"] is not None:
        raise Interrupted(stop["signal"])

    # ------------------------------------------------------------------------------------------
    # Run directory: the effective config and a reference to the data, once every check has passed.
    # A resumed run's config.yaml is rewritten only once its checkpoint has been restored.
    if is_main and not args.resume:
        run_dir.mkdir()
        config_lib.save_run_config(cfg, run_dir)
        tokenizer = local_data / index["tokenizer"]
        data_ref = {
            "dir": cfg.data.dir,
            "index": f"{data_dir}/index.json" if remote_data else str((data_dir / "index.json").resolve()),
            "tokenizer": f"{data_dir}/{index['tokenizer']}" if remote_data else str(tokenizer.resolve()),
            "tokenizer_sha256": index.get("tokenizer_sha256"),
            "vocab_size": index["vocab_size"],
            "kind": index.get("kind", "text"),  # prompt_completion: sample.py completes prompts like training
        }
        run_dir.write_text("data.json", json.dumps(data_ref, indent=2) + "\n")
        run_dir.write_bytes("tokenizer.json", tokenizer.read_bytes())  # the run decodes without the corpus

    # ------------------------------------------------------------------------------------------
    # Model and optimizer: shapes first (no memory), then a jitted init
    mcfg = cfg.model
    apply, abstract_vars = step_lib.make_apply(mcfg)  # the model's shapes and axis names, no memory
    tx, schedule = step_lib.make_optimizer(t)
    masked_loss = step_lib.make_masked_loss(apply)  # validation of prompt/completion data: no FCM
    init_key, train_key = jax.random.split(jax.random.key(cfg.seed))
    init_state = step_lib.make_init_state(mcfg, tx)

    # ------------------------------------------------------------------------------------------
    # Placement: the one place where the state and the batch go onto devices (sharding.py's rules
    # for the ZeRO stage; the gradients' shardings are those stage 2 and 3 reduce-scatter into)
    device = jax.local_devices()[0]
    abstract_state = jax.eval_shape(init_state, init_key, train_key)
    axes = nnx.to_pure_dict(model_lib.param_axes(abstract_vars))
    state_sharding, grad_sharding, fallbacks = sharding_lib.state_shardings(abstract_state, axes, mesh, sh.zero_stage)
    abstract_state = sharding_lib.with_shardings(abstract_state, state_sharding)
    batch_sharding = sharding_lib.batch_sharding(mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    activations = sharding_lib.activation_rules(mesh)
    if is_main:
        print(sharding_lib.describe(abstract_state, state_sharding, mesh, sh.zero_stage, fallbacks), flush=True)

    def place_batch(local_rows):
        """A batch (an array, or a dict of arrays with rows first) onto the devices."""
        return jax.tree.map(lambda x: sharding_lib.place_batch(x, mesh, x.shape[0] * rows_count), local_rows)

    def process_slice(global_rows: np.ndarray) -> np.ndarray:
        """This process's rows of a batch every process holds whole (the validation sample)."""
        n = global_rows.shape[0] // rows_count
        return global_rows[rows_index * n:(rows_index + 1) * n]

    # ------------------------------------------------------------------------------------------
    # Step: gradient accumulation over micro-batches inside one jitted, state-donating step
    # (step.py builds it, so that bench.py times exactly this function)
    train_step = step_lib.make_train_step(apply, tx, t.micro_batches, grad_sharding, activations,
                                          fcm_max_ratio=t.fcm_max_ratio)
    train_step = jax.jit(train_step, donate_argnums=0, in_shardings=(state_sharding, batch_sharding),
                         out_shardings=(state_sharding, replicated))

    @functools.partial(jax.jit, in_shardings=(state_sharding["params"], batch_sharding), out_shardings=replicated)
    def eval_step(params, batch):
        """Summed loss and count of a validation batch: no dropout, no FCM; segments kept apart."""
        with model_lib.activation_sharding(activations):
            if "segments" in batch:
                loss, n = masked_loss(params, batch)
            else:
                loss, n = model_lib.cross_entropy(apply(params, batch["tokens"][:, :-1]), batch["tokens"][:, 1:],
                                                  batch["weights"])
        return loss * n, n

    @functools.partial(jax.jit, out_shardings=replicated)
    def all_finite(tree):
        return jnp.all(jnp.asarray([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))

    def evaluate(params) -> dict:
        sums = [eval_step(params, place_batch(jax.tree.map(process_slice, batch))) for batch in val_sample]
        loss_sum, n = np.sum(np.asarray(jax.device_get(sums), np.float64), axis=0)
        loss = float(loss_sum / n)
        return {"val_loss": loss, "val_ppl": perplexity(loss)}

    # ------------------------------------------------------------------------------------------
    # Checkpoint: orbax, asynchronous; a step directory appears only once it is complete
    logging.getLogger("absl").setLevel(logging.WARNING)
    ckpt_dir = run_dir.checkpoint_dir()  # a resolved local path, or the URL (orbax writes gs:// itself)
    mngr = ocp.CheckpointManager(
        ckpt_dir,
        options=ocp.CheckpointManagerOptions(max_to_keep=ck.keep, enable_async_checkpointing=ck.async_save),
        item_handlers=ocp.StandardCheckpointHandler(),  # so that a checkpoint's tree can be read before restoring
    )
    last_ckpt = mngr.latest_step()
    if args.resume and last_ckpt is not None:
        default_hook, sys.unraisablehook = sys.unraisablehook, config_lib.drop_closed_loop_errors
        try:
            state, last_ckpt = restore_newest(mngr, abstract_state, ckpt_dir, say)
            sys.unraisablehook = default_hook
        except RunError:  # (the hook stays: we exit)
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "Future exception was never retrieved"
            mngr.close()
            raise
        start_step = int(state["step"])
        if start_step >= t.steps:
            mngr.close()
            say(f"{run_dir} is already trained to step {start_step}; to train further: "
                f"python train.py --resume run_dir={run_dir} training.steps=N")
            return 0
    else:
        if args.resume:  # the run stopped before its first checkpoint: it starts again, as configured
            say(f"no checkpoint in {ckpt_dir} yet: the run starts from step 0 with its saved config")
        state = jax.jit(init_state, out_shardings=state_sharding)(init_key, train_key)
        if t.init_from:  # fine-tuning: the optimizer state (zero moments) and step stay fresh
            state["params"] = load_init_params(t.init_from, state_sharding["params"])
            say(f"parameters from {t.init_from}")
        start_step = 0
    if stop["signal"] is not None:  # before the first step: nothing to save
        mngr.close()
        raise Interrupted(stop["signal"])

    # ------------------------------------------------------------------------------------------
    # Logging: metrics.jsonl continues after the restored step; W&B keeps its run id in the run dir
    metrics_file, clock = None, 0.0  # clock: the run's time before this start (its rows' time_s go on from it)
    if is_main:
        metrics_file = storage.JsonLines(run_dir, "metrics.jsonl", keep=lambda row: row["step"] <= start_step)
        if metrics_file.torn is not None:
            say(f"{run_dir.show('metrics.jsonl')}: its last line was cut off (a stop during its write); dropped it")
        if metrics_file.rows:
            clock = float(metrics_file.rows[-1].get("time_s", 0.0))
        if args.resume:  # restored and its log read: the effective config (with this command's overrides) is the run's
            config_lib.save_run_config(cfg, run_dir)
    wandb_run = None
    if is_main and cfg.wandb.mode != "disabled":
        import wandb

        has_id = run_dir.is_file("wandb_id.txt")
        run_id = run_dir.read_text("wandb_id.txt").strip() if has_id else uuid.uuid4().hex[:8]
        run_dir.write_text("wandb_id.txt", run_id + "\n")
        wandb_run = wandb.init(
            project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or run_dir.name,
            id=run_id, resume="allow", mode=cfg.wandb.mode, dir=None if run_dir.remote else str(run_dir),
            config=config_lib.to_dict(cfg),
        )

    n_params = model_lib.param_count(mcfg)
    tokens_per_step = t.batch_size * seq_len
    peak = peak_flops(device.device_kind)
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
        return {"step": s, "loss": loss, "lr": float(schedule(s - 1)), "grad_norm": grad_norm,
                "tokens": s * tokens_per_step, "time_s": clock + now - t_start}

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
    batches = loader.iterate(start_step)
    try:
        while step < t.steps:
            state, metrics = train_step(state, place_batch(next(batches)))
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
                if not bool(all_finite(state["params"])):
                    raise Diverged(f"parameters are not finite after step {step}; "
                                   f"last good checkpoint: {last_ckpt} ({run_dir})")
                mngr.save(step, args=ocp.args.StandardSave(state), force=True)
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
        mngr.wait_until_finished()  # the last started save completes, even on an error
        mngr.close()
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
    entropy = index.get("unigram_entropy")
    train_loss = float(np.mean(recent_losses)) if recent_losses else None
    summary = {
        "steps": step,
        "tokens": step * tokens_per_step,
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
        "checkpoint": os.path.join(ckpt_dir, str(last_ckpt)) if last_ckpt is not None else None,
    }
    if entropy is not None and summary["val_loss"] is not None:
        summary["val_loss_below_unigram"] = entropy - summary["val_loss"]
    if is_main:
        run_dir.write_text("summary.json", json.dumps(summary, indent=2) + "\n")
        if wandb_run is not None:
            wandb_run.summary.update(summary)
            wandb_run.finish()
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    say(
        f"done: {summary['steps']} steps, {summary['tokens'] / 1e6:.2f}M tokens in {summary['wall_time_s']:.0f}s\n"
        f"  train loss {fmt(train_loss, '.4f')} (ppl {fmt(summary['train_ppl'], '.2f')}), "
        f"val loss {fmt(summary['val_loss'], '.4f')} (ppl {fmt(summary['val_ppl'], '.2f')}) on a fixed sample of "
        f"{val_windows} windows, {val_tokens:,} tokens (python eval.py measures the whole split)\n"
        f"  unigram entropy of the corpus {fmt(entropy, '.4f')} nats/token"
        + (f"; the val loss is {abs(gap):.3f} nats {'below' if gap >= 0 else 'above'} it"
           if (gap := summary.get("val_loss_below_unigram")) is not None else "")
        + f"\n  checkpoint {summary['checkpoint']}"
    )
    return 0


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr: exit 2 for bad input, 1 for divergence."""
    try:
        return main(argv)
    except (config_lib.ConfigError, data.DataError, RunError, sharding_lib.ShardingError,
            storage.StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second SIGINT/SIGTERM: stopped at once, after the last saved checkpoint
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
