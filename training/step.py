"""The training step: the optimizer, its learning-rate schedule, the initial state, the update, and
`build`, the one place where they are placed on a mesh and jitted.

train.py runs what `build(...)` returns; bench.py times the very same jitted step, so the benchmark
measures what training runs. Nothing here reads files.

    state = {params, opt_state, step, rng}          one pytree; `step` is also the loader position
    train_step(state, batch) -> (new state, {"loss", "grad_norm", "lr"})
        batch: tokens (B, T+1) int, or for prompt/completion data a dict {tokens (B, T+1),
        weights (B, T) loss weights, segments (B, T) packed-example ids}

LoRA (training.lora): the state's params are the adapters alone (lora.split's second tree, the
`lora_a` and `lora_b` leaves in the model's nesting), and the optimizer state is theirs; the frozen base
model is an argument of its own, never donated nor updated, placed by the same rules table:
    train_step(state, batch, base) -> (new state, metrics)      eval_step(params, batch, base)
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import model as model_lib
import sharding as sharding_lib
from core import seeds
from layers import attention as attention_lib
from layers import logical_axes
from layers import lora as lora_lib
from layers import loss as loss_lib
from training import dpo as dpo_lib

# the keys of a config.TrainingConfig that the learning rate of a step depends on
SCHEDULE_KEYS = ("steps", "schedule", "lr", "min_lr", "warmup_steps", "decay_fraction")


def lr_schedule(t):
    """The learning rate of each update for a config.TrainingConfig `t`: a linear warm-up to t.lr over
    warmup_steps, then by t.schedule

        cosine    down to t.min_lr at t.steps along half a cosine
        wsd       warm-up, stable, decay: flat at t.lr, then down to t.min_lr at t.steps over the last
                  t.decay_fraction of the steps along 1 - sqrt(progress), the cooldown that Hägele et al.
                  (2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations") found
                  better than a linear one
        constant  flat at t.lr (t.min_lr unused)

    Takes optax's count (updates done before this one), so update 1 uses lr/warmup_steps and
    never a wasted learning rate of 0. The rate is a function of the step alone: a resume continues it
    where the run stopped (past the warm-up, no second one), laid over the resume's training.steps.
    """

    def schedule(count):
        step = count + 1
        warm = t.lr * step / max(t.warmup_steps, 1)
        if t.schedule == "constant":
            return jnp.where(step <= t.warmup_steps, warm, t.lr)
        if t.schedule == "wsd":
            decay = t.decay_fraction * t.steps  # > 0: the config's check
            progress = jnp.clip((step - (t.steps - decay)) / decay, 0.0, 1.0)
            return jnp.where(step <= t.warmup_steps, warm, t.min_lr + (t.lr - t.min_lr) * (1.0 - jnp.sqrt(progress)))
        progress = jnp.clip((step - t.warmup_steps) / max(t.steps - t.warmup_steps, 1), 0.0, 1.0)
        cosine = t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step <= t.warmup_steps, warm, cosine)

    return schedule


def schedule_words(t) -> str:
    """What the learning rate of a config.TrainingConfig `t` does after its warm-up, in words."""
    if t.schedule == "constant":
        return f"the constant schedule holds {t.lr:.3g} after its warm-up"
    if t.schedule == "wsd":
        flat = math.floor(t.steps - t.decay_fraction * t.steps)  # the last step at t.lr, as lr_schedule computes it
        return (f"the wsd schedule now spans {t.steps:,} steps, flat until step {flat:,}, then down to {t.min_lr:.3g}")
    return f"the warm-up and cosine schedule now spans {t.steps} steps"


def decay_mask(params, decay_embeddings: bool):
    """True where weight decay applies: weight matrices; embeddings (wte, wpe) only if asked.

    Never LayerNorm parameters (`scale`, `bias`) nor any `bias`, whatever its shape (the fused
    qkv bias is 2-D).
    """

    def decide(path, x):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if {"wte", "wpe"} & set(names):
            return decay_embeddings
        return x.ndim >= 2 and names[-1] not in ("bias", "scale")

    return jax.tree_util.tree_map_with_path(decide, params)


def muon_dimensions(axes) -> dict:
    """For each parameter, given the tree of their logical axis names (logical_axes.param_axes' pure dict):
    the optax.contrib.MuonDimensionNumbers that make it a matrix for Muon, or None where AdamW trains it.

    Muon takes the blocks' weight matrices, every `kernel` under `blocks`. The axes a projection contracts
    with its input are the reduction axes: `embed` for those reading the residual stream (q, k, v, the
    MLP's up and gate), every axis but the last for those writing it (attention's output: heads and kv;
    the MLP's down: mlp); its other named axes are the output axes. An unnamed axis (the q/k/v index of a
    fused projection, k/v of grouped heads) is a batch axis: each projection is orthogonalized as its own
    matrix, as if unfused. Everything else (token and position embeddings, an untied head, norms, biases,
    LoRA's adapters) is None: Muon is for hidden matrices, whose inputs and outputs are both activations."""
    from optax.contrib import MuonDimensionNumbers

    def decide(path, names):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if keys[0] != "blocks" or keys[-1] != "kernel":
            return None
        if names[0] == "embed":
            return MuonDimensionNumbers((0,), tuple(i for i, n in enumerate(names) if i and n is not None))
        return MuonDimensionNumbers(tuple(range(len(names) - 1)), (len(names) - 1,))

    return jax.tree_util.tree_map_with_path(decide, axes, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(t, axes=None):
    """(optax transformation, lr schedule) for a config.TrainingConfig: clipping, then AdamW, or with
    training.optimizer=muon Muon on the blocks' matrices (muon_dimensions of the parameters' logical `axes`)
    and AdamW, as an AdamW run has it, on the rest. Both follow the one schedule.

    Muon is optax.contrib.muon with its Newton-Schulz iteration as published (5 steps of the quintic
    (3.4445, -4.775, 2.0315) on the Frobenius-normalised momentum) and these choices made explicitly:
    Nesterov momentum (training.muon_momentum, 0.95: Jordan et al.'s recipe); each update rescaled to an RMS of
    training.muon_rms (0.2, `consistent_rms`: Liu et al. 2025, "Muon is Scalable"), AdamW's typical RMS, so
    that one learning rate and one weight decay serve both; decoupled weight decay (training.weight_decay,
    times the rate, as optax.adamw's), which Liu et al. found Muon needs at scale. optax's Muon would also
    take every 2-D leaf (the embedding too) and give the others Adam with Muon's Nesterov flag: here
    optax.partition hands Muon only its matrices and keeps the AdamW the other leaves always had."""
    schedule = lr_schedule(t)
    clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip else optax.identity()
    adamw = optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                        mask=lambda p: decay_mask(p, t.decay_embeddings))
    from optax.contrib import MuonDimensionNumbers, muon

    is_dims = lambda x: x is None or isinstance(x, MuonDimensionNumbers)  # noqa: E731
    dims = muon_dimensions(axes) if t.optimizer == "muon" and axes is not None else None
    if dims is None or all(d is None for d in jax.tree.leaves(dims, is_leaf=is_dims)):
        return optax.chain(clip, adamw), schedule  # (a LoRA run: adapters alone, AdamW's)
    labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims, is_leaf=is_dims)
    by_path = {jax.tree_util.keystr(p): d for p, d in jax.tree_util.tree_flatten_with_path(dims, is_leaf=is_dims)[0]}

    def muon_dims(params):  # the matrices' dimension numbers, in the tree optax.partition hands Muon
        return jax.tree_util.tree_map_with_path(lambda p, _: by_path[jax.tree_util.keystr(p)], params)

    muon_tx = muon(schedule, beta=t.muon_momentum, nesterov=True, weight_decay=t.weight_decay,
                   consistent_rms=t.muon_rms, muon_weight_dimension_numbers=muon_dims)
    return optax.chain(clip, optax.partition({"muon": muon_tx, "adamw": adamw}, labels)), schedule


def make_loss(mcfg: model_lib.GPTConfig, loss_chunk: int = 0, lora=None):
    """(loss, abstract_vars): loss(params, tokens (B, T+1), weights=None, dropout_key=None, **masking) ->
    (mean next-token loss over counted tokens, their count) from a pure dict of params, traced inside
    jit; `masking` is the model's optional mask (an attention.Masking) and segment_ids (B, T). With
    loss_chunk > 0 the loss of more than loss_chunk tokens is computed loss_chunk tokens at a time
    (`GPT.loss`), never holding the whole float32 logits. abstract_vars holds the parameters' shapes and axis names.
    With `lora` (a config.LoRAConfig) the model carries adapters, and params are base and adapters together."""
    model_of, abstract_vars = _model_of(mcfg, lora)

    def loss(params, tokens, weights=None, dropout_key=None, **masking):
        return model_of(params).loss(tokens[:, :-1], tokens[:, 1:], weights, chunk=loss_chunk,
                                     dropout_key=dropout_key, **masking)

    return loss, abstract_vars


def _model_of(mcfg: model_lib.GPTConfig, lora=None):
    """(model_of, abstract_vars): model_of(params) is the GPT of a pure dict of params (inside jit: no memory of
    its own); abstract_vars the parameters' shapes and axis names, made without memory."""
    abstract_model = nnx.eval_shape(lambda: model_lib.GPT(mcfg, lora=lora, rngs=nnx.Rngs(0)))
    graphdef, abstract_vars = nnx.split(abstract_model)  # nnx.State of abstract Variables (with axis names)

    def model_of(params):
        variables = jax.tree.map(lambda v: v, abstract_vars)  # fresh Variables to fill
        nnx.replace_by_pure_dict(variables, params)
        return nnx.merge(graphdef, variables)

    return model_of, abstract_vars


def make_masked_loss(loss_fn, fcm_max_ratio: float = 0.0):
    """masked_loss(params, batch, dropout_key=None, fcm_key=None) -> (mean loss, counted tokens), from
    a `make_loss` function.

    batch is a prompt/completion dict {tokens, weights?, segments?}: attention stays inside each
    packed example, and with an fcm_key a random share of past keys is hidden (forgetful causal
    masking, up to fcm_max_ratio)."""

    def masked_loss(params, batch, dropout_key=None, fcm_key=None):
        tokens, segments = batch["tokens"], batch.get("segments")
        B, T = tokens.shape[0], tokens.shape[1] - 1
        mask = attention_lib.attention_mask(B, T, segment_ids=segments, fcm_key=fcm_key, fcm_max_ratio=fcm_max_ratio)
        return loss_fn(params, tokens, batch.get("weights"), dropout_key, mask=mask, segment_ids=segments)

    return masked_loss


def make_init_state(mcfg: model_lib.GPTConfig, tx, lora=None):
    """init_state(init_key, train_key) -> the training state, ready for jax.jit with out_shardings. With
    `lora`, its params are the new adapters alone (B zero; the base weights made here are dropped, so a
    jitted init never computes them)."""

    def init_state(init_key, train_key):
        params = nnx.to_pure_dict(nnx.state(model_lib.GPT(mcfg, lora=lora, rngs=nnx.Rngs(params=init_key))))
        if lora is not None:
            params = lora_lib.split(params)[1]
        return {
            "params": params,
            "opt_state": tx.init(params),
            "step": jnp.zeros((), jnp.int32),  # updates done; also the loader position
            "rng": jax.random.key_data(train_key),  # raw uint32 key data: checkpoints as a plain array
        }

    return init_state


def make_token_logps(mcfg: model_lib.GPTConfig, lora=None):
    """token_logps(params, tokens (B, T+1), dropout_key=None, **masking) -> float32 (B, T): each next token's
    log-probability under the model of the pure dict `params` (model.GPT.token_logps), traced inside jit."""
    model_of, _ = _model_of(mcfg, lora)

    def token_logps(params, tokens, dropout_key=None, **masking):
        return model_of(params).token_logps(tokens[:, :-1], tokens[:, 1:], dropout_key=dropout_key, **masking)

    return token_logps


def lm_objective(loss_fn, fcm_max_ratio: float = 0.0, joined=None):
    """objective(params, rows, dropout_key, frozen, fcm_key=None) -> (summed next-token loss, {"n": tokens counted})
    for make_train_step, from a `make_loss` function; `joined(params, frozen)` the full parameters (LoRA)."""
    masked_loss = make_masked_loss(loss_fn, fcm_max_ratio)

    def objective(params, rows, dropout_key, frozen, fcm_key=None):
        rows = rows if isinstance(rows, dict) else {"tokens": rows}  # plain tokens without FCM get no mask
        full = params if joined is None else joined(params, frozen)
        loss, n = masked_loss(full, rows, dropout_key, fcm_key)
        return loss * n, {"n": n}

    objective.sums = ("n",)  # the names of the sums it returns beside the loss
    return objective


def make_train_step(loss_fn, tx, micro_batches: int, grad_sharding=None, activations=None, fcm_max_ratio: float = 0.0,
                    schedule: Callable | None = None, objective=None):
    """train_step(state, batch) -> (state, {"loss", "grad_norm"}, and "lr" given the `schedule`), to be
    jitted by the caller; `loss_fn` is a `make_loss` function. The learning rate the update used comes
    back with the metrics, so that logging it asks the device for nothing more. For LoRA,
    train_step(state, batch, base): the loss sees base and adapters (state["params"]) joined, and only
    the adapters get gradients and updates.

    `objective(params, rows, dropout_key, frozen) -> (summed loss, {"n": count, other sums})`, whose
    attribute `sums` names those sums, replaces the
    next-token loss (lm_objective) where given, e.g. DPO's (dpo.make_objective), with train_step(state,
    batch, frozen): the loss is the sum over the batch divided by the summed count, and every other sum is
    a metric, divided by it too.

    Gradient accumulation over `micro_batches` pieces in a scan. `grad_sharding` (a pytree of
    shardings like the params, or None) constrains the gradients: at ZeRO stages 2 and 3 the
    data-parallel reduction becomes a reduce-scatter. `activations` is sharding.activation_rules(mesh).
    A batch is tokens, or a prompt/completion dict (loss weights, packed segments); with fcm_max_ratio > 0
    a share of past keys is masked. The loss is the mean over counted tokens of the whole batch.
    """
    M = micro_batches
    if objective is None:
        objective = lm_objective(loss_fn, fcm_max_ratio, joined=lambda p, base: p if base is None
                                 else lora_lib.join(base, p))
    fcm = fcm_max_ratio > 0

    def constrain_grads(grads):
        return grads if grad_sharding is None else jax.lax.with_sharding_constraint(grads, grad_sharding)

    def train_step(state, batch, frozen=None):
        if activations is None:
            return _train_step(state, batch, frozen)
        with logical_axes.activation_sharding(activations):
            return _train_step(state, batch, frozen)

    def _train_step(state, batch, frozen):
        params = state["params"]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        # micro-batch i takes rows i, i+M, i+2M, ...: every device's contiguous block of rows
        # splits into M pieces in place, so each micro-batch spans all data-parallel devices
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1), batch)  # (M, B/M, ...)

        def summed(p, rows, i):
            # FCM's key: fold_in(key, M + i) differs from every micro-batch's dropout key
            extra = {"fcm_key": jax.random.fold_in(key, M + i)} if fcm else {}
            return objective(p, rows, jax.random.fold_in(key, i), frozen, **extra)

        def accumulate(carry, xs):
            grads, loss_sum, sums = carry
            i, rows = xs
            (loss, aux), g = jax.value_and_grad(summed, has_aux=True)(params, rows, i)
            grads = constrain_grads(jax.tree.map(jnp.add, grads, constrain_grads(g)))
            return (grads, loss_sum + loss, jax.tree.map(jnp.add, sums, aux)), None

        zeros = (constrain_grads(jax.tree.map(jnp.zeros_like, params)), jnp.zeros((), jnp.float32),
                 {k: jnp.zeros((), jnp.float32) for k in objective.sums})
        (grads, loss_sum, sums), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(M), micro))
        n = sums["n"]
        with jax.named_scope("optimizer"):  # a profile's name for what follows the gradients
            grads = jax.tree.map(lambda g: g / n, grads)  # mean over every token (or pair) of the batch
            grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))  # before clipping
            updates, opt_state = tx.update(grads, state["opt_state"], params)
            new_params = optax.apply_updates(params, updates)
        new_state = {
            "params": new_params,
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": state["rng"],
        }
        metrics = {"loss": loss_sum / n, "grad_norm": grad_norm,
                   **{k: v / jnp.maximum(n, 1.0) for k, v in sums.items() if k != "n"}}
        if schedule is not None:
            metrics["lr"] = schedule(state["step"])
        return new_state, metrics

    return train_step


def state_shapes(mcfg: model_lib.GPTConfig, t, abstract_vars=None):
    """(abstract state, axes): the training state's shapes and dtypes, made without memory, and the
    logical axis names of its parameters, as sharding.state_shardings takes them. `abstract_vars`:
    make_loss's, if at hand (with training.lora: of the model with adapters, whose axes are returned)."""
    lora = t.lora
    if abstract_vars is None:
        _, abstract_vars = make_loss(mcfg, lora=lora)
    keys = jax.random.split(jax.random.key(0))  # shapes only: the seed changes no shape
    axes = nnx.to_pure_dict(logical_axes.param_axes(abstract_vars))
    if lora is not None:
        axes = lora_lib.split(axes)[1]
    tx, _ = make_optimizer(t, axes)
    return jax.eval_shape(make_init_state(mcfg, tx, lora), *keys), axes


def base_shapes(mcfg: model_lib.GPTConfig, lora, abstract_vars=None) -> tuple[dict, dict]:
    """(abstract base, axes) of a LoRA run's frozen base: its ShapeDtypeStructs in the dtypes it is held in
    (frozen_shapes) and the logical axis names of its parameters, the base model's own tree. `abstract_vars`:
    make_loss's (of the model with adapters), if at hand."""
    if abstract_vars is None:
        _, abstract_vars = make_loss(mcfg, lora=lora)
    base = lora_lib.split(nnx.to_pure_dict(abstract_vars))[0]
    axes = lora_lib.split(nnx.to_pure_dict(logical_axes.param_axes(abstract_vars)))[0]
    return frozen_shapes(base, lora.base_dtype), axes


def frozen_shapes(abstract_base, base_dtype):
    """The frozen base's ShapeDtypeStructs in the dtypes it is held in (training.lora.base_dtype): weight
    matrices and embeddings in base_dtype when it is set; norms and biases stay float32."""
    def held(path, x):
        name = getattr(path[-1], "key", None)
        keep = base_dtype is None or x.ndim < 2 or name in ("bias", "scale")
        return jax.ShapeDtypeStruct(x.shape, x.dtype if keep else model_lib.DTYPES[base_dtype])

    return jax.tree_util.tree_map_with_path(held, abstract_base)


# ---------------------------------------------------------------------------------------------
# Placed on a mesh and jitted


@dataclasses.dataclass(frozen=True)
class Built:
    """The jitted functions of a training run on a mesh, and the shardings they were built with."""

    init: Callable  # () -> the initial state, made directly in place (never whole on one device first)
    train_step: Callable  # (state, batch[, base]) -> (state, {"loss", "grad_norm", "lr"}); the state is donated
    eval_step: Callable  # (params, batch {tokens, weights[, segments]}[, base]) -> (summed loss, counted tokens)
    all_finite: Callable  # (tree) -> whether every element is finite
    schedule: Callable  # optax count -> learning rate
    abstract_state: dict  # shapes, dtypes and shardings of the state: what a checkpoint restores into
    state_sharding: dict
    batch_sharding: jax.sharding.NamedSharding
    description: str  # the mesh and how much of params and optimizer state each device holds
    loss_chunk: int  # training.loss_chunk resolved: tokens per device the loss takes at a time, 0 = all
    # LoRA only: the frozen base's shapes and dtypes (training.lora.base_dtype), and its shardings
    abstract_base: dict | None = None
    base_sharding: dict | None = None
    # what the steps' third argument is: None, "base" (LoRA's frozen base) or "reference" (DPO's frozen copy of
    # init_from's model, where its log-probabilities are computed in each step)
    frozen_kind: str | None = None
    # DPO: (LoRA's base or the reference's params, pair batch) -> the reference's (B, 2, K) log-probabilities
    reference_step: Callable | None = None

    def place_base(self, params: dict) -> dict:
        """The base model's parameters (numpy, float32: weights.Weights.load_params's) in their dtypes, placed."""
        dtypes = jax.tree.map(lambda a: a.dtype, self.abstract_base)
        cast = jax.tree.map(lambda x, d: np.asarray(x).astype(d, copy=False), params, dtypes)
        return jax.device_put(cast, self.base_sharding)


_BUILT: collections.OrderedDict = collections.OrderedDict()  # the last few builds, by their arguments
_KEEP_BUILT = 4


def build(mcfg: model_lib.GPTConfig, t, mesh, zero_stage: int, seed: int = 0) -> Built:
    """Everything a run on `mesh` at `zero_stage` executes, for the model `mcfg` and the
    config.TrainingConfig `t`: the model's shapes first (no memory), then the shardings from
    sharding.py's rules, then jax.jit with them. Checks that tensor parallelism divides the model.
    The same arguments in one process give the same Built (the last few are kept), whose jitted
    functions are compiled already: a second run of one config in a process (a resume after a stop,
    an evaluation beside training) does not compile again."""
    sharding_lib.check_model(mesh, mcfg.axis_sizes)
    key = (repr(mcfg), repr(t), mesh, zero_stage, seed)
    if key in _BUILT:
        _BUILT.move_to_end(key)
        return _BUILT[key]
    built = _build(mcfg, t, mesh, zero_stage, seed)
    _BUILT[key] = built
    while len(_BUILT) > _KEEP_BUILT:
        _BUILT.popitem(last=False)
    return built


def _build(mcfg: model_lib.GPTConfig, t, mesh, zero_stage: int, seed: int) -> Built:
    # the model's shapes and axis names, no memory; training.loss_chunk counts one device's tokens,
    # so the loss's chunk over the whole (micro-)batch is that many on every data-parallel device
    dp = sharding_lib.axis_size(mesh, sharding_lib.BATCH_AXES)
    chunk = loss_chunk(mcfg, t, mesh)
    lora = t.lora
    loss_fn, abstract_vars = make_loss(mcfg, chunk * dp, lora)
    abstract_state, axes = state_shapes(mcfg, t, abstract_vars)
    tx, schedule = make_optimizer(t, axes)
    init_key, train_key = jax.random.split(seeds.key_of(seed))
    init_state = make_init_state(mcfg, tx, lora)
    state_sharding, grad_sharding, fallbacks = sharding_lib.state_shardings(abstract_state, axes, mesh, zero_stage)
    abstract_base = base_sharding = None
    if lora is not None:  # the frozen base: placed as the params of a full run at this ZeRO stage would be
        abstract_base, base_axes = base_shapes(mcfg, lora, abstract_vars)
        base_sharding = sharding_lib.state_shardings({"params": abstract_base, "opt_state": {}}, base_axes, mesh,
                                                     zero_stage)[0]["params"]
    frozen = () if lora is None else (base_sharding,)
    batch_sharding = sharding_lib.batch_sharding(mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    activations = sharding_lib.activation_rules(mesh)
    objective = reference_step = None
    frozen_kind = None if lora is None else "base"
    if t.objective == "dpo":  # the reference: LoRA's base with its adapters off, else a frozen copy (or precomputed)
        dpo = t.dpo_settings
        token_logps = make_token_logps(mcfg, lora)
        if lora is not None:
            joined = lambda p, base: lora_lib.join(base, p)  # noqa: E731
            reference_of = lambda p, base: lora_lib.join(base, jax.tree.map(jnp.zeros_like, p))  # noqa: E731
        else:
            joined = lambda p, _: p  # noqa: E731
            reference_of = lambda _, reference: reference  # noqa: E731
            if not dpo.precompute_reference:  # the reference's parameters, placed as the params are
                frozen, frozen_kind = (state_sharding["params"],), "reference"
        objective = dpo_lib.make_objective(token_logps, dpo, joined, reference_of)
        adapters = abstract_state["params"]

        @functools.partial(jax.jit, in_shardings=(frozen[0] if frozen else state_sharding["params"], batch_sharding),
                           out_shardings=replicated)
        def reference_step(weights, batch):
            """The reference's (B, 2, K) log-probabilities of a pair batch (precompute_reference): `weights` is
            LoRA's base, or else the reference's own parameters."""
            with logical_axes.activation_sharding(activations):
                if lora is not None:
                    weights = lora_lib.join(weights, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), adapters))
                return dpo_lib.sequence_logps(token_logps, weights, batch)[0]
    # gradient accumulation over micro-batches inside one jitted, state-donating step; at ZeRO stages
    # 2 and 3 the gradients' shardings make the data-parallel reduction a reduce-scatter
    train_step = make_train_step(loss_fn, tx, t.micro_batches, grad_sharding, activations,
                                 fcm_max_ratio=t.fcm_max_ratio, schedule=schedule, objective=objective)
    masked_loss = make_masked_loss(loss_fn)  # validation: no FCM

    @functools.partial(jax.jit, in_shardings=(state_sharding["params"], batch_sharding, *frozen),
                       out_shardings=replicated)
    def eval_step(params, batch, frozen=None):
        """Summed loss and count of a validation batch: no dropout, no FCM; segments kept apart. DPO: the
        summed loss, the pairs, and the summed reward accuracy."""
        with logical_axes.activation_sharding(activations):
            if objective is not None:
                loss, sums = objective(params, batch, None, frozen)
                return jnp.stack([loss, sums["n"], sums["rewards/accuracies"]])
            loss, n = masked_loss(params if frozen is None else lora_lib.join(frozen, params), batch)
        return loss * n, n

    # the initial state's program runs once: on the CPU compiled without LLVM's optimisations, which take
    # most of its compile time (seconds, even for a small model) and buy nothing for one run
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None

    @functools.cache
    def compiled_init():
        return jax.jit(init_state, out_shardings=state_sharding).lower(init_key, train_key).compile(options)

    return Built(
        init=lambda: compiled_init()(init_key, train_key),
        train_step=jax.jit(train_step, donate_argnums=0, in_shardings=(state_sharding, batch_sharding, *frozen),
                           out_shardings=(state_sharding, replicated)),
        eval_step=eval_step, all_finite=_all_finite(mesh), schedule=schedule,
        abstract_state=sharding_lib.with_shardings(abstract_state, state_sharding),
        state_sharding=state_sharding, batch_sharding=batch_sharding,
        description=sharding_lib.describe(abstract_state, state_sharding, mesh, zero_stage, fallbacks)
        + ("" if lora is None else "\n" + describe_base(abstract_base, base_sharding, mesh, lora)),
        loss_chunk=chunk, abstract_base=abstract_base, base_sharding=base_sharding,
        frozen_kind=frozen_kind, reference_step=reference_step,
    )


@functools.lru_cache(maxsize=8)
def _all_finite(mesh):
    """(tree) -> whether every element is finite, replicated on `mesh`: one jitted function per mesh, so
    that its compilations (one per tree structure) serve every build."""
    @functools.partial(jax.jit, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    def all_finite(tree):
        return jnp.all(jnp.asarray([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))

    return all_finite


def describe_base(abstract_base, base_sharding, mesh, lora) -> str:
    """One line: the frozen base of a LoRA run, its dtype and bytes per device."""
    total, per_device, sharded = sharding_lib.sharded_bytes(abstract_base, base_sharding, mesh)
    return (f"  base (frozen, {lora.base_dtype or 'float32'}): {sharded / max(total, 1):.1%} of "
            f"{total / 2**20:.2f} MiB sharded; {per_device / 2**20:.2f} MiB per device; LoRA rank {lora.rank} on "
            f"{', '.join(lora.targets)}")


def loss_chunk(mcfg: model_lib.GPTConfig, t, mesh, memory: float | None = None) -> int:
    """training.loss_chunk resolved for this run (loss.resolve_chunk): tokens per device at a time, 0 for
    the whole logits. `memory`: one device's bytes (default: what the mesh's first device reports)."""
    dp = sharding_lib.axis_size(mesh, sharding_lib.BATCH_AXES)
    tokens = t.batch_size // t.micro_batches // dp * (t.seq_len or mcfg.block_size)
    vocab = mcfg.padded_vocab_size // mesh.shape["tensor"]
    if memory is None and t.loss_chunk == "auto" and isinstance(mesh, jax.sharding.Mesh):  # not an AbstractMesh
        # this process's own device (another process's cannot be asked); every process must decide alike,
        # as they compile one program: a mesh's devices are of one kind, with one memory
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        stats = local[0].memory_stats() if local else None
        memory = (stats or {}).get("bytes_limit")
    return loss_lib.resolve_chunk(t.loss_chunk, tokens, vocab, np.dtype(model_lib.DTYPES[mcfg.dtype]).itemsize, memory)
