"""The fused attention paths against the reference, on the CPU: ALiBi as extra head dimensions
(alibi_dims.py, what the cudnn path feeds cuDNN, here through XLA's attention), the Pallas kernel and
splash attention (splash.py) in interpret mode, with packed examples and forgetful causal masking as
segment ids, grouped-query heads, and under a device mesh; and no (T, T) array in a fine-tuning
step that takes a fused path."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import alibi_dims
import attention as A
import config
import model as M
import sharding
import step

B, T, H, K, D = 2, 200, 4, 2, 32  # T: not a whole number of any kernel's blocks; K < H: grouped heads


def qkvg(shape=(B, T, H, K, D), seed=0):
    b, t, h, k, d = shape
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (b, t, h, d)), jax.random.normal(keys[1], (b, t, k, d)),
            jax.random.normal(keys[2], (b, t, k, d)), jax.random.normal(keys[3], (b, t, h, d)))


def cfg_for(impl, h=H, k=K, d=D, alibi=True, dtype="float32"):
    return M.GPTConfig(num_head=h, num_kv_head=k, embedding_dim=h * d, alibi_attn=alibi, attention=impl, dtype=dtype)


def value_and_grads(attend, q, k, v, g, dtype):
    """(output, (dq, dk, dv)) of sum(attend(q, k, v) * g), the inputs cast to `dtype` first."""
    def loss(q, k, v):
        y = attend(q.astype(dtype), k.astype(dtype), v.astype(dtype))
        return jnp.sum(y.astype(jnp.float32) * g), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return y, grads


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_matches_reference(attend, cfg, mask=None, dtype=jnp.float32, shape=(B, T, H, K, D), seed=0):
    """attend(q, k, v) and its gradients within 1e-5 (float32) or 1e-2 (bfloat16) of the float32
    reference (attention="xla") over the whole output: ||ours - ref|| / ||ref||."""
    q, k, v, g = qkvg(shape, seed)
    ref_cfg = dataclasses.replace(cfg, attention="xla", dtype="float32")
    want, want_grads = value_and_grads(lambda q, k, v: A.attention(q, k, v, ref_cfg, mask=mask), q, k, v, g,
                                       jnp.float32)
    got, got_grads = value_and_grads(attend, q, k, v, g, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    errors = {"out": rel(got, want), **{f"d{n}": rel(a, b) for n, a, b in zip("qkv", got_grads, want_grads)}}
    assert all(e < tol for e in errors.values()), errors
    return errors


def packed_masking(b=B, t=T, fcm=0.0, seed=1):
    """Three packed examples and padding (id 0) in each row, and with fcm > 0 forgetful causal masking."""
    lengths = [t // 4, t // 3, t // 5]
    segments = np.repeat([1, 2, 3, 0], lengths + [t - sum(lengths)])
    seg = jnp.asarray(np.broadcast_to(segments, (b, t)))
    key = jax.random.key(seed) if fcm else None
    return A.attention_mask(b, t, segment_ids=seg, fcm_key=key, fcm_max_ratio=fcm)


# ----------------------------------------------------------------------------------------------
# ALiBi as head dimensions


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_alibi_columns_make_slope_times_position(dtype):
    """Every column is a number of the compute dtype, and scale * (q_cols . k_cols) is slope * j to
    about 2^-16 (two 16-bit parts of the scaled slope), for every head and position up to 65,535."""
    slopes = A.alibi_slopes(12)  # 12 heads: slopes that are not powers of two
    length, scale = alibi_dims.MAX_POSITIONS if dtype != np.float32 else 8192, 1 / np.sqrt(96)
    q_cols, k_cols = alibi_dims.columns(slopes, length, dtype, scale)
    assert q_cols.dtype == k_cols.dtype == jnp.dtype(dtype)
    assert q_cols.shape == (12, alibi_dims.extra_columns(dtype)) and k_cols.shape[0] == length
    got = scale * (np.asarray(q_cols, np.float64) @ np.asarray(k_cols, np.float64).T)  # (H, T)
    want = slopes.astype(np.float64)[:, None] * np.arange(length)[None, :]
    assert np.abs(got - want).max() <= 2.0**-15 * np.abs(want).max()
    if dtype != np.float32:  # each product of two 16-bit columns is exact in float32, the kernels' accumulator
        products = np.asarray(q_cols, np.float64)[:, None, :] * np.asarray(k_cols, np.float64)[None, ::257, :]
        np.testing.assert_array_equal(products.astype(np.float32).astype(np.float64), products)
        with pytest.raises(ValueError, match="at most 65536 positions"):
            alibi_dims.columns(slopes, length + 1, dtype, scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("alibi", [True, False])
def test_cudnn_path_through_xla_matches_reference(alibi, dtype):
    """The cudnn path's whole computation, ALiBi as head dimensions, odd lengths padded, grouped heads,
    run by XLA's attention instead of cuDNN's kernel (which needs a GPU)."""
    cfg = cfg_for("xla", alibi=alibi)  # cudnn_attention reads only alibi_attn; the config refuses cudnn in float32
    attend = lambda q, k, v: A.cudnn_attention(q, k, v, cfg, implementation="xla")  # noqa: E731
    assert_matches_reference(attend, cfg, dtype=dtype, shape=(B, 37, H, K, D))


def test_alibi_as_head_dimensions_holds_at_long_context():
    """At 2,048 positions with a slope of 1/2 the bias reaches 1,000 inside the scores; the bfloat16
    result still matches the float32 reference within 1e-2, forward and gradients."""
    cfg = cfg_for("xla", h=8, k=8, d=16)
    attend = lambda q, k, v: A.cudnn_attention(q, k, v, cfg, implementation="xla")  # noqa: E731
    assert_matches_reference(attend, cfg, dtype=jnp.bfloat16, shape=(1, 2048, 8, 8, 16))


# ----------------------------------------------------------------------------------------------
# The Pallas kernel and splash attention, masked and not


@pytest.mark.parametrize("impl", ["pallas", "splash"])
@pytest.mark.parametrize("alibi, masking, dtype", [
    (True, None, jnp.float32), (True, "packed", jnp.float32), (True, "fcm", jnp.float32),
    (False, "fcm", jnp.float32), (True, "fcm", jnp.bfloat16), (False, None, jnp.bfloat16),
])
def test_fused_kernels_match_reference(impl, alibi, masking, dtype):
    """The kernels in interpret mode, through attention.attention as the model calls them: ALiBi or no
    bias, whole rows, packed examples, and packed examples under forgetful causal masking."""
    mask = {None: None, "packed": packed_masking(), "fcm": packed_masking(fcm=0.5)}[masking]
    cfg = cfg_for(impl, alibi=alibi, dtype="float32" if dtype == jnp.float32 else "bfloat16")
    assert A.resolve_attention(cfg, masked=mask is not None) == impl
    assert_matches_reference(lambda q, k, v: A.attention(q, k, v, cfg, mask=mask), cfg, mask, dtype)


def test_masking_is_what_the_reference_sees():
    """Packed examples never see each other; under FCM a hidden key is hidden from every query of its
    example (its own included), and each example's first token stays visible."""
    m = packed_masking(fcm=0.5)
    dense = np.asarray(m.dense()) & np.tril(np.ones((T, T), bool))[None]  # causal on top
    seg = np.asarray(m.q_segments)
    assert not (dense & (seg[:, :, None] != seg[:, None, :])).any()
    starts = np.flatnonzero(np.diff(seg[0], prepend=-1))
    hidden = np.asarray(m.kv_segments) == A.HIDDEN
    assert not hidden[:, starts].any() and hidden.any()
    assert not dense[0][:, hidden[0]].any()  # a hidden key: no query sees it
    assert dense.any(axis=2).all()  # every query sees at least one key


@pytest.mark.parametrize("impl", ["pallas", "splash"])
def test_fused_kernels_run_per_device_under_a_mesh(impl):
    """Rows over data x fsdp, heads over tensor: each device runs the kernel on its rows, heads, slopes
    and segment ids (shard_map); the same values and gradients as the reference."""
    mesh = sharding.make_mesh(2, 2, 2)
    rules = sharding.activation_rules(mesh)
    at = rules(("batch", "length", "heads", "kv"))
    mask = packed_masking(b=4, t=128, fcm=0.3)
    cfg = cfg_for(impl, h=4, k=4, d=16)
    attend = lambda q, k, v: A.attention(q, k, v, cfg, mask=mask, sharding=at)  # noqa: E731
    assert_matches_reference(attend, cfg, mask, shape=(4, 128, 4, 4, 16))


# ----------------------------------------------------------------------------------------------
# A fine-tuning step holds no (T, T) array


def large_arrays(compiled_text: str, length: int) -> list[str]:
    """Every array shape in compiled HLO text with two dimensions of at least `length`."""
    shapes = re.findall(r"\b(?:pred|s8|s32|u32|bf16|f16|f32)\[([\d,]+)\]", compiled_text)
    return [s for s in shapes if sum(int(n) >= length for n in s.split(",")) >= 2]


@pytest.mark.parametrize("impl", ["xla", "pallas", "splash"])
def test_finetuning_step_holds_no_t_by_t_array(impl):
    """train.py's step on a prompt/completion batch of packed examples with forgetful causal masking,
    compiled: with a fused kernel no array has two dimensions as long as the context (the reference,
    xla, has them: the check can fail)."""
    seq = 300
    mcfg = M.GPTConfig(vocab_size=128, block_size=seq, embedding_dim=32, num_head=4, N=1, attention=impl)
    t = dataclasses.replace(config.load_config().training, batch_size=2, seq_len=seq, fcm_max_ratio=0.5)
    fns = step.build(mcfg, t, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), zero_stage=0)
    state = fns.abstract_state
    masking = packed_masking(b=2, t=seq)
    batch = {"tokens": jax.ShapeDtypeStruct((2, seq + 1), jnp.int32),
             "weights": jax.ShapeDtypeStruct((2, seq), jnp.float32),
             "segments": jnp.asarray(masking.q_segments)}
    text = fns.train_step.lower(state, batch).compile().as_text()
    found = large_arrays(text, seq)
    if impl == "xla":
        assert found  # (B, H, T, T) scores
    else:
        assert not found, found[:5]
