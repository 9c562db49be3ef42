"""Attention for model.py: ALiBi and rotary positions, the reference attention with grouped-query
heads, the other implementations and the choice among them, cached attention for sampling, masks.

    attention(q, k, v, cfg)    q (B, T, H, D), k and v (B, T, K, D) -> (B, T, H, D), causal

ALiBi (Press, Smith & Lewis, "Train Short, Test Long", ICLR 2022) adds `-slope_h * (i - j)` to
the scaled attention score of query i and key j <= i, with one fixed slope per head and no
position embedding. The bias is built for whatever length is fed, so a model trained at context
T runs at 2T, 4T, 8T. Rotary embeddings (GPT-J, GPT-NeoX, LLaMA) turn q and k by their positions
before attention instead.

K key/value heads divide the H query heads (grouped-query attention): query head h reads key/value
head h // (H / K); K = H is plain multi-head attention.

Implementations (`model.attention` in the config, `ATTENTION_IMPLS`): the reference `xla` (below,
`_attend`: float32 scores and softmax, dropout, extra masks), `dot_product` and `cudnn` through
jax.nn.dot_product_attention, and `pallas`, flash_alibi.py's kernel; `auto` is resolved per backend
by `resolve_attention`. Generation's cached attention (`cached_attention`) is always the reference.

`cfg` below is a model.GPTConfig; only its attention fields are read (alibi_attn, attention, dtype,
dropout, head_dim, rotary_dim, rotary_base). This file imports nothing of the project but
flash_alibi.py, and that only when `pallas` runs.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# auto: the fastest measured for this backend and model (`resolve_attention`); xla: the reference
# below; dot_product: jax.nn.dot_product_attention with JAX's default implementation (XLA's, as of
# JAX 0.10); cudnn: the same forced to cuDNN's fused kernel (NVIDIA GPU only); pallas: flash_alibi.py's
# kernel, which makes the ALiBi bias inside (O(T) memory)
ATTENTION_IMPLS = ("auto", "xla", "dot_product", "cudnn", "pallas")


# ----------------------------------------------------------------------------------------------
# ALiBi


def alibi_slopes(n_head: int) -> np.ndarray:
    """Per-head ALiBi slopes, float32 (n_head,).

    For a power of two n: the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8). Otherwise the
    paper's rule: the n' = 2^floor(log2 n) slopes of the closest lower power of two, followed by
    every other slope of the sequence for 2n' (its 1st, 3rd, 5th, ...) until n slopes are taken.
    """

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(n_head)))
    slopes = geometric(closest) + geometric(2 * closest)[0::2][: n_head - closest]
    return np.asarray(slopes, dtype=np.float32)


def alibi_bias(n_head: int, q_len: int, k_len: int) -> jax.Array:
    """-slope * (i - j) for query i, key j, float32 (n_head, q_len, k_len); queries are the last q_len keys."""
    return alibi_bias_at(n_head, jnp.arange(k_len - q_len, k_len), jnp.arange(k_len))


def alibi_bias_at(n_head: int, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """-slope * (i - j) for query positions i (Tq,) and key positions j (Tk,), float32 (n_head, Tq, Tk).

    The positions may be traced, e.g. a decode step's queries at pos..pos+Tq-1 against a whole cache.
    """
    i = q_pos[:, None]  # (Tq, 1) absolute query positions
    j = k_pos[None, :]  # (1, Tk)
    distance = (i - j).astype(jnp.float32)  # (Tq, Tk); negative above the diagonal, masked anyway
    return -jnp.asarray(alibi_slopes(n_head))[:, None, None] * distance  # (H, Tq, Tk)


# ----------------------------------------------------------------------------------------------
# Rotary position embeddings (Su et al., "RoFormer", 2021; GPT-J, GPT-NeoX, LLaMA)


def rotary_angles(cfg, positions: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """(cos, sin) float32 (T, rotary_dim/2) of the angles p * base^(-2i/rotary_dim) at positions p (T,);
    None without rotary embeddings. Computed once per forward pass and shared by every layer."""
    if not cfg.rotary_dim:
        return None
    exponents = jnp.arange(0, cfg.rotary_dim, 2, dtype=jnp.float32) / cfg.rotary_dim
    inv_freq = 1.0 / (jnp.float32(cfg.rotary_base) ** exponents)  # (rotary_dim/2,)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (T, rotary_dim/2)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, rope: tuple[jax.Array, jax.Array], interleaved: bool) -> jax.Array:
    """Rotate the first rotary_dim dims of every head of x (B, T, H, D) by the angles of `rope`, in float32.

    Dim pairs (a, b) turn into (a cos - b sin, b cos + a sin): pairs (2i, 2i+1) when interleaved
    (GPT-J), (i, i + rotary_dim/2) otherwise (GPT-NeoX, LLaMA). The other dims pass unchanged.
    """
    cos, sin = (r[None, :, None, :] for r in rope)  # (1, T, 1, rotary_dim/2)
    half = cos.shape[-1]
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., : 2 * half], xf[..., 2 * half:]
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    a, b = a * cos - b * sin, b * cos + a * sin
    rot = jnp.stack([a, b], axis=-1).reshape(rot.shape) if interleaved else jnp.concatenate([a, b], axis=-1)
    return jnp.concatenate([rot, rest], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# The reference attention (`xla`), with grouped-query heads


def _attend(q, k, v, q_pos, k_pos, cfg, dropout_key=None, mask=None) -> jax.Array:
    """The reference attention: queries q (B, Tq, H, D) at positions q_pos (Tq,), keys and values
    (B, Tk, K, D) at k_pos (Tk,); query i sees key j iff j <= i (and mask[b, i, j], when a (B, Tq, Tk)
    mask is given), with -slope * (i - j) under ALiBi. Query head h reads key/value head h // (H / K)."""
    B, Tq, H, D = q.shape
    K, Tk = k.shape[2], k.shape[1]
    qg = q.reshape(B, Tq, K, H // K, D)  # the query heads in groups, one per key/value head
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)  # (B, K, G, Tq, Tk)
    scores = scores.reshape(B, H, Tq, Tk) * (1.0 / math.sqrt(D))
    if cfg.alibi_attn:
        scores = scores + alibi_bias_at(H, q_pos, k_pos)[None]  # (1, H, Tq, Tk)
    causal = k_pos[None, :] <= q_pos[:, None]  # (Tq, Tk)
    if mask is not None:
        causal = (causal[None] & mask)[:, None]  # (B, 1, Tq, Tk)
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # float32, always: a bf16 softmax destabilises training
    probs = dropout(probs, cfg.dropout, dropout_key).astype(v.dtype).reshape(B, K, H // K, Tq, Tk)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(B, Tq, H, D)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """x with each element zeroed with probability `rate` and the rest scaled by 1 / (1 - rate); x itself
    without a key or at rate 0. The attention probabilities' dropout, and the model's on embeddings and
    residual branches."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# The implementations and the choice among them


def attention(q, k, v, cfg, dropout_key=None, mask=None, sharding=None) -> jax.Array:
    """Causal attention of q (B, T, H, D) over k, v (B, T, K, D) -> (B, T, H, D), with the ALiBi bias
    when configured. K key/value heads divide the H query heads: query head h reads key/value head
    h // (H / K) (grouped-query attention; K = H is plain multi-head attention).

    `mask` (B, T, T) bool, optional: query i may see key j only where mask[b, i, j] is also true
    (packed segments, forgetful causal masking; see `attention_mask`). A masked call always takes
    the reference path.

    `sharding`, optional: how q, k and v are placed on a device mesh, the NamedSharding of the
    activation axes (batch, length, heads, kv) (model.py passes what sharding.py's activation rules
    give them). Only `pallas` reads it: XLA cannot partition a Pallas call, so the kernel runs per
    device on that device's rows and heads. None: one device, or q, k and v whole on each.
    """
    B, T, H, D = q.shape
    if mask is not None:
        return _attend(q, k, v, jnp.arange(T), jnp.arange(T), cfg, dropout_key, mask)
    impl = resolve_attention(cfg)
    if impl == "pallas":  # O(T) memory: the bias is made inside the kernel from the slopes
        group = H // k.shape[2]  # the kernel takes as many key/value heads as query heads
        k, v = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (k, v))
        return _pallas_attention(q, k, v, cfg, sharding)
    if impl == "cudnn":
        check_attention_backend(dataclasses.replace(cfg, attention=impl))
        # cuDNN's fused kernel takes even lengths only; one extra key after every query is hidden
        # by the causal mask, and the extra query row is dropped. Its backward pass also computes
        # the gradient of the constant bias, (1, H, T, T), and throws it away: O(T^2) memory again.
        if T % 2:
            q, k, v = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (q, k, v))
        n = q.shape[1]
        bias = alibi_bias(H, n, n)[None].astype(q.dtype) if cfg.alibi_attn else None  # (1, H, n, n)
        y = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True, implementation="cudnn")
        return y[:, :T]
    if impl == "dot_product":
        bias = alibi_bias(H, T, T)[None].astype(q.dtype) if cfg.alibi_attn else None  # (1, H, T, T)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True)
    return _attend(q, k, v, jnp.arange(T), jnp.arange(T), cfg, dropout_key)


def _pallas_attention(q, k, v, cfg, sharding) -> jax.Array:
    """flash_alibi's kernel. With a `sharding` of q, k and v each device runs it on its own rows and
    heads (shard_map): a Pallas call is opaque to XLA's partitioner, which would otherwise gather
    q, k and v whole onto every device. The slopes are split with the heads."""
    import flash_alibi  # only when chosen: Pallas is not needed otherwise

    H = q.shape[2]
    slopes = alibi_slopes(H) if cfg.alibi_attn else np.zeros(H, np.float32)
    if sharding is None:
        return flash_alibi.flash_alibi_attention(q, k, v, slopes)
    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    if spec[1] is not None or spec[3] is not None:
        raise ValueError(f"model.attention=pallas needs whole sequences and head dimensions on each device; "
                         f"the activation sharding splits (batch, length, heads, kv) as {spec}")
    qkv_spec = jax.sharding.PartitionSpec(*spec)
    run = jax.shard_map(flash_alibi.flash_alibi_attention, mesh=sharding.mesh,
                        in_specs=(qkv_spec, qkv_spec, qkv_spec, jax.sharding.PartitionSpec(spec[2])),
                        out_specs=qkv_spec, check_vma=False)
    return run(q, k, v, jnp.asarray(slopes))


def resolve_attention(cfg, backend: str | None = None) -> str:
    """The implementation `cfg.attention` stands for on `backend` (default: JAX's default backend).

    `auto` is the fastest correct one measured there (bench/RESULTS.md, `python bench.py attention`
    and `train`): on an NVIDIA GPU in bfloat16 or float16, `pallas` for ALiBi models (the bias is
    made in-kernel; cuDNN takes 1.25x its time at 760m's shape, 1.7x at T=8192, and O(T^2) memory
    for its bias gradient) and `cudnn` for learned positions and rotary models (no bias; 3% ahead of
    pallas on 124m's step), whose heads cuDNN's fused kernel takes: a size of at most 128, a multiple
    of 8 (GPT-J's 256 is not). Everywhere else `xla`: the CPU, TPUs, float32 (not measured on a GPU)
    and attention dropout (only xla has it)."""
    if cfg.attention != "auto":
        return cfg.attention
    backend = backend or jax.default_backend()
    if backend == "gpu" and cfg.dtype != "float32" and cfg.dropout == 0:
        if cfg.alibi_attn:
            return "pallas"
        return "cudnn" if cfg.head_dim <= 128 and cfg.head_dim % 8 == 0 else "xla"
    return "xla"


def check_attention_backend(cfg) -> None:
    """Raises ValueError (one line) when `cfg.attention` cannot run on the default JAX backend."""
    backend = jax.default_backend()
    if cfg.attention == "cudnn" and backend != "gpu":
        raise ValueError(f"model.attention=cudnn needs an NVIDIA GPU (cuDNN); this JAX runs on {backend}: "
                         f"use attention=xla, dot_product or pallas")
    if cfg.attention == "pallas" and backend == "tpu":
        raise ValueError("model.attention=pallas is a Triton kernel for NVIDIA GPUs; on a TPU use attention=xla "
                         "or dot_product")


# ----------------------------------------------------------------------------------------------
# Cached attention, for generation


def cached_attention(q, k_cache, v_cache, pos, cfg) -> jax.Array:
    """Attention of queries q (B, T, H, D) at positions pos..pos+T-1 over caches (B, L, K, D) -> (B, T, H, D).

    Cache slots at and beyond pos + T (still empty) are never seen. The `xla` implementation's
    float32 scores and softmax, whatever `cfg.attention` says.
    """
    T, L = q.shape[1], k_cache.shape[1]
    y = _attend(q, k_cache.astype(q.dtype), v_cache, pos + jnp.arange(T), jnp.arange(L), cfg)
    return y.astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Attention masks beyond causal: packed segments and forgetful causal masking


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position within its segment, int32 (B, T), for segment ids (B, T) that are
    constant over each run of consecutive tokens: 0 at every token whose id differs from the one before."""
    T = segment_ids.shape[1]
    t = jnp.arange(T)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)  # (B, T)
    first = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)  # (B, T) index of the segment's first token
    return (t - first).astype(jnp.int32)


def attention_mask(batch: int, length: int, *, segment_ids: jax.Array | None = None, fcm_key=None,
                   fcm_max_ratio: float = 0.0) -> jax.Array | None:
    """The extra attention mask (B, T, T) bool for `GPT.__call__` (True = may attend), or None.

    segment_ids (B, T): query i sees key j only within its own segment (packed examples).
    Forgetful causal masking (Liu et al. 2022, arXiv 2210.13432), when fcm_key is given and
    fcm_max_ratio > 0: each sequence draws a ratio r ~ U(0, fcm_max_ratio) and hides each key
    position with probability r from every query. The first token (of the sequence and of each
    segment) stays visible, and a token always sees itself, so no query is left without a key.
    For training only: evaluation and generation use no FCM.
    """
    if segment_ids is None and (fcm_key is None or fcm_max_ratio <= 0):
        return None
    mask = jnp.ones((batch, length, length), bool)
    if segment_ids is not None:
        mask = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, Tq, Tk)
    if fcm_key is not None and fcm_max_ratio > 0:
        ratio_key, drop_key = jax.random.split(fcm_key)
        ratio = jax.random.uniform(ratio_key, (batch, 1), maxval=fcm_max_ratio)  # (B, 1) one r per sequence
        visible = jax.random.uniform(drop_key, (batch, length)) >= ratio  # (B, Tk) P(hidden) = r
        visible = visible.at[:, 0].set(True)
        if segment_ids is not None:
            visible = visible | (segment_positions(segment_ids) == 0)
        diagonal = jnp.eye(length, dtype=bool)[None]  # (1, Tq, Tk)
        mask = mask & (visible[:, None, :] | diagonal)
    return mask
