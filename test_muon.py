"""Tests of training.optimizer=muon: which parameters Muon trains, its update against a Newton-Schulz iteration
written out here, ZeRO stages and tensor parallelism against one device, its optimizer state sharded and
counted by the plan, and the runs that use it (resume, a switch of optimizer refused, LoRA's AdamW).
"""
import json
import pathlib
import signal

import jax
import numpy as np
import pytest
from flax import nnx

import model
import sharding
import train
from layers import logical_axes
from store import fingerprints
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)
from training import config, devices, plan
from training import step as step_lib

MUON = ("training.optimizer=muon",)


def names(tree) -> list[str]:
    return [name for name, _ in fingerprints.named_leaves(tree)]


def test_muon_trains_every_block_matrix_and_adamw_the_rest():
    """The LLaMA layout (grouped heads, a gated MLP, an untied head) and the default one: every `kernel`
    of a block goes to Muon, as one matrix per projection; embeddings, the head, norms and biases to AdamW."""
    for overrides, per_block in ((["model=test"], 4), (["model=test", "model.norm=rmsnorm", "model.alibi_attn=false",
                                                        "model.rotary_dim=8", "model.activation=swiglu",
                                                        "model.num_kv_head=2",
                                                        "model.tie_embeddings=false", "model.bias=false"], 6)):
        cfg = config.load_config(overrides=[*overrides, *MUON])
        abstract, axes = step_lib.state_shapes(cfg.model, cfg.training)
        params = names(abstract["params"])
        matrices = [n for n in params if n.startswith("blocks/") and n.endswith("/kernel")]
        assert len(matrices) == per_block * cfg.model.N, matrices
        opt = names(abstract["opt_state"])
        momentum = sorted(n.split("/mu/", 1)[1] for n in opt if "/inner_states/muon/" in n and "/mu/" in n)
        first_moment = sorted(n.split("/mu/", 1)[1] for n in opt if "/inner_states/adamw/" in n and "/mu/" in n)
        assert momentum == sorted(matrices)
        assert first_moment == sorted(set(params) - set(matrices)) and "wte" in first_moment
        assert not any("/nu/" in n for n in opt if "/inner_states/muon/" in n)  # one moment: half of AdamW's


def newton_schulz(g: np.ndarray) -> np.ndarray:
    """Muon's orthogonalization as Jordan et al. (2024) publish it: the quintic iteration with coefficients
    (3.4445, -4.7750, 2.0315), 5 steps, on the matrix divided by its Frobenius norm; float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (np.linalg.norm(g) + 1e-8)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def test_muons_first_update_is_the_newton_schulz_of_the_gradient():
    """The first update of each block matrix is -lr (0.2 sqrt(max(fan_in, fan_out)) NS(G) + wd W), with G the
    gradient seen as the projection's matrix (inputs by outputs; q, k and v each their own), since the
    first momentum is a multiple of the gradient and the iteration starts by normalising it; and every
    other parameter's is AdamW's first update, -lr (g / (|g| + eps) + wd W) where decayed."""
    cfg = config.load_config(overrides=["model=test", *MUON, "training.lr=0.01", "training.warmup_steps=0",
                                        "training.grad_clip=null"])
    t = cfg.training
    abstract = nnx.eval_shape(lambda: model.GPT(cfg.model, rngs=nnx.Rngs(0)))
    axes = nnx.to_pure_dict(logical_axes.param_axes(nnx.split(abstract)[1]))
    params = nnx.to_pure_dict(nnx.state(model.GPT(cfg.model, rngs=nnx.Rngs(params=jax.random.key(0)))))
    grads = jax.tree.map(lambda p: np.asarray(jax.random.normal(jax.random.key(p.size), p.shape)), params)
    tx, schedule = step_lib.make_optimizer(t, axes)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    lr = float(schedule(0))
    checked = 0
    for (name, u), (_, g), (_, p) in zip(*(fingerprints.named_leaves(x) for x in (updates, grads, params)), strict=True):
        u, g, p = (np.asarray(x, np.float64) for x in (u, g, p))
        if name.startswith("blocks/") and name.endswith("/kernel"):
            if name.endswith("c_attn/kernel"):  # (embed, 3, heads, kv): q, k and v, each embed x (heads kv)
                mats = [g[:, i].reshape(g.shape[0], -1) for i in range(3)]
                expected = np.stack([newton_schulz(m).reshape(g.shape[0], *g.shape[2:]) for m in mats], 1)
            elif name.endswith("attn/c_proj/kernel"):  # (heads, kv, embed): (heads kv) x embed
                expected = newton_schulz(g.reshape(-1, g.shape[-1])).reshape(g.shape)
            else:  # the MLP's (embed, mlp) and (mlp, embed)
                expected = newton_schulz(g)
            fan = max(expected.shape[0] if name.endswith("c_attn/kernel") or "mlp" in name else
                      g.shape[0] * g.shape[1], g.shape[-1] * (g.shape[-2] if name.endswith("c_attn/kernel") else 1))
            expected = -lr * (t.muon_rms * np.sqrt(fan) * expected + t.weight_decay * p)
            np.testing.assert_allclose(u, expected, rtol=2e-3, atol=2e-6 * lr * np.sqrt(fan))
            checked += 1
        else:
            decayed = p.ndim >= 2 and name != "wte" and not name.endswith(("bias", "scale"))
            expected = -lr * (g / (np.abs(g) + t.eps) + (t.weight_decay * p if decayed else 0))
            np.testing.assert_allclose(u, expected, rtol=1e-5, atol=1e-9)
    assert checked == 4 * cfg.model.N


def muon_steps(mesh_sizes, stage, state=None, steps=3, micro_batches=1):
    """Three Muon steps of the `test` size (train.py's jitted step, step.build) at `stage` on a mesh of
    `mesh_sizes`, from `state` (host arrays; the build's initial state if None), on one fixed batch."""
    cfg = config.load_config(overrides=["model=test", "model.vocab_size=300"]).model
    t = config.TrainingConfig(batch_size=8, seq_len=32, lr=1e-2, warmup_steps=0, optimizer="muon",
                              micro_batches=micro_batches)
    mesh = sharding.make_mesh(*mesh_sizes, devices=jax.devices()[:int(np.prod(mesh_sizes))])
    built = step_lib.build(cfg, t, mesh, stage)
    state = built.init() if state is None else jax.device_put(state, built.state_sharding)
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (8, 33), 0, 300), np.int32)
    batch = jax.device_put(tokens, built.batch_sharding)
    start = jax.device_get(state)
    for _ in range(steps):
        state, metrics = built.train_step(state, batch)
    return start, jax.device_get(state), built


@pytest.fixture(scope="module")
def one_device():
    return muon_steps((1, 1, 1), 0)


@pytest.mark.parametrize("mesh_sizes, stage, micro", [((8, 1, 1), 1, 1), ((4, 2, 1), 2, 1), ((2, 2, 2), 3, 2),
                                                       ((2, 1, 4), 0, 1)])
def test_muon_under_zero_stages_and_tensor_parallelism_matches_one_device(one_device, mesh_sizes, stage, micro):
    """After three steps the parameters and Muon's momentum equal one device's within 1e-5 (at stage 3 with the
    batch in 2 micro-batches: gradient accumulation gives the same mean gradient); the momentum is sharded over
    the data-parallel devices as AdamW's moments are, from stage 1 on."""
    start, ref, _ = one_device
    _, got, built = muon_steps(mesh_sizes, stage, start, micro_batches=micro)
    for (name, a), (_, b) in zip(fingerprints.named_leaves(got), fingerprints.named_leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
    shard = dict(fingerprints.named_leaves(built.state_sharding))
    for name, leaf in fingerprints.named_leaves(built.abstract_state):
        if "/inner_states/muon/" in name and "/mu/" in name:
            spec = shard[name].spec
            assert any(entry is not None for entry in spec) is (stage >= 1 or mesh_sizes[2] > 1), (name, spec)


def test_the_plan_counts_one_moment_for_muons_matrices():
    """--plan's optimizer state on one device: AdamW's two float32 moments of every parameter, and with Muon
    one for each block matrix (its momentum) and two for the rest, from the parameter counts."""
    got = {}
    for opt in ("adamw", "muon"):
        cfg = config.load_config(overrides=["model=124m", f"training.optimizer={opt}", "training.batch_size=8"])
        e = plan.estimate(cfg, devices.target("H100", 1))
        got[opt] = (e.terms["optimizer state"], e.notes["optimizer state"])
    abstract, _ = step_lib.state_shapes(cfg.model, cfg.training)
    sizes = dict((n, x.size) for n, x in fingerprints.named_leaves(abstract["params"]))
    matrices = sum(s for n, s in sizes.items() if n.startswith("blocks/") and n.endswith("/kernel"))
    total = sum(sizes.values())
    assert got["adamw"][0] == pytest.approx(8 * total, rel=1e-5)
    assert got["muon"][0] == pytest.approx(8 * total - 4 * matrices, rel=1e-5)
    assert got["muon"][1].startswith("Muon's momentum of the block matrices")


STRAIGHT = (*MUON, "training.steps=12", "checkpoint.every=4", "model.dropout=0.1")  # what the stopped runs redo


@pytest.fixture(scope="module")
def muon_straight(corpus, tmp_path_factory):  # noqa: F811
    """A Muon run trained straight to step 12: what the stopped and killed runs below must end as."""
    run = tmp_path_factory.mktemp("muon") / "straight"
    assert train.main(tiny(run, corpus, *STRAIGHT)) == 0
    return run


def test_a_muon_run_resumes_exactly_and_refuses_a_switch_of_optimizer(corpus, muon_straight, tmp_path,  # noqa: F811
                                                                      capsys, monkeypatch):
    """A Muon run stopped at step 3 (SIGTERM during the step) and resumed ends as the straight run does, bit
    for bit; a resume that names the other optimizer is one line (the checkpoints hold Muon's state), and
    the run is untouched; a fine-tune from it with AdamW starts (a fresh optimizer)."""
    from test_stops import Hook, hook_fns, saved_state

    straight, stopped = muon_straight, tmp_path / "stopped"
    with monkeypatch.context() as patched:
        hook_fns(patched, Hook(signal.SIGTERM, lambda calls, *a: calls == 3), "train_step")
        assert train.main(tiny(stopped, corpus, *STRAIGHT, "checkpoint.every=100")) == 128 + signal.SIGTERM
    before = {p: p.read_bytes() for p in stopped.rglob("*") if p.is_file()}
    assert train.cli(["--resume", f"run_dir={stopped}", "training.optimizer=adamw"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "error: --resume cannot change training.optimizer (muon -> adamw): its checkpoints hold muon's state; "
        f"start a new run (training.init_from={stopped} starts from these weights with a fresh optimizer)")
    assert {p: p.read_bytes() for p in stopped.rglob("*") if p.is_file()} == before
    assert train.main(["--resume", f"run_dir={stopped}"]) == 0
    rows = lambda run: [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "mfu", "time_s")}  # noqa: E731
                        for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows(stopped) == rows(straight)
    jax.tree.map(np.testing.assert_array_equal, saved_state(stopped, 12), saved_state(straight, 12))
    tuned = tmp_path / "tuned"
    assert train.main(tiny(tuned, corpus, f"training.init_from={straight}", "training.optimizer=adamw",
                           "training.steps=2")) == 0


def test_an_adamw_run_saved_before_the_key_is_read_as_adamw():
    """Every fixture run's config.yaml (written by earlier versions, before training.optimizer existed) reads
    as an AdamW run; test_formats.py resumes them."""
    fixtures = sorted(pathlib.Path(__file__).parent.joinpath("fixtures", "runs").glob("*/run/config.yaml"))
    assert fixtures
    for fixture in fixtures:
        raw = config.parse_yaml(fixture.read_bytes(), fixture)
        assert "optimizer" not in raw["training"]
        assert config.from_saved(raw).training.optimizer == "adamw"


def test_a_muon_run_killed_during_a_save_resumes_exactly(corpus, muon_straight, tmp_path):  # noqa: F811
    """python train.py with Muon, SIGKILLed while its asynchronous save of step 8 is being written (a hook in
    the process says when that save has been handed to orbax), then --resume: it restores the newest
    complete checkpoint and ends at step 12 with the straight run's state and logged steps, bit for bit."""
    import subprocess
    import sys
    import time

    from test_stops import saved_state
    from test_train import deterministic, rows

    args = STRAIGHT
    straight, killed = muon_straight, tmp_path / "killed"
    marker = tmp_path / "saving-8"
    hook = ("import pathlib, runpy, sys\n"
            "from store import checkpoints\n"
            "save = checkpoints.Saver.save\n"
            "def saving(self, step, *a, **k):\n"
            "    save(self, step, *a, **k)\n"
            f"    if step == 8: pathlib.Path({str(marker)!r}).touch()\n"
            "checkpoints.Saver.save = saving\n"
            "sys.argv[0] = 'train.py'\n"
            "runpy.run_path('train.py', run_name='__main__')")
    process = subprocess.Popen([sys.executable, "-c", hook, *tiny(killed, corpus, *args)], cwd=pathlib.Path(__file__).parent,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not marker.exists() and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        time.sleep(0.005)
    process.kill()
    process.wait()
    assert train.main(["--resume", f"run_dir={killed}"]) == 0
    assert [deterministic(r) for r in rows(killed)] == [deterministic(r) for r in rows(straight)]
    jax.tree.map(np.testing.assert_array_equal, saved_state(killed, 12), saved_state(straight, 12))


def test_lora_keeps_adamw_and_muon_trains_in_bfloat16_with_fp8(corpus, tmp_path, capsys):  # noqa: F811
    """A LoRA run with training.optimizer=muon trains its adapters with AdamW, saying so (Muon is for a full
    run's block matrices); a Muon run in bfloat16 with FP8 projections trains, its loss falling."""
    base, adapted, fp8 = tmp_path / "base", tmp_path / "lora", tmp_path / "fp8"
    assert train.main(tiny(base, corpus, "training.steps=2")) == 0
    capsys.readouterr()
    assert train.main(tiny(adapted, corpus, *MUON, f"training.init_from={base}", "training.lora.rank=4",
                           "training.steps=2")) == 0
    assert "parameters trained with AdamW (training.optimizer=muon trains a full run's block matrices" \
        in capsys.readouterr().out
    from test_stops import saved_state
    opt = names(saved_state(adapted, 2)["opt_state"])
    assert opt and not any("muon" in n for n in opt) and any("/mu/" in n for n in opt)
    assert train.main(tiny(fp8, corpus, *MUON, "model.dtype=bfloat16", "model.fp8=true")) == 0
    losses = [json.loads(line)["loss"] for line in (fp8 / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.2, losses
