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

import model as M
import sharding
from layers import alibi_dims
from layers import attention as A
from training import config, step

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
    """Every column is a number of the compute dtype, and scale * (q_cols . k_cols) is slope * (j - T // 2)
    (positions from the middle) to about 2^-16 (two 16-bit parts of the scaled slope), for every head and
    position up to 65,536."""
    slopes = A.alibi_slopes(12)  # 12 heads: slopes that are not powers of two
    length, scale = alibi_dims.MAX_POSITIONS if dtype != np.float32 else 8192, 1 / np.sqrt(96)
    q_cols, k_cols = alibi_dims.columns(slopes, length, dtype, scale)
    assert q_cols.dtype == k_cols.dtype == jnp.dtype(dtype)
    assert q_cols.shape == (12, alibi_dims.extra_columns(dtype)) and k_cols.shape[0] == length
    got = scale * (np.asarray(q_cols, np.float64) @ np.asarray(k_cols, np.float64).T)  # (H, T)
    want = slopes.astype(np.float64)[:, None] * (np.arange(length) - length // 2)[None, :]
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


# ----------------------------------------------------------------------------------------------
# Exact at every length: ALiBi as head dimensions only where it stays within the kernels' own rounding

# three heads: 128 heads' first slope (0.96, about the steepest any model has) and two flat ones (0.016,
# 0.0041: attention spread over thousands of keys), whose scaled slopes lose most to a 16-bit rounding
# (the low part matters most); heads of 96 (760m's, whose 1/sqrt(96) is no power of two)
LONG_SLOPES = A.alibi_slopes(128)[[0, 94, 126]]
LONG_D, LONG_ROWS = 96, 32


def long_inputs(length, dtype, seed=0):
    """q, k, v (1, length, 3, 96) in `dtype`; the float64 ALiBi scores (3, rows, length) of the last
    LONG_ROWS queries from those same rounded numbers (-inf above the diagonal), and their attention
    output (1, rows, 3, 96)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((1, length, 3, LONG_D), np.float32) * s).astype(dtype)
               for s in (2.0, 1.0, 1.0))  # q twice as large: sharper attention than unit scores
    q64, k64, v64 = (np.asarray(x[0].astype(jnp.float32), np.float64) for x in (q[:, -LONG_ROWS:], k, v))  # (T, H, D)
    i, j = np.arange(length - LONG_ROWS, length)[:, None], np.arange(length)[None, :]
    logits, want = [], []
    for h, slope in enumerate(LONG_SLOPES.astype(np.float64)):  # one head: (T, D) each
        scores = np.where(j <= i, q64[:, h] @ k64[:, h].T / np.sqrt(LONG_D) - slope * (i - j), -np.inf)  # (rows, T)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        logits.append(scores)
        want.append(p / p.sum(-1, keepdims=True) @ v64[:, h])  # (rows, D)
    return q, k, v, np.stack(logits), np.stack(want, axis=1)[None]


def dot32(a, b):
    """a (1, rows, H, n) . b (1, T, H, n) -> (1, H, rows, T) as the kernels form it: every product of two
    16-bit numbers is exact in float32, and the sum is accumulated in float32."""
    return jnp.einsum("bqhd,bkhd->bhqk", a.astype(jnp.float32), b.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def last_rows(scores, v):
    """A kernel's end of attention for the last rows: float32 scores (1, H, rows, T) masked causally, a
    float32 softmax, the probabilities in v's dtype times v accumulated in float32, the output in v's dtype."""
    T, rows = scores.shape[-1], scores.shape[-2]
    visible = jnp.arange(T)[None, :] <= jnp.arange(T - rows, T)[:, None]
    p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(v.dtype).astype(jnp.float32)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST).astype(v.dtype)


@jax.jit
def forms(q, k, v):
    """({form: last rows' output}, {form: their float32 scores (H, rows, T)}) as each implementation forms
    ALiBi: the bias form (xla, dot_product, pallas: the bias added to each scaled float32 score) and the
    two kernels that carry it as head dimensions, with alibi_dims' real columns: cudnn (q . k accumulated
    in float32 with the columns, then scaled) and splash (q scaled by splash.scaled_query, a scale of 1)."""
    from layers import splash
    T, scale = q.shape[1], 1 / np.sqrt(LONG_D)
    i, j = jnp.arange(T - LONG_ROWS, T)[:, None], jnp.arange(T)[None, :]
    rows = lambda x: x[:, -LONG_ROWS:]  # noqa: E731
    cq, ck = alibi_dims.extend(q, k, LONG_SLOPES, A.CUDNN_MULTIPLE, scale=scale)
    sq, sk = alibi_dims.extend(*splash.scaled_query(q, k), LONG_SLOPES, splash.LANES, scale=1.0)
    scores = {"bias": dot32(rows(q), k) * scale - jnp.asarray(LONG_SLOPES)[:, None, None] * (i - j).astype(jnp.float32),
              "cudnn": dot32(rows(cq), ck) * scale, "splash": dot32(rows(sq), sk)}
    return {name: last_rows(x, v) for name, x in scores.items()}, {name: x[0] for name, x in scores.items()}


def logits_error(scores, logits64) -> np.ndarray:
    """Per head, the largest error of a form's scores against the float64 ALiBi scores, each taken
    relative to its row's own diagonal (a softmax sees nothing else), over the keys that carry weight
    (probability above 1e-6 of the row's largest)."""
    rows = np.arange(LONG_ROWS)
    diagonal = np.arange(logits64.shape[-1] - LONG_ROWS, logits64.shape[-1])
    got = np.asarray(scores, np.float64)
    got, want = (x - x[:, rows, diagonal][:, :, None] for x in (got, logits64))
    weighty = logits64 >= logits64.max(-1, keepdims=True) + np.log(1e-6)
    return np.where(weighty, np.abs(got - want), 0).max(axis=(1, 2))


def form_of(impl: str) -> str:
    return impl if impl in A.ALIBI_AS_COLUMNS else "bias"


def resolved_everywhere(dtype, length):
    """{(backend, chosen implementation): what runs} for 760m's heads (16 of 96) with ALiBi at `length`."""
    chosen = {}
    for impl in A.ATTENTION_IMPLS:
        if impl == "cudnn" and dtype == "float32":
            continue  # refused by the config (test_model)
        cfg = cfg_for(impl, h=16, k=16, d=LONG_D, dtype=dtype)
        for backend in ("cpu", "gpu", "tpu"):
            chosen[backend, impl] = A.resolve_attention(cfg, backend, length=length, max_head=256)
    return chosen


def test_float32_alibi_within_1e5_at_8192_on_every_path():
    """In float32 every implementation, `auto` on every backend included, stays within 1e-5 of the float64
    ALiBi reference at T = 8192. ALiBi as head dimensions would not (its float32 accumulator holds
    s + m (j - c), whose rounding grows with T): resolve_attention gives float32 the bias form."""
    q, k, v, _, want = long_inputs(8192, jnp.float32)
    errors = {name: rel(y, want) for name, y in forms(q, k, v)[0].items()}
    assert errors["bias"] < 1e-6, errors
    for where, impl in resolved_everywhere("float32", 8192).items():
        assert errors[form_of(impl)] < 1e-5, (where, impl, errors)


@pytest.mark.parametrize("dtype, length", [("bfloat16", alibi_dims.MAX_POSITIONS), ("float16", 32768)])
def test_16_bit_alibi_within_its_rounding_at_the_longest_length(dtype, length):
    """In bfloat16 at 65,536 positions (the columns' limit) and float16 at 32,768 (its bound), every
    implementation on every backend stays within the dtype's own rounding: <= 1e-2 and no worse than
    the bias form by more than 2x. The columns' scores err by no more than their float32 accumulator's
    rounding of the largest bias it holds (16 units of m T / 2), or 2^-12 (a sixteenth of bfloat16's
    rounding of the probabilities) on flat heads, whose slopes' low parts that bound needs."""
    q, k, v, logits64, want = long_inputs(length, jnp.dtype(dtype))
    outputs, scores = forms(q, k, v)
    errors = {name: rel(y, want) for name, y in outputs.items()}
    chosen = resolved_everywhere(dtype, length)
    assert {"cudnn", "splash"} <= set(chosen.values())  # the identity is used at this length
    for where, impl in chosen.items():
        assert errors[form_of(impl)] <= min(1e-2, 2 * errors["bias"]), (where, impl, errors)
    bound = np.maximum(2.0**-21 * LONG_SLOPES * length, 2.0**-12)  # (H,)
    for name in A.ALIBI_AS_COLUMNS:
        err = logits_error(scores[name], logits64)
        assert (err <= bound).all(), (name, err, bound)


def test_past_the_bound_alibi_takes_the_bias_form():
    """One position past the identity's bound in each dtype, nothing chooses the columns: cudnn and auto
    take pallas on a GPU, splash and auto take xla on a TPU."""
    for dtype in ("bfloat16", "float16", "float32"):
        length = alibi_dims.exact_length(jnp.dtype(dtype)) + 1
        chosen = resolved_everywhere(dtype, length)
        assert not set(chosen.values()) & set(A.ALIBI_AS_COLUMNS), chosen
        if dtype != "float32":
            assert chosen["gpu", "auto"] == chosen["gpu", "cudnn"] == "pallas"
        assert chosen["tpu", "auto"] == chosen["tpu", "splash"] == "xla"
        short = resolved_everywhere(dtype, 2048)  # within the bound (float32: none) the kernels as before
        assert short["tpu", "auto"] == ("xla" if dtype == "float32" else "splash")


def test_past_65536_positions_every_implementation_traces():
    """A bfloat16 model's attention at 65,536 + 128 positions (an 8x evaluation of a context of 8,208)
    traces with every implementation that can run here: the columns would raise in the trace, and the
    model's call resolves at its own length."""
    T = alibi_dims.MAX_POSITIONS + 128
    q = jax.ShapeDtypeStruct((1, T, 4, 32), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, 2, 32), jnp.bfloat16)
    for impl in A.ATTENTION_IMPLS:  # cudnn resolves to pallas here (interpret mode on the CPU), splash to xla
        cfg = cfg_for(impl, dtype="bfloat16")
        y = jax.eval_shape(lambda q, k, v: A.attention(q, k, v, cfg), q, kv, kv)  # noqa: B023
        assert y.shape == q.shape and y.dtype == jnp.bfloat16
    tiny = M.GPTConfig(vocab_size=64, block_size=64, embedding_dim=64, num_head=2, N=1, dtype="bfloat16",
                       attention="splash")
    from flax import nnx

    model = nnx.eval_shape(lambda: M.GPT(tiny, rngs=nnx.Rngs(params=0)))
    logits = nnx.eval_shape(lambda m, x: m(x), model, jax.ShapeDtypeStruct((1, T), jnp.int32))
    assert logits.shape[:2] == (1, T)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the lines a CPU gets")
def test_what_cannot_run_as_chosen_says_so_at_start_up(tmp_path, capsys):
    """train.py on a CPU says once, before any work, that pallas or splash runs in interpret mode, and
    that splash hands float32 ALiBi to the bias form; cudnn is refused for the missing GPU first, in
    float32 too (only on a GPU does the dtype come next)."""
    import train

    def start(*overrides):  # a missing data directory stops the run after the start-up lines
        rc = train.cli([f"run_dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'none'}", "model=test", *overrides])
        out, err = capsys.readouterr()
        assert rc == 2 and not (tmp_path / "run").exists(), err
        return out, err.strip().splitlines()

    for overrides, note in [(["model.attention=pallas"], "model.attention=pallas runs in Pallas's interpret mode"),
                            (["model.attention=splash", "model.dtype=bfloat16"],
                             "model.attention=splash runs in Pallas's interpret mode"),
                            (["model.attention=splash"],
                             "model.attention=splash carries ALiBi as head dimensions, which is not exact in "
                             "float32: attention runs as xla"),
                            (["model.attention=xla"], None), (["model.attention=auto"], None)]:
        out, err = start(*overrides)
        assert out.count("note: ") == (note is not None) and (note is None or f"note: {note}" in out), out
        assert err[-1].endswith("index.json not found; prepare the data with `python data.py`")
    for overrides in (["model.attention=cudnn"], ["model.attention=cudnn", "model.dtype=bfloat16"]):
        out, err = start(*overrides)
        assert err == ["error: model.attention=cudnn needs an NVIDIA GPU (cuDNN); this JAX runs on cpu: use "
                       "attention=xla, dot_product or pallas" + ("" if "model.dtype=bfloat16" in overrides else
                       "; on a GPU, cudnn needs model.dtype bfloat16 or float16 too")], err


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what a CPU chooses")
def test_a_reader_picks_an_implementation_this_machine_runs():
    """eval.py's choice (attention_here): the run's own where it runs compiled here, else auto with one
    line saying why; a requested one that cannot run here is refused with check_attention_backend's line."""
    saved = {impl: cfg_for(impl, dtype="bfloat16") for impl in A.ATTENTION_IMPLS}
    for impl in ("auto", "xla", "dot_product"):
        assert A.attention_here(saved[impl]) == (saved[impl], None)
    for impl, why in (("cudnn", "model.attention=cudnn needs an NVIDIA GPU (cuDNN); this JAX runs on cpu"),
                      ("pallas", "model.attention=pallas would run in Pallas's interpret mode here"),
                      ("splash", "model.attention=splash would run in Pallas's interpret mode here")):
        chosen, note = A.attention_here(saved[impl])
        assert chosen == dataclasses.replace(saved[impl], attention="auto")
        assert note == f"{why}: reading this run with attention=auto (xla) instead (--attention chooses another)"
    chosen, note = A.attention_here(saved["cudnn"], "pallas")  # asked for: runs, and the line says how
    assert chosen.attention == "pallas" and "interpret mode" in note
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        A.attention_here(saved["xla"], "cudnn")
    with pytest.raises(ValueError, match="model.attention must be one of"):
        A.attention_here(saved["xla"], "flash")


# ----------------------------------------------------------------------------------------------
# The Pallas kernel and splash attention, masked and not


F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("impl, alibi, masking, dtype", [
    ("pallas", True, None, F32), ("pallas", True, "packed", F32), ("pallas", True, "fcm", F32),
    ("pallas", False, "fcm", F32), ("pallas", True, "fcm", BF16),
    # splash: ALiBi (as head dimensions) in 16-bit types only; float32 ALiBi takes the bias form
    ("splash", True, None, BF16), ("splash", True, "packed", BF16), ("splash", True, "fcm", BF16),
    ("splash", False, "fcm", F32),
])
def test_fused_kernels_match_reference(impl, alibi, masking, dtype):
    """The kernels in interpret mode, through attention.attention as the model calls them: ALiBi or no
    bias, whole rows, packed examples, and packed examples under forgetful causal masking."""
    mask = {None: None, "packed": packed_masking(), "fcm": packed_masking(fcm=0.5)}[masking]
    cfg = cfg_for(impl, alibi=alibi, dtype="float32" if dtype == jnp.float32 else "bfloat16")
    assert A.resolve_attention(cfg, masked=mask is not None) == impl
    assert_matches_reference(lambda q, k, v: A.attention(q, k, v, cfg, mask=mask), cfg, mask, dtype)


def test_splash_scales_q_without_a_rounding_of_its_own():
    """Splash applies no scale, and q / sqrt(96) rounded to bfloat16 is one rounding more than the
    reference makes (it scales float32 scores): with sharp scores that made splash's error 2.6x the
    reference's. Carried as a bfloat16 pair, the scaled q costs nothing: splash's bfloat16 output is as
    close to the float64 ALiBi attention of the same inputs as the bias-form reference's (xla)."""
    t, h, d = 256, 2, 96
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, h, d)) * s, jnp.bfloat16) for s in (10.0, 1.0, 1.0))
    q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64)[0].transpose(1, 0, 2) for x in (q, k, v))
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    scores = q64 @ k64.transpose(0, 2, 1) / np.sqrt(d) - A.alibi_slopes(h).astype(np.float64)[:, None, None] * (i - j)
    scores = np.where(j <= i, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True) @ v64).transpose(1, 0, 2)[None]  # (1, T, H, D)
    errors = {impl: rel(A.attention(q, k, v, cfg_for(impl, h=h, k=h, d=d, dtype="bfloat16")), want)
              for impl in ("xla", "splash")}
    assert errors["splash"] <= 1.25 * errors["xla"], errors


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
    dtype = "bfloat16" if impl == "splash" else "float32"  # splash's ALiBi: 16-bit types
    cfg = cfg_for(impl, h=4, k=4, d=16, dtype=dtype)
    assert A.resolve_attention(cfg, masked=True, length=128) == impl
    attend = lambda q, k, v: A.attention(q, k, v, cfg, mask=mask, sharding=at)  # noqa: E731
    assert_matches_reference(attend, cfg, mask, shape=(4, 128, 4, 4, 16), dtype=jnp.dtype(dtype).type)


# ----------------------------------------------------------------------------------------------
# A fine-tuning step holds no (T, T) array


def large_arrays(compiled_text: str, length: int) -> list[str]:
    """Every array shape in compiled HLO text with two dimensions of at least `length`."""
    shapes = re.findall(r"\b(?:pred|s8|s32|u32|bf16|f16|f32)\[([\d,]+)\]", compiled_text)
    return [s for s in shapes if sum(int(n) >= length for n in s.split(",")) >= 2]


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.parametrize("impl", ["xla", "pallas", "splash", *(["cudnn"] if ON_GPU else [])])  # cudnn: a GPU's
def test_finetuning_step_holds_no_t_by_t_array(impl):
    """train.py's step on a prompt/completion batch of packed examples with forgetful causal masking,
    compiled: with a fused kernel no array has two dimensions as long as the context (the reference,
    xla, has them: the check can fail). cudnn (on a GPU) hands masked batches to pallas: its step is
    compiled on a plain batch of whole rows too, where cuDNN's kernel runs."""
    seq = 300
    dtype = "bfloat16" if impl == "cudnn" else "float32"
    alibi = impl != "splash"  # splash's ALiBi takes 16-bit types, which its kernel compiles far slower in on a CPU
    mcfg = M.GPTConfig(vocab_size=128, block_size=seq, embedding_dim=32, num_head=4, N=1, attention=impl,
                       dtype=dtype, alibi_attn=alibi, embed_norm=alibi)
    assert A.resolve_attention(mcfg, masked=True, length=seq) == ("pallas" if impl == "cudnn" else impl)
    masked = dataclasses.replace(config.load_config().training, batch_size=2, seq_len=seq, fcm_max_ratio=0.5)
    masking = packed_masking(b=2, t=seq)
    batches = [(masked, {"tokens": jax.ShapeDtypeStruct((2, seq + 1), jnp.int32),
                         "weights": jax.ShapeDtypeStruct((2, seq), jnp.float32),
                         "segments": jnp.asarray(masking.q_segments)})]
    if impl == "cudnn":  # the plain step: no segments, no FCM
        plain = dataclasses.replace(masked, fcm_max_ratio=0.0)
        assert A.resolve_attention(mcfg, length=seq) == impl
        batches.append((plain, jax.ShapeDtypeStruct((2, seq + 1), jnp.int32)))
    for t, batch in batches:
        fns = step.build(mcfg, t, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), zero_stage=0)
        text = fns.train_step.lower(fns.abstract_state, batch).compile().as_text()
        found = large_arrays(text, seq)
        if impl == "xla":
            assert found  # (B, H, T, T) scores
        else:
            assert not found, found[:5]
