"""The output projection and the loss: from a GPT's final hidden states to its mean next-token
cross-entropy, through the whole logits or a chunk of positions at a time.

    tied_logits(h, weight, dtype)                  h (B, T, d) @ weight (V, d).T -> float32 logits (B, T, V)
    cross_entropy(logits, targets, weights)        (mean loss, counted tokens)
    chunked_cross_entropy(h, weight, bias, ...)    the same numbers without the whole (B, T, V) logits

model.py's GPT.head and GPT.loss are built on these. The logits and the loss are float32 whatever
the compute dtype; padding rows of the vocabulary (ids >= vocab_size) take PADDED_LOGIT, so every
softmax is over the real vocabulary. Intermediate arrays are placed by logical axis names
(logical_axes.py), so a vocabulary split over the tensor axis stays split. This file imports
nothing of the project but logical_axes.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from layers.logical_axes import logical_constraint

# the logit of every padding row (ids >= vocab_size): its probability is exactly 0 in float32 next to
# any real logit, so every softmax is over the real vocabulary; finite, so 0 * logit stays 0
PADDED_LOGIT = -1e9


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def tied_logits(x: jax.Array, wte: jax.Array, dtype) -> jax.Array:
    """The output projection x (B, T, d) @ wte (V, d).T (the tied token embedding, or a separate
    lm_head) in the compute dtype, with float32 accumulation and result (the loss needs it):
    float32 (B, T, V).

    The backward pass takes the logits' float32 gradient in the compute dtype, as every other
    activation gradient of the model: left to autodiff, a float32 cotangent against bfloat16
    operands turns both backward products, the largest of a small model, into float32 (TF32)
    matrix products at half the rate. The embedding's gradient still accumulates in float32.
    With dtype float32 nothing is rounded: the same products as plain autodiff."""
    return jnp.einsum("btd,vd->btv", x, wte.astype(dtype), preferred_element_type=jnp.float32)


def _tied_logits_fwd(x, wte, dtype):
    return tied_logits(x, wte, dtype), (x, wte)


def _tied_logits_bwd(dtype, residuals, g):
    x, wte = residuals
    g = g.astype(dtype)  # (B, T, V)
    dx = jnp.einsum("btv,vd->btd", g, wte.astype(dtype), preferred_element_type=jnp.float32)  # (B, T, d)
    dwte = jnp.einsum("btv,btd->vd", g, x.astype(dtype), preferred_element_type=jnp.float32)  # (V, d)
    return dx.astype(x.dtype), dwte.astype(wte.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None):
    """Mean next-token cross-entropy in float32 over counted tokens, and the count.

    logits (B, T, V), targets (B, T) int; weights (B, T) optional, e.g. 1 on completion tokens and
    0 on the prompt. Returns (loss, n) where n = sum of weights (B * T without weights).
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)  # (B, T)
    if weights is None:
        weights = jnp.ones_like(losses)
    weights = weights.astype(jnp.float32)
    n = weights.sum()
    return (losses * weights).sum() / jnp.maximum(n, 1.0), n


AUTO_CHUNK = 4096  # training.loss_chunk=auto: the tokens per device a chunk takes, when it chunks
AUTO_SHARE = 8  # auto: the whole logits when they and their gradient take at most 1/8 of a device's memory


def resolve_chunk(setting, tokens: int, vocab: int, compute_bytes: int, memory: float | None) -> int:
    """training.loss_chunk as tokens per device (0: the whole logits). An int is itself; `auto` takes the
    whole logits, the faster way (2% on 124m's step on an H200, bench/RESULTS.md), when one device's
    float32 logits and their gradient in the compute dtype, tokens x vocab x (4 + compute_bytes), fit in
    1/AUTO_SHARE of its memory (`memory`, bytes; None: unknown, as on the CPU, taken as plentiful), and
    AUTO_CHUNK tokens at a time otherwise."""
    if setting != "auto":
        return int(setting)
    if memory is None or tokens * vocab * (4 + compute_bytes) * AUTO_SHARE <= memory:
        return 0
    return AUTO_CHUNK


def chunk_layout(B: int, T: int, chunk: int) -> tuple[int, int] | None:
    """How the loss over (B, T) tokens is cut for `chunk` tokens at a time: (chunks, positions of each row
    in a chunk), as even as the chunk count allows (the padding is under `chunks` positions); None when
    it takes the whole logits at once (chunk 0, or no more than `chunk` tokens). GPT.loss and plan.py
    decide by it too."""
    if chunk <= 0 or B * T <= chunk:
        return None
    chunks = -(-T // max(1, chunk // B))
    return chunks, -(-T // chunks)


def chunked_cross_entropy(h: jax.Array, head: jax.Array, bias: jax.Array | None, targets: jax.Array,
                          weights: jax.Array | None = None, *, vocab_size: int, chunk: int, dtype=jnp.float32):
    """`cross_entropy` of the logits h @ head.T (+ bias), computed about `chunk` tokens at a time, so that
    only one chunk's float32 logits (chunk, V) exist at once, in the forward pass and in the backward.

    h (B, T, d): final hidden states (`GPT.hidden`); head (V_padded, d), bias (V_padded,) or None: the
    output projection (`GPT.head_weights`); targets, weights (B, T) as for `cross_entropy`; ids >=
    vocab_size are padding, masked to PADDED_LOGIT as in `GPT.head`; dtype: the compute dtype of the
    products, whose logits and softmax are float32. Returns (loss, n) as `cross_entropy` does: the
    same numbers up to the order of float32 sums. The weights take no gradient.

    A chunk is the same span of positions in every row, (B, T / chunks), so the batch keeps its
    data-parallel sharding through the loop; a vocabulary split over the tensor axis stays split
    (the logsumexp and the target logit are reductions over it). The gradients are computed in the
    forward pass, while each chunk's logits exist (the loss is a scalar, so its cotangent only
    scales them), and kept: dh (B, T, d) and the head's float32 gradient, the size of the head itself.
    """
    B, T, _ = h.shape
    chunks, per_row = chunk_layout(B, T, chunk) or (1, T)
    w = jnp.ones((B, T), jnp.float32) if weights is None else weights.astype(jnp.float32)
    n = w.sum()
    plan = (chunks, per_row, vocab_size, jnp.dtype(dtype), h.dtype, head.dtype)
    # the gradients are the weighted sum's, O(1) per token, and reach 1/n only through the cotangent:
    # as through the whole logits, a float16 product of them does not underflow when n is large
    return _chunked_loss_sum(h, head, bias, targets, w, plan) / jnp.maximum(n, 1.0), n


def _chunked_loss_and_grads(h, head, bias, targets, weights, plan, grads: bool):
    """sum(weights * cross-entropy) over chunks of positions, and with `grads` its gradients with respect
    to h (float32 (B, T, d)), head and bias (float32). weights (B, T) float32; plan: (chunks, positions
    per row in a chunk, vocab_size, compute dtype, h's dtype, head's dtype)."""
    B, T, d = h.shape
    chunks, per_row, vocab_size, dtype = plan[:4]
    V = head.shape[0]
    pad = chunks * per_row - T  # padded positions have weight 0: no loss, no gradient

    def split(x):  # (B, T, ...) -> (chunks, B, per_row, ...)
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x
        return x.reshape(B, chunks, per_row, *x.shape[2:]).swapaxes(0, 1)

    hs = logical_constraint(split(h), (None, "batch", "length", "embed"))  # (chunks, B, per_row, d)
    ts, ws = split(targets), split(weights)  # (chunks, B, per_row)
    weight = logical_constraint(head.astype(dtype), ("vocab", "embed"))  # (V, d), gathered once if ZeRO-3 split it
    vocab = jnp.arange(V)
    real = vocab < vocab_size

    def step(carry, xs):
        h_c, t_c, w_c = xs  # (B, c, d), (B, c), (B, c)
        h_c = logical_constraint(h_c, ("batch", "length", "embed"))
        logits = jnp.einsum("btd,vd->btv", h_c, weight, preferred_element_type=jnp.float32)  # (B, c, V)
        if bias is not None:
            logits = logits + bias
        if V > vocab_size:
            logits = jnp.where(real, logits, PADDED_LOGIT)
        logits = logical_constraint(logits, ("batch", "length", "vocab"))
        # optax.softmax_cross_entropy_with_integer_labels: log(sum(exp(shifted))) - shifted[target]
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_z = jnp.log(jnp.exp(shifted).sum(axis=-1))  # (B, c)
        is_target = vocab == t_c[..., None]  # (B, c, V)
        losses = log_z - jnp.where(is_target, shifted, 0.0).sum(axis=-1)  # (B, c)
        loss_sum = carry["loss"] + (losses * w_c).sum()
        if not grads:
            return {"loss": loss_sum}, None
        # d loss_sum / d logits, float32 (B, c, V): softmax - one-hot, weighted. Made from the logits
        # again rather than from exp(shifted), so each reduction and this product fuse with their
        # own exp and only the logits and the product below are stored. The padding rows' entries are
        # exactly 0 already: exp(PADDED_LOGIT - ...) underflows to 0 and no target is a padding id
        g = (jnp.exp(shifted - log_z[..., None]) - is_target) * w_c[..., None]
        g = logical_constraint(g, ("batch", "length", "vocab"))
        low = g.astype(dtype)  # the products in the compute dtype, as tied_logits' backward pass
        dh = jnp.einsum("btv,vd->btd", low, weight, preferred_element_type=jnp.float32)  # (B, c, d)
        dhead = carry["head"] + jnp.einsum("btv,btd->vd", low, h_c.astype(dtype), preferred_element_type=jnp.float32)
        out = {"loss": loss_sum, "head": logical_constraint(dhead, ("vocab", "embed"))}
        if bias is not None:
            out["bias"] = logical_constraint(carry["bias"] + g.sum(axis=(0, 1)), ("vocab",))
        return out, logical_constraint(dh, ("batch", "length", "embed"))

    init = {"loss": jnp.zeros((), jnp.float32)}
    if grads:
        init["head"] = logical_constraint(jnp.zeros((V, d), jnp.float32), ("vocab", "embed"))
        if bias is not None:
            init["bias"] = logical_constraint(jnp.zeros((V,), jnp.float32), ("vocab",))
    out, dh = jax.lax.scan(step, init, (hs, ts, ws))
    if not grads:
        return out["loss"]
    dh = dh.swapaxes(0, 1).reshape(B, chunks * per_row, d)[:, :T]  # (B, T, d)
    return out["loss"], (dh, out["head"], out.get("bias"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunked_loss_sum(h, head, bias, targets, weights, plan):
    return _chunked_loss_and_grads(h, head, bias, targets, weights, plan, grads=False)


def _chunked_loss_sum_fwd(h, head, bias, targets, weights, plan):
    return _chunked_loss_and_grads(h, head, bias, targets, weights, plan, grads=True)


def _chunked_loss_sum_bwd(plan, grads, ct):
    """The gradients computed in the forward pass, scaled by the cotangent; none for targets and weights."""
    dh, dhead, dbias = grads
    h_dtype, head_dtype = plan[4:]
    return ((ct * dh).astype(h_dtype), (ct * dhead).astype(head_dtype),
            None if dbias is None else (ct * dbias).astype(dbias.dtype), None, None)


_chunked_loss_sum.defvjp(_chunked_loss_sum_fwd, _chunked_loss_sum_bwd)
