"""FP8 projections (model.fp8, fp8.py) on the CPU: the rounding against a formula written out here, the
gradients, training beside float32, checkpoints and resume as without FP8, and the dots in the form XLA's
GPU compiler turns into FP8 GEMMs."""
import collections
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import sharding
import train
from layers import fp8
from store import rundir
from test_plan import STEP_CASES, cfg_of, cpus, xla_temp_bytes
from test_train import corpus, deterministic, restore, rows, tiny  # noqa: F401  (corpus is a fixture)
from tokendata import loader, shards
from training import config, devices, plan
from training import step as step_lib

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}  # the formats' largest finite values (OCP FP8: 1.75 x 2^8, 1.75 x 2^15)
FORMATS = {"e4m3": (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn), "e5m2": (jnp.float8_e5m2, ml_dtypes.float8_e5m2)}
COMPUTE = {"float32": (jnp.float32, np.float32), "bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16)}


def expected_round_trip(x, fmt: str, compute: str) -> np.ndarray:
    """x quantized and dequantized, written out: scale = amax / fmax rounded to the compute dtype (1 for a
    tensor of zeros); x / scale in float32, clamped to +-fmax, rounded to nearest even in the format
    (ml_dtypes' cast); back to the compute dtype, times the scale."""
    wide = COMPUTE[compute][1]
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x))
    scale = np.float32(wide(amax / np.float32(FMAX[fmt]))) if amax > 0 else np.float32(1.0)
    q = np.clip(x / scale, -FMAX[fmt], FMAX[fmt]).astype(FORMATS[fmt][1])
    return (q.astype(wide) * wide(scale)).astype(np.float32)


def spread(shape, seed=0) -> np.ndarray:
    """Values over many binades (2^-20 to 2^4, both signs), as activations and gradients are."""
    rng = np.random.default_rng(seed)
    return (rng.choice([-1, 1], shape) * 2.0 ** rng.uniform(-20, 4, shape)).astype(np.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_round_trip_is_the_formula(fmt, compute):
    x = spread((64, 48))
    x[3, 5] = 3.0 * x.max()  # one large value: the scale is set by it, the smallest underflow to zero
    got = np.asarray(fp8.round_trip(jnp.asarray(x), FORMATS[fmt][0], COMPUTE[compute][0]), np.float32)
    want = expected_round_trip(x, fmt, compute)
    np.testing.assert_array_equal(got, want)
    # what the format keeps: 3 (e4m3) or 2 (e5m2) mantissa bits near the top of the range (and bfloat16 its 8
    # in the dequantized product)
    top = np.abs(x) > np.abs(x).max() / 4
    bits = {"e4m3": 3, "e5m2": 2}[fmt]
    assert np.all(np.abs(got[top] - x[top]) <= np.abs(x[top]) * (2.0 ** -(bits + 1) + 2.0 ** -8))
    assert np.any(got[top] != x[top])  # it does round
    # a tensor of zeros stays zeros (scale 1)
    zeros = fp8.round_trip(jnp.zeros((4, 4)), FORMATS[fmt][0], COMPUTE[compute][0])
    assert not np.any(np.asarray(zeros, np.float32))
    # a NaN or an infinity is not hidden by the clamp: the step's finiteness check sees it
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[0, 0] = bad
        assert not np.all(np.isfinite(np.asarray(fp8.round_trip(jnp.asarray(y), FORMATS[fmt][0], jnp.float32))))


def test_einsum_forward_and_gradients_are_the_formula():
    """fp8.einsum's value and gradients against the rounding written out: y = r(x) r(w), dx = r(g) r(w)^T,
    dw = r(x)^T r(g), with r the e4m3 round trip for x and w and the e5m2 one for the incoming gradient g."""
    x, w, g = spread((2, 8, 16), 1), spread((16, 24), 2) / 64, spread((2, 8, 24), 3) / 1e3
    y, vjp = jax.vjp(lambda x, w: fp8.einsum("btd,df->btf", x, w, jnp.float32), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    rx, rw, rg = (expected_round_trip(a, f, "float32") for a, f in ((x, "e4m3"), (w, "e4m3"), (g, "e5m2")))
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    np.testing.assert_allclose(y, np.einsum("btd,df->btf", f64(rx), f64(rw)), rtol=1e-5, atol=1e-6 * np.abs(y).max())
    np.testing.assert_allclose(dx, np.einsum("btf,df->btd", f64(rg), f64(rw)), rtol=1e-5,
                               atol=1e-6 * np.abs(dx).max())
    np.testing.assert_allclose(dw, np.einsum("btd,btf->df", f64(rx), f64(rg)), rtol=1e-5,
                               atol=1e-6 * np.abs(dw).max())
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    # and it is not the plain product: the rounding shows in each
    assert not np.allclose(dw, np.einsum("btd,btf->df", x, g), rtol=1e-3)


# ----------------------------------------------------------------------------------------------
# The step's HLO: each projection's three dots in the form XLA's GPU compiler rewrites into an FP8 GEMM


INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(([^)]*)\)")
# what the rewriter moves in front of the dequantization (gemm_rewriter.cc's MatchFp8Param)
COMMUTES = {"bitcast", "broadcast", "copy", "reshape", "transpose", "slice", "dynamic-slice", "pad"}


def fp8_operand(hlo: dict, name: str) -> str | None:
    """The float8 type a dot operand is dequantized from: through ops that commute with the dequantization, a
    multiply of convert(float8 array) by a broadcast scalar; None otherwise."""
    while hlo[name][1] in COMMUTES:
        name = hlo[name][2][0]
    _, op, args, _ = hlo[name]
    if op != "multiply":
        return None
    for a, b in (args, args[::-1]):
        if hlo[a][1] == "convert" and hlo[hlo[a][2][0]][0].startswith("f8") and hlo[b][1] == "broadcast" \
                and hlo[hlo[b][2][0]][3] == "":  # the broadcast's operand: a scalar
            return hlo[hlo[a][2][0]][0]
    return None


def step_dots(fp8_on: bool, dtype: str) -> list[tuple]:
    """(lhs float8 type or None, rhs likewise) of every dot in the HLO of train.py's step for the test size,
    as jit hands it to XLA."""
    cfg = config.load_config(overrides=["model=test", f"model.dtype={dtype}", f"model.fp8={str(fp8_on).lower()}",
                                        "training.batch_size=2", "training.seq_len=16",
                                        "training.optimizer=adamw"])  # (the model's dots: Muon's add their own)
    fns = step_lib.build(cfg.model, cfg.training, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), 0)
    batch = jax.ShapeDtypeStruct((2, 17), jnp.int32, sharding=fns.batch_sharding)
    text = fns.train_step.lower(fns.abstract_state, batch).as_text(dialect="hlo")
    hlo = {}
    for line in text.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            name, dtype_, dims, op, args = m.groups()
            hlo[name] = (dtype_, op, [a.strip() for a in args.split(",") if a.strip()], dims)
    return [tuple(fp8_operand(hlo, a) for a in args[:2]) for _, op, args, _ in hlo.values() if op == "dot"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_projection_dots_read_dequantized_float8(dtype):
    """Per block, the four projections (q/k/v, attention output, MLP in and out) each make one forward dot of
    two e4m3 operands and two gradient dots of an e5m2 gradient and an e4m3 operand, each operand a convert
    from float8 times a broadcast scalar; the attention's dots and the output head's are untouched, and
    without model.fp8 no dot reads float8."""
    dots = step_dots(True, dtype)
    N = 2  # the test size's blocks
    e4, e5 = "f8e4m3fn", "f8e5m2"
    kinds = collections.Counter(tuple(sorted(map(str, d))) for d in dots)
    assert kinds[(e4, e4)] == 4 * N  # forward
    assert kinds[(e4, e5)] == 8 * N  # the gradients of the inputs and of the weights
    assert kinds[("None", "None")] == len(dots) - 12 * N == 6 * N + 3  # attention (2 + 4 a block), the head (1 + 2)
    assert not [d for d in dots if (d[0] is None) != (d[1] is None)]  # never one operand alone
    assert all(d == (None, None) for d in step_dots(False, dtype)) and len(step_dots(False, dtype)) == len(dots)


# ----------------------------------------------------------------------------------------------
# Training


def trained_losses(corpus, fp8_on: bool, steps: int = 200) -> tuple[float, float]:
    """(mean training loss of the last 20 steps, validation loss on 64 fixed windows) after `steps` steps of
    train.py's step for the test size, 64 wide, in bfloat16 on one device, 8 x 32 tokens a step from the corpus."""
    cfg = config.load_config(overrides=[
        "model=test", "model.vocab_size=300", "model.embedding_dim=64", "model.dtype=bfloat16",
        f"model.fp8={str(fp8_on).lower()}", "training.batch_size=8", "training.seq_len=32", f"training.steps={steps}",
        "training.warmup_steps=20", "training.lr=1e-2", "training.min_lr=1e-3"])
    fns = step_lib.build(cfg.model, cfg.training, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), 0)
    state, batches = fns.init(), loader.open_loader(shards.open_data(corpus), "train", 32, 8, seed=0)
    put = lambda s: jax.device_put(batches.get_batch(s), fns.batch_sharding)  # noqa: E731
    # compiled as users' is, with LLVM's optimisations (the suite's other programs go without): 200 steps of
    # the unoptimised code take 1.6x as long
    train_step = fns.train_step.lower(state, put(0)).compile({"xla_backend_optimization_level": 3})
    losses = []
    for s in range(steps):
        state, metrics = train_step(state, put(s))
        losses.append(metrics["loss"])
    windows = loader.open_loader(shards.open_data(corpus), "val", 32, 64, seed=1).get_batch(0)
    total, count = fns.eval_step(state["params"], {"tokens": jax.device_put(windows, fns.batch_sharding),
                                                   "weights": jax.device_put(np.ones((64, 32), np.float32),
                                                                             fns.batch_sharding)})
    return float(np.mean(jax.device_get(losses[-20:]))), float(total) / float(count)


def test_training_in_fp8_reaches_the_loss_of_bfloat16(corpus):
    """200 steps of the test size (64 wide) with the projections in FP8 end within 2% of the same run in bfloat16, in
    training loss and validation loss; both have learnt (from ln 300 = 5.7)."""
    (train8, val8), (train16, val16) = trained_losses(corpus, True), trained_losses(corpus, False)
    assert val16 < 2.5 and train16 < 2.5
    assert abs(train8 / train16 - 1) < 0.02 and abs(val8 / val16 - 1) < 0.02, (train8, train16, val8, val16)


@pytest.fixture(scope="module")
def fp8_run(corpus, tmp_path_factory):
    """train.py's tiny run with the projections in FP8, over 4 data-parallel devices and 2 tensor-parallel ones
    (the scales' maxima taken across them): checkpoints at steps 4 and 8."""
    run_dir = tmp_path_factory.mktemp("runs") / "fp8"
    assert train.main(tiny(run_dir, corpus, "model.fp8=true", "sharding.data=4", "sharding.tensor=2")) == 0
    return run_dir


def test_fp8_run_resumes_exactly(fp8_run, tmp_path):
    """Crashed after the checkpoint at step 4 and resumed: steps 5..8 and the final state equal the straight
    run's (nothing of FP8 is carried between steps, so nothing is missing from the checkpoint)."""
    crashed = tmp_path / "crashed"
    shutil.copytree(fp8_run, crashed)
    shutil.rmtree(crashed / "checkpoints" / "8")
    (crashed / "summary.json").unlink()
    assert train.main(["--resume", f"run_dir={crashed}"]) == 0
    assert [deterministic(r) for r in rows(crashed)] == [deterministic(r) for r in rows(fp8_run)]
    for x, y in zip(jax.tree.leaves(restore(fp8_run, 8)), jax.tree.leaves(restore(crashed, 8)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_fp8_checkpoint_is_a_plain_runs(fp8_run, tmp_path):
    """The run's config says fp8; its checkpoints hold what a run without FP8 holds, and such a run continues
    from them (--resume model.fp8=false), writing a checkpoint of the very same tree, shapes and dtypes."""
    assert rundir.Run(fp8_run).record.config().model.fp8 is True
    plain = tmp_path / "plain"
    shutil.copytree(fp8_run, plain)
    shutil.rmtree(plain / "checkpoints" / "8")
    (plain / "summary.json").unlink()
    assert train.main(["--resume", f"run_dir={plain}", "model.fp8=false"]) == 0
    assert rundir.Run(plain).record.config().model.fp8 is False
    described = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    assert described(restore(plain, 8)) == described(restore(fp8_run, 8))
    steps = [r["loss"] for r in rows(plain)], [r["loss"] for r in rows(fp8_run)]
    assert steps[0][:4] == steps[1][:4] and steps[0][4:] != steps[1][4:]  # computed without FP8 from step 5


def test_fp8_needs_a_wide_enough_compute_dtype():
    with pytest.raises(config.ConfigError, match=r"^model.fp8 needs model.dtype float32 or bfloat16, got 'float16'"):
        config.load_config(overrides=["model=test", "model.fp8=true", "model.dtype=float16"])
    assert config.load_config(overrides=["model=test"]).model.fp8 is False  # off unless asked


# ----------------------------------------------------------------------------------------------
# The plan


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_counts_the_float8_copies_on_a_gpu(remat, dtype):
    """On a GPU, FP8 adds to each block whose activations are kept (all without remat, the one recomputed
    under it) the float8 copy of each projection's input, which the gradients' products read (both norms'
    outputs, the attended values, the MLP's activation: 3d + F bytes a token), and the float8 copy of its
    projection weights (4d^2 + 2dF bytes), which replaces their compute-dtype copy (c bytes each, where c < 4)."""
    fields = {"dtype": dtype, "remat": remat, "attention": "xla"}
    plain, fp8_cfg = (cfg_of({**STEP_CASES[2][0], **fields, "fp8": on}, size="x", batch=8, loss_chunk=0)
                      for on in (False, True))
    m, gpu = plain.model, devices.target("H100")
    d, F, N, BT = m.embedding_dim, m.ffn_dim, m.N, 8 * plain.seq_len
    c = {"float32": 4, "bfloat16": 2}[dtype]
    weights = 3 * d * d + d * d + 2 * d * F  # q/k/v, attention output, MLP in and out, per block
    inputs = (3 * d + F) * BT
    blocks_keeping = N if remat == "none" else 1  # under remat one block's activations, recomputed
    want = blocks_keeping * (inputs + weights - (weights * c if c < 4 else 0))
    e, e8 = plan.estimate(plain, gpu), plan.estimate(fp8_cfg, gpu)
    assert e8.total - e.total == want
    assert {k: v for k, v in e8.terms.items() if v != e.terms[k]}.keys() <= {
        "activations kept for the backward pass", "one block recomputed in the backward pass"}
    assert "(projections in FP8)" in plan.report(fp8_cfg, gpu)


def test_plan_with_fp8_matches_xla_compiled_step():
    """Without FP8 GEMMs (the CPU), the dots read the weights and inputs dequantized in the compute dtype; the
    plan's sum of the activation terms (there: the float32 dequantized weights) stays within 15% of XLA's figure
    for the compiled step, as without FP8 (test_plan.py)."""
    fields, batch, micro, mesh = STEP_CASES[1]
    cfg = cfg_of({**fields, "embed_norm": True, "attention": "xla", "fp8": True}, size="x",
                 batch=batch, micro=micro, mesh=mesh)
    e = plan.estimate(cfg, cpus(1))
    planned = e.total - e.terms["parameters"] - e.terms["optimizer state"]
    measured = xla_temp_bytes(cfg, mesh)
    assert abs(planned / measured - 1) < 0.15, (planned, measured)
