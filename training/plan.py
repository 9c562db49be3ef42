"""Know before you book: a training config's memory per device, tokens, FLOPs and step time on a
target device, in seconds on a CPU, without devices, data or a run directory.

    python train.py --plan [--device H100] [--devices 8] [--mfu 0.4] [key=value ...]

    config ──step.state_shapes──> abstract state {params, opt_state, step, rng} (eval_shape: no memory)
           ──sharding.abstract_mesh + state_shardings──> bytes per device of parameters, gradients and
             optimizer state: exact, from the same rules table and ZeRO stage the run would use
           ──the activation model below──> activations, logits and loss, attention temporaries
    total per device ──against the device's memory──> a verdict, and when it does not fit the cheapest
    changes that do (ZeRO stage, micro-batches, remat, tensor parallelism, LoRA for a fine-tuning run,
    batch size), each with its total

The state terms are exact byte counts. The rest is a model of what XLA keeps at the peak of a
training step, per device and per micro-batch of b sequences of T tokens, in the compute dtype
(c bytes) unless float32 is named; its constants were measured on XLA's own figures for this
project's jitted step (test_plan.py; bench/RESULTS.md compares it with the peaks measured on a GPU):

    kept for the backward pass, per block (remat none):
        each norm: its centred and normalised input in float32 (Flax normalises in float32) and its
            output:                                                     (2 x 4 + c) B T d
        q, k, v and the attended values:                                (2H + 2K) D' B T c
            (D' the head size the attention keeps them at: D for xla, the fused kernels' padded copies:
            cudnn with ALiBi D + 4 to a multiple of 8, splash D (+ 4 with ALiBi) to 128, pallas D to a
            power of two)
        the MLP's pre-activation, activation and part of its
            intermediates (2.5 tensors of its input projections' width): 2.5 F' B T c
        the attention's softmax: probabilities in float32, and their copy in a narrower compute dtype
            for the product with v (xla, dot_product):                   H B T^2 (4 + c)
            only its row statistics (cudnn, pallas, splash):             H B T 4
        the compute-dtype copy of the block's weights (gathered at ZeRO stage 3), when c < 4:
                                                                        block parameters x c
        with model.fp8, the float8 copy of each projection's input, which the gradients' products read
            again (the norms' outputs, the attended values, the MLP's activation), counted on top of the
            compute-dtype activations (which a GPU's FP8 GEMMs may leave unread):  (norms d + H D + F) B T
            and, instead of their compute-dtype copy, the projections' weights quantized: in float8 on a
            GPU (what its FP8 GEMMs read), elsewhere dequantized in the compute dtype, float32 included:
                                                                        projection weights x (1 | c)
    remat full keeps only each block's input, B T d c; remat save_matmuls the block's input, q, k, v,
        the attention's output projection and the MLP's input projections ((H + 2K) D + d + F') B T c.
        Either recomputes one block at a time in the backward pass: one block's "none" set on top.
    attention temporaries, one block's backward: the gradients of the probabilities and the scores,
        2 H B T^2 float32 (xla, dot_product), and a (B, T, T) bool mask for masked batches (packed
        examples, FCM); the fused kernels (cudnn, pallas, splash) none: their blocks live in on-chip
        memory, and a masked batch is two (B, T) vectors of segment ids
    logits and loss: the float32 logits and their gradient in the compute dtype, B T V (4 + c); with
        a chunked loss (training.loss_chunk) one chunk's float32 logits and gradient (and its copy in a
        narrower compute dtype) at a time, the (B, T, d) float32 gradient of the hidden states, and
        the head in a narrower compute dtype (the head's gradient is the gradients' term); under remat
        the chunk is gone before the first block is recomputed, so it counts only by what it exceeds
        the recomputed block and its attention temporaries (with the whole logits, the compiler keeps
        them through the blocks' backward pass: they count whole)
    gradients: float32, as sharded at the ZeRO stage: one copy; with micro-batches two, the
        accumulator and the micro-batch's own (measured on the compiled step at ZeRO 0: one more copy
        whatever the number of micro-batches; at ZeRO 2 the CPU compiler held 1.2-2.3 sharded copies
        more, the unreduced gradient of the caveat below)

d width, H query and K key/value heads of size D, F' the MLP's input projection width (2F for
SwiGLU's gate and up), V the padded vocabulary; everything over the tensor axis but the norms, the
block inputs and outputs is split by it, and so are the vocabulary and its logits. At ZeRO stage 3
one block's gathered weights (and the output embedding) are a transient on top. The total is the
sum of the terms.

LoRA (training.lora): the parameters, gradients and optimizer state are the adapters' (float32, exact as
for full training), and the frozen base is a term of its own: its weights in training.lora.base_dtype (norms
and biases float32), placed as a full run's parameters at the ZeRO stage, with no compute-dtype copy when it
is held in the compute dtype. Activations are counted as for full training, plus each adapter's dropped input
when training.lora.dropout > 0; against XLA's CPU compiled step (float32, two sizes) that is -31% to +17%
without remat and -4% to +46% under remat full: the step keeps less where few projections are adapted (a
frozen projection's input is not needed for a gradient) and more where all are. Its FLOPs: 4N + 6LdT + 6 per
adapter parameter (no weight gradients of the base). Where fine-tuning (training.init_from) does not fit,
LoRA on a base held in the compute dtype is among the changes offered.

Measured errors, against XLA's temporary memory for the compiled step on the CPU (float32, xla
attention; three sizes, and tensor parallelism with micro-batches: test_plan.py): -5% to +4% with
remat none (0% to +11% with the loss 256 tokens at a time); -10% to +11% under remat full and
save_matmuls (-11% to +14% with the loss in chunks). Against the peaks measured on an H100 without
remat: -1% to +15% (bench/RESULTS.md). With model.fp8 (three sizes, float32 and bfloat16, each remat
policy): -16% to +13% against the CPU's compiled step, which runs the products on dequantized copies,
where the same configurations without FP8 are -17% to +19%; the GPU's FP8 GEMMs are still to be
measured. The model assumes a memory-minimising accelerator schedule:
each block recomputed and its activations freed as the backward pass reaches it (under remat
remat.py pins this with optimization barriers, which the GPU compiler keeps until it has scheduled
and the CPU compiler drops before; TPUs unmeasured), and the gradients reduced (at ZeRO stages 2
and 3 scattered) as they are made (in a configuration dominated by parameters rather than
activations, the CPU compiler was measured holding the whole unreduced gradient at stages 2 and 3,
up to 50% above the plan).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import typing

import jax
import numpy as np

import model as model_lib
import sharding as sharding_lib
from core import storage
from core.errors import ConfigError
from layers import attention as attention_lib
from layers import loss as loss_lib
from tokendata import mixture
from training import config as config_lib
from training import step as step_lib
from training import devices
from training.devices import GiB, Target, target

# ----------------------------------------------------------------------------------------------
# The memory model


@dataclasses.dataclass
class Estimate:
    """Bytes per device of each term (`terms`, in print order), and what they were computed for."""

    terms: dict[str, float]
    notes: dict[str, str]  # term -> what it is made of, for the printout
    memory: float
    mesh: dict[str, int]
    micro_rows: int  # sequences per device per micro-batch
    attention: str  # the attention implementation on the target backend
    fallbacks: list[str]

    @property
    def total(self) -> float:
        return sum(self.terms.values())


_STATES: dict = {}  # by model and training config: a plan's changes and a table of plans share their shapes


def _state_of(cfg) -> "_State":
    key = (repr(cfg.model), repr(cfg.training))
    if key not in _STATES:
        if len(_STATES) >= 16:
            _STATES.clear()
        _STATES[key] = _State(cfg)
    return _STATES[key]


class _State:
    """The training state's shapes and the params' axis names, made once per model and optimizer; with
    training.lora, the state is the adapters' and the model's weights are the frozen base's, in the dtypes
    it is held in."""

    def __init__(self, cfg):
        self.lora = cfg.training.lora
        self.abstract, self.axes = step_lib.state_shapes(cfg.model, cfg.training)
        if self.lora is None:
            self.weights, self.weight_axes = self.abstract["params"], self.axes
        else:
            self.weights, self.weight_axes = step_lib.base_shapes(cfg.model, self.lora)

    def placed(self, mesh, zero_stage: int):
        """Per-device bytes {params, grads, opt_state (with step and rng), base (a LoRA run's frozen base,
        else 0), blocks (the blocks' weights as tensor parallelism alone splits them), head (the output
        embedding, likewise), blocks_f32 and head_f32 (the same were they float32), and kernels_f32 (the
        blocks' projection weights alone, float32)}, and the weights that a ZeRO rule could not split evenly."""
        shardings, grad_shardings, fallbacks = sharding_lib.state_shardings(self.abstract, self.axes, mesh, zero_stage)
        per_device = lambda tree, sh: sharding_lib.sharded_bytes(tree, sh, mesh)[1]  # noqa: E731
        f32 = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), tree)  # noqa: E731
        none = jax.ShapeDtypeStruct((0,), np.float32)  # a leaf of no bytes, keeping the tree's structure
        kernels = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731
            lambda path, x: x if path[-1].key == "kernel" else none, tree)
        weights = {"params": self.weights, "opt_state": {}}
        tensor_only = sharding_lib.state_shardings(weights, self.weight_axes, mesh, 0)[0]["params"]
        base = 0
        if self.lora is not None:  # placed as a full run's params at this ZeRO stage
            base_sharding, _, more = sharding_lib.state_shardings(weights, self.weight_axes, mesh, zero_stage)
            base, fallbacks = per_device(self.weights, base_sharding["params"]), fallbacks + more
        params, w = self.abstract["params"], self.weights
        head = "wte" if w.get("lm_head") is None else "lm_head"
        return {
            "params": per_device(params, shardings["params"]),
            "grads": per_device(params, grad_shardings),
            "opt_state": sum(per_device(self.abstract[k], shardings[k]) for k in ("opt_state", "step", "rng")),
            "base": base,
            "blocks": per_device(w["blocks"], tensor_only["blocks"]),
            "blocks_f32": per_device(f32(w["blocks"]), tensor_only["blocks"]),
            "head": per_device(w[head], tensor_only[head]),
            "head_f32": per_device(f32(w[head]), tensor_only[head]),
            "kernels_f32": per_device(kernels(f32(w["blocks"])), tensor_only["blocks"]),
        }, fallbacks


def _dropped_inputs(m, lora, tp: int) -> int:
    """The width, per token and device, of the inputs that LoRA's dropout drops for the adapters of one
    block (each adapted projection draws its own: the q/k/v weights take the block's width, the attention's
    output projection the heads', the MLP's the width and, for its output projection, the MLP's)."""
    targets = set(lora.targets)
    if m.kv_heads == m.num_head:  # one fused q/k/v weight
        width = m.embedding_dim if targets & {"q", "k", "v"} else 0
    else:  # q, and k with v
        width = m.embedding_dim * (("q" in targets) + bool(targets & {"k", "v"}))
    if "o" in targets:
        width += m.num_head * m.head_dim // tp
    if "mlp" in targets:
        width += m.embedding_dim * (2 if m.activation == "swiglu" else 1) + m.ffn_dim // tp
    return width


def _kernel_head(impl: str, m) -> float:
    """The head size of the q, k, v and output a step keeps for the attention's backward pass: the
    fused kernels' padded copies (cudnn: ALiBi's columns, a multiple of 8; splash: q and k in whole
    128-lane tiles; pallas: a power of two), the model's own otherwise."""
    from layers import alibi_dims
    D = m.head_dim
    if impl == "cudnn" and m.alibi_attn:
        return alibi_dims.padded_dim(D, model_lib.DTYPES[m.dtype], attention_lib.CUDNN_MULTIPLE)
    if impl == "splash":  # q and k as splash.qk_width says, v and the output at D: their mean for all four
        from layers import splash
        return (splash.qk_width(D, model_lib.DTYPES[m.dtype], m.alibi_attn) + D) / 2
    if impl == "pallas":
        return 1 << (D - 1).bit_length()
    return D


def estimate(cfg, dev: Target, state: _State | None = None) -> Estimate:
    """The memory per device of training `cfg` (a config.Config) on `dev`; `state`: a _State of the
    same model and optimizer, to reuse. Raises sharding.ShardingError for a mesh, batch or tensor
    split that does not divide."""
    m, t, sh = cfg.model, cfg.training, cfg.sharding
    mesh = sharding_lib.abstract_mesh(sh.data, sh.fsdp, sh.tensor, n=dev.count)
    sharding_lib.check_model(mesh, m.axis_sizes)
    sharding_lib.check_batch(mesh, t.batch_size, t.micro_batches)
    state = state or _state_of(cfg)
    placed, fallbacks = state.placed(mesh, sh.zero_stage)

    tp = mesh.shape["tensor"]
    dp = sharding_lib.axis_size(mesh, sharding_lib.BATCH_AXES)
    # one device's micro-batch, in sequences (DPO: a row's chosen and rejected sides)
    B, T = t.batch_size // t.micro_batches // dp * cfg.sequences_per_row, cfg.seq_len
    d, H, K, D, F, N, V = (m.embedding_dim, m.num_head, m.kv_heads, m.head_dim, m.ffn_dim, m.N,
                           m.padded_vocab_size)
    F_in = 2 * F if m.activation == "swiglu" else F  # the MLP's input projections: SwiGLU's gate and up
    c = np.dtype(model_lib.DTYPES[m.dtype]).itemsize
    lora = t.lora
    masked = t.fcm_max_ratio > 0  # FCM: a masked batch (fine-tuning data is masked too; the plan does not read data)
    impl = attention_lib.resolve_attention(m, dev.backend, masked=masked, length=T)
    D_kernel = _kernel_head(impl, m)  # the head size the kernel's saved q, k, v and output have
    norms = 1 if m.residual == "parallel_shared" else 2
    BT = B * T
    narrow = c < 4
    held = np.dtype(model_lib.DTYPES[lora.base_dtype]).itemsize if lora is not None and lora.base_dtype else 4
    copies = c < held  # the weights' compute-dtype copies exist (not when a LoRA base is held in that dtype)
    block_copies = placed["blocks_f32"] / N * c / 4 if copies else 0.0  # one block's weights in the compute dtype
    if m.fp8:  # its projections' weights quantized instead: float8 on a GPU (what its FP8 GEMMs read), else dequantized
        kernels = placed["kernels_f32"] / N / 4  # one block's projection weights on a device
        block_copies += kernels * (1 if dev.backend == "gpu" else c) - (kernels * c if copies else 0)

    # one block's activations kept for the backward pass without remat (the module docstring's table)
    softmax = H / tp * B * T * T * (4 + (c if narrow else 0)) if impl in ("xla", "dot_product") else H / tp * BT * 4
    none_block = (norms * (2 * 4 + c) * BT * d + (2 * H + 2 * K) * D_kernel / tp * BT * c + 2.5 * F_in / tp * BT * c
                  + softmax + block_copies)
    if m.fp8:  # the float8 copies of the projections' inputs (the norms' outputs, the attended values, the activation)
        none_block += (norms * d + (H * D + F) / tp) * BT
    if lora is not None and lora.dropout > 0:  # each adapter's dropped input, kept for its A's gradient
        none_block += _dropped_inputs(m, lora, tp) * BT * c
    if m.remat == "none":
        kept, recomputed = N * none_block, 0.0
        kept_note = f"{N} blocks, all of each block's"
    elif m.remat == "full":
        kept, recomputed = N * BT * d * c, none_block
        kept_note = f"{N} block inputs"
    else:  # save_matmuls: the block input and the outputs of its weight matrices but the last
        kept, recomputed = N * ((H + 2 * K) * D / tp + d + F_in / tp + d) * BT * c, none_block
        kept_note = f"{N} blocks' inputs and weight-matrix outputs"

    if impl in ("xla", "dot_product"):
        attention = 2 * H / tp * B * T * T * 4
        attention += B * T * T if masked else 0  # the reference's bool (B, T, T) mask
    else:  # the fused kernels: their blocks live on chip; a mask is two (B, T) id vectors
        attention = 0.0

    chunk = step_lib.loss_chunk(m, t, mesh, memory=dev.memory)  # tokens per device at a time
    layout = loss_lib.chunk_layout(B, T, chunk)
    if layout is not None:  # chunked: one chunk's float32 logits and gradient at a time, as loss.py cuts them
        rows = layout[1]  # positions of each row in a chunk
        # the chunk's logits (float32), their gradient (float32, and in a narrower compute dtype), the
        # hidden states' gradient kept for the backward pass (B, T, d) float32, and the head in a narrower
        # compute dtype; the head's float32 gradient is the gradients' own term
        chunk_logits = B * rows * V / tp * (4 + 4 + (c if narrow else 0))
        logits_note = f"{B * rows} tokens' logits at a time (training.loss_chunk {chunk})"
        if recomputed:  # the loss is done before the first block is recomputed: only the larger phase counts
            chunk_logits = max(0.0, chunk_logits - recomputed - attention)
            if not chunk_logits:
                logits_note = f"the hidden states' gradient; {B * rows}-token chunks of logits reuse the recomputed block's"
        logits = chunk_logits + BT * d * 4 + (placed["head_f32"] * c / 4 if copies else 0)
    else:
        logits = BT * V / tp * (4 + c)
        logits_note = f"({B}, {T}, {V // tp}) float32, and their gradient"

    grads = placed["grads"] * (2 if t.micro_batches > 1 else 1)
    terms = {
        "parameters": placed["params"],
        "frozen base": placed["base"],
        "gradients": grads,
        "optimizer state": placed["opt_state"],
        "activations kept for the backward pass": kept,
        "one block recomputed in the backward pass": recomputed,
        "logits and loss": logits,
        "attention temporaries": attention,
    }
    notes = {
        "parameters": "float32",
        "gradients": "float32" + (": the accumulator and a micro-batch's own" if t.micro_batches > 1 else ""),
        "optimizer state": ("Muon's momentum of the block matrices, AdamW's two moments of the rest, float32"
                            if t.optimizer == "muon" else "AdamW moments, float32"),
        "frozen base": f"LoRA: the base's weights in {lora.base_dtype or 'float32'}, no gradients or moments"
        if lora is not None else "",
        "activations kept for the backward pass": f"remat {m.remat}: {kept_note}",
        "one block recomputed in the backward pass": f"remat {m.remat}",
        "logits and loss": logits_note,
        "attention temporaries": ("one block's score gradients, float32" + (", the mask" if masked else "")
                                  if impl in ("xla", "dot_product") else f"none: {impl}'s blocks are on chip"),
    }
    if sh.zero_stage == 3:  # gathered where a layer uses them: one block's and the output embedding, plus copies
        terms["ZeRO-3 gathered weights"] = (placed["blocks"] / N + placed["head"] + block_copies
                                            + (placed["head_f32"] * c / 4 if copies else 0))
        notes["ZeRO-3 gathered weights"] = "one block's and the output embedding's"
    if t.objective == "dpo" and lora is None and not t.dpo_settings.precompute_reference:
        terms["DPO reference model"] = placed["params"]  # init_from's parameters, frozen, placed as the params are
        notes["DPO reference model"] = "init_from's weights, float32, frozen (precompute_reference: none)"
    if lora is not None:
        notes["parameters"] = f"float32: the adapters (LoRA rank {lora.rank} on {', '.join(lora.targets)})"
        notes["gradients"] = notes["gradients"].replace("float32", "float32, the adapters'", 1)
        notes["optimizer state"] = "AdamW moments of the adapters, float32"
    else:
        del terms["frozen base"]
    if not recomputed:
        del terms["one block recomputed in the backward pass"]
    return Estimate(terms, notes, dev.memory, dict(mesh.shape), B, impl, fallbacks)


# ----------------------------------------------------------------------------------------------
# Verdict, alternatives, report

TIGHT = 0.9  # above this share of the memory the model's own error (about 10%) decides
JAX_GPU_SHARE = 0.75  # what JAX preallocates of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise


def verdict(e: Estimate) -> str:
    share = e.total / e.memory
    if share <= TIGHT:
        return f"fits: {e.total / GiB:.1f} of {e.memory / GiB:.1f} GiB ({share:.0%})"
    if share <= 1:
        return f"tight: {e.total / GiB:.1f} of {e.memory / GiB:.1f} GiB ({share:.0%}), within the estimate's error"
    return f"does not fit: {e.total / GiB:.1f} GiB needed, {e.memory / GiB:.1f} GiB per device ({share:.0%})"


def _apply(cfg, parts: dict):
    """cfg with {section: {field: value}} replaced (sections: model, training, sharding)."""
    new = dataclasses.replace(cfg)
    for name, fields in parts.items():
        setattr(new, name, dataclasses.replace(getattr(cfg, name), **fields))
    return new


def _changes(cfg):
    """(kind, label, parts) for each single change, cheapest first: a higher ZeRO stage
    (communication only), more micro-batches (the same work in smaller pieces), rematerialisation
    (save_matmuls recomputes attention and elementwise work, full about a forward pass), tensor
    parallelism (communication in every block), a smaller batch (a different training run)."""
    m, t, sh = cfg.model, cfg.training, cfg.sharding
    for stage in range(sh.zero_stage + 1, 4):
        yield "zero", f"sharding.zero_stage={stage}", {"sharding": {"zero_stage": stage}}
    micro = t.micro_batches * 2
    while micro <= t.batch_size:
        if t.batch_size % micro == 0:
            yield "micro", f"training.micro_batches={micro}", {"training": {"micro_batches": micro}}
        micro *= 2
    for remat in ("save_matmuls", "full")[1 if m.remat == "save_matmuls" else 0:]:
        if m.remat != "full":
            yield "remat", f"model.remat={remat}", {"model": {"remat": remat}}
    tensor = max(sh.tensor, 1) * 2
    while tensor <= m.num_head:
        label = f"sharding.tensor={tensor}" + (" sharding.data=-1" if sh.data != -1 else "")
        yield "tensor", label, {"sharding": {"data": -1, "fsdp": 1 if sh.fsdp == -1 else sh.fsdp, "tensor": tensor}}
        tensor *= 2
    if t.init_from and t.lora is None:  # fine-tuning: low-rank adapters on a frozen base held in the compute dtype
        lora = config_lib.LoRAConfig(base_dtype=None if m.dtype == "float32" else m.dtype)
        label = "training.lora.rank=8" + (f" training.lora.base_dtype={m.dtype}" if lora.base_dtype else "")
        yield "lora", label, {"training": {"lora": lora}}
    batch = t.batch_size // 2
    while batch >= t.micro_batches and batch % t.micro_batches == 0:
        yield "batch", f"training.batch_size={batch}", {"training": {"batch_size": batch}}
        batch //= 2


def alternatives(cfg, dev: Target, state: _State, limit: int = 4) -> tuple[list[tuple[str, Estimate]], bool]:
    """Up to `limit` single changes that fit, cheapest first. When none does, one combination: the
    strongest change of each kind but the batch size, then, costliest kind first, each as cheap as
    the others allow (or none). Returns (changes, whether they are one combination); no changes when
    even the strongest combination does not fit."""
    base = estimate(cfg, dev, state)
    states = {repr(cfg.training.lora): state}  # by LoRA config: a change may add adapters

    def planned(parts) -> Estimate | None:
        new = _apply(cfg, parts)
        try:
            if repr(new.training.lora) not in states:
                states[repr(new.training.lora)] = _state_of(new)
            return estimate(new, dev, states[repr(new.training.lora)])
        except sharding_lib.ShardingError:
            return None  # does not divide: not a candidate

    def fits(e):
        return e is not None and e.total <= TIGHT * e.memory

    options = collections.defaultdict(list)  # kind -> [(label, parts, estimate)] that save memory
    found = []
    for kind, label, parts in _changes(cfg):
        e = planned(parts)
        if e is None or e.total >= base.total:
            continue
        options[kind].append((label, parts, e))
        if fits(e) and len(found) < limit:
            found.append((label, e))
    if found:
        return found, False

    def merged(chosen):
        parts = collections.defaultdict(dict)
        for _, p, _ in chosen.values():
            for section, fields in p.items():
                parts[section].update(fields)
        return dict(parts)

    chosen = {kind: opts[-1] for kind, opts in options.items() if kind != "batch"}  # the strongest of each
    if not fits(planned(merged(chosen))):
        return [], True
    for kind in reversed(list(chosen)):  # then the costlier kinds first as cheap as the others allow, or left out
        for option in [None, *options[kind]]:
            trial = {k: v for k, v in chosen.items() if k != kind}
            if option is not None:
                trial[kind] = option
            if fits(planned(merged(trial))):
                chosen = trial
                break
    e = planned(merged(chosen))
    order = [kind for kind, _, _ in _changes(cfg)]
    return [(" ".join(chosen[kind][0] for kind in sorted(chosen, key=order.index)), e)], True


def check_fits(cfg, dev: Target) -> None:
    """A start that this machine cannot hold is refused before anything is made (a ConfigError in one
    line): the plan's total per device past the device's memory, with the cheapest change that fits, as
    `train.py --plan` names it. Within the estimate's error (up to the memory) it goes ahead."""
    state = _state_of(cfg)
    e = estimate(cfg, dev, state)
    if e.total <= e.memory:
        return
    options, combined = alternatives(cfg, dev, state, limit=1)
    fix = (f"{'together ' if combined else ''}{options[0][0]} fits ({options[0][1].total / GiB:.1f} GiB)" if options
           else "no change of ZeRO stage, micro-batches, remat, tensor parallelism or batch size fits: more devices "
                "or a smaller model are needed")
    raise ConfigError(f"model {cfg.model_name} with batch {cfg.training.batch_size} x {cfg.seq_len} needs about "
                      f"{e.total / GiB:.1f} GiB per device, more than the {e.memory / GiB:.1f} GiB of {dev.label}; "
                      f"{fix} (" + ("python train.py --plan --device cpu shows this machine's plan)" if dev.backend == "cpu"
                                   else "train.py --plan shows the plan)"))


def run(args, new_config: typing.Callable) -> int:
    """`train.py --plan`: the configured run's memory per device, tokens, FLOPs and step time on --device
    (`args`: train.py's parsed command line; `new_config(path, overrides)`: the config a new run would
    have). JAX runs on the CPU alone here, so that planning never takes an accelerator a run is using."""
    if args.resume:
        raise ConfigError("--plan plans a config (--config and key=value overrides), not --resume")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {args.mfu}")
    jax.config.update("jax_platforms", "cpu")
    cfg = new_config(args.config, args.overrides)
    if args.device.lower() == "cpu":  # this machine's CPU devices and memory, as a start here is checked
        if args.devices is not None:
            raise ConfigError("--device cpu plans for this machine's CPU devices; --devices does not apply")
        dev = devices.here()
    else:
        dev = target(args.device, args.devices)
    print(report(cfg, dev, mfu=args.mfu))
    return 0


def _fmt(n: float) -> str:
    return f"{n / GiB:8.2f} GiB"


def report(cfg, dev: Target, mfu: float = 0.4) -> str:
    """The plan as printed by `train.py --plan`."""
    m, t, sh = cfg.model, cfg.training, cfg.sharding
    state = _state_of(cfg)
    e = estimate(cfg, dev, state)
    mesh = " x ".join(f"{k}={v}" for k, v in e.mesh.items())
    n_params = model_lib.param_count(m)
    lines = [
        f"plan: model {cfg.model_name} ({n_params / 1e6:,.1f}M parameters) on {dev.count} x {dev.label}"
        + (f", {dev.processes} host(s), one process each" if dev.processes else ""),
        f"  mesh {mesh}, ZeRO stage {sh.zero_stage}; batch {t.batch_size} x {cfg.seq_len} tokens in "
        f"{t.micro_batches} micro-batch(es): {e.micro_rows} sequence(s) per device per micro-batch",
        f"  {m.dtype} compute{' (projections in FP8)' if m.fp8 else ''}, remat {m.remat}, attention {e.attention}"
        + (f" (model.attention=auto on {dev.backend.upper()})" if m.attention == "auto" else ""),
        "per device:",
    ]
    width = max(len(k) for k in e.terms)
    for name, value in e.terms.items():
        lines.append(f"  {name:<{width}} {_fmt(value)}   {e.notes[name]}")
    lines.append(f"  {'total':<{width}} {_fmt(e.total)}   of {e.memory / GiB:.1f} GiB")
    if e.fallbacks:
        lines.append(f"  not divisible by the ZeRO devices, so split along another dimension or replicated: "
                     f"{'; '.join(e.fallbacks)}")
    lines.append(verdict(e))
    if dev.backend == "gpu" and JAX_GPU_SHARE * e.memory < e.total <= TIGHT * e.memory:
        lines.append(f"  more than the {JAX_GPU_SHARE:.0%} of a GPU's memory JAX takes by default: set "
                     f"XLA_PYTHON_CLIENT_MEM_FRACTION=.95")
    if e.total > TIGHT * e.memory:
        options, combined = alternatives(cfg, dev, state)
        if options:
            lines.append("no single change fits; together these do:" if combined
                         else "changes that fit, cheapest first:")
            for what, alt in options:
                lines.append(f"  {what:<48} {_fmt(alt.total)} ({alt.total / alt.memory:.0%})")
        else:
            lines.append("no change of ZeRO stage, micro-batches, remat, tensor parallelism or batch size fits: "
                         "more devices are needed")
    tokens = cfg.tokens_per_step
    adapters = None if t.lora is None else sum(x.size for x in jax.tree.leaves(state.abstract["params"]))
    per_token = model_lib.flops_per_token(m, cfg.seq_len, adapters)
    formula = "6N + 6LdT" if adapters is None else "LoRA: 4N + 6LdT + 6 x the adapters"
    if t.objective == "dpo" and not t.dpo_settings.precompute_reference:  # the reference's forward pass too
        per_token += model_lib.flops_per_token(m, cfg.seq_len) / 3
        formula += " + the DPO reference's forward, a third of 6N + 6LdT"
    flops = per_token * tokens
    line = (f"step: {tokens:,} tokens, {flops:.3g} FLOPs ({per_token:.3g} per token, {formula}; remat's "
            f"recomputation not counted)")
    if dev.peak_flops:
        seconds = flops / (mfu * dev.peak_flops * dev.count)
        line += (f"; at {mfu:.0%} MFU of {dev.peak_flops / 1e12:.0f} TFLOP/s x {dev.count}: {seconds:.3g} s per "
                 f"step, {tokens / seconds:,.0f} tokens/s")
    else:
        line += "; no peak FLOP/s known for a memory size: name the device (--device H100) for a step time"
    lines.append(line)
    if cfg.data.mixture:  # the shares of each stage and each source's tokens over the run (no data read)
        stages, names = config_lib.mixture_stages(cfg.data), list(cfg.data.mixture)
        schedule = mixture.Schedule(stages, t.batch_size, seed=cfg.seed)
        lines += mixture.share_lines(names, schedule, stages)
        taken = schedule.taken(t.steps * t.batch_size).tolist()
        lines.append(f"over {t.steps} steps: " + ", ".join(f"{n} {k * cfg.seq_len:,} tokens" for n, k in zip(names, taken)))
        for name, source in cfg.data.mixture.items():  # the plan reads no data, but a missing directory is said
            if source.dir and not storage.is_url(source.dir) and not os.path.isfile(os.path.join(source.dir,
                                                                                                 "index.json")):
                lines.append(f"note: data.mixture.{name}.dir {source.dir} is not a prepared data directory (no "
                             f"index.json): its tokens above are the weights' share only; a run refuses it")
    return "\n".join(lines)
