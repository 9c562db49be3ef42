"""Causal attention on TPUs through JAX's splash attention kernel (Pallas on Mosaic), with ALiBi carried as
extra head dimensions (alibi_dims.py) and packed examples / forgetful causal masking as segment ids.

    splash_attention(q, k, v, slopes=None, segments=None)   q (B, T, H, D), k and v (B, T, K, D) -> (B, T, H, D)

The same function as attention.py's reference path: query i sees key j <= i (and, with segments,
only where q_segments[b, i] == kv_segments[b, j]), scores q . k / sqrt(D) - slope_h (i - j),
softmax in float32. Splash keeps no (T, T) array: its mask is the lazy causal one, evaluated per
block, and the segment ids are two int32 vectors per row.

Splash takes no bias and applies no scale, so q is scaled by 1/sqrt(D) first and the ALiBi columns
hold the slopes themselves. Head dimensions are padded with zeros to whole 128-lane tiles (760m's
96 + 4 ALiBi columns cost nothing; a head of 128 with ALiBi takes a second tile), and lengths to
whole 128-row blocks: the extra keys lie after every real query (the causal mask hides them), the
extra queries are dropped. Grouped-query heads run as splash's multi-query kernel, one call per
key/value head (vmapped with the batch rows).

Off a TPU the kernel runs in Pallas interpret mode (slow, exact): how the tests check it on a CPU.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

import alibi_dims

LANES = 128  # a TPU vector register's lanes: head dimensions are padded to whole tiles of them
BLOCKS = (512, 256, 128)  # block sizes tried, largest first: the largest that divides the padded length
_PAD_QUERY, _PAD_KEY = -(2**31), -(2**31) + 1  # segment ids of padding rows: no real query or key has them


def _block(length: int) -> int:
    return next(b for b in BLOCKS if length % b == 0)


def splash_attention(q, k, v, slopes=None, segments=None, *, interpret: bool | None = None) -> jax.Array:
    """Causal attention of q (B, T, H, D) over k, v (B, T, K, D) -> (B, T, H, D) in q's dtype.

    slopes (H,), optional: ALiBi's per-head slopes (attention.alibi_slopes); None: no bias. segments, optional: (q_segments, kv_segments), int (B, T) each (attention.Masking).
    `interpret`: None runs the kernel compiled on a TPU and in interpret mode elsewhere.
    """
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    dtype = q.dtype
    q = (q.astype(jnp.float32) * (1.0 / math.sqrt(D))).astype(dtype)  # splash applies no scale
    if slopes is not None:
        q, k, v = alibi_dims.extend(q, k, v, slopes, LANES, scale=1.0)
    else:
        width = -(-D // LANES) * LANES - D
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width))) for x in (q, k, v))
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
    # one multi-query call per (row, key/value head): q (G, T, Dp), k and v (T, Dp)
    qg = q.reshape(B, T_pad, K, G, Dp).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, Dp)
    kg, vg = (x.transpose(0, 2, 1, 3) for x in (k, v))  # (B, K, T, Dp)

    def one(q1, k1, v1, seg):
        return kernel(q1, k1, v1, segment_ids=seg)

    if segments is None:
        run = jax.vmap(jax.vmap(lambda q1, k1, v1: one(q1, k1, v1, None)))
        y = run(qg, kg, vg)
    else:
        ids = splash_kernel.SegmentIds(q=segments[0].astype(jnp.int32), kv=segments[1].astype(jnp.int32))
        run = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)), in_axes=(0, 0, 0, 0))
        y = run(qg, kg, vg, ids)  # (B, K, G, T, Dp)
    y = y.transpose(0, 3, 1, 2, 4).reshape(B, T_pad, H, Dp)
    return y[:, :T, :, :D].astype(dtype)
