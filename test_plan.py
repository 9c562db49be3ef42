"""Tests of plan.py (`train.py --plan`): the state terms against the ZeRO paper's formulas and the
real placed state, the activation terms against XLA's compiled training step and autodiff's own
residuals, the target devices' naming rules, and the command line.

Runs on the 8 simulated CPU devices of conftest.py.
"""
import collections

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import model
import sharding
import train
from training import config, devices, plan, step

GiB = 2**30
# XLA's CPU compiler schedules for concurrency by default, keeping buffers alive far longer than a
# device compiler would; its memory-minimising scheduler (the kind GPU and TPU compilers run) is
# the one whose figures the plan is compared with. It also drops optimization barriers before it
# schedules, where the GPU compiler drops them after: kept, they pin remat's recomputation and a
# block's gradients in place (remat.pinned) as they are on a GPU.
MEMORY_SCHEDULER = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                    "xla_disable_hlo_passes": "cse_barrier_expander"}


def cfg_of(model_fields=None, *, size="test", batch=16, micro=1, mesh=(-1, 1, 1), stage=0, loss_chunk=4096):
    fields = {"name": size, **(model_fields or {})}
    training = {"batch_size": batch, "micro_batches": micro, "loss_chunk": loss_chunk}
    return config.from_dict({"model": fields, "training": training,
                             "sharding": {"data": mesh[0], "fsdp": mesh[1], "tensor": mesh[2], "zero_stage": stage}})


def cpus(n):
    return devices.Target(f"{n} CPU devices", 2**40, n, "cpu", None)


# ----------------------------------------------------------------------------------------------
# State: exact


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 4, 1)])
def test_state_terms_are_the_zero_papers_formulas(stage, mesh):
    """ZeRO (Rajbhandari et al. 2019) as this project stores the state: float32 parameters (4 bytes
    each), float32 gradients (4) and AdamW's two float32 moments (8), 16 bytes per parameter when
    nothing is sharded; stage 1 shards the moments over the n data-parallel devices, stage 2 also the
    gradients, stage 3 also the parameters. The `test` size divides by 8 everywhere."""
    cfg = cfg_of(mesh=mesh, stage=stage)
    e = plan.estimate(cfg, cpus(8))
    psi, n = model.param_count(cfg.model), 8
    assert e.fallbacks == []
    assert e.terms["parameters"] == 4 * psi / (n if stage >= 3 else 1)
    assert e.terms["gradients"] == 4 * psi / (n if stage >= 2 else 1)
    # the moments, plus the scalars every device keeps whole: AdamW's and the learning-rate schedule's
    # step counts (int32), the state's step (int32) and its RNG key data (2 x uint32)
    assert e.terms["optimizer state"] == 8 * psi / (n if stage >= 1 else 1) + 4 + 4 + 4 + 8
    assert e.terms["parameters"] + e.terms["gradients"] + e.terms["optimizer state"] - 20 == {
        0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def bytes_per_device(tree) -> dict:
    counts = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            counts[shard.device] += shard.data.nbytes
    return counts


@pytest.mark.parametrize("mesh, stage", [((2, 2, 2), 0), ((2, 2, 2), 1), ((2, 2, 2), 2), ((2, 2, 2), 3),
                                         ((8, 1, 1), 1), ((8, 1, 1), 3)])
def test_state_terms_equal_the_placed_state(mesh, stage):
    """The real state, made in place by step.build's jitted init on 8 devices: every device holds
    exactly the plan's bytes of parameters and of optimizer state (with step and RNG), with and
    without tensor parallelism."""
    cfg = cfg_of(mesh=mesh, stage=stage)
    state = step.build(cfg.model, cfg.training, sharding.make_mesh(*mesh), stage).init()
    e = plan.estimate(cfg, cpus(8))
    params = bytes_per_device(state["params"])
    others = bytes_per_device([state["opt_state"], state["step"], state["rng"]])
    assert len(params) == len(others) == 8
    assert set(params.values()) == {e.terms["parameters"]}
    assert set(others.values()) == {e.terms["optimizer state"]}


LORA = {"rank": 4, "targets": ["q", "v", "o", "mlp"], "base_dtype": "bfloat16"}


def lora_cfg(mesh, stage, lora=LORA):
    return config.from_dict({"model": {"name": "test", "dtype": "bfloat16"},
                             "training": {"batch_size": 16, "init_from": "runs/base", "lora": lora},
                             "sharding": {"data": mesh[0], "fsdp": mesh[1], "tensor": mesh[2], "zero_stage": stage}})


@pytest.mark.parametrize("mesh, stage", [((8, 1, 1), 0), ((2, 2, 2), 1), ((8, 1, 1), 3)])
def test_lora_state_terms_equal_the_placed_state(mesh, stage):
    """A LoRA run's state is its adapters and their moments, and its frozen base is held in bfloat16 and
    placed as a full run's params at the ZeRO stage: the plan's terms are the bytes every device holds of
    step.build's adapters, optimizer state and placed base. The adapters written out: the test size's fused
    q/k/v weight (d, 3d) takes A (d, r) and B (r, 3d) though k is not a target, the attention's output
    projection and the MLP's two r (d + d) and r (d + 4d) each; the base: its kernels and embeddings in
    bfloat16, its norms and biases in float32."""
    cfg = lora_cfg(mesh, stage)
    fns = step.build(cfg.model, cfg.training, sharding.make_mesh(*mesh), stage)
    state = fns.init()
    base = fns.place_base(jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), fns.abstract_base))
    e = plan.estimate(cfg, cpus(8))
    assert set(bytes_per_device(state["params"]).values()) == {e.terms["parameters"]}
    assert set(bytes_per_device([state["opt_state"], state["step"], state["rng"]]).values()) == \
        {e.terms["optimizer state"]}
    assert set(bytes_per_device(base).values()) == {e.terms["frozen base"]}
    assert "adapters (LoRA rank 4 on q, v, o, mlp)" in e.notes["parameters"]
    if mesh != (8, 1, 1):
        return  # tensor parallelism splits some of them
    m, r = cfg.model, LORA["rank"]
    d, F = m.embedding_dim, m.ffn_dim
    adapters = m.N * r * ((d + 3 * d) + (d + d) + (d + F) + (F + d))
    assert e.terms["gradients"] == 4 * adapters / (8 if stage >= 2 else 1)
    leaves = jax.tree_util.tree_flatten_with_path(fns.abstract_base)[0]
    kept = sum(x.size for p, x in leaves if p[-1].key in ("bias", "scale"))  # norms and biases
    matrices = sum(x.size for _, x in leaves) - kept
    if stage < 3:
        assert e.terms["parameters"] == 4 * adapters
        assert e.terms["frozen base"] == 2 * matrices + 4 * kept


def test_lora_is_what_the_plan_recommends_for_fine_tuning_that_does_not_fit(capsys):
    """Fine-tuning (training.init_from) that does not fit on one GPU: the plan offers LoRA on a base held in
    the compute dtype among its changes, and that config plans to the printed total."""
    args = ["--device", "24GiB", "model=1_3b", "model.dtype=bfloat16", "training.batch_size=1",
            "training.init_from=runs/base", "training.optimizer=adamw"]  # (with Muon's one moment it fits)
    assert train.cli(["--plan", *args]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "\n  frozen base" not in out
    (line,) = [s for s in out.splitlines() if "training.lora.rank=8" in s]
    assert line.split()[:2] == ["training.lora.rank=8", "training.lora.base_dtype=bfloat16"]
    assert train.cli(["--plan", *args, *line.split()[:2]]) == 0
    again = capsys.readouterr().out
    totals = [s.split()[1] for s in again.splitlines() if s.split()[:1] == ["total"]]
    assert totals == [line.split("GiB")[0].split()[-1]] and "\nfits:" in again
    assert "LoRA: 4N + 6LdT" in again


# ----------------------------------------------------------------------------------------------
# Activations: against XLA and autodiff


_TEMP_BYTES = {}


def xla_temp_bytes(cfg, mesh) -> int:
    """XLA's temporary memory per device for train.py's jitted step (state donated), once per config in a
    process. Compiled without LLVM's optimisations: the buffers are XLA's own assignment, made before code
    generation, so the figure is the same (and the compilation ~30% shorter)."""
    key = (repr(cfg), mesh)
    if key not in _TEMP_BYTES:
        _TEMP_BYTES[key] = _xla_temp_bytes(cfg, mesh)
    return _TEMP_BYTES[key]


def _xla_temp_bytes(cfg, mesh) -> int:
    n = mesh[0] * mesh[1] * mesh[2]
    fns = step.build(cfg.model, cfg.training, sharding.make_mesh(*mesh, devices=jax.devices()[:n]),
                     cfg.sharding.zero_stage)
    batch = jax.ShapeDtypeStruct((cfg.training.batch_size, cfg.seq_len + 1), jnp.int32, sharding=fns.batch_sharding)
    compiled = fns.train_step.lower(fns.abstract_state, batch).compile(
        {**MEMORY_SCHEDULER, "xla_backend_optimization_level": 0})
    # remat's barriers reach the compiled step (were the pass renamed, the option would be ignored)
    assert (cfg.model.remat == "none") == ("opt-barrier" not in compiled.as_text())
    return compiled.memory_analysis().temp_size_in_bytes


# three sizes (width, heads, blocks, vocabulary, context, batch), and tensor parallelism with micro-batches
STEP_CASES = [
    ({"embedding_dim": 64, "num_head": 4, "N": 2, "vocab_size": 512, "block_size": 64}, 16, 1, (1, 1, 1)),
    ({"embedding_dim": 128, "num_head": 4, "N": 4, "vocab_size": 1024, "block_size": 128}, 8, 1, (1, 1, 1)),
    ({"embedding_dim": 192, "num_head": 6, "N": 3, "vocab_size": 2000, "block_size": 256}, 4, 1, (1, 1, 1)),
    ({"embedding_dim": 128, "num_head": 4, "N": 4, "vocab_size": 1024, "block_size": 128}, 32, 2, (2, 1, 2)),
]


# every size with every remat policy; the loss in chunks of 256 tokens for every policy and size (the second
# size's fields are the fourth's), the whole logits likewise; the second size with the whole logits under
# every policy, which test_remat_keeps_less_in_the_compiled_step compares
ACTIVATION_CASES = [(*case, remat, 256 if (i + j) % 2 and i != 1 else 4096)
                    for i, case in enumerate(STEP_CASES) for j, remat in enumerate(["none", "full", "save_matmuls"])]


@pytest.mark.parametrize("fields, batch, micro, mesh, remat, loss_chunk", ACTIVATION_CASES)
def test_activation_terms_match_xla_compiled_step(fields, batch, micro, mesh, remat, loss_chunk):
    """Everything but the parameters and the optimizer state (which are the step's arguments) lives in
    XLA's temporary buffer: gradients, activations (what each remat policy keeps, and one block
    recomputed at a time), logits and loss, attention temporaries. The plan's sum of them is within
    15% of XLA's own figure for the compiled step (float32, xla attention: the model behind them is
    the one the plan's docstring describes), at three sizes and with tensor parallelism and
    micro-batches, with the loss over the whole logits (every case has at most 4096 tokens per device)
    and 256 tokens of it at a time."""
    cfg = cfg_of({**fields, "embed_norm": True, "attention": "xla", "remat": remat}, size="x", batch=batch,
                 micro=micro, mesh=mesh, loss_chunk=loss_chunk)
    e = plan.estimate(cfg, cpus(mesh[0] * mesh[1] * mesh[2]))
    planned = e.total - e.terms["parameters"] - e.terms["optimizer state"]
    measured = xla_temp_bytes(cfg, mesh)
    assert abs(planned / measured - 1) < 0.15, (planned, measured)


def test_remat_keeps_less_in_the_compiled_step():
    """Remat keeps its promise in the compiled step: less temporary memory than without it."""
    fields, batch, micro, mesh = STEP_CASES[1]
    measured = {remat: xla_temp_bytes(cfg_of({**fields, "embed_norm": True, "attention": "xla", "remat": remat},
                                             size="x", batch=batch, micro=micro, mesh=mesh), mesh)
                for remat in ("none", "save_matmuls", "full")}
    assert measured["full"] < measured["save_matmuls"] < measured["none"], measured


@pytest.mark.parametrize("remat", ["none", "full"])
def test_micro_batches_cost_one_gradient_copy(remat):
    """Accumulating over micro-batches holds the accumulator and a micro-batch's own gradients, however many
    there are: a batch of three micro-batches of 4 sequences costs XLA's compiled step one float32 copy of
    the gradients more than a batch of one such micro-batch, within 15%, and the plan exactly that."""
    fields = {**STEP_CASES[1][0], "embed_norm": True, "attention": "xla", "remat": remat}
    one, three = (cfg_of(fields, size="x", batch=4 * micro, micro=micro, mesh=(1, 1, 1)) for micro in (1, 3))
    grads = 4 * model.param_count(one.model)
    assert plan.estimate(three, cpus(1)).total - plan.estimate(one, cpus(1)).total == grads
    measured = xla_temp_bytes(three, (1, 1, 1)) - xla_temp_bytes(one, (1, 1, 1))
    assert abs(measured / grads - 1) < 0.15, (measured, grads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fields", [f for f, *_ in STEP_CASES[:3]])
def test_remat_terms_match_autodiff_residuals(fields, dtype):
    """Under remat full and save_matmuls, what a block keeps for the backward pass is fixed by the
    policy: the residuals of jax.vjp of the real model, per block (blocks 2 and 4 apart), less the
    block's own parameters, which the recomputation reads, are the plan's activations per block."""
    B = 4

    def kept_per_block(remat):
        per = {}
        for N in (2, 4):
            cfg = cfg_of({**fields, "N": N, "embed_norm": True, "remat": remat, "dtype": dtype,
                          "attention": "xla"}, size="x", batch=B)
            graphdef, params = nnx.split(nnx.eval_shape(lambda: model.GPT(cfg.model, rngs=nnx.Rngs(0))))
            x = jnp.zeros((B, cfg.seq_len), jnp.int32)
            residuals = jax.eval_shape(lambda p: jax.vjp(lambda p: nnx.merge(graphdef, p)(x).sum(), p)[1], params)
            size = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa: E731
            per[N] = size(residuals) - size(params), plan.estimate(cfg, cpus(1)).terms
        (kept2, _), (kept4, terms4) = per[2], per[4]
        return (kept4 - kept2) / 2, terms4["activations kept for the backward pass"] / 4

    for remat in ("full", "save_matmuls"):
        measured, planned = kept_per_block(remat)
        assert abs(planned / measured - 1) < 0.02, (remat, planned, measured)


# ----------------------------------------------------------------------------------------------
# Target devices


@pytest.mark.parametrize("name, count, memory", [
    # v2, v3: slices name TensorCores, 2 per chip, each a JAX device; 8 and 16 GiB per core
    ("v2-8", 8, 8 * GiB), ("v3-32", 32, 16 * GiB),
    # v4, v5p: slices name TensorCores, 2 per chip seen as one JAX device; 32 and 95 GiB per chip
    ("v4-32", 16, 32 * GiB), ("v5p-128", 64, 95 * GiB),
    # v5e, v6e: slices name chips, one core each; 16 and 32 GiB per chip
    ("v5e-16", 16, 16 * GiB), ("v5litepod-8", 8, 16 * GiB), ("v6e-8", 8, 32 * GiB),
    ("H100", 1, 80 * GiB), ("h200", 1, 141e9), ("A100-40", 1, 40 * GiB), ("a100 80GB", 1, 80 * GiB),
    ("24GiB", 1, 24 * GiB),
])
def test_device_names(name, count, memory):
    dev = devices.target(name)
    assert (dev.count, dev.memory) == (count, memory)


def test_tpu_peak_is_per_jax_device():
    """devices.PEAK_FLOPS holds a chip's peak; a v3 chip is two JAX devices, a v4 chip one."""
    assert devices.target("v3-8").peak_flops == devices.PEAK_FLOPS["TPU v3"] / 2
    assert devices.target("v4-8").peak_flops == devices.PEAK_FLOPS["TPU v4"]
    assert devices.peak_flops("TPU v2") == 45e12 / 2 and devices.peak_flops("TPU v3") == 123e12 / 2
    assert devices.peak_flops("TPU v4") == 275e12 and devices.peak_flops("NVIDIA H100 80GB HBM3") == 989e12


@pytest.mark.parametrize("kind, devices, chips, chip_peak", [("TPU v3", 8, 4, 123e12), ("TPU v4", 4, 4, 275e12)])
def test_training_mfu_counts_chips_not_cores(monkeypatch, kind, devices, chips, chip_peak):
    """train.py's logged MFU on a TPU v3-8 (4 chips, 8 JAX devices, one per core) is the model FLOPs over
    the 4 chips' peak, as on a v4-8 (4 chips, 4 devices): JAX counting cores must not halve it."""
    import types

    from training import progress
    cfg = cfg_of()
    monkeypatch.setattr(jax, "local_devices", lambda: [types.SimpleNamespace(device_kind=kind)])
    monkeypatch.setattr(jax, "device_count", lambda: devices)
    steps = progress.Steps(cfg, progress.Stop(), start_step=0, tokens_before=0, t_start=0.0, metrics_file=None,
                           wandb_run=None, last_ckpt=None, run_dir=None)
    row = {"step": 10, "time_s": 2.0, "loss": 3.0}
    steps.log(row)
    tokens_per_s = 10 * cfg.training.batch_size * cfg.seq_len / 2.0
    want = tokens_per_s * model.flops_per_token(cfg.model, cfg.seq_len) / (chips * chip_peak)
    assert row["mfu"] == pytest.approx(want, rel=1e-12)


def test_auto_loss_chunk_takes_the_whole_logits_where_memory_is_plentiful():
    """training.loss_chunk=auto (the default): the whole logits, the faster way, when one device's float32
    logits and their gradient (tokens x vocab x (4 + c)) fit in 1/8 of its memory; 4096-token chunks
    otherwise. The plan resolves it for the target as the run does for its devices."""
    cfg = config.load_config(overrides=["model=124m", "model.dtype=bfloat16", "training.batch_size=16"])
    assert cfg.training.loss_chunk == "auto"
    logits = 16 * 1024 * cfg.model.padded_vocab_size * (4 + 2)  # 124m's whole logits and gradient, bfloat16
    mesh = sharding.abstract_mesh(-1, 1, 1, n=1)
    for memory, want in ((8 * logits, 0), (8 * logits - 1, 4096), (None, 0)):
        assert step.loss_chunk(cfg.model, cfg.training, mesh, memory=memory) == want, memory
    assert plan.estimate(cfg, devices.target("H200")).notes["logits and loss"].startswith("(16, 1024")  # whole
    assert "4096 tokens' logits at a time" in plan.estimate(cfg, devices.target("24GiB")).notes["logits and loss"]
    fixed = config.load_config(overrides=["model=124m", "training.batch_size=16", "training.loss_chunk=2048"])
    assert step.loss_chunk(fixed.model, fixed.training, mesh, memory=10**15) == 2048  # a number is itself
    with pytest.raises(config.ConfigError, match="training.loss_chunk must be auto or an integer >= 0"):
        config.load_config(overrides=["training.loss_chunk=some"])


# ----------------------------------------------------------------------------------------------
# The command line


def test_plan_reads_and_makes_nothing(tmp_path, capsys):
    run_dir, data_dir = tmp_path / "run", tmp_path / "no-data"
    assert train.cli(["--plan", "--device", "v3-32", "model=760m", "model.dtype=bfloat16", "training.batch_size=256",
                      "training.micro_batches=4", "sharding.zero_stage=1", f"run_dir={run_dir}",
                      f"data.dir={data_dir}"]) == 0
    out = capsys.readouterr().out
    assert not run_dir.exists() and not data_dir.exists()
    assert "on 32 x TPU v3" in out and "4 host(s)" in out
    assert "2 sequence(s) per device per micro-batch" in out  # 256 / 4 / 32
    flops = model.flops_per_token(cfg_of(size="760m").model, 1024) * 256 * 1024
    assert f"{256 * 1024:,} tokens, {flops:.3g} FLOPs" in out


def test_changes_that_fit_do_fit(capsys):
    """A config that does not fit gets changes, each of which, applied as overrides, plans to the
    printed total and fits."""
    args = ["--device", "A100-40", "--devices", "8", "model=1_3b", "model.dtype=bfloat16", "training.batch_size=64",
            "training.optimizer=adamw"]  # (AdamW's two moments: Muon's one fits without ZeRO)
    assert train.cli(["--plan", *args]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out
    changes = out.split("changes that fit, cheapest first:\n")[1].split("\nstep:")[0].splitlines()
    assert changes and changes[0].split()[0] == "sharding.zero_stage=1"
    for line in changes:
        overrides = [w for w in line.split() if "=" in w]
        total = float(line.split("GiB")[0].split()[-1])
        assert train.cli(["--plan", *args, *overrides]) == 0
        again = capsys.readouterr().out
        totals = [s.split()[1] for s in again.splitlines() if s.split()[:1] == ["total"]]
        assert totals == [f"{total:.2f}"] and "\nfits:" in again


@pytest.mark.parametrize("args, message", [
    (["--device", "v9"], "error: unknown device 'v9'"),
    (["--device", "v3-31"], "error: TPU slice v3-31"),
    (["--device", "v3-32", "--devices", "8"], "error: v3-32 has 32 JAX devices, not --devices 8"),
    (["--devices", "8", "sharding.data=3"], "error: sharding mesh data=3 x fsdp=1 x tensor=1 needs 3 devices"),
    (["--devices", "8", "training.batch_size=4"], "error: a micro-batch of 4 sequences"),
    (["--devices", "8", "sharding.tensor=8", "model=test"], "error: model.num_head (4) is not divisible"),
    (["--mfu", "2"], "error: --mfu must be in (0, 1]"),
    (["--device", "v4-0"], "error: TPU slice v4-0: no cores in it; the smallest is v4-2"),
    (["--device", "v5e-0"], "error: TPU slice v5e-0: no chips in it; the smallest is v5e-1"),
    (["--device", "0GiB"], "error: --device 0GiB: a GPU's memory must be more than 0"),
    (["--device", "0.0GB"], "error: --device 0.0GB: a GPU's memory must be more than 0"),
])
def test_bad_input_is_one_line(args, message, capsys):
    assert train.cli(["--plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_plan_with_resume_is_refused(capsys):
    assert train.cli(["--plan", "--resume"]) == 2
    assert "error: --plan plans a config" in capsys.readouterr().err


def test_the_plan_of_a_mixture_gives_each_stages_shares_and_each_sources_tokens(tmp_path, capsys):
    """Weights 3:1 are 768 and 256 of every block of 1024 sequences; with 16 sequences a step the stage at
    step 64 starts at the second block, so over 128 steps a gives 768 sequences and b 256 + 1024, of 128
    tokens each (the default context); no data is read (the directories do not exist)."""
    assert train.main(["--plan", "--device", "H100", f"data.mixture.a.dir={tmp_path / 'none-a'}",
                       "data.mixture.a.weight=3", f"data.mixture.b.dir={tmp_path / 'none-b'}", "training.steps=128",
                       "data.stages=[{step: 64, weights: {a: 0, b: 2}}]"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-5:-2] == ["data mixture from step 0: a 75.0%, b 25.0%", "data mixture from step 64: a 0.0%, b 100.0%",
                            f"over 128 steps: a {768 * 128:,} tokens, b {1280 * 128:,} tokens"]
    # the directories do not exist: each is said (the tokens are the weights' share; a run refuses them)
    assert lines[-2:] == [f"note: data.mixture.{n}.dir {tmp_path / f'none-{n}'} is not a prepared data directory (no "
                          f"index.json): its tokens above are the weights' share only; a run refuses it" for n in "ab"]
    assert list(tmp_path.iterdir()) == []
