"""Tests of sharding.py: ZeRO stages 0-3 and tensor parallelism against one device, the rules
table, gradients that leave the reduction sharded, resharding on restore, two processes with gloo.

Runs on the 8 simulated CPU devices of conftest.py; the 4-device and two-process runs are
subprocesses of `python train.py` with their own XLA_FLAGS.
"""
import dataclasses
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import model
import sharding
import train
from layers import logical_axes
from layers import loss as loss_lib
from store import rundir
from test_model import largest_array
from test_multihost import finish, run_subprocess
from test_train import corpus, rows, tiny  # noqa: F401  (corpus is a fixture)
from training import config
from training import step as step_lib

REPO = pathlib.Path(__file__).resolve().parent
Z = ("data", "fsdp")  # the ZeRO / data-parallel axes as a PartitionSpec entry


def tiny_model(cfg=None):
    cfg = cfg or config.load_config(overrides=["model=test", "model.vocab_size=300"]).model
    abstract = nnx.eval_shape(lambda: model.GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, variables = nnx.split(abstract)
    return cfg, graphdef, variables


def loss_fn(graphdef, variables, params, tokens):
    fresh = jax.tree.map(lambda v: v, variables)
    nnx.replace_by_pure_dict(fresh, params)
    logits = nnx.merge(graphdef, fresh)(tokens[:, :-1])
    return loss_lib.cross_entropy(logits, tokens[:, 1:])[0]


def one_step(mesh, stage, params, opt_state, tokens, cfg=None):
    """Loss, gradients and one AdamW update of the `test` size (or `cfg`), placed by sharding.py for
    `stage` on `mesh`.

    A large epsilon keeps Adam's first update smooth in the gradient (with 1e-8 it is lr * sign(g),
    which rounding-level gradients flip between one device and eight).
    """
    cfg, graphdef, variables = tiny_model(cfg)
    tx = optax.adamw(1e-2, eps=1e-3, weight_decay=0.1)
    abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, params)
    axes = nnx.to_pure_dict(logical_axes.param_axes(variables))
    shardings, grad_sh, _ = sharding.state_shardings(abstract, axes, mesh, stage)
    act = sharding.activation_rules(mesh)

    def step(state, tokens):
        with logical_axes.activation_sharding(act):
            loss, g = jax.value_and_grad(lambda p: loss_fn(graphdef, variables, p, tokens))(state["params"])
        g = jax.lax.with_sharding_constraint(g, grad_sh)
        updates, opt = tx.update(g, state["opt_state"], state["params"])
        return loss, g, {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}

    state = jax.device_put({"params": params, "opt_state": opt_state}, shardings)
    batch = sharding.place_batch(tokens, mesh, tokens.shape[0])
    step = jax.jit(step, in_shardings=(shardings, sharding.batch_sharding(mesh)))  # outputs: as XLA propagates
    return step, state, batch, grad_sh


@pytest.fixture(scope="module")
def init():
    cfg, graphdef, variables = tiny_model()
    params = nnx.to_pure_dict(nnx.state(model.GPT(cfg, rngs=nnx.Rngs(params=jax.random.key(1)))))
    opt_state = optax.adamw(1e-2, eps=1e-3, weight_decay=0.1).init(params)
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (8, 33), 0, 300), np.int32)
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    step, state, batch, _ = one_step(one, 0, params, opt_state, tokens)
    return params, opt_state, tokens, jax.device_get(step(state, batch))  # the single-device reference


@pytest.mark.parametrize("mesh_sizes, stage", [
    ((8, 1, 1), 0), ((8, 1, 1), 1), ((4, 2, 1), 2), ((2, 4, 1), 3), ((2, 1, 4), 0), ((2, 2, 2), 3),
])
def test_stages_and_tensor_parallel_match_one_device(init, mesh_sizes, stage):
    params, opt_state, tokens, (ref_loss, ref_g, ref_new) = init
    mesh = sharding.make_mesh(*mesh_sizes)
    step, state, batch, grad_sh = one_step(mesh, stage, params, opt_state, tokens)
    loss, g, new = step(state, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    # the gradients leave the step where the table puts them: split over the data-parallel
    # devices from stage 2 on (each device holds 1/8 of the token embedding's gradient then)
    for x, s in zip(jax.tree.leaves(g), jax.tree.leaves(grad_sh), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)
    per_device = g["wte"].addressable_shards[0].data.size / g["wte"].size
    data_parallel = mesh_sizes[0] * mesh_sizes[1]
    assert per_device == (1 / mesh_sizes[2]) * (1 / data_parallel if stage >= 2 else 1)


def expected_spec(name: str, stage: int, part: str, mesh) -> P:
    """The table written out for the test model (d=32, 4 heads of 8, MLP 128, vocab 384), by weight name."""
    zero = {"params": stage >= 3, "grads": stage >= 2, "opt_state": stage >= 1}[part]
    t = "tensor" if mesh.shape["tensor"] > 1 else None
    dp = tuple(a for a in Z if mesh.shape[a] > 1)
    z = (dp if len(dp) > 1 else dp[0]) if zero and dp else None
    if name == "wte":  # (vocab, embed)
        return P(t, z)
    if name.endswith("c_attn.kernel"):  # (embed, 3, heads, kv)
        return P(z, None, t, None)
    if name.endswith("c_attn.bias"):  # (3, heads, kv): ZeRO falls to kv (8 divides by up to 8)
        return P(None, t, z)
    if name.endswith("attn.c_proj.kernel"):  # (heads, kv, embed)
        return P(t, None, z)
    if name.endswith("c_fc.kernel"):  # (embed, mlp)
        return P(z, t)
    if name.endswith("c_fc.bias"):  # (mlp,): tensor first; ZeRO only without tensor parallelism
        return P(t if t else z)
    if name.endswith("mlp.c_proj.kernel"):  # (mlp, embed)
        return P(t, z)
    return P(z)  # (embed,): LayerNorm scales and biases, projection biases


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mesh_sizes", [(8, 1, 1), (2, 2, 2)])
def test_rules_table(stage, mesh_sizes):
    mesh = sharding.make_mesh(*mesh_sizes)
    cfg, _, variables = tiny_model()
    params = nnx.to_pure_dict(variables)
    axes = nnx.to_pure_dict(logical_axes.param_axes(variables))
    tx = optax.adamw(1e-2)
    abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32)},
                              params)
    shardings, grad_sh, fallbacks = sharding.state_shardings(abstract, axes, mesh, stage)
    assert fallbacks == []
    mu = shardings["opt_state"][0].mu
    for part, tree in (("params", shardings["params"]), ("opt_state", mu), ("grads", grad_sh)):
        for path, s in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name = ".".join(str(getattr(k, "key", k)) for k in path)
            assert s.spec == expected_spec(name, stage, part, mesh), (part, name, s.spec)
    assert shardings["step"].spec == P() and shardings["opt_state"][0].count.spec == P()
    if stage != 3:
        return
    # the placed state really is laid out so (a jitted init with these output shardings)
    state = jax.jit(lambda: {"params": nnx.to_pure_dict(nnx.state(model.GPT(cfg, rngs=nnx.Rngs(0))))},
                    out_shardings={"params": shardings["params"]})()
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings["params"]), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim)
        shard = x.addressable_shards[0].data.shape
        split = [x.shape[i] // shard[i] for i in range(x.ndim)]
        assert np.prod(split) == np.prod([sharding.axis_size(mesh, e) for e in s.spec if e])


def grouped_query_test_model():
    """The `test` size (d=32, 4 query heads of 8) with 2 key/value heads."""
    return dataclasses.replace(config.load_config(overrides=["model=test"]).model, num_kv_head=2)


def test_key_value_heads_have_their_own_rule():
    """The key/value weight of a grouped-query model names its head dimension kv_heads, and the table's
    kv_heads row places it: over `tensor` as the query heads by default, elsewhere if that row says so."""
    mesh = sharding.make_mesh(2, 2, 2)
    _, _, variables = tiny_model(grouped_query_test_model())
    params, axes = nnx.to_pure_dict(variables), nnx.to_pure_dict(logical_axes.param_axes(variables))
    attn = lambda tree: tree["blocks"][0]["attn"]  # noqa: E731
    assert attn(axes)["c_kv"]["kernel"] == ("embed", None, "kv_heads", "kv")  # (d, 2, K, D)
    rules = sharding.rules_for(3)["params"]
    specs = sharding.param_specs(params, axes, rules, mesh)
    assert attn(specs)["c_kv"]["kernel"] == P(Z, None, "tensor", None)
    assert attn(specs)["c_q"]["kernel"] == P(Z, "tensor", None)  # (d, H, D)
    replicated_kv = tuple((name, None if name == "kv_heads" else axes) for name, axes in rules)
    specs = sharding.param_specs(params, axes, replicated_kv, mesh)
    assert attn(specs)["c_kv"]["kernel"] == P(Z, None, None, None)  # ZeRO's kv rule finds Z taken by embed
    assert attn(specs)["c_q"]["kernel"] == P(Z, "tensor", None)


def test_check_model_checks_every_dimension_the_table_splits_over_tensor(monkeypatch):
    cfg = grouped_query_test_model()
    sharding.check_model(sharding.make_mesh(4, 1, 2), cfg.axis_sizes)  # 2 divides 4 and 2 heads, 128, 384
    with pytest.raises(sharding.ShardingError) as e:
        sharding.check_model(sharding.make_mesh(2, 1, 4), cfg.axis_sizes)
    assert str(e.value) == "model.num_kv_head (2) is not divisible by the tensor axis (sharding.tensor=4)"
    # a row the table gains is checked too, with no other change
    monkeypatch.setattr(sharding, "TENSOR_RULES", sharding.TENSOR_RULES + (("embed", "tensor"),))
    sizes = {**cfg.axis_sizes, "kv_heads": 4, "embed": 34}
    with pytest.raises(sharding.ShardingError) as e:
        sharding.check_model(sharding.make_mesh(2, 1, 4), sizes)
    assert str(e.value) == "model.embedding_dim (34) is not divisible by the tensor axis (sharding.tensor=4)"


def test_uncovered_parameter_is_an_error():
    mesh = sharding.make_mesh(8, 1, 1)
    rules = sharding.rules_for(1)["opt_state"]
    params = {"moe": {"kernel": jax.ShapeDtypeStruct((8, 32), jnp.float32)}}
    with pytest.raises(sharding.ShardingError, match=r"'experts' of parameter \['moe'\]\['kernel'\]"):
        sharding.param_specs(params, {"moe": {"kernel": ("experts", "embed")}}, rules, mesh)
    with pytest.raises(sharding.ShardingError, match=r"\['moe'\]\['kernel'\].*no logical axis names"):
        sharding.param_specs(params, {"moe": {"kernel": None}}, rules, mesh)
    # a ZeRO dimension that does not divide falls through to the next rule, and is reported
    fallbacks = []
    spec = sharding.spec_for("odd", (30, 128), ("embed", "mlp"), rules, mesh, fallbacks)
    assert spec == P(None, "data") and fallbacks == ["odd dim 0 (embed=30) over data"]


def test_bad_mesh_and_batch_are_one_line_errors(corpus, tmp_path, capsys):  # noqa: F811
    cases = [
        (["sharding.fsdp=3"], "3 does not divide the 8 devices"),
        (["sharding.data=2", "sharding.fsdp=2"], "needs 4 devices, but there are 8"),
        (["sharding.data=-1", "sharding.tensor=-1"], "at most one of them -1"),
        (["sharding.zero_stage=4"], "zero_stage must be 0, 1, 2 or 3"),
        (["training.batch_size=12"], "micro-batch of 12 sequences"),
        (["sharding.data=1", "sharding.tensor=8"], "num_head (4) is not divisible by the tensor axis"),
    ]
    for i, (extra, message) in enumerate(cases):
        assert train.cli(tiny(tmp_path / f"bad{i}", corpus, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, (extra, err)


def compile_memory(stage):
    """XLA's memory analysis of one compiled step (2 micro-batches accumulated) at a ZeRO stage."""
    cfg = config.load_config(overrides=["model=test", "model.vocab_size=300", "model.embedding_dim=128"]).model
    abstract = nnx.eval_shape(lambda: model.GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, variables = nnx.split(abstract)
    params = nnx.to_pure_dict(variables)
    tx = optax.adamw(1e-2)
    mesh = sharding.make_mesh(8, 1, 1)
    state = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, params)
    shardings, grad_sh, _ = sharding.state_shardings(state, nnx.to_pure_dict(logical_axes.param_axes(variables)), mesh, stage)
    constrain = lambda g: jax.lax.with_sharding_constraint(g, grad_sh)  # noqa: E731

    def step(state, batch):
        def acc(grads, tokens):
            g = jax.grad(lambda p: loss_fn(graphdef, variables, p, tokens))(state["params"])
            return constrain(jax.tree.map(jnp.add, grads, constrain(g))), None

        grads, _ = jax.lax.scan(acc, constrain(jax.tree.map(jnp.zeros_like, state["params"])), batch)
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}

    batch_sh = NamedSharding(mesh, P(None, "data"))
    lowered = jax.jit(step, in_shardings=(shardings, batch_sh), out_shardings=shardings, donate_argnums=0).lower(
        sharding.with_shardings(state, shardings), jax.ShapeDtypeStruct((2, 8, 17), jnp.int32, sharding=batch_sh))
    m = lowered.compile().memory_analysis()
    return m.argument_size_in_bytes, m.temp_size_in_bytes, m.argument_size_in_bytes + m.temp_size_in_bytes


def test_stage_2_and_3_use_less_memory_per_device():
    one, two, three = (compile_memory(s) for s in (1, 2, 3))
    assert two[0] == one[0]  # the same state in: replicated params, sharded optimizer state
    assert two[1] < one[1]  # the accumulated gradients are 1/8 as large
    assert three[0] < two[0] and three[2] < two[2]  # the parameters too


def chunked_step(mesh, stage, loss_chunk, state, batch):
    """train.py's jitted step and eval step (step.build) of the `test` size (vocabulary 300, padded to
    384) at `stage` on `mesh`, 2 micro-batches and training.loss_chunk: (metrics, new state, eval sums,
    the largest array the step's jaxpr makes, the compiled step's HLO text). `state` and `batch` are
    host arrays, placed here."""
    cfg = config.load_config(overrides=["model=test", "model.vocab_size=300"]).model
    B, T = batch["tokens"].shape[0], batch["tokens"].shape[1] - 1
    # lr 1e-2 at once (no warm-up), eps 1e-3: the update follows the gradient smoothly, so it shows it
    t = config.TrainingConfig(batch_size=B, seq_len=T, micro_batches=2, loss_chunk=loss_chunk, lr=1e-2, min_lr=0.0,
                              warmup_steps=0, eps=1e-3)
    built = step_lib.build(cfg, t, mesh, stage)
    state, placed = jax.device_put(state, built.state_sharding), jax.device_put(batch, built.batch_sharding)
    largest = largest_array(built.train_step.trace(state, placed).jaxpr)
    evaluated = jax.device_get(built.eval_step(state["params"], {"tokens": placed["tokens"],
                                                                  "weights": placed["weights"]}))
    compiled = built.train_step.lower(state, placed).compile()
    new_state, metrics = compiled(state, placed)
    return jax.device_get(metrics), jax.device_get(new_state), evaluated, largest, compiled.as_text()


@pytest.fixture(scope="module")
def chunk_reference():
    """One device, the loss over the whole logits: the initial state, a batch with loss weights,
    and what the step and the eval step give for it."""
    cfg = config.load_config(overrides=["model=test", "model.vocab_size=300"]).model
    t = config.TrainingConfig(batch_size=16, seq_len=31, micro_batches=2)
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = jax.device_get(step_lib.build(cfg, t, one, 0).init())
    rng = np.random.default_rng(3)
    batch = {"tokens": rng.integers(0, 300, (16, 32)).astype(np.int32),
             "weights": (rng.random((16, 31)) > 0.3).astype(np.float32)}
    return state, batch, chunked_step(one, 0, 0, state, batch)


@pytest.mark.parametrize("mesh_sizes, stage", [((2, 1, 4), 0), ((4, 1, 2), 1), ((2, 2, 2), 2), ((1, 4, 2), 3)])
def test_chunked_loss_with_micro_batches_under_every_stage_and_tensor_parallelism(chunk_reference, mesh_sizes,
                                                                                    stage):
    """training.loss_chunk=8 tokens per device on 8 devices (2 or 4 data-parallel: chunks of 2 or 4
    positions of each row, the last chunk padded), the vocabulary split over the tensor axis, 2
    micro-batches, loss weights: the loss, gradient norm, updated state and validation sums of one
    device computing the loss over the whole logits, and no array of the step as large as a
    micro-batch's logits. The token embedding (the output projection) is never gathered whole: only
    its vocabulary shard over the data-parallel devices, from stage 1 on (the updated parameters;
    at stage 3 also where a layer uses them)."""
    state, batch, (ref_metrics, ref_state, ref_eval, ref_largest, _) = chunk_reference
    metrics, new_state, evaluated, largest, hlo = chunked_step(sharding.make_mesh(*mesh_sizes), stage, 8, state, batch)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(evaluated, ref_eval, rtol=1e-6)
    before = jax.tree.leaves(state["params"])
    for old, a, b in zip(before, jax.tree.leaves(new_state["params"]), jax.tree.leaves(ref_state["params"]),
                         strict=True):
        # the updates, to a float32 rounding of parameters near 1 (LayerNorm scales)
        np.testing.assert_allclose(a - old, b - old, rtol=1e-4, atol=2.5e-7)
    micro_logits = 8 * 31 * 384  # a micro-batch of 8 rows: (8, 31, 384)
    assert ref_largest >= micro_logits > largest
    gathered = lambda rows: re.search(rf"= \w+\[{rows},32\]\S* all-gather\(", hlo)  # noqa: E731  (V, d) rows
    assert not gathered(384)
    assert bool(gathered(384 // mesh_sizes[2])) is (stage >= 1)


def test_chunked_loss_step_never_holds_the_whole_logits():
    """XLA's memory analysis of train.py's compiled step and eval step on one device, for a model
    whose float32 logits (8 x 64 tokens x 16384) dwarf everything else: with training.loss_chunk=64
    the temporaries shrink by more than the whole logits, and stay below the logits' size."""
    cfg = model.GPTConfig(vocab_size=16384, block_size=64, embedding_dim=32, num_head=4, N=1)
    B, T = 8, 64
    logits_bytes = B * T * cfg.padded_vocab_size * 4
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    temp = {}
    for chunk in (0, 64):
        built = step_lib.build(cfg, config.TrainingConfig(batch_size=B, seq_len=T, loss_chunk=chunk), one, 0)
        tokens = jax.ShapeDtypeStruct((B, T + 1), jnp.int32, sharding=built.batch_sharding)
        weights = jax.ShapeDtypeStruct((B, T), jnp.float32, sharding=built.batch_sharding)
        train_step = built.train_step.lower(built.abstract_state, tokens).compile()
        eval_step = built.eval_step.lower(built.abstract_state["params"], {"tokens": tokens, "weights": weights})
        temp[chunk] = [c.memory_analysis().temp_size_in_bytes for c in (train_step, eval_step.compile())]
    (whole_train, whole_eval), (chunked_train, chunked_eval) = temp[0], temp[64]
    assert whole_train >= logits_bytes and whole_eval >= logits_bytes  # the whole logits, and their gradient
    assert whole_train - chunked_train >= logits_bytes and chunked_train < logits_bytes
    assert whole_eval - chunked_eval >= logits_bytes / 2 and chunked_eval < logits_bytes / 2


def test_restore_onto_another_mesh_and_stage(corpus, tmp_path):  # noqa: F811
    """Saved at stage 3 on 8 devices, resumed at stage 1 on 4 devices: the same run continues."""
    straight, resumed = tmp_path / "straight", tmp_path / "resharded"
    args = ("training.steps=6", "checkpoint.every=3", "sharding.zero_stage=3", "sharding.fsdp=2")
    assert train.main(tiny(straight, corpus, *args)) == 0
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    (resumed / "summary.json").unlink()
    finish([run_subprocess(["--resume", f"run_dir={resumed}", "sharding.zero_stage=1", "sharding.fsdp=1",
                            "sharding.data=-1"], devices=4)])
    a, b = rows(straight), rows(resumed)
    assert [r["step"] for r in b] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in b[3:]], [r["loss"] for r in a[3:]], rtol=1e-5)
    assert rundir.Run(resumed).record.config().sharding.zero_stage == 1  # the effective config of the resumed run
    x, y = (restore_params(d, 6) for d in (straight, resumed))
    for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        # float rounding differs between 8 and 4 devices; Adam (eps 1e-8) turns rounding-level
        # gradients into updates of up to lr = 1e-2, so the tolerance is absolute, 1e-3 * lr
        np.testing.assert_allclose(p, q, rtol=1e-4, atol=1e-5)


def restore_params(run_dir, step):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(pathlib.Path(run_dir).resolve() / "checkpoints") as mngr:
        return mngr.restore(step, args=ocp.args.StandardRestore())["params"]
