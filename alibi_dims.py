"""ALiBi carried as extra head dimensions, so that a fused attention kernel with no bias input (cuDNN's
flash attention on GPUs, splash attention on TPUs) computes ALiBi attention exactly, in O(T) memory.

    extend(q, k, v, slopes, multiple)  ->  q', k', v' (B, T, ., D') with D' >= D + extra, a multiple of `multiple`

For query i and key j <= i, ALiBi's score is s_ij - m_h (i - j) = s_ij + m_h j - m_h i. The last term
is the same for every key of query i, and a softmax does not change when one number is added to a
whole row, so the bias m_h j alone gives the same probabilities. And m_h j is a dot product: a few
dimensions appended to each head, constant per head in the queries and per position in the keys.

A kernel multiplies q . k by a scale s (cuDNN: 1/sqrt(D) of the real head size; splash: 1, q
being scaled first); the query columns hold c_h = m_h / s, so the scaled product is m_h j. In bfloat16 and float16 every factor is made
representable and every product exact (the kernels accumulate q . k in float32):

    c_h = c_hi + c_lo            two numbers of the compute dtype (c_lo the rounding error of c_hi)
    j   = 256 a + b              a, b < 256: integers exact in either 16-bit type
    q_extra = [c_hi, c_hi, c_lo, c_lo]     k_extra = [256 a, b, 256 a, b]

whose product is (c_hi + c_lo)(256 a + b) = c_h j up to c_h's rounding to two 16-bit parts (a
relative 2^-16 or so, far below bfloat16's own). In float32 one column each holds c_h and j exactly.
v gets zero columns; the output's extra columns are zero and dropped; the gradients of q, k and v
are their first D columns exactly (the extra columns are constants, their gradients discarded).

Positions count from the row's start. Packed examples need nothing more: within one example i - j
is the same whether positions count from the row's start or the example's.

Limits: positions up to 65,535 in the 16-bit types (two base-256 digits); `fits` says whether a head
size plus the extra columns stays within what a kernel takes.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIGIT = 256  # positions in base 256: every digit and every 256 * digit exact in bfloat16 and float16
MAX_POSITIONS = DIGIT * DIGIT  # two digits: positions 0 .. 65,535 in the 16-bit types


def extra_columns(dtype) -> int:
    """How many columns the bias takes in this compute dtype: 4 in 16-bit types, 1 in float32."""
    return 1 if jnp.dtype(dtype).itemsize >= 4 else 4


def padded_dim(head_dim: int, dtype, multiple: int) -> int:
    """The head size with the bias columns, rounded up to a multiple of `multiple`."""
    return -(-(head_dim + extra_columns(dtype)) // multiple) * multiple


def columns(slopes, length: int, dtype, scale: float) -> tuple[jax.Array, jax.Array]:
    """(query columns (H, n), key columns (length, n)) in `dtype`, n = extra_columns(dtype): the
    product scale * (q_cols[h] . k_cols[j]) is slopes[h] * j, for a kernel that scales q . k by `scale`.
    The slopes may be traced (under shard_map they arrive as a device's share)."""
    dtype = jnp.dtype(dtype)
    c = jnp.asarray(slopes, jnp.float32) / jnp.float32(scale)  # (H,)
    j = jnp.arange(length)
    if extra_columns(dtype) == 1:
        return c.astype(dtype)[:, None], j.astype(dtype)[:, None]
    if length > MAX_POSITIONS:
        raise ValueError(f"ALiBi as head dimensions takes at most {MAX_POSITIONS} positions in {dtype.name}, "
                         f"got {length}")
    hi = c.astype(dtype)
    lo = (c - hi.astype(jnp.float32)).astype(dtype)  # c - hi is exact in float32
    q_cols = jnp.stack([hi, hi, lo, lo], axis=1)  # (H, 4)
    a, b = (j // DIGIT) * DIGIT, j % DIGIT
    k_cols = jnp.stack([a, b, a, b], axis=1).astype(dtype)  # (length, 4)
    return q_cols, k_cols


def extend(q, k, v, slopes, multiple: int, scale: float | None = None):
    """q (B, T, H, D), k and v (B, T, K, D) -> the same with the ALiBi columns appended (q and k) or
    zeros (v), then zeros to a multiple of `multiple` columns. `scale`: what the kernel multiplies q . k
    by (default 1/sqrt(D) of the real D); the output's first D columns are the attention's."""
    B, T, H, D = q.shape
    K = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q_cols, k_cols = columns(slopes, T, q.dtype, scale)
    n = q_cols.shape[1]
    width = padded_dim(D, q.dtype, multiple) - D - n
    q = jnp.concatenate([q, jnp.broadcast_to(q_cols[None, None], (B, T, H, n)).astype(q.dtype),
                         jnp.zeros((B, T, H, width), q.dtype)], axis=-1)
    k = jnp.concatenate([k, jnp.broadcast_to(k_cols[None, :, None], (B, T, K, n)).astype(k.dtype),
                         jnp.zeros((B, T, K, width), k.dtype)], axis=-1)
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, n + width)))
    return q, k, v
