"""Causal attention on TPUs through JAX's splash attention kernel (Pallas on Mosaic), with ALiBi carried as
extra head dimensions (alibi_dims.py) and packed examples / forgetful causal masking as segment ids.

    splash_attention(q, k, v, slopes=None, segments=None)   q (B, T, H, D), k and v (B, T, K, D) -> (B, T, H, D)

The same function as attention.py's reference path: query i sees key j <= i (and, with segments,
only where q_segments[b, i] == kv_segments[b, j]), scores q . k / sqrt(D) - slope_h (i - j),
softmax in float32. Splash keeps no (T, T) array: its mask is the lazy causal one, evaluated per
block, and the segment ids are two int32 vectors per row.

Splash takes no bias and applies no scale, so q is scaled by 1/sqrt(D) first and the ALiBi columns
hold the slopes themselves. The scaling adds no rounding the reference does not make: where 1/sqrt(D)
is a power of two (D = 16, 64, 256) or q is float32 it is exact as it is; otherwise (760m's 96, 128)
q / sqrt(D) in a 16-bit dtype is carried as two halves, hi and its rounding error lo, against two
copies of k (q' = [hi, lo], k' = [k, k]: q' . k' = q . k / sqrt(D) to about 2^-16), the price a
second 128-lane tile of q and k where D + 4 fits one. q and k are padded with zeros to whole
128-lane tiles; v keeps its own head size (splash takes a v narrower than q and k). Lengths are
padded to whole 128-row blocks: the extra keys lie after every real query (the causal mask hides
them), the extra queries are dropped. Grouped-query heads run as splash's multi-query kernel, one
call per key/value head (vmapped with the batch rows).

In float32, and past alibi_dims.exact_length, ALiBi as head dimensions is not exact enough (its
accumulator's rounding grows with the length, and on a TPU Mosaic may round a float32 q . k's operands
to bfloat16): attention.resolve_attention sends those to the bias-form reference instead.

Off a TPU the kernel runs in Pallas interpret mode (slow, exact): how the tests check it on a CPU.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from layers import alibi_dims

LANES = 128  # a TPU vector register's lanes: head dimensions are padded to whole tiles of them
BLOCKS = (512, 256, 128)  # block sizes tried, largest first: the largest that divides the padded length
_PAD_QUERY, _PAD_KEY = -(2**31), -(2**31) + 1  # segment ids of padding rows: no real query or key has them


def _block(length: int) -> int:
    return next(b for b in BLOCKS if length % b == 0)


def splash_attention(q, k, v, slopes=None, segments=None, *, interpret: bool | None = None) -> jax.Array:
    """Causal attention of q (B, T, H, D) over k, v (B, T, K, D) -> (B, T, H, D) in q's dtype.

    slopes (H,), optional: ALiBi's per-head slopes (attention.alibi_slopes); None: no bias.
    segments, optional: (q_segments, kv_segments), int (B, T) each (attention.Masking).
    `interpret`: None runs the kernel compiled on a TPU and in interpret mode elsewhere.
    """
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    dtype = q.dtype
    q, k = scaled_query(q, k)  # splash applies no scale
    if slopes is not None:
        q, k = alibi_dims.extend(q, k, slopes, LANES, scale=1.0)
    else:
        width = -(-q.shape[-1] // LANES) * LANES - q.shape[-1]
        q, k = (jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width))) for x in (q, k))
    T_pad = -(-T // LANES) * LANES
    if T_pad != T:
        q, k, v = (jnp.pad(x, ((0, 0), (0, T_pad - T), (0, 0), (0, 0))) for x in (q, k, v))
        if segments is not None:
            segments = tuple(jnp.pad(s, ((0, 0), (0, T_pad - T)), constant_values=fill)
                             for s, fill in zip(segments, (_PAD_QUERY, _PAD_KEY)))
    b = _block(T_pad)
    sizes = splash_kernel.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                     block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((T_pad, T_pad))] * G)
    kernel = splash_kernel.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                           interpret=interpret)
    Dp = q.shape[-1]
    # one multi-query call per (row, key/value head): q (G, T, Dp), k (T, Dp) and v (T, D)
    qg = q.reshape(B, T_pad, K, G, Dp).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, Dp)
    kg, vg = (x.transpose(0, 2, 1, 3) for x in (k, v))  # (B, K, T, Dp) and (B, K, T, D)

    def one(q1, k1, v1, seg):
        return kernel(q1, k1, v1, segment_ids=seg)

    if segments is None:
        run = jax.vmap(jax.vmap(lambda q1, k1, v1: one(q1, k1, v1, None)))
        y = run(qg, kg, vg)
    else:
        ids = splash_kernel.SegmentIds(q=segments[0].astype(jnp.int32), kv=segments[1].astype(jnp.int32))
        run = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)), in_axes=(0, 0, 0, 0))
        y = run(qg, kg, vg, ids)  # (B, K, G, T, D)
    y = y.transpose(0, 3, 1, 2, 4).reshape(B, T_pad, H, D)
    return y[:, :T].astype(dtype)


def exact_scale(head_dim: int, dtype) -> bool:
    """Whether q / sqrt(head_dim) in `dtype` rounds no more than the reference's scaled float32 scores:
    1/sqrt(D) a power of two (D a power of 4), or a float32 q."""
    return jnp.dtype(dtype).itemsize >= 4 or (head_dim & (head_dim - 1) == 0 and head_dim.bit_length() % 2 == 1)


def qk_width(head_dim: int, dtype, alibi: bool) -> int:
    """The head size of q and k as splash gets them: q / sqrt(D) in one or two halves (`scaled_query`),
    ALiBi's columns, whole 128-lane tiles. v keeps head_dim."""
    from layers import alibi_dims
    width = head_dim * (1 if exact_scale(head_dim, dtype) else 2)
    return -(-(width + (alibi_dims.extra_columns(dtype) if alibi else 0)) // LANES) * LANES


def scaled_query(q, k):
    """(q', k') with q' . k' = q . k / sqrt(D) for q (B, T, H, D), k (B, T, K, D), and no rounding beyond
    the reference's: q scaled where that is exact (`exact_scale`), else q' = [hi, lo] (B, T, H, 2D),
    hi = q / sqrt(D) rounded to q's dtype and lo its rounding error, against k' = [k, k]."""
    D = q.shape[-1]
    scaled = q.astype(jnp.float32) * (1.0 / math.sqrt(D))
    if exact_scale(D, q.dtype):
        return scaled.astype(q.dtype), k
    hi = scaled.astype(q.dtype)
    lo = jax.lax.stop_gradient(scaled - hi.astype(jnp.float32)).astype(q.dtype)  # q's gradient flows through hi
    return jnp.concatenate([hi, lo], axis=-1), jnp.concatenate([k, k], axis=-1)
