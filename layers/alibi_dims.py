"""ALiBi carried as extra head dimensions, so that a fused attention kernel with no bias input (cuDNN's
flash attention on GPUs, splash attention on TPUs) computes ALiBi attention in O(T) memory.

    extend(q, k, slopes, multiple)  ->  q', k' (B, T, ., D') with D' >= D + extra, a multiple of `multiple`

For query i and key j <= i, ALiBi's score is s_ij - m_h (i - j) = s_ij + m_h (j - c) - m_h (i - c) for
any constant c. The last term is the same for every key of query i, and a softmax does not change when
one number is added to a whole row, so the bias m_h (j - c) alone gives the same probabilities. And
m_h (j - c) is a dot product: a few dimensions appended to each head, constant per head in the queries
and per position in the keys. c is the middle of the sequence (c = T // 2): the kernel's float32
accumulator then holds s + m_h (j - c), at most m_h T / 2 in size instead of m_h T, which halves the
absolute rounding of the scores it sums.

A kernel multiplies q . k by a scale s (cuDNN: 1/sqrt(D) of the real head size; splash: 1, q
being scaled first); the query columns hold c_h = m_h / s, so the scaled product is m_h (j - c). In
bfloat16 and float16 every factor is made representable and every product exact (the kernels
accumulate q . k in float32):

    256 c_h = C_hi + C_lo        two numbers of the compute dtype (C_lo the rounding error of C_hi)
    j - c = 256 a + b            -128 <= a < 128 and 0 <= b < 256: a and b / 256 exact in either 16-bit type
    q_extra = [C_hi, C_hi, C_lo, C_lo]     k_extra = [a, b / 256, a, b / 256]

whose product is (C_hi + C_lo)(a + b / 256) = c_h (j - c) up to c_h's rounding to two 16-bit parts (a
relative 2^-16 or so, far below bfloat16's own); each product of two such numbers is exact in float32.
(The factor 256 keeps float16's C_lo of the flattest slopes, 2^-8, clear of its subnormal numbers.)
In float32 one column each holds c_h and j - c, and the kernel's q . k must then be a full float32
product. The output is v's; the gradients of q and k are their first D columns exactly (the extra
columns are constants, their gradients discarded).

Positions count from the row's start. Packed examples need nothing more: within one example i - j
is the same whether positions count from the row's start or the example's.

How exact: the products are exact, but the accumulator's sum s + m_h (j - c) is rounded to float32,
an absolute error that grows with m_h T, against the bias form's (the bias added to the scaled score,
xla and pallas), which stays at the score's own rounding. Measured on the CPU (the extended columns
through a float32 softmax, the last rows of the sequence, slopes up to 0.96, heads of 96, against a
float64 reference on the same rounded inputs; output relative error, identity / bias form):

    bfloat16   T = 8192: 2.4e-3 / 2.4e-3   65,536: 2.3-2.4e-3 / 2.4e-3 (at most 1.03x: the output's own rounding)
    float16    T = 16,384: 3.2e-4 / 2.8e-4 (1.13x)   32,768: 3.9e-4 / 2.9e-4 (1.33x)   65,536: 7.7e-4 / 2.7e-4 (2.8x)
    float32    T = 2048: 2.5e-5 / 9.5e-8   8192: 8.8e-5 / 9.7e-8   (150-900x the bias form's error)

`exact_length` says up to which length the identity stays within a kernel's own rounding (no worse
than the bias form by more than 2x, <= 1e-2): attention.resolve_attention sends longer sequences, and
float32, to a bias-form kernel. Limits: 65,536 positions in the 16-bit types (two base-256 digits).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIGIT = 256  # positions in base 256: every digit and every digit / 256 exact in bfloat16 and float16
MAX_POSITIONS = DIGIT * DIGIT  # two digits: 65,536 positions (-32,768 .. 32,767 from the middle) in 16-bit types
# The longest sequence on which the identity stays within the kernels' own rounding (measured above):
# bfloat16 to its limit, float16 to 32,768 (1.33x the bias form's error at slope 0.96, 2.8x at 65,536),
# float32 never (already 150x the bias form's error at T = 2048).
EXACT_LENGTH = {"bfloat16": MAX_POSITIONS, "float16": MAX_POSITIONS // 2, "float32": 0}


def extra_columns(dtype) -> int:
    """How many columns the bias takes in this compute dtype: 4 in 16-bit types, 1 in float32."""
    return 1 if jnp.dtype(dtype).itemsize >= 4 else 4


def padded_dim(head_dim: int, dtype, multiple: int) -> int:
    """The head size with the bias columns, rounded up to a multiple of `multiple`."""
    return -(-(head_dim + extra_columns(dtype)) // multiple) * multiple


def exact_length(dtype) -> int:
    """The longest sequence whose ALiBi this identity carries within the kernels' own rounding in the
    compute dtype `dtype` (0: none; see the module docstring)."""
    return EXACT_LENGTH[jnp.dtype(dtype).name]


def columns(slopes, length: int, dtype, scale: float) -> tuple[jax.Array, jax.Array]:
    """(query columns (H, n), key columns (length, n)) in `dtype`, n = extra_columns(dtype): the
    product scale * (q_cols[h] . k_cols[j]) is slopes[h] * (j - length // 2), for a kernel that scales
    q . k by `scale`. The slopes may be traced (under shard_map they arrive as a device's share)."""
    dtype = jnp.dtype(dtype)
    c = jnp.asarray(slopes, jnp.float32) / jnp.float32(scale)  # (H,)
    j = jnp.arange(length) - length // 2  # positions from the middle
    if extra_columns(dtype) == 1:
        return c.astype(dtype)[:, None], j.astype(dtype)[:, None]
    if length > MAX_POSITIONS:
        raise ValueError(f"ALiBi as head dimensions takes at most {MAX_POSITIONS} positions in {dtype.name}, "
                         f"got {length}")
    c = c * DIGIT  # against a + b / 256: keeps float16's lo part of the flattest slopes clear of subnormals
    hi = c.astype(dtype)
    lo = (c - hi.astype(jnp.float32)).astype(dtype)  # c - hi is exact in float32
    q_cols = jnp.stack([hi, hi, lo, lo], axis=1)  # (H, 4)
    a, b = j // DIGIT, (j % DIGIT) / DIGIT  # floor division: b / 256 in [0, 1) below the middle too
    k_cols = jnp.stack([a, b, a, b], axis=1).astype(dtype)  # (length, 4)
    return q_cols, k_cols


def extend(q, k, slopes, multiple: int, scale: float | None = None):
    """q (B, T, H, Dq), k (B, T, K, Dq) -> the same with the ALiBi columns appended, then zeros to a
    multiple of `multiple` columns. `scale`: what the kernel multiplies q . k by (default 1/sqrt(Dq));
    v is not touched (a kernel that needs it as wide pads it with zeros)."""
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
    return q, k
