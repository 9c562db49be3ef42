"""The Pallas flash-attention kernel against the XLA reference, the attention dispatch, and
`python bench.py train` as a CPU smoke test. On the CPU the kernel runs in Pallas interpret mode;
on a GPU the same tests run the Triton kernels and cuDNN."""
import dataclasses
import json
import math
import os
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import bench
import model as M
import sharding
import train
from benchmarks import bench_profile, bench_train
from core import errors
from layers import attention as A
from layers import flash_alibi, logical_axes, loss
from training import config, step

ON_GPU = jax.default_backend() == "gpu"


def reference(q, k, v, alibi=True):
    """attention.py's XLA attention (the reference implementation), in float32."""
    B, T, H, D = q.shape
    cfg = M.GPTConfig(num_head=H, embedding_dim=H * D, alibi_attn=alibi, attention="xla")
    return A.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), cfg)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_flash_kernel_matches_reference_forward_and_gradients(dtype, tol):
    # T = 40 is not a multiple of the 16-row blocks (3 blocks, the last padded); H = 3 takes the
    # slope rule for a head count that is not a power of two; D = 8 is padded to Triton's 16.
    B, T, H, D = 2, 40, 3, 8
    q, k, v, g = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in jax.random.split(jax.random.key(0), 4))
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    slopes = A.alibi_slopes(H)

    def ours(q, k, v):
        return flash_alibi.flash_alibi_attention(q, k, v, slopes, block_fwd=16, block_bwd=16)

    y = ours(q, k, v)
    assert y.shape == (B, T, H, D) and y.dtype == dtype
    y_ref = reference(q, k, v)
    scale = float(jnp.abs(y_ref).max())
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref), atol=tol * scale)

    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * g)  # noqa: E731
    grads = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    grads_ref = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for name, got, want in zip("qkv", grads, grads_ref):
        assert got.dtype == dtype, name
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol * scale,
                                   err_msg=f"d{name}")


def test_flash_kernel_without_bias_is_plain_causal_attention():
    B, T, H, D = 1, 20, 2, 16
    q, k, v = (jax.random.normal(key, (B, T, H, D)) for key in jax.random.split(jax.random.key(1), 3))
    y = flash_alibi.flash_alibi_attention(q, k, v, None, block_fwd=16, block_bwd=16)
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference(q, k, v, alibi=False)), atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        flash_alibi.flash_alibi_attention(q, k, v, None, block_fwd=24)


def test_pallas_model_runs_past_its_training_context():
    """An ALiBi GPT trained at block_size 16 runs at 40 tokens with attention=pallas, as with xla."""
    cfg = M.GPTConfig(vocab_size=64, block_size=16, embedding_dim=32, num_head=4, N=1)
    tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, 64)
    logits = {}
    for impl in ("xla", "pallas"):
        model = M.GPT(dataclasses.replace(cfg, attention=impl), rngs=nnx.Rngs(0))  # the same parameters
        logits[impl] = np.asarray(model(tokens))
    np.testing.assert_allclose(logits["pallas"], logits["xla"], atol=1e-4)


def triton_calls(lowered_text: str, with_warps: bool = False) -> list[tuple]:
    """(kernel name, operand types[, warps]) of every Triton custom call in lowered StableHLO."""
    calls = []
    for line in lowered_text.splitlines():
        if "xla.gpu.triton" in line:
            [name] = re.findall(r'name = "([^"]*)"', line)
            [operands] = re.findall(r":\s*\(([^)]*)\)\s*->", line)
            [warps] = re.findall(r"num_warps = (\d+)", line)
            calls.append((name, [t.strip() for t in operands.split(",")]) + ((int(warps),) if with_warps else ()))
    return calls


@pytest.mark.parametrize("B, T, H, D, dtype, settings", [
    (1, 1024, 12, 64, jnp.bfloat16, {}),  # 124m at its context
    (1, 8192, 16, 96, jnp.bfloat16, {}),  # 760m at 8192: D = 96 is padded to 128
    (1, 2048, 16, 96, jnp.bfloat16, {"block_fwd": 128, "block_bwd": 64, "num_warps": 8}),  # larger tiles
    (2, 200, 3, 8, jnp.float32, {}),  # padded length, odd head count, D below Triton's smallest tile
])
def test_flash_kernel_lowers_to_triton_for_cuda(monkeypatch, B, T, H, D, dtype, settings):
    """The kernels pass Pallas's Triton lowering (every tile a power of two, every operation one
    Triton has), checked from any machine by lowering the gradient for CUDA."""
    monkeypatch.setattr(flash_alibi, "interpret_by_default", lambda: False)
    x = jax.ShapeDtypeStruct((B, T, H, D), dtype)

    def loss(q, k, v):
        return flash_alibi.flash_alibi_attention(q, k, v, A.alibi_slopes(H), **settings).astype(jnp.float32).sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
    calls = triton_calls(text, with_warps=True)
    assert sorted(name for name, _, _ in calls) == ["flash_alibi_dkv", "flash_alibi_dq", "flash_alibi_fwd"]
    assert {warps for _, _, warps in calls} == {settings.get("num_warps", flash_alibi.NUM_WARPS)}


@pytest.mark.parametrize("data, fsdp", [(4, 1), (2, 2)])
def test_pallas_attention_runs_per_device_under_a_mesh(monkeypatch, data, fsdp):
    """Under data parallelism x tensor parallelism each device runs the kernel on its own rows and
    heads (shard_map), with its heads' slopes: the same values and gradients as the reference."""
    mesh = sharding.make_mesh(data, fsdp, 2)
    rules = sharding.activation_rules(mesh)
    B, T, H, D = 8, 48, 4, 16
    q, k, v, g = (jax.random.normal(key, (B, T, H, D)) for key in jax.random.split(jax.random.key(4), 4))
    placed = [jax.device_put(x, rules(("batch", "length", "heads", "kv"))) for x in (q, k, v)]

    def grad_fn(impl):
        cfg = M.GPTConfig(num_head=H, embedding_dim=H * D, attention=impl)

        def loss(q, k, v):
            return jnp.sum(A.attention(q, k, v, cfg, sharding=rules(("batch", "length", "heads", "kv"))) * g)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    (got, got_grads), (want, want_grads) = grad_fn("pallas")(*placed), grad_fn("xla")(*placed)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for name, a, b in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=f"d{name}")

    # for CUDA, every Triton call takes one device's block: B/4 rows, T padded to 64, H/2 heads
    monkeypatch.setattr(flash_alibi, "interpret_by_default", lambda: False)
    text = grad_fn("pallas").trace(*placed).lower(lowering_platforms=("cuda",)).as_text()
    calls = triton_calls(text)
    assert sorted(name for name, _ in calls) == ["flash_alibi_dkv", "flash_alibi_dq", "flash_alibi_fwd"]
    for name, operands in calls:
        assert operands[0] == "tensor<2x16xf32>", name  # this device's 2 slopes, as a row of 16
        assert operands[1:4] == ["tensor<2x64x2x16xf32>"] * 3, name  # q, k, v


def test_zero3_train_step_with_pallas_lowers_for_cuda(monkeypatch):
    """train.py's step (ZeRO-3 over data=4, heads over tensor=2, bfloat16, attention=pallas) lowers
    for CUDA with the kernels on per-device blocks, forward (recomputed under remat) and backward."""
    monkeypatch.setattr(flash_alibi, "interpret_by_default", lambda: False)
    mcfg = M.GPTConfig(vocab_size=256, block_size=64, embedding_dim=64, num_head=4, N=2, dtype="bfloat16",
                       attention="pallas", remat="full")
    mesh = sharding.make_mesh(4, 1, 2)
    t = config.load_config().training
    loss_fn, abstract_vars = step.make_loss(mcfg)
    tx, _ = step.make_optimizer(t)
    init_state = step.make_init_state(mcfg, tx)
    keys = jax.random.split(jax.random.key(0))
    abstract_state = jax.eval_shape(init_state, *keys)
    axes = nnx.to_pure_dict(logical_axes.param_axes(abstract_vars))
    state_sharding, grad_sharding, _ = sharding.state_shardings(abstract_state, axes, mesh, 3)
    train_step = step.make_train_step(loss_fn, tx, 2, grad_sharding, sharding.activation_rules(mesh))
    batch = jax.ShapeDtypeStruct((16, 65), jnp.int32, sharding=sharding.batch_sharding(mesh))
    text = jax.jit(train_step, donate_argnums=0).trace(sharding.with_shardings(abstract_state, state_sharding),
                                                       batch).lower(lowering_platforms=("cuda",)).as_text()
    calls = triton_calls(text)
    names = [name for name, _ in calls]
    # per block: backward once, forward twice (remat="full" recomputes it in the backward pass)
    assert names.count("flash_alibi_dkv") == names.count("flash_alibi_dq") == mcfg.N
    assert names.count("flash_alibi_fwd") == 2 * mcfg.N
    for name, operands in calls:  # 16 rows in 2 micro-batches over 4 devices: 2 rows, 2 of 4 heads
        assert operands[1:4] == ["tensor<2x64x2x16xbf16>"] * 3, name


def test_cudnn_dispatch():
    B, T, H, D = 1, 9, 2, 16  # odd length: cuDNN takes even lengths, so the dispatch pads one position
    q, k, v = (jax.random.normal(key, (B, T, H, D)) for key in jax.random.split(jax.random.key(3), 3))
    cfg = M.GPTConfig(num_head=H, embedding_dim=H * D, attention="cudnn", dtype="bfloat16")
    if ON_GPU:
        got = A.attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), cfg)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(reference(q, k, v)), atol=3e-2)
    else:
        with pytest.raises(ValueError, match="attention=cudnn needs an NVIDIA GPU"):
            A.attention(q, k, v, cfg)
    with pytest.raises(ValueError, match="cudnn needs model.dtype bfloat16 or float16"):
        M.GPTConfig(attention="cudnn")  # float32
    with pytest.raises(ValueError, match="cannot drop attention probabilities"):
        M.GPTConfig(attention="pallas", dropout=0.1)


def expected_params(c: M.GPTConfig) -> int:
    """GPT-2 layout by hand: embeddings, 12d^2 + 13d per block (weights, biases, 2 LayerNorms), final norms."""
    d, vocab = c.embedding_dim, -(-c.vocab_size // 128) * 128
    norms = (2 if c.embed_norm else 1) * 2 * d
    return vocab * d + (0 if c.alibi_attn else c.block_size * d) + c.N * (12 * d * d + 13 * d) + norms


def test_bench_train_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["train", "--model", "test", "--no-alibi", "--seq", "24", "--batch", "2", "--dtype", "float32",
            "--steps", "3", "--warmup", "1", "--peak-tflops", "0.5", "--threads", "1", "--out", str(out)]
    cores, torch_threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        assert bench.main(argv) == 0
        # both frameworks on the first core alone: this process's affinity (XLA's threads and torch's) and torch's
        assert os.sched_getaffinity(0) == {min(cores)} and torch.get_num_threads() == 1
    finally:  # this test process goes on with its cores
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(torch_threads)
    printed = capsys.readouterr().out
    [path] = out.glob("train-*.json")
    record = json.loads(path.read_text())
    assert record["command"] == "python bench.py " + " ".join(argv)
    for lib in ("jax", "flax", "torch", "transformers"):
        assert record["versions"][lib]
    # what changes the measurement is kept: here conftest's XLA flag for 8 CPU devices
    assert "--xla_force_host_platform_device_count=8" in record["machine"]["environment"]["XLA_FLAGS"]
    r = record["results"]
    assert r["config"]["alibi_attn"] is False and r["batch"] == 2 and r["seq"] == 24
    c = M.GPTConfig(**r["config"])
    assert r["parameters"] == expected_params(c)
    flops = 6 * expected_params(c) + 6 * c.N * c.embedding_dim * 24  # 6N + 6LdT per token
    for name in ("jax", "torch", "hf"):
        run = r[name]
        assert len(run["step_s"]) == 3 and run["step_s_median"] == statistics.median(run["step_s"])
        assert run["tokens_per_s"] == pytest.approx(2 * 24 / run["step_s_median"], rel=1e-12)
        assert run["mfu"] == pytest.approx(run["tokens_per_s"] * flops / 0.5e12, rel=1e-9)
        assert f"{run['tokens_per_s']:,.0f} tokens/s" in printed
    for name in ("torch", "hf"):
        assert r[f"ratio_vs_{name}"] == pytest.approx(r["jax"]["tokens_per_s"] / r[name]["tokens_per_s"])
    # the JAX step trained the model it says: a fresh model's loss is about ln(padded vocabulary)
    assert abs(r["jax"]["loss_first"] - math.log(512)) < 0.1
    # targets count only on an H100/H200: never met on another device
    counted = any(kind in r["jax"]["device_kind"] for kind in ("H100", "H200"))
    assert r["targets"]["counted"] is counted
    assert r["targets"]["ratio_vs_torch_met"] is (counted and r["ratio_vs_torch"] >= 1.2)
    assert path.name in (out / "RESULTS.md").read_text()
    assert r["threads"] == {"threads": 1, "cores": [min(cores)]}
    assert re.search(rf"^threads +1 for both \(cores {min(cores)};", printed, re.M), printed
    # how busy the machine was: the 1-minute load average over its cores before and after, said busy when it
    # exceeds a quarter of a core beyond what this run (one core of the machine's) could add itself
    load = r["load_per_core"]
    assert load["cores"] == os.cpu_count() and 0 <= load["start"] and 0 <= load["end"]
    busy = load["start"] > 0.25 or load["end"] > 1 / os.cpu_count() + 0.25
    assert re.search(rf"^machine load +{load['start']:.2f} per core before, {load['end']:.2f} after", printed, re.M)
    assert ("BUSY: other work shared the cores" in printed) is busy and ("; idle" in printed) is not busy


def test_bench_train_profile_records_device_time_per_operation(tmp_path, capsys, monkeypatch):
    """--profile traces extra steps after the timed ones and records each operation's time per step;
    --loss-chunk sets the step's training.loss_chunk (here 8 of the 32 tokens at a time)."""
    out, trace_dir = tmp_path / "bench", tmp_path / "trace"
    argv = ["train", "--model", "test", "--seq", "16", "--batch", "2", "--dtype", "float32", "--no-torch",
            "--steps", "2", "--warmup", "1", "--profile", str(trace_dir), "--profile-steps", "2", "--loss-chunk", "8",
            "--out", str(out)]
    layouts = []  # how the step's loss was cut: what --loss-chunk reached
    monkeypatch.setattr(M, "chunk_layout",
                        lambda B, T, chunk: layouts.append((B, T, chunk)) or loss.chunk_layout(B, T, chunk))
    assert bench.main(argv) == 0
    assert set(layouts) == {(2, 16, 8)} and loss.chunk_layout(2, 16, 8) == (4, 4)
    printed = capsys.readouterr().out
    [path] = out.glob("train-*.json")
    r = json.loads(path.read_text())["results"]
    assert r["loss_chunk"] == 8 and "loss_chunk 8" in printed
    assert abs(r["jax"]["loss_first"] - math.log(512)) < 0.1  # a fresh model's loss, through the chunked loss
    assert r["attention"] == A.resolve_attention(M.GPTConfig(**r["config"]))  # auto, resolved for this backend
    profile = r["jax"]["profile"]
    assert profile["steps"] == 2 and profile["trace"].startswith(str(trace_dir))
    assert list(trace_dir.rglob("perfetto_trace.json.gz"))
    assert profile["devices"]
    for thread, entry in profile["devices"].items():
        times = [us for _, us, _ in entry["top"]]
        assert times == sorted(times, reverse=True) and sum(times) <= entry["total_us"] * (1 + 1e-9)
        for _, us, share in entry["top"]:
            assert share == pytest.approx(us / entry["total_us"])
        assert f"profile: {thread}" in printed
    assert len(r["jax"]["step_s"]) == 2  # the traced steps are not among the timed ones
    # the same time by what it computes, named from the compiled step's HLO (model.py's named scopes)
    rows = profile["by_scope"]
    assert sum(us for *_, us, _ in rows) == pytest.approx(profile["attributed_us"]) and profile["attributed_us"] > 0
    assert [us for *_, us, _ in rows] == sorted((us for *_, us, _ in rows), reverse=True)
    where = {w for w, *_ in rows}
    assert {"forward block/mlp/fc", "backward block/mlp/fc", "forward block/attn/qkv", "backward block/attn/qkv",
            "forward block/attn/attention", "backward block/attn/attention", "loss", "update optimizer"} <= where
    assert ("backward block/mlp/proj", "matmul") in {(w, k) for w, k, *_ in rows}
    assert "profile by scope" in printed
    assert 0 < profile["busy_us"] <= profile["span_us"] and "device busy" in printed


def test_busy_time_is_the_union_of_the_kernels_intervals():
    """busy: the time covered by at least one interval, per step, against the first start to the last end."""
    intervals = [(10.0, 20.0), (15.0, 25.0), (30.0, 31.0), (12.0, 14.0), (40.0, 50.0)]  # 10..25, 30..31, 40..50
    assert bench_profile.busy(intervals, 2) == {"span_us": (50 - 10) / 2, "busy_us": (15 + 1 + 10) / 2}
    assert bench_profile.busy([], 3) == {"span_us": 0.0, "busy_us": 0.0}


def test_profile_attribution_names_kernels_by_their_hlo_operations():
    """hlo_operations reads each instruction's op_name scopes, direction and kind from HLO text; attribute
    sums event times by them: a GPU kernel by its "hlo_op", else by its name with "_N" read as ".N"."""
    hlo = "\n".join([
        'HloModule jit_train_step',
        '%fused_computation.1 (p: f32[8]) -> f32[8] {',
        '  ROOT %tanh.3 = f32[8]{0} tanh(f32[8]{0} %p), metadata={op_name="jit(train_step)/jvp(block)/mlp/activation/tanh"}',
        '}',
        'ENTRY %main (a: f32[8]) -> f32[8] {',
        '  %loop_tanh_fusion.2 = f32[8]{0} fusion(f32[8]{0} %a), kind=kLoop, calls=%fused_computation.1, '
        'metadata={op_name="jit(train_step)/jvp(block)/mlp/activation/tanh"}',
        '  %custom-call.7 = (bf16[8]{0}, s8[16]{0}) custom-call(f32[8]{0} %a), custom_call_target="__cublas$gemm", '
        'metadata={op_name="jit(train_step)/transpose(jvp(block))/mlp/fc/btd,df->btf/dot_general"}',
        '  %input_reduce_fusion = f32[] fusion(f32[8]{0} %a), kind=kInput, calls=%x, '
        'metadata={op_name="jit(train_step)/optimizer/reduce_sum"}',
        '  %while.4 = (s32[]) while((s32[]) %t), condition=%c, body=%b, metadata={op_name="jit(train_step)/jvp(loss)/while"}',
        '  %custom-call.8 = (bf16[8]{0}, f32[8]{0}) custom-call(f32[8]{0} %a), custom_call_target="__cudnn$fmhaSoftmax", '
        'metadata={op_name="jit(train_step)/transpose(jvp(block))/checkpoint/rematted_computation/attn/attention/x"}',
        '  %input_scatter_fusion = f32[8]{0} fusion(f32[8]{0} %a), kind=kInput, calls=%y, '
        'metadata={op_name="jit(train_step)/transpose(jvp(embed))/scatter-add"}',
        '  ROOT %dot.5 = f32[8]{0} dot(f32[8]{0} %a, f32[8]{0} %a), metadata={op_name="jit(train_step)/jvp(loss)/btd,vd->btv/dot_general"}',
        '}'])
    ops = bench_profile.hlo_operations(hlo)
    assert ops["loop_tanh_fusion.2"] == ("forward block/mlp/activation", "elementwise")
    assert ops["tanh.3"] == ("forward block/mlp/activation", "tanh")
    assert ops["custom-call.7"] == ("backward block/mlp/fc", "matmul")
    assert ops["input_reduce_fusion"] == ("update optimizer", "reduction")
    assert ops["while.4"] == ("loss", None) and ops["dot.5"] == ("loss", "matmul")
    assert ops["custom-call.8"] == ("recompute block/attn/attention", "attention (cuDNN)")
    assert ops["input_scatter_fusion"] == ("backward embed", "scatter")
    timed = [("custom-call.7", "nvjet_sm90_tst_192x192", 5.0), (None, "loop_tanh_fusion_2", 2.0),
             (None, "input_reduce_fusion", 1.0), (None, "while.4", 9.0), (None, "dot.5", 2.0),
             (None, "end: dot.5", 0.5), ("custom-call.7", "cutlass_kernel", 1.0)]
    out = bench_profile.attribute(timed, ops)
    assert out["by_scope"] == [["backward block/mlp/fc", "matmul", 6.0, 6.0 / 11],
                               ["forward block/mlp/activation", "elementwise", 2.0, 2.0 / 11],
                               ["loss", "matmul", 2.0, 2.0 / 11], ["update optimizer", "reduction", 1.0, 1.0 / 11]]
    assert out["attributed_us"] == 11.0 and out["unattributed_us"] == 0.5  # the loop's own 9.0 is its body's


def test_bench_train_lora_step(tmp_path, capsys):
    """--lora times the LoRA step train.py runs: adapters on a random frozen base, the FLOPs of a frozen
    base (4N + 6LdT + 6 per adapter parameter) in the MFU; mistakes are one line."""
    out = tmp_path / "bench"
    argv = ["train", "--model", "test", "--seq", "16", "--batch", "2", "--dtype", "float32", "--no-torch",
            "--steps", "2", "--warmup", "1", "--peak-tflops", "0.5", "--lora", "4", "--lora-targets", "q,mlp",
            "--out", str(out)]
    assert bench.main(argv) == 0
    [path] = out.glob("train-*.json")
    r = json.loads(path.read_text())["results"]
    c = M.GPTConfig(**r["config"])
    d, F = c.embedding_dim, c.ffn_dim
    adapters = c.N * 4 * ((d + 3 * d) + (d + F) + (F + d))  # the fused q/k/v weight's, the MLP's two
    assert r["jax"]["adapters"] == adapters and r["lora"]["targets"] == ["q", "mlp"]
    flops = 4 * expected_params(c) + 6 * adapters + 6 * c.N * d * 16
    assert r["jax"]["mfu"] == pytest.approx(r["jax"]["tokens_per_s"] * flops / 0.5e12, rel=1e-9)
    assert math.isfinite(r["jax"]["loss_last"]) and "LoRA rank 4 on q,mlp" in capsys.readouterr().out
    for extra, message in [(["--lora", "4"], "--lora times our step alone; pass --no-torch"),
                           (["--lora", "-1"], "error: --lora -1: the adapters' rank must be a positive integer "
                                              "(e.g. --lora 8), or 0 for full training\n"),
                           (["--lora", "4", "--no-torch", "--lora-targets", "q,x"], "unknown target 'x'")]:
        assert bench.cli(["train", "--model", "test", *extra, "--out", str(tmp_path / "none")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "none").exists()


def test_bench_train_fp8_beside_the_step_without(tmp_path, capsys):
    """--fp8 times the step with the projections in FP8 and, in the same run, the same step without: their
    tokens/s and ratio, each compiled step's memory; the FP8 target counts for 760m on an H100/H200 only."""
    out = tmp_path / "bench"
    argv = ["train", "--model", "test", "--seq", "16", "--batch", "2", "--dtype", "float32", "--no-torch",
            "--steps", "2", "--warmup", "1", "--fp8", "--out", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    [path] = out.glob("train-*.json")
    r = json.loads(path.read_text())["results"]
    fp8, without = r["jax"], r["without_fp8"]
    assert r["config"]["fp8"] is True and fp8["fp8"] is True and without["fp8"] is False
    assert r["fp8_speedup"] == pytest.approx(fp8["tokens_per_s"] / without["tokens_per_s"], rel=1e-12)
    assert fp8["compiled_temp_bytes"] > 0 and without["compiled_temp_bytes"] > 0
    # the same model and batch, computed two ways: the FP8 rounding moves the first loss a little
    assert 0 < abs(fp8["loss_first"] - without["loss_first"]) < 1e-2 * without["loss_first"]
    assert "fp8 / without" in printed and "the blocks' projections in FP8" in printed
    assert "fp8_speedup_min" not in r["targets"]  # the test size: no target
    mcfg = M.GPTConfig(**{**r["config"], "dtype": "bfloat16"})
    for kind, speedup, met in (("NVIDIA H100 80GB HBM3", 1.3, True), ("NVIDIA H200", 1.2, False), ("cpu", 2.0, False)):
        t = bench_train.targets("760m", mcfg, 2048, {"device_kind": kind, "mfu": 0.5}, {"fp8_speedup": speedup})
        assert t["fp8_speedup_min"] == 1.25 and t["fp8_speedup_met"] is met
    for extra, message in [([], "--fp8 times our step with and without FP8; pass --no-torch"),
                           (["--no-torch", "--dtype", "float16"], "model.fp8 needs model.dtype float32 or bfloat16")]:
        assert bench.cli(["train", "--model", "test", "--fp8", *extra, "--out", str(tmp_path / "none")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "none").exists()


def test_bench_train_errors_are_one_line(tmp_path, capsys):
    out = tmp_path / "bench"
    assert bench.cli(["train", "--model", "nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown --model 'nope'" in err and "124m" in err
    assert bench.cli(["train", "--model", "test", "--seq", "65", "--no-alibi", "--out", str(out)]) == 2
    assert "longer than block_size 64" in capsys.readouterr().err
    assert bench.cli(["train", "--model", "test", "--seq", "0", "--out", str(out)]) == 2  # (it ran at block_size)
    assert "--seq, --batch, --steps and --warmup must be at least 1" in capsys.readouterr().err
    assert bench.cli(["train", "--model", "test", "--loss-chunk", "-1", "--out", str(out)]) == 2
    assert "--loss-chunk must be at least 0" in capsys.readouterr().err
    cores = len(os.sched_getaffinity(0))
    assert bench.cli(["train", "--model", "test", "--threads", str(cores + 1), "--out", str(out)]) == 2
    assert f"--threads must be between 1 and the {cores} core(s)" in capsys.readouterr().err
    # a sub-command's argparse mistake is the benchmark's own error too: one line, no usage block
    with pytest.raises(errors.BenchError, match=r"--seq: invalid int value: 'x' \(see python .*train --help\)"):
        bench.main(["train", "--seq", "x", "--out", str(out)])
    if not ON_GPU:
        assert bench.cli(["train", "--model", "test", "--attention", "cudnn", "--out", str(out)]) == 2
        assert "needs an NVIDIA GPU" in capsys.readouterr().err
        # train.py refuses it the same way, before preparing data or making the run directory
        run_dir = tmp_path / "run"
        assert train.cli([f"run_dir={run_dir}", "model.attention=cudnn", "model.dtype=bfloat16"]) == 2
        assert "model.attention=cudnn needs an NVIDIA GPU" in capsys.readouterr().err
        assert not run_dir.exists()
    assert not out.exists()  # nothing recorded for a run that did not happen


def test_bench_attention_checks_each_implementation(tmp_path):
    out = tmp_path / "bench"
    argv = ["attention", "--impls", "xla,cudnn,pallas", "--batch", "1", "--seq", "256", "--heads", "2",
            "--head-dim", "16", "--steps", "2", "--warmup", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    [path] = out.glob("attention-*.json")
    r = json.loads(path.read_text())["results"]
    pallas, xla = r["impls"]["pallas"], r["impls"]["xla"]
    for impl in (xla, pallas):  # bfloat16 inputs against the float32 reference
        assert max(impl[f"error_{n}"] for n in ("out", "dq", "dk", "dv")) < 2e-2
        assert impl["step_s_median"] == statistics.median(impl["step_s"])
    # no (T, T) scores kept: at T = 256 the kernel's temporaries are a fraction of the reference's
    assert pallas["temp_bytes"] < xla["temp_bytes"] / 2
    assert ("unavailable" in r["impls"]["cudnn"]) is not ON_GPU
    assert r["fastest"] in [i for i, e in r["impls"].items() if "step_s" in e]


def test_bench_attention_compares_kernel_settings(tmp_path, capsys):
    """pallas:FWDxBWD[xWARPS[xSTAGES]] entries run the kernel with those settings, each checked against the
    reference; bad entries are one line, and nothing is recorded."""
    out = tmp_path / "bench"
    argv = ["attention", "--impls", "pallas:16x16,pallas:32x16x8,pallas:16x32x4x3", "--batch", "1", "--seq", "40",
            "--heads", "2", "--head-dim", "16", "--steps", "1", "--warmup", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    [path] = out.glob("attention-*.json")
    impls = json.loads(path.read_text())["results"]["impls"]
    assert sorted(impls) == ["pallas:16x16", "pallas:16x32x4x3", "pallas:32x16x8"]
    for entry in impls.values():
        assert max(entry[f"error_{n}"] for n in ("out", "dq", "dk", "dv")) < 2e-2
    capsys.readouterr()
    bad = {"pallas:24x16": "block_fwd must be a power of two", "pallas:16x16x3": "num_warps must be a power of two",
           "pallas:16x16x4x0": "num_stages must be at least 1", "pallas:16x16x4x2x1": "only pallas takes settings",
           "xla:16x16": "only pallas takes settings", "pallas:16": "only pallas takes settings",
           "flash": "unknown --impls entry 'flash'"}
    for impl, message in bad.items():
        assert bench.cli(["attention", "--impls", impl, "--out", str(tmp_path / "none")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, impl
    assert not (tmp_path / "none").exists()


def test_bench_recipe_reads_its_runs_into_the_three_figures(tmp_path, capsys, monkeypatch):
    """bench.py recipe's arithmetic on runs given here (train.py itself is what each run would be): the means
    over seeds, whether Muon is better on every seed, the steps AdamW needs to reach Muon's loss
    interpolated linearly between its 600- and 900-step runs, and its ratio to 600; recorded in RESULTS.md."""
    from benchmarks import bench_recipe

    finals = {("adamw", 0, 600): 3.40, ("adamw", 1, 600): 3.42, ("muon", 0, 600): 3.15, ("muon", 1, 600): 3.16,
              ("adamw", 0, 900): 3.20, ("adamw", 0, 1200): 3.05}

    def fake_train(args, work, optimizer, seed, steps):
        return {"val_loss": {steps // 2: 4.0, steps: finals[(optimizer, seed, steps)]}, "wall_s": 1.0}

    monkeypatch.setattr(bench_recipe, "train", fake_train)
    assert bench.main(["recipe", "--seeds", "0,1", "--time-rounds", "0", "--out", str(tmp_path)]) == 0
    [record] = tmp_path.glob("recipe-*.json")
    got = json.loads(record.read_text())["results"]
    assert got["mean_final_val_loss"] == pytest.approx({"adamw": 3.41, "muon": 3.155})
    assert got["muon_better_every_seed"] is True
    reach = 900 + 300 * (3.20 - 3.15) / (3.20 - 3.05)  # on the segment from 900 (3.20) to 1200 (3.05)
    assert got["adamw_steps_to_muon_loss"] == pytest.approx(reach)
    assert got["tokens_to_equal_loss_ratio"] == pytest.approx(reach / 600)
    assert "adamw needs 1.67x the tokens" in (tmp_path / "RESULTS.md").read_text()
    assert bench_recipe.steps_to_reach(2.9, {600: 3.4, 900: 3.2, 1200: 3.05}) is None  # beyond the longest run
    assert bench.cli(["recipe", "--steps", "600", "--adamw-steps", "500"]) == 2
    assert capsys.readouterr().err.strip().endswith("every --adamw-steps longer than --steps")


def test_a_record_goes_under_the_results_header_not_another_tables_separator(tmp_path):
    """A row is put under the results table's own header, even when a table of as many columns comes first
    (its separator line is the same text)."""
    other = ["# Benchmark results", "", "| a | b | c | d | e | f |", "| --- | --- | --- | --- | --- | --- |",
             "| 1 | 2 | 3 | 4 | 5 | 6 |", ""]
    results = ["| date | benchmark | machine | command | results | file |", "| --- | --- | --- | --- | --- | --- |",
               "| old | row | . | . | . | . |"]
    (tmp_path / "RESULTS.md").write_text("\n".join(other + results) + "\n")
    path = bench._record("demo", tmp_path, ["demo"], {}, "a summary")
    lines = (tmp_path / "RESULTS.md").read_text().splitlines()
    assert lines[:len(other) + 2] == other + results[:2]
    assert lines[len(other) + 2].endswith(f"| a summary | {path.name} |") and lines[len(other) + 3] == results[2]
