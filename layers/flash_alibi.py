"""Causal flash attention with the ALiBi bias computed inside the kernel, in Pallas (Triton on GPU).

    flash_alibi_attention(q, k, v, slopes)     q, k, v (B, T, H, D) -> (B, T, H, D)

The same function as attention.py's reference path (`attention: xla`) for self-attention: query
i sees key j <= i with the score q_i . k_j / sqrt(D) - slope_h * (i - j), softmax in float32. No
(T, T) array is ever stored: the forward pass walks the key blocks of each query block with an
online softmax and keeps only the output and the log-sum-exp per row (O(T) memory); the bias is
rebuilt from the head's slope and the block positions wherever a score is formed.

The backward pass is two Pallas kernels (as FlashAttention-2 splits it), both recomputing the
probabilities from q, k and the saved log-sum-exp:
  dk, dv   one program per key block, walking the query blocks at or after it;
  dq       one program per query block, walking the key blocks at or before it.
delta_i = sum_d dO_id O_id, the softmax's correction term, is a cheap elementwise pass in XLA.

On a GPU the kernels compile through Triton. Elsewhere they run in Pallas interpret mode (the
kernel body evaluated by XLA, grid step by grid step): correct but slow, for tests on the CPU.
TPUs are refused (Pallas on TPU lowers through Mosaic, which this kernel is not written for).

Shapes the kernels do not take directly are padded in the wrapper, which is exact:
  T to a multiple of the block size: the extra keys lie after every real query, so the causal
    mask hides them; the extra query rows are dropped, and their zero output gradient adds
    nothing to dk and dv;
  D to a power of two (Triton's tiles need one, e.g. 96 -> 128): zero columns add nothing to
    q . k, and the output's extra columns are dropped. The scale stays 1/sqrt(real D).
Packed examples and forgetful causal masking come as two int32 vectors per row, the query's and
the key's segment ids (attention.Masking): O(T) memory like the rest. Dropout is not supported here;
attention.py keeps it on the XLA reference path. Under a device mesh attention.py calls this per device (shard_map over the
batch rows and heads), since XLA cannot partition a Pallas call.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# Tuned on an H100 (bench/RESULTS.md, 2026-11-23) at 760m's heads (H=16, D=96 padded to 128),
# forward + backward: at B=8 T=2048 64x64 took 2.51 ms against 3.09-5.04 ms for 32x32, 128x64,
# 128x128 with 8 warps, 3 stages or 1; at B=4 T=2048 1.40 ms against 2.24 ms for 64x32, the old
# default; at B=1 T=8192 4.00 ms against 5.05 ms for 128x64.
BLOCK_FWD = 64  # query and key block of the forward kernel
BLOCK_BWD = 64  # query and key block of the backward kernels
NUM_WARPS = 4  # warps per Triton program (each program is one block of one (batch, head))
NUM_STAGES = 2  # Triton software-pipelining depth of the loads in each kernel's loop
MIN_BLOCK = 16  # Triton's smallest dot tile
SLOPE_LANES = 16  # the slope is read as a row of this many copies: Triton loads tiles, not scalars
MASKED = -1e30  # score of a key above the diagonal: exp(MASKED - anything finite) is exactly 0
_PAD_QUERY, _PAD_KEY = -(2**31), -(2**31) + 1  # segment ids of padding rows: no real query or key has them


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _scores(q, k, slope, q_pos, k_pos, scale, q_seg=None, k_seg=None):
    """Scaled, biased and masked scores of a (bq, D) query tile against a (bk, D) key tile: float32
    (bq, bk). Query i sees key j iff j <= i and, with segments, q_seg[i] == k_seg[j]."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # q @ k.T
    distance = (q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)  # (bq, bk): i - j
    s = s * scale - slope * distance
    visible = k_pos[None, :] <= q_pos[:, None]
    if q_seg is not None:
        visible = visible & (q_seg[:, None] == k_seg[None, :])
    return jnp.where(visible, s, MASKED)


# ----------------------------------------------------------------------------------------------
# Kernels. Refs carry one (batch, head): q_ref (block or T, D), lse_ref (block or T,), slope_ref (16,);
# with segments, qseg_ref and kseg_ref hold int32 segment ids of the rows (block or T,)


def _forward_kernel(slope_ref, q_ref, k_ref, v_ref, *refs, block_k, scale, segmented):
    qseg_ref, kseg_ref, o_ref, lse_ref = refs if segmented else (None, None) + refs
    block_q = q_ref.shape[0]
    i = pl.program_id(2)
    slope = jnp.max(slope_ref[...])
    q = q_ref[...]  # (bq, D)
    q_pos = i * block_q + jnp.arange(block_q)
    q_seg = qseg_ref[...] if segmented else None

    def visit(j, carry):
        m, l, acc = carry  # running max (bq,), running sum (bq,), unnormalised output (bq, D)
        cols = pl.ds(j * block_k, block_k)
        k, v = k_ref[cols, :], v_ref[cols, :]  # (bk, D)
        k_seg = kseg_ref[cols] if segmented else None
        s = _scores(q, k, slope, q_pos, j * block_k + jnp.arange(block_k), scale, q_seg, k_seg)  # (bq, bk)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        correction = jnp.exp(m - m_new)  # rescales what was summed under the old maximum
        l = l * correction + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return m_new, l, acc * correction[:, None] + pv

    m = jnp.full((block_q,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_q,), jnp.float32)
    acc = jnp.zeros(q.shape, jnp.float32)
    # key blocks up to the one holding this block's last query. A block whose keys a row cannot see
    # leaves that row's maximum at MASKED and sums garbage, which the first visible key's correction
    # exp(MASKED - m) = 0 wipes out: every real row sees at least one key (key 0 of its segment)
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv((i + 1) * block_q, block_k), visit, (m, l, acc))
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(slope_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, block_q, scale, segmented):
    qseg_ref, kseg_ref, dk_ref, dv_ref = refs if segmented else (None, None) + refs
    block_k = k_ref.shape[0]
    j = pl.program_id(2)
    slope = jnp.max(slope_ref[...])
    k, v = k_ref[...], v_ref[...]  # (bk, D)
    k_pos = j * block_k + jnp.arange(block_k)
    k_seg = kseg_ref[...] if segmented else None
    n_q = q_ref.shape[0] // block_q

    def visit(i, carry):
        dk, dv = carry  # float32 (bk, D)
        rows = pl.ds(i * block_q, block_q)
        q, do = q_ref[rows, :], do_ref[rows, :]  # (bq, D)
        lse, delta = lse_ref[rows], delta_ref[rows]  # (bq,)
        q_seg = qseg_ref[rows] if segmented else None
        s = _scores(q, k, slope, i * block_q + jnp.arange(block_q), k_pos, scale, q_seg, k_seg)
        p = jnp.exp(s - lse[:, None])  # (bq, bk)
        dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)  # p.T @ dO
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # dO @ v.T
        ds = p * (dp - delta[:, None])  # (bq, bk): gradient of the scaled scores
        dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)  # ds.T @ q
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    # query blocks from the one holding this block's first key to the end
    dk, dv = jax.lax.fori_loop((j * block_k) // block_q, n_q, visit, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(slope_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, block_k, scale, segmented):
    qseg_ref, kseg_ref, dq_ref = refs if segmented else (None, None) + refs
    block_q = q_ref.shape[0]
    i = pl.program_id(2)
    slope = jnp.max(slope_ref[...])
    q, do = q_ref[...], do_ref[...]  # (bq, D)
    lse, delta = lse_ref[...], delta_ref[...]  # (bq,)
    q_pos = i * block_q + jnp.arange(block_q)
    q_seg = qseg_ref[...] if segmented else None

    def visit(j, dq):
        cols = pl.ds(j * block_k, block_k)
        k, v = k_ref[cols, :], v_ref[cols, :]  # (bk, D)
        k_seg = kseg_ref[cols] if segmented else None
        s = _scores(q, k, slope, q_pos, j * block_k + jnp.arange(block_k), scale, q_seg, k_seg)
        p = jnp.exp(s - lse[:, None])
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        return dq + jax.lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)  # ds @ k

    dq = jax.lax.fori_loop(0, pl.cdiv((i + 1) * block_q, block_k), visit, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers on padded (B, T, H, D) inputs; grid (B, H, blocks)


def _specs(T: int, D: int):
    """BlockSpec makers: a (block, D) tile of one (batch, head), all T rows of it, rows of (B, H, T),
    the slope, and segment ids (B, T): a block of them and all T."""
    tile = lambda n: pl.BlockSpec((None, n, None, D), lambda b, h, x: (b, x, h, 0))  # noqa: E731
    whole = pl.BlockSpec((None, T, None, D), lambda b, h, x: (b, 0, h, 0))
    row = lambda n: pl.BlockSpec((None, None, n), lambda b, h, x: (b, h, x))  # noqa: E731
    slope = pl.BlockSpec((None, SLOPE_LANES), lambda b, h, x: (h, 0))
    seg = lambda n: pl.BlockSpec((None, n), lambda b, h, x: (b, x))  # noqa: E731
    seg_whole = pl.BlockSpec((None, T), lambda b, h, x: (b, 0))
    return tile, whole, row, slope, seg, seg_whole


def _call(kernel, grid, in_specs, out_specs, out_shape, opts, name):
    params = {}
    if not opts["interpret"]:
        from jax.experimental.pallas import triton as plgpu

        params["compiler_params"] = plgpu.CompilerParams(num_warps=opts["num_warps"], num_stages=opts["num_stages"])
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=opts["interpret"], name=name, **params)


def _forward(slopes, q, k, v, segments, opts):
    B, T, H, D = q.shape
    bq = bk = opts["block_fwd"]
    tile, whole, row, slope, seg, seg_whole = _specs(T, D)
    segmented = segments is not None
    kernel = functools.partial(_forward_kernel, block_k=bk, scale=opts["scale"], segmented=segmented)
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32))
    specs, args = [slope, tile(bq), whole, whole], [slopes, q, k, v]
    if segmented:
        specs, args = specs + [seg(bq), seg_whole], args + list(segments)
    return _call(kernel, (B, H, T // bq), specs, (tile(bq), row(bq)), out_shape, opts,
                 "flash_alibi_fwd")(*args)  # o (B, T, H, D), lse (B, H, T)


def _backward(slopes, q, k, v, segments, o, lse, do, opts):
    B, T, H, D = q.shape
    b = opts["block_bwd"]
    tile, whole, row, slope, seg, seg_whole = _specs(T, D)
    segmented = segments is not None
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))  # (B, H, T)
    whole_row = pl.BlockSpec((None, None, T), lambda b_, h, x: (b_, h, 0))
    args = [slopes, q, k, v, do, lse, delta] + (list(segments) if segmented else [])
    dkv = functools.partial(_dkv_kernel, block_q=b, scale=opts["scale"], segmented=segmented)
    specs = [slope, whole, tile(b), tile(b), whole, whole_row, whole_row] + ([seg_whole, seg(b)] if segmented else [])
    dk, dv = _call(dkv, (B, H, T // b), specs, (tile(b), tile(b)),
                   (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
                   opts, "flash_alibi_dkv")(*args)
    dq_kernel = functools.partial(_dq_kernel, block_k=b, scale=opts["scale"], segmented=segmented)
    specs = [slope, tile(b), whole, whole, tile(b), row(b), row(b)] + ([seg(b), seg_whole] if segmented else [])
    dq = _call(dq_kernel, (B, H, T // b), specs, tile(b), jax.ShapeDtypeStruct(q.shape, q.dtype), opts,
               "flash_alibi_dq")(*args)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(slopes, q, k, v, segments, opts):
    return _forward(slopes, q, k, v, segments, dict(opts))[0]


def _flash_fwd(slopes, q, k, v, segments, opts):
    o, lse = _forward(slopes, q, k, v, segments, dict(opts))
    return o, (slopes, q, k, v, segments, o, lse)


def _flash_bwd(opts, residuals, do):
    slopes, q, k, v, segments, o, lse = residuals
    dq, dk, dv = _backward(slopes, q, k, v, segments, o, lse, do, dict(opts))
    # the slopes are constants of the model; segment ids are integers (float0 cotangents)
    no_grad = None if segments is None else tuple(np.zeros(s.shape, jax.dtypes.float0) for s in segments)
    return jnp.zeros_like(slopes), dq, dk, dv, no_grad


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------------
# Entry point


def check_settings(block_fwd: int, block_bwd: int, num_warps: int, num_stages: int = NUM_STAGES) -> None:
    """Raises ValueError (one line) unless the blocks are powers of two >= MIN_BLOCK, the warps a power
    of two and the stages at least 1."""
    for name, block in (("block_fwd", block_fwd), ("block_bwd", block_bwd)):
        if block < MIN_BLOCK or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {block}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")


def interpret_by_default() -> bool:
    """Interpret mode everywhere but on an NVIDIA GPU (tests replace this to lower for CUDA on a CPU)."""
    return jax.default_backend() != "gpu"


def flash_alibi_attention(q, k, v, slopes=None, segments=None, *, block_fwd: int = BLOCK_FWD,
                          block_bwd: int = BLOCK_BWD, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                          interpret: bool | None = None) -> jax.Array:
    """Causal self-attention of q, k, v (B, T, H, D) -> (B, T, H, D) in q's dtype, with the ALiBi
    bias -slopes[h] * (i - j) (slopes (H,), e.g. attention.alibi_slopes(H); None: no bias).

    segments, optional: (q_segments, kv_segments), int (B, T) each: query i also needs
    q_segments[b, i] == kv_segments[b, j] to see key j (packed examples, forgetful causal masking;
    attention.Masking). Every query must see at least one key.

    Differentiable in q, k and v. `interpret`: None runs the Triton kernels on a GPU and interpret
    mode on the CPU. Block sizes are powers of two of at least 16; a short sequence uses smaller ones.
    The defaults (BLOCK_FWD, BLOCK_BWD, NUM_WARPS, NUM_STAGES) are the tuning knobs; `python bench.py attention
    --impls pallas:FWDxBWD[xWARPS[xSTAGES]],...` compares settings.
    """
    B, T, H, D = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"flash_alibi_attention is self-attention: q, k, v must share a shape, got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    check_settings(block_fwd, block_bwd, num_warps, num_stages)
    backend = jax.default_backend()
    if backend == "tpu":
        raise ValueError("the Pallas flash-attention kernel is written for NVIDIA GPUs (Triton); on a TPU "
                         "use model.attention=xla or dot_product")
    if interpret is None:
        interpret = interpret_by_default()
    slopes = np.zeros(H, np.float32) if slopes is None else slopes
    slopes = jnp.broadcast_to(jnp.asarray(slopes, jnp.float32)[:, None], (H, SLOPE_LANES))

    # blocks no longer than the (power-of-two rounded) sequence; T padded to whole blocks, D to a power of two
    fit = max(MIN_BLOCK, _next_pow2(T))
    block_fwd, block_bwd = min(block_fwd, fit), min(block_bwd, fit)
    T_pad = -(-T // max(block_fwd, block_bwd)) * max(block_fwd, block_bwd)
    D_pad = max(MIN_BLOCK, _next_pow2(D))
    widths = ((0, 0), (0, T_pad - T), (0, 0), (0, D_pad - D))
    pad = (lambda x: x) if (T_pad, D_pad) == (T, D) else (lambda x: jnp.pad(x, widths))
    # hashable: a static argument of the custom_vjp
    opts = (("block_fwd", block_fwd), ("block_bwd", block_bwd), ("num_warps", num_warps), ("num_stages", num_stages),
            ("interpret", bool(interpret)), ("scale", 1.0 / math.sqrt(D)))
    if segments is not None:  # padded queries and keys get ids no real row has; nothing sees them
        segments = tuple(jnp.pad(jnp.asarray(s, jnp.int32), ((0, 0), (0, T_pad - T)), constant_values=fill)
                         for s, fill in zip(segments, (_PAD_QUERY, _PAD_KEY)))
    y = _flash(slopes, pad(q), pad(k), pad(v), segments, opts)  # (B, T_pad, H, D_pad)
    return y[:, :T, :, :D]
