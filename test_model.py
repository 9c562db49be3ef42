"""Tests of model.py, each against an expectation computed independently of the model code."""
import dataclasses
import math
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

import model as M
from layers import attention as A
from layers import logical_axes
from layers import loss as loss_lib

TINY = M.GPTConfig(vocab_size=200, block_size=16, embedding_dim=32, num_head=4, N=2)


def build(cfg, seed=0):
    return M.GPT(cfg, rngs=nnx.Rngs(params=seed))


def tokens(shape, vocab=200, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), dtype=jnp.int32)


def loss_fn(graphdef, params, batch, key=None, **masking):
    logits = nnx.merge(graphdef, params)(batch[:, :-1], dropout_key=key, **masking)
    return loss_lib.cross_entropy(logits, batch[:, 1:])[0]


@pytest.mark.parametrize("alibi", [True, False])
def test_causal(alibi):
    cfg = dataclasses.replace(TINY, alibi_attn=alibi, embed_norm=alibi)
    model = build(cfg)
    x = tokens((2, 16))
    t = 6
    y = x.at[:, t + 1 :].set((x[:, t + 1 :] + 7) % 200)  # change every token after position t
    a, b = model(x), model(y)
    np.testing.assert_array_equal(np.asarray(a[:, : t + 1]), np.asarray(b[:, : t + 1]))
    assert not np.allclose(np.asarray(a[:, t + 1 :]), np.asarray(b[:, t + 1 :]))


@pytest.mark.parametrize("n", [8, 12, 16, 20, 24, 32])
def test_alibi_slopes_follow_the_paper(n):
    # Press et al.: for n = 2^k heads, slope_i = 2^(-8 i / n), i = 1..n. Otherwise take the c = 2^floor(log2 n)
    # slopes for c heads, then slopes 2^(-8 j / (2c)) for odd j = 1, 3, 5, ... until there are n.
    c = 1
    while c * 2 <= n:
        c *= 2
    expected = [2 ** (-8 * i / c) for i in range(1, c + 1)]
    expected += [2 ** (-8 * j / (2 * c)) for j in range(1, 4 * c, 2)][: n - c]
    np.testing.assert_allclose(A.alibi_slopes(n), expected, rtol=1e-6)
    if n == 8:  # the paper's example: 1/2, 1/4, ..., 1/256
        np.testing.assert_allclose(A.alibi_slopes(8), [1 / 2 ** i for i in range(1, 9)], rtol=1e-6)


def naive_attention(q, k, v, slopes):
    """Loops over batch, head and query, in float64."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, T, H, D = q.shape
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                s = np.array([q[b, i, h] @ k[b, j, h] / math.sqrt(D) - slopes[h] * (i - j) for j in range(i + 1)])
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, i, h] = sum(p[j] * v[b, j, h] for j in range(i + 1))
    return out


@pytest.mark.parametrize("impl", ["xla", "dot_product"])
def test_attention_adds_alibi_bias_under_causal_mask(impl):
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 7, 4, 8)), jnp.float32) for _ in range(3))
    cfg = dataclasses.replace(TINY, attention=impl)
    got = A.attention(q, k, v, cfg)
    slopes = [2 ** (-8 * i / 4) for i in range(1, 5)]
    np.testing.assert_allclose(np.asarray(got), naive_attention(q, k, v, slopes), atol=1e-5)
    no_alibi = A.attention(q, k, v, dataclasses.replace(cfg, alibi_attn=False))
    np.testing.assert_allclose(np.asarray(no_alibi), naive_attention(q, k, v, [0.0] * 4), atol=1e-5)


def test_alibi_runs_longer_than_trained_and_learned_positions_refuse():
    alibi = build(TINY)
    logits = alibi(tokens((1, 4 * TINY.block_size)))
    assert logits.shape == (1, 64, TINY.padded_vocab_size)
    assert np.isfinite(np.asarray(logits)).all()
    learned = build(dataclasses.replace(TINY, alibi_attn=False))
    learned(tokens((1, TINY.block_size)))  # exactly block_size is fine
    with pytest.raises(ValueError, match="longer than block_size 16"):
        learned(tokens((1, TINY.block_size + 1)))


def expected_param_count(d, n_layer, vocab, block, bias, embed_norm, alibi):
    padded = math.ceil(vocab / 128) * 128
    attn = d * 3 * d + d * d + (3 * d + d if bias else 0)
    mlp = d * 4 * d + 4 * d * d + (4 * d + d if bias else 0)
    ln = d + (d if bias else 0)
    return padded * d + (0 if alibi else block * d) + n_layer * (attn + mlp + 2 * ln) + ln * (2 if embed_norm else 1)


@pytest.mark.parametrize(
    "d,n_layer,vocab,bias,embed_norm,alibi",
    [(32, 2, 200, True, False, True), (48, 3, 300, False, True, False), (64, 1, 129, True, True, False)],
)
def test_param_count(d, n_layer, vocab, bias, embed_norm, alibi):
    cfg = M.GPTConfig(vocab_size=vocab, block_size=24, embedding_dim=d, num_head=4, N=n_layer,
                      bias=bias, embed_norm=embed_norm, alibi_attn=alibi)
    expected = expected_param_count(d, n_layer, vocab, 24, bias, embed_norm, alibi)
    assert M.param_count(cfg) == expected
    abstract = nnx.eval_shape(lambda: build(cfg))  # shapes only
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract))) == expected


def test_named_sizes_have_the_sizes_they_are_named_after():
    sizes = yaml.safe_load((Path(__file__).parent / "conf" / "model_config.yaml").read_text())
    for name, millions in [("124m", 124), ("417m", 417), ("760m", 760), ("1_3b", 1300)]:
        cfg = M.GPTConfig(**sizes[name])
        abstract = nnx.eval_shape(lambda: build(cfg))
        n = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract)))
        assert n == M.param_count(cfg)
        assert abs(n / 1e6 - millions) / millions < 0.01, (name, n)
    small = M.GPTConfig(**sizes["small"])
    # the default job's model must be expressible in BLOOM's layout
    assert small.alibi_attn and small.embed_norm and small.bias and small.gelu_approximate
    assert small.layer_norm_epsilon == 1e-5


def test_flops_per_token_formula():
    cfg = M.GPTConfig(vocab_size=256, block_size=64, embedding_dim=64, num_head=4, N=3)
    n = expected_param_count(64, 3, 256, 64, True, False, True)
    assert M.flops_per_token(cfg, 64) == 6 * n + 6 * 3 * 64 * 64


# LLaMA's and GPT-J's switches: rotary angles, grouped-query heads, SwiGLU, RMSNorm, one shared norm
ROTARY_GQA = {"alibi_attn": False, "rotary_dim": 8, "num_kv_head": 2, "activation": "swiglu", "norm": "rmsnorm",
              "residual": "parallel_shared", "bias": False}


@pytest.mark.parametrize("layout", ["alibi", "rotary_gqa"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("policy", ["full", "save_matmuls"])
def test_remat_gives_the_same_loss_and_gradients(policy, masked, layout):
    """Remat (with its pinned backward pass) changes what is kept, not what is computed: with dropout
    (same keys, same masks), with an attention mask and packed segments, for ALiBi and for rotary
    grouped-query blocks."""
    x = tokens((2, 17))
    key = jax.random.key(3)
    segments = jnp.repeat(jnp.arange(2)[None], 2, 0).repeat(8, 1)  # (2, 16): two packed examples a row
    masking = {"segment_ids": segments, "mask": A.attention_mask(2, 16, segment_ids=segments)} \
        if masked else {}

    results = []
    for remat in ("none", policy):
        cfg = dataclasses.replace(TINY, remat=remat, dropout=0.1, **(ROTARY_GQA if layout == "rotary_gqa" else {}))
        graphdef, params = nnx.split(build(cfg))
        results.append(jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, p, x, key, **masking)))(params))
    (l0, g0), (l1, g1) = results
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_remat_full_keeps_one_input_per_block_for_the_backward_pass(dtype):
    """What the backward pass keeps (the residuals of jax.vjp, by shape alone), per extra block:
    under remat=full at most the block's parameters and its input (B, T, d) in the compute dtype;
    without remat also the (B, H, T, T) float32 attention probabilities and more; save_matmuls
    in between."""
    B, T, d, H = 2, 48, 64, 4
    x = tokens((B, T))

    def kept_bytes(remat, N):
        cfg = dataclasses.replace(TINY, embedding_dim=d, num_head=H, block_size=T, N=N, remat=remat, dtype=dtype)
        graphdef, params = nnx.split(nnx.eval_shape(lambda: build(cfg)))
        residuals = jax.eval_shape(lambda p: jax.vjp(lambda p: nnx.merge(graphdef, p)(x).sum(), p)[1], params)
        size = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa: E731
        return size(residuals), size(params)

    per_block = {}
    for remat in ("none", "full", "save_matmuls"):
        (kept2, params2), (kept4, params4) = kept_bytes(remat, 2), kept_bytes(remat, 4)
        per_block[remat] = (kept4 - kept2) / 2, (params4 - params2) / 2
    kept, block_params = per_block["full"]
    block_input = B * T * d * jnp.dtype(dtype).itemsize
    assert block_input <= kept <= block_params + block_input
    assert per_block["none"][0] > block_params + block_input + B * H * T * T * 4
    assert per_block["full"][0] < per_block["save_matmuls"][0] < per_block["none"][0]


def test_bfloat16_compute_and_attention_implementations_agree():
    x = tokens((4, 17))
    losses = {}
    for dtype in ("float32", "bfloat16"):
        for impl in ("xla", "dot_product"):
            cfg = dataclasses.replace(TINY, dtype=dtype, attention=impl)
            graphdef, params = nnx.split(build(cfg))  # same seed: same float32 parameters
            losses[dtype, impl] = float(jax.jit(lambda p: loss_fn(graphdef, p, x))(params))
    ref = losses["float32", "xla"]
    assert abs(losses["float32", "dot_product"] - ref) < 1e-5 * ref
    assert abs(losses["bfloat16", "xla"] - ref) < 1e-2 * ref
    assert abs(losses["bfloat16", "dot_product"] - ref) < 1e-2 * ref
    assert abs(losses["bfloat16", "dot_product"] - losses["bfloat16", "xla"]) < 1e-2 * ref


def test_padded_vocabulary_rows_never_take_probability():
    """A model whose real logits all sit far below 0, as a trained GPT-2's do: its loss is the
    cross-entropy over the real vocabulary alone (written out in numpy), not diluted by the
    embedding's zero padding rows, whose logit would otherwise be 0 (here 24 of them)."""
    cfg = dataclasses.replace(TINY, vocab_size=1000)  # padded to 1024
    m = build(cfg)
    rng = np.random.default_rng(0)
    u = rng.standard_normal(cfg.embedding_dim)
    wte = np.zeros((cfg.padded_vocab_size, cfg.embedding_dim), np.float32)  # padding rows zero, as an import
    wte[: cfg.vocab_size] = u + 0.3 * rng.standard_normal((cfg.vocab_size, cfg.embedding_dim))
    m.wte[...] = jnp.asarray(wte)
    m.ln_f.scale[...] = jnp.zeros(cfg.embedding_dim)  # the final LayerNorm outputs its bias whatever the input
    bias = -0.5 * u
    m.ln_f.bias[...] = jnp.asarray(bias, jnp.float32)
    batch = tokens((2, 9), vocab=cfg.vocab_size)
    logits = m(batch[:, :-1])

    real = bias @ wte[: cfg.vocab_size].T  # (V,) the same at every position
    assert real.max() < -5  # strongly negative, as trained weights give
    log_probs = real - (real.max() + np.log(np.exp(real - real.max()).sum()))
    want = -log_probs[np.asarray(batch[:, 1:])].mean()
    got = float(loss_lib.cross_entropy(logits, batch[:, 1:])[0])
    assert abs(got - want) < 1e-4 * want
    probs = jax.nn.softmax(logits, axis=-1)
    assert float(probs[..., cfg.vocab_size:].max()) == 0.0
    np.testing.assert_allclose(np.asarray(probs[..., : cfg.vocab_size].sum(-1)), 1.0, rtol=1e-5)


def test_logits_are_float32_in_every_compute_dtype():
    for dtype in ("float32", "bfloat16"):
        assert build(dataclasses.replace(TINY, dtype=dtype))(tokens((1, 8))).dtype == jnp.float32


def _dot_operand_dtypes(fn, *args):
    """The operand dtypes of every matrix product in fn's jaxpr (nested jaxprs included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_tied_logits_backward_runs_in_the_compute_dtype():
    """The logits' float32 gradient enters the two backward products in the compute dtype (plain
    autodiff would make both float32 products, TF32 on a GPU: a fifth of 124m's step on an H100),
    the embedding's gradient stays float32, and in float32 nothing changes at all."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 5, 32), jnp.float32)
    w = jax.random.normal(kw, (256, 32), jnp.float32)
    g = jax.random.normal(kg, (2, 5, 256), jnp.float32)

    def autodiff(x, w, dtype):  # the projection written plainly, as before
        return jnp.einsum("btd,vd->btv", x, w.astype(dtype), preferred_element_type=jnp.float32)

    def grads(f, dtype):
        out, vjp = jax.vjp(lambda a, b: f(a, b, dtype), x.astype(dtype), w)
        return (out, *vjp(g))

    for got, want in zip(grads(loss_lib.tied_logits, jnp.float32), grads(autodiff, jnp.float32)):
        np.testing.assert_array_equal(got, want)  # float32: the same products, bit for bit

    backward = lambda f: lambda a, b: jax.vjp(lambda a, b: f(a, b, jnp.bfloat16), a, b)[1](g)  # noqa: E731
    plain = _dot_operand_dtypes(backward(autodiff), x.astype(jnp.bfloat16), w)
    ours = _dot_operand_dtypes(backward(loss_lib.tied_logits), x.astype(jnp.bfloat16), w)
    assert any("float32" in pair for pair in plain)  # what this replaces: float32 in a product (XLA: TF32)
    assert len(ours) == 3 and all(pair == ("bfloat16", "bfloat16") for pair in ours)  # forward and 2 backward

    exact = grads(autodiff, jnp.float32)
    logits, dx, dw = grads(loss_lib.tied_logits, jnp.bfloat16)
    assert logits.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    for got, want in zip((logits, dx, dw), exact):  # bfloat16 rounding of the operands, no more
        rel = float(jnp.abs(got.astype(jnp.float32) - want).max() / jnp.abs(want).max())
        assert rel < 2e-2


def test_auto_attention_picks_the_measured_fastest_per_backend():
    cfg = M.GPTConfig()  # ALiBi, heads of 64
    assert cfg.attention == "auto"
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    heads96 = dataclasses.replace(bf16, embedding_dim=96 * 12)  # 760m's head size
    assert A.resolve_attention(heads96, "gpu") == "cudnn"  # ALiBi as head dimensions: 96 + 4 -> 104 columns
    assert A.resolve_attention(bf16, "gpu") == "pallas"  # ALiBi heads of 64: pallas measured faster
    assert A.resolve_attention(dataclasses.replace(bf16, alibi_attn=False), "gpu") == "cudnn"
    rotary = dataclasses.replace(bf16, alibi_attn=False, rotary_dim=16)
    assert A.resolve_attention(rotary, "gpu") == "cudnn"  # head size 64
    heads128 = dataclasses.replace(heads96, embedding_dim=128 * 12)  # ALiBi's columns take 128 to 136:
    assert A.resolve_attention(heads128, "gpu", max_head=256) == "cudnn"  # Hopper's cuDNN takes it,
    assert A.resolve_attention(heads128, "gpu", max_head=128) == "pallas"  # an older GPU's does not
    assert A.resolve_attention(dataclasses.replace(heads128, attention="cudnn"), "gpu", max_head=128) == "pallas"
    gptj_heads = dataclasses.replace(rotary, embedding_dim=256 * 12)  # head size 256 without ALiBi: Hopper's limit
    assert A.resolve_attention(gptj_heads, "gpu", max_head=256) == "cudnn"
    assert A.resolve_attention(gptj_heads, "gpu", max_head=128) == "pallas"
    for layout in (bf16, heads96, rotary):  # masked batches (packed examples, FCM): the fused kernels
        assert A.resolve_attention(layout, "gpu", masked=True) == "pallas"
        assert A.resolve_attention(layout, "tpu", masked=True) == "splash"
        assert A.resolve_attention(layout, "tpu") == "splash"
        assert A.resolve_attention(layout, "cpu", masked=True) == "xla"
    assert A.resolve_attention(dataclasses.replace(heads96, attention="cudnn"), "gpu", masked=True) == "pallas"
    assert A.resolve_attention(dataclasses.replace(bf16, attention="dot_product"), "gpu", masked=True) == "xla"
    assert A.resolve_attention(bf16, "cpu") == "xla"
    assert A.resolve_attention(cfg, "gpu") == "xla"  # float32
    assert A.resolve_attention(cfg, "tpu") == "xla"  # float32 ALiBi: the bias form (ALiBi's columns are not exact)
    assert A.resolve_attention(dataclasses.replace(cfg, alibi_attn=False), "tpu") == "splash"  # no ALiBi: exact
    for backend in ("gpu", "tpu"):
        assert A.resolve_attention(dataclasses.replace(bf16, dropout=0.1), backend) == "xla"  # only xla drops
    for impl in ("xla", "dot_product", "cudnn", "pallas", "splash"):  # a named implementation is kept
        assert A.resolve_attention(dataclasses.replace(heads96, attention=impl), "cpu") == impl
    # auto on this backend computes what its choice computes
    x = tokens((2, 9))
    chosen = A.resolve_attention(TINY)
    auto, named = build(dataclasses.replace(TINY, attention="auto")), build(dataclasses.replace(TINY, attention=chosen))
    np.testing.assert_array_equal(auto(x), named(x))


def test_cross_entropy_with_weights():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 5))
    weights = (rng.random((2, 5)) > 0.4).astype(np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    loss, n = loss_lib.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
    assert float(n) == weights.sum()
    np.testing.assert_allclose(float(loss), (nll * weights).sum() / weights.sum(), rtol=1e-5)
    loss, n = loss_lib.cross_entropy(jnp.asarray(logits), jnp.asarray(targets))
    assert float(n) == 10
    np.testing.assert_allclose(float(loss), nll.mean(), rtol=1e-5)


def test_dropout_is_a_function_of_the_key():
    model = build(dataclasses.replace(TINY, dropout=0.2))
    x = tokens((2, 16))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    np.testing.assert_array_equal(np.asarray(model(x, dropout_key=k1)), np.asarray(model(x, dropout_key=k1)))
    assert not np.allclose(np.asarray(model(x, dropout_key=k1)), np.asarray(model(x, dropout_key=k2)))
    assert not np.allclose(np.asarray(model(x, dropout_key=k1)), np.asarray(model(x)))


def test_initial_weights_have_gpt2_standard_deviations():
    n_layer = 4
    cfg = M.GPTConfig(vocab_size=1000, block_size=64, embedding_dim=128, num_head=4, N=n_layer, alibi_attn=False,
                      embed_norm=True)
    model = build(cfg)
    residual = 0.02 / math.sqrt(2 * n_layer)

    def check(w, std):
        w = np.asarray(w).ravel()
        se = std * math.sqrt(2 / w.size)  # standard error of a sample standard deviation
        assert abs(w.std() - std) < 5 * se, (w.std(), std)
        assert abs(w.mean()) < 5 * std / math.sqrt(w.size)

    check(model.wte[...], 0.02)
    check(model.wpe[...], 0.02)
    for block in model.blocks:
        check(block.attn.c_attn.kernel[...], 0.02)
        check(block.mlp.c_fc.kernel[...], 0.02)
        check(block.attn.c_proj.kernel[...], residual)
        check(block.mlp.c_proj.kernel[...], residual)
        for ln in (block.ln_1, block.ln_2):
            np.testing.assert_array_equal(np.asarray(ln.scale[...]), 1.0)
            np.testing.assert_array_equal(np.asarray(ln.bias[...]), 0.0)
        np.testing.assert_array_equal(np.asarray(block.mlp.c_fc.bias[...]), 0.0)


def test_every_parameter_has_logical_axis_names():
    cfg = dataclasses.replace(TINY, alibi_attn=False, embed_norm=True)
    state = nnx.state(build(cfg))
    names = {"batch", "length", "embed", "heads", "kv_heads", "kv", "mlp", "vocab", None}
    leaves = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert len(leaves) == len(jax.tree.leaves(state))
    for var in leaves:
        axes = var.get_metadata("axes")
        assert len(axes) == var[...].ndim
        assert set(axes) <= names


def test_activation_sharding_hook_sees_the_named_activations():
    seen = []

    def to_sharding(axes):
        seen.append(axes)
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])

    graphdef, params = nnx.split(build(TINY))
    with logical_axes.activation_sharding(to_sharding):
        jax.jit(lambda p: nnx.merge(graphdef, p)(tokens((1, 8))))(params)
    assert ("batch", "length", "embed") in seen
    assert ("batch", "length", "heads", "kv") in seen
    assert ("batch", "length", "mlp") in seen
    assert ("batch", "length", "vocab") in seen


def test_the_model_can_learn_a_fixed_batch():
    cfg = M.GPTConfig(vocab_size=128, block_size=32, embedding_dim=64, num_head=4, N=2)
    graphdef, params = nnx.split(build(cfg))
    batch = tokens((4, 33), vocab=128, seed=5)
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    first = None
    for _ in range(300):
        params, opt_state, loss = step(params, opt_state)
        first = float(loss) if first is None else first
    assert first > 4.0  # about ln(128) at the start
    assert float(loss) < 0.1


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="divisible"):
        M.GPTConfig(embedding_dim=30, num_head=4)
    with pytest.raises(ValueError, match="dtype"):
        M.GPTConfig(dtype="float8")
    with pytest.raises(ValueError, match="remat"):
        M.GPTConfig(remat="some")
    with pytest.raises(ValueError, match="dot_product"):
        M.GPTConfig(attention="dot_product", dropout=0.1)
    assert M.GPTConfig(vocab_size=4096).padded_vocab_size == 4096
    assert M.GPTConfig(vocab_size=50257).padded_vocab_size == 50304


# ----------------------------------------------------------------------------------------------
# The chunked loss (GPT.loss with a chunk): the loss over the whole logits is the reference


def largest_array(closed_jaxpr) -> int:
    """The element count of the largest value a jaxpr makes (nested jaxprs included)."""
    largest = 0

    def walk(jaxpr):
        nonlocal largest
        for eqn in jaxpr.eqns:
            largest = max([largest, *(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return largest


def whole_and_chunked(cfg, batch, weights, chunk):
    """((loss, n), gradients) of cross_entropy over the model's whole logits, and of GPT.loss with
    `chunk`, and the largest array each of the two computations makes."""
    graphdef, params = nnx.split(build(cfg))

    def whole(p):
        return loss_lib.cross_entropy(nnx.merge(graphdef, p)(batch[:, :-1]), batch[:, 1:], weights)

    def chunked(p):
        return nnx.merge(graphdef, p).loss(batch[:, :-1], batch[:, 1:], weights, chunk=chunk)

    fns = [jax.value_and_grad(f, has_aux=True) for f in (whole, chunked)]
    return jax.jit(lambda p: [f(p) for f in fns])(params), [largest_array(jax.make_jaxpr(f)(params)) for f in fns]


def check_chunked_loss(cfg, B: int, T: int, weighted: bool, chunk: int):
    """Loss, count and every gradient (embedding, lm_head, logit bias, the blocks through the hidden
    states) of GPT.loss with `chunk` equal those through the whole float32 logits (padded vocabulary
    masked, loss weights if `weighted`), and no array as large as the logits is ever made."""
    batch = tokens((B, T + 1), vocab=cfg.vocab_size)
    weights = jnp.asarray(np.random.default_rng(1).random((B, T)) > 0.3, jnp.float32) if weighted else None
    (((loss, n), grads), ((chunked_loss, chunked_n), chunked_grads)), (whole_size, chunked_size) = \
        whole_and_chunked(cfg, batch, weights, chunk)
    assert float(chunked_n) == float(n) == (float(weights.sum()) if weighted else B * T)
    np.testing.assert_allclose(chunked_loss, loss, rtol=1e-6)
    assert jax.tree.structure(chunked_grads) == jax.tree.structure(grads)
    for got, want in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))
    logits_size = B * T * cfg.padded_vocab_size
    assert whole_size >= logits_size > chunked_size  # B * T > d: the head itself is smaller than the logits


@pytest.mark.parametrize("layout, weighted, chunk", [
    (dict(), False, 16),  # tied head, vocabulary 200 padded to 256; 4 chunks of 4 positions
    (dict(tie_embeddings=False, head_bias=True), True, 12),  # 6 chunks of 3 positions, the last 2 padding
    (dict(head_bias=True, vocab_size=256), True, 20),  # no padding rows; 4 chunks of 4 positions
])
def test_chunked_loss_equals_the_loss_over_the_whole_logits(layout, weighted, chunk):
    check_chunked_loss(dataclasses.replace(TINY, **layout), 4, 16, weighted, chunk)


def test_chunked_loss_in_bfloat16_matches_the_whole_logits():
    """bfloat16 compute: the logits are the same products chunk by chunk, so the loss agrees to float32
    rounding; the gradients, whose products run in bfloat16, are as close to float32 compute's as the
    gradients through the whole logits are (about 1% here: bfloat16 rounding through two blocks)."""
    cfg = dataclasses.replace(TINY, dtype="bfloat16", tie_embeddings=False, head_bias=True)
    batch = tokens((4, 17), vocab=cfg.vocab_size)
    weights = jnp.asarray(np.random.default_rng(1).random((4, 16)) > 0.3, jnp.float32)
    (((loss, _), grads), ((chunked_loss, _), chunked_grads)), _ = whole_and_chunked(cfg, batch, weights, 24)
    (((_, _), exact), _), _ = whole_and_chunked(dataclasses.replace(cfg, dtype="float32"), batch, weights, 24)
    np.testing.assert_allclose(chunked_loss, loss, rtol=1e-6)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(chunked_grads))
    norm = lambda tree: math.sqrt(sum(float(jnp.sum(jnp.square(x))) for x in jax.tree.leaves(tree)))  # noqa: E731
    error = lambda tree: norm(jax.tree.map(jnp.subtract, tree, exact)) / norm(exact)  # noqa: E731
    assert 1e-3 < error(grads) < 3e-2  # bfloat16's rounding, and no more
    assert error(chunked_grads) < 1.25 * error(grads)
