"""FP8 matrix products by XLA's own rewrite: the projections of a block in float8 on an H100/H200.

    x (B, T, in) ──quantize: x / s_x, clamp to ±448, round to float8_e4m3fn──> q_x ──dequantize: q_x * s_x──┐
    w (in, out)  ──quantize: w / s_w, clamp to ±448, round to float8_e4m3fn──> q_w ──dequantize: q_w * s_w──┴─> dot
    backward: the incoming gradient g ──quantize to float8_e5m2 (±57344), dequantize──> the two gradient dots

Each dot's operands are written as XLA's GPU compiler looks for them (gemm_rewriter.cc): a convert from
float8 to the compute dtype, multiplied by a broadcast scalar scale. On a Hopper (or Ada) GPU with CUDA 12
it turns such a dot into one cuBLASLt FP8 GEMM that reads the float8 tensors and applies both scales to
its float32 accumulator, at twice the bfloat16 peak (1,979 against 989 TFLOP/s dense). Forward operands
are e4m3 (more precision), gradients e5m2 (more range), as Transformer Engine does; a dot of two e5m2
operands has no FP8 kernel and never arises here. Elsewhere (a CPU, a TPU, an older GPU) the same
program runs the dots in the compute dtype on the rounded values: the numerics of FP8, not its speed.

Scaling is per tensor and current: each tensor's scale is computed in the step from its own absolute
maximum, s = amax / fmax (fmax the format's largest finite value: 448 for e4m3, 57344 for e5m2),
rounded to the compute dtype, so that the dequantization multiplies by exactly the scale the
quantization divided by. Nothing is carried between steps (no delayed scaling's history of maxima),
so the training state, its checkpoints and resuming are those of a run without FP8; the cost is a
reduction over each tensor before it is quantized. A tensor of zeros takes scale 1; a non-finite value
stays non-finite (the training step's NaN check sees it). The gradient of quantize-then-dequantize is
taken as the identity (straight through), since the rounding is only a cheaper way to compute the dot.

The quantization divides in float32 and rounds once, to nearest even; the dequantization and the dot
are in the compute dtype (float32 or bfloat16: float16 cannot hold a gradient's scale, amax / 57344,
without underflow). What the step keeps for the backward pass becomes, after the GPU rewrite, the
float8 copies: one byte per element of each projection's input and of its weight.

Flax's own FP8 layers (flax.linen.fp8_ops) keep delayed scaling's state (scales, histories of maxima) as
variables of the model, which would enter the training state and its checkpoints; only the rewrite
pattern is shared with them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

FORWARD = jnp.float8_e4m3fn  # activations and weights: 3 mantissa bits, largest finite 448
GRADIENT = jnp.float8_e5m2  # gradients: 2 mantissa bits, largest finite 57344
COMPUTE_DTYPES = ("float32", "bfloat16")  # the compute dtypes FP8 matrix products run in (model.dtype)


def fmax(fp8_dtype) -> float:
    """The largest finite value of a float8 format."""
    return float(jnp.finfo(fp8_dtype).max)


def scale_of(x: jax.Array, fp8_dtype, dtype) -> jax.Array:
    """The per-tensor scale of x for `fp8_dtype`: amax(|x|) / fmax, rounded to `dtype` (a float32 scalar
    holding a value of `dtype`); 1 where x is all zeros, non-finite where x is."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    # all zeros: any scale will do; NaN > 0 is false, and the NaN stays in x (and in q); an infinite amax gives
    # an infinite scale, and inf / inf a NaN
    scale = jnp.where(amax > 0, amax / fmax(fp8_dtype), 1.0)
    return jax.lax.stop_gradient(scale.astype(dtype).astype(jnp.float32))


def quantize(x: jax.Array, fp8_dtype, scale: jax.Array) -> jax.Array:
    """x / scale in float32, clamped to the format's finite range and rounded to nearest even: (shape of x)
    in `fp8_dtype`."""
    limit = fmax(fp8_dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(fp8_dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """q in `dtype`, times the scalar scale (exact in `dtype`: scale_of rounds it so). The convert and the
    multiply by a broadcast scalar are the pattern the GPU compiler folds into an FP8 GEMM."""
    return q.astype(dtype) * scale.astype(dtype)


def round_trip(x: jax.Array, fp8_dtype, dtype) -> jax.Array:
    """x quantized to `fp8_dtype` with its current scale and dequantized to `dtype`."""
    scale = scale_of(x, fp8_dtype, dtype)
    return dequantize(quantize(x, fp8_dtype, scale), scale, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def forward_operand(x: jax.Array, dtype) -> jax.Array:
    """x rounded to e4m3 and back to `dtype`: an operand of an FP8 dot. Gradient: straight through, in x's
    dtype."""
    return round_trip(x, FORWARD, dtype)


def _forward_operand_fwd(x, dtype):
    return round_trip(x, FORWARD, dtype), jnp.zeros((), x.dtype)  # the residual: a scalar of x's dtype


def _forward_operand_bwd(dtype, x_dtype_scalar, g):
    return (g.astype(x_dtype_scalar.dtype),)


forward_operand.defvjp(_forward_operand_fwd, _forward_operand_bwd)


@jax.custom_vjp
def gradient_in_fp8(y: jax.Array) -> jax.Array:
    """y unchanged; its incoming gradient is rounded to e5m2 (with its own current scale) before the dots
    of the backward pass read it."""
    return y


def _gradient_in_fp8_fwd(y):
    return y, None


def _gradient_in_fp8_bwd(_, g):
    return (round_trip(g, GRADIENT, g.dtype),)


gradient_in_fp8.defvjp(_gradient_in_fp8_fwd, _gradient_in_fp8_bwd)


def einsum(spec: str, x: jax.Array, kernel: jax.Array, dtype) -> jax.Array:
    """jnp.einsum(spec, x, kernel) in FP8: both operands rounded to e4m3 with per-tensor scales, the result in
    `dtype`, and the gradient of the result rounded to e5m2 in the backward pass. x and kernel may be of any
    float dtype (the kernel's float32 is quantized directly: no compute-dtype copy of the weight)."""
    y = jnp.einsum(spec, forward_operand(x, dtype), forward_operand(kernel, dtype))
    return gradient_in_fp8(y)

