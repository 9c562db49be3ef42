"""`python bench.py train`: the training step's speed, MFU and memory, and PyTorch's on the same model.

    python bench.py train [--model 124m|417m|760m|1_3b|small|test] [--seq T] [--batch B]
                          [--dtype bfloat16] [--remat POLICY] [--attention IMPL] [--loss-chunk N] [--steps N]
                          [--fp8 --no-torch]

What is timed, for each framework, on one device and the same batch of B x T random tokens:
  ours    the train_step of step.build, the very function train.py runs (state donated,
          shardings from sharding.py for a one-device mesh): forward, backward, gradient
          clipping and the AdamW update;
  torch   torch_gpt.GPT, the same architecture in PyTorch (scaled_dot_product_attention with
          the ALiBi bias as a float mask), torch.compile by default on a GPU, autocast to the
          compute dtype, clip_grad_norm_ and torch.optim.AdamW (fused on a GPU);
  hf      for a learned-position model, transformers' GPT2LMHeadModel of the same shape (SDPA
          attention), as a third-party baseline, stepped the same way.
Each runs --warmup steps (compilation included) and then --steps timed steps, each synchronised
(block_until_ready / torch.cuda.synchronize); the median step time gives tokens/s = B*T / median.
Ours then runs --steps more as train.py's loop does, each dispatched before the previous step's loss
is read (`pipelined`): the device does not wait for the host's dispatch between steps, which the
synchronised steps include (12 ms of 180 at 760m on an H200).

With --fp8 ours runs with the blocks' projections in FP8 (model.fp8: cuBLASLt FP8 GEMMs on an H100/H200),
and in the same run, first, the same step without FP8: both tokens/s, their ratio (the target: 1.25x for
760m at T = 2048 in bfloat16), and each compiled step's temporary memory (XLA's figure for the program,
which the process-wide peak cannot give for the second of two steps).

MFU = tokens/s x (6 N + 6 L d T) / peak FLOP/s (model.flops_per_token; N parameters, L blocks,
width d, context T), with the peak from the device kind (devices.PEAK_FLOPS: 989 TFLOP/s dense bf16
for an H100 or H200 SXM) or --peak-tflops. On the CPU there is no peak and no MFU unless given.
Peak memory: the device's peak bytes in use (JAX memory_stats; torch.cuda.max_memory_allocated),
where the backend reports it. PyTorch runs first and frees its cache before JAX starts, since JAX
takes 75% of GPU memory when it starts (XLA_PYTHON_CLIENT_MEM_FRACTION changes that).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

import numpy as np

from benchmarks import bench_profile
from core.errors import TrainBenchError
from training import devices

# ---------------------------------------------------------------------------------------------
# Timing, shared by both frameworks


def time_steps(step, sync, warmup: int, steps: int) -> dict:
    """Runs step() `warmup` times, then `steps` times, sync(result) after each. Step times in seconds."""
    start = time.perf_counter()
    for _ in range(warmup):
        sync(step())
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        sync(step())
        times.append(time.perf_counter() - start)
    return {"warmup_steps": warmup, "warmup_s": warmup_s, "steps": steps, "step_s": times,
            "step_s_median": statistics.median(times)}


def time_pipelined(step, read, steps: int) -> float:
    """train.py's loop: each step dispatched before the previous step's metrics are read, so the device
    never waits for the host between steps. Seconds per step over `steps` steps (after warm-up)."""
    start = time.perf_counter()
    previous = None
    for _ in range(steps):
        out = step()
        if previous is not None:
            read(previous)
        previous = out
    read(previous)
    return (time.perf_counter() - start) / steps


def _throughput(timing: dict, tokens_per_step: int, flops_per_token: float, peak: float | None) -> dict:
    tokens_per_s = tokens_per_step / timing["step_s_median"]
    out = {**timing, "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_s,
           "mfu": tokens_per_s * flops_per_token / peak if peak else None}
    if "step_s_pipelined" in timing:
        out["tokens_per_s_pipelined"] = tokens_per_step / timing["step_s_pipelined"]
        out["mfu_pipelined"] = out["tokens_per_s_pipelined"] * flops_per_token / peak if peak else None
    return out


# ---------------------------------------------------------------------------------------------
# Ours: the step train.py runs


def bench_jax(mcfg, batch: int, seq: int, args, peak_override: float | None) -> dict:
    import jax
    import jax.numpy as jnp

    import model as model_lib
    import sharding as sharding_lib
    from training import step as step_lib
    device = jax.devices()[0]
    mesh = sharding_lib.make_mesh(1, 1, 1, devices=[device])  # one device: per-device figures
    fns = step_lib.build(mcfg, args.train_config, mesh, zero_stage=0)  # what train.py builds, with --optimizer's
    state = fns.init()
    train_step, adapters = fns.train_step, None
    if fns.abstract_base is not None:  # LoRA: a random frozen base, made in place in its dtypes, beside every step
        def random_base(key):
            leaves, treedef = jax.tree_util.tree_flatten_with_path(fns.abstract_base)
            keys = jax.random.split(key, len(leaves))
            return jax.tree.unflatten(treedef, [
                jnp.ones(x.shape, x.dtype) if path[-1].key == "scale" else
                (0.02 * jax.random.normal(k, x.shape)).astype(x.dtype) for (path, x), k in zip(leaves, keys)])

        base = (jax.jit(random_base, out_shardings=fns.base_sharding)(jax.random.key(1)),)
        adapters = sum(x.size for x in jax.tree.leaves(fns.abstract_state["params"]))
    else:
        base = ()
    rows = np.random.default_rng(0).integers(0, mcfg.vocab_size, (batch, seq + 1), dtype=np.int32)
    tokens = jax.device_put(rows, fns.batch_sharding)
    if args.packed:  # a prompt/completion batch: the masked step train.py runs on fine-tuning data
        tokens = {"tokens": tokens, **{name: jax.device_put(a, fns.batch_sharding)
                                       for name, a in packed_rows(batch, seq, args.packed).items()}}
    hlo = temp_bytes = None
    if getattr(args, "profile", None) or getattr(args, "fp8", False):
        # compiled here: the profile's operations named from its HLO; the program's own memory for --fp8's two steps
        train_step = train_step.lower(state, tokens, *base).compile()
        hlo = train_step.as_text() if getattr(args, "profile", None) else None
        analysis = train_step.memory_analysis()
        temp_bytes = getattr(analysis, "temp_size_in_bytes", None)
    losses = []

    def one_step():
        nonlocal state
        state, metrics = train_step(state, tokens, *base)
        return state, metrics

    def sync(out):
        jax.block_until_ready(out)
        losses.append(float(out[1]["loss"]))

    timing = time_steps(one_step, sync, args.warmup, args.steps)
    # the state is donated to the next step: only the metrics are read after it was dispatched
    timing["step_s_pipelined"] = time_pipelined(one_step, lambda out: losses.append(float(out[1]["loss"])),
                                                args.steps)
    profile = None
    if getattr(args, "profile", None):  # after the timed steps, so the trace never skews them
        # dispatched back to back as train.py runs them: the trace's gaps are then the step's own, not the host's
        read = lambda out: losses.append(float(out[1]["loss"]))  # noqa: E731
        profile = bench_profile.profile_steps(lambda: time_pipelined(one_step, read, args.profile_steps), args.profile_steps,
                                args.profile, hlo=hlo)
    if not all(np.isfinite(losses)):
        raise TrainBenchError(f"the JAX step's loss is not finite: {losses}")
    peak = peak_override or devices.peak_flops(device.device_kind)
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    result = _throughput(timing, batch * seq, model_lib.flops_per_token(mcfg, seq, adapters), peak)
    result.update({"device_kind": device.device_kind, "adapters": adapters, "platform": device.platform, "peak_flops": peak,
                   "loss_chunk": fns.loss_chunk, "fp8": mcfg.fp8, "compiled_temp_bytes": temp_bytes,
                   "peak_memory_bytes": (stats or {}).get("peak_bytes_in_use"),
                   "loss_first": losses[0], "loss_last": losses[-1], "loss_steps": len(losses)})
    if profile is not None:
        result["profile"] = profile
    return result


def packed_rows(batch: int, seq: int, examples: int) -> dict:
    """Loss weights and segment ids of rows that each pack `examples` equal examples, numbered 1, 2, ...,
    the last 1/8 of each example its completion: {weights float32 (B, T), segments int32 (B, T)}."""
    segments = 1 + (np.arange(seq) * examples // seq)  # (T,)
    starts = np.searchsorted(segments, segments, side="left")
    ends = np.searchsorted(segments, segments, side="right")
    completion = (np.arange(seq) - starts) >= (ends - starts) * 7 // 8
    return {"weights": np.broadcast_to(completion.astype(np.float32), (batch, seq)).copy(),
            "segments": np.broadcast_to(segments.astype(np.int32), (batch, seq)).copy()}


# ---------------------------------------------------------------------------------------------
# Theirs: PyTorch


def _torch_model(mcfg, which: str):
    """torch: torch_gpt.GPT of the config; hf: GPT2LMHeadModel of its shape (learned positions). Both
    map tokens (B, T) to logits (B, T, V_padded)."""
    import torch

    if which == "torch":
        from interop import torch_gpt
        return torch_gpt.GPT(torch_gpt.TorchGPTConfig.from_dict(dataclasses.asdict(mcfg)))
    from transformers import GPT2Config, GPT2LMHeadModel

    class LogitsOnly(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens):
            return self.model(input_ids=tokens, use_cache=False).logits

    hf = GPT2Config(vocab_size=mcfg.padded_vocab_size, n_positions=mcfg.block_size, n_embd=mcfg.embedding_dim,
                    n_layer=mcfg.N, n_head=mcfg.num_head, activation_function="gelu_new",
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=mcfg.layer_norm_epsilon,
                    bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return LogitsOnly(GPT2LMHeadModel(hf))


def bench_torch(mcfg, batch: int, seq: int, args, which: str, peak: float | None) -> dict:
    """One framework's step on the same batch shape; which: torch (torch_gpt.GPT) or hf (GPT2LMHeadModel)."""
    import torch
    import torch.nn.functional as F

    import model as model_lib

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = _torch_model(mcfg, which).to(device).train()
    compiled = args.torch_compile if args.torch_compile is not None else cuda
    forward = torch.compile(model) if compiled else model
    t = args.train_config
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.b1, t.b2), eps=t.eps,
                            weight_decay=t.weight_decay, **({"fused": True} if cuda else {}))
    dtype = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[mcfg.dtype]
    rows = np.random.default_rng(0).integers(0, mcfg.vocab_size, (batch, seq + 1))
    tokens = torch.from_numpy(rows).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def one_step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = forward(x)  # (B, T, V_padded)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # float32, as ours
        loss.backward()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        return loss.detach()

    def sync(loss):
        if cuda:
            torch.cuda.synchronize()
        losses.append(float(loss))

    timing = time_steps(one_step, sync, args.warmup, args.steps)
    result = _throughput(timing, batch * seq, model_lib.flops_per_token(mcfg, seq), peak)
    result.update({"device": torch.cuda.get_device_name() if cuda else "cpu", "compiled": compiled,
                   "autocast": str(dtype).replace("torch.", "") if dtype else None,
                   "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                   "parameters": sum(p.numel() for p in model.parameters()),
                   "loss_first": losses[0], "loss_last": losses[-1]})
    del model, forward, opt
    if cuda:
        torch.cuda.empty_cache()
    return result


def usable_cores() -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def load_per_core() -> float | None:
    """The 1-minute load average over the machine's cores: about the share of them busy (None where unknown)."""
    return os.getloadavg()[0] / (os.cpu_count() or 1) if hasattr(os, "getloadavg") else None


def same_threads(threads: int | None, torch_too: bool) -> dict:
    """Ours and PyTorch (`torch_too`) on the same `threads` CPU cores (default: all this process may use),
    set before JAX starts: the process's CPU affinity, by which XLA sizes its CPU thread pool and to which
    it confines PyTorch's too, and torch.set_num_threads. With unequal threads (OMP_NUM_THREADS=1 gives
    PyTorch one, and ours all), or other work on the cores, the comparison measures that instead:
    PyTorch's OpenMP threads wait for one another spinning, so a busy machine slows it by far more than
    ours, the ratio growing a hundredfold."""
    cores = usable_cores()
    if threads is not None:
        if not 1 <= threads <= len(cores):
            raise TrainBenchError(f"--threads must be between 1 and the {len(cores)} core(s) this process may use, "
                                  f"got {threads}")
        cores = cores[:threads]
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
    if torch_too:
        import torch

        torch.set_num_threads(len(cores))
    return {"threads": len(cores), "cores": cores}


BUSY_LOAD = 0.25  # a 1-minute load average per core above this (besides the run's own) is a busy machine


# ---------------------------------------------------------------------------------------------
# The run


def resolve(args):
    """(name, GPTConfig, seq) from the command line; TrainBenchError for a bad choice."""
    from layers import attention as attention_lib
    from training import config as config_lib
    sizes = config_lib.load_model_sizes()
    if args.model not in sizes:
        raise TrainBenchError(f"unknown --model {args.model!r}; valid sizes: {', '.join(sizes)}")
    overrides = {"dtype": args.dtype, "remat": args.remat, "attention": args.attention, "dropout": 0.0}
    if args.alibi is not None:
        overrides["alibi_attn"] = args.alibi
    try:
        name, mcfg = config_lib.resolve_model({"name": args.model, **overrides}, sizes)
    except config_lib.ConfigError as e:
        raise TrainBenchError(str(e)) from None
    seq = mcfg.block_size if args.seq is None else args.seq  # (--seq 0 is refused, not the default)
    if seq < 1 or args.batch < 1 or args.steps < 1 or args.warmup < 1:
        raise TrainBenchError("--seq, --batch, --steps and --warmup must be at least 1")
    if seq > mcfg.block_size:
        if mcfg.max_length is not None:
            raise TrainBenchError(f"--seq {seq} is longer than block_size {mcfg.block_size} of the learned-position "
                                  f"model {name}")
        mcfg = dataclasses.replace(mcfg, block_size=seq)  # ALiBi: the context is what is fed
    try:
        attention_lib.check_attention_backend(mcfg)  # before anything is timed
    except ValueError as e:
        raise TrainBenchError(str(e)) from None
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise TrainBenchError("--peak-tflops must be positive")
    if args.loss_chunk is not None and args.loss_chunk < 0:
        raise TrainBenchError("--loss-chunk must be at least 0 (0: the loss over the whole logits)")
    chunk = {} if args.loss_chunk is None else {"loss_chunk": args.loss_chunk}
    if not 0 <= args.packed <= seq or not 0.0 <= args.fcm < 1.0:
        raise TrainBenchError(f"--packed must be between 0 and --seq ({seq}), --fcm in [0, 1)")
    if getattr(args, "fp8", False):
        if args.torch:
            raise TrainBenchError("--fp8 times our step with and without FP8; pass --no-torch")
        try:
            mcfg = dataclasses.replace(mcfg, fp8=True)
        except ValueError as e:
            raise TrainBenchError(f"--fp8: {e}") from None
    lora = None
    if getattr(args, "lora", 0) < 0:  # before --no-torch's line: a rank it could never take
        raise TrainBenchError(f"--lora {args.lora}: the adapters' rank must be a positive integer (e.g. --lora 8), "
                              f"or 0 for full training")
    if getattr(args, "lora", 0):
        if args.torch:
            raise TrainBenchError("--lora times our step alone; pass --no-torch")
        try:
            lora = config_lib.LoRAConfig(rank=args.lora, targets=args.lora_targets.split(","),
                                         base_dtype=None if mcfg.dtype == "float32" else mcfg.dtype)
            config_lib.check_lora(lora, "a random base")
        except config_lib.ConfigError as e:
            raise TrainBenchError(f"--lora: {e}") from None
    args.train_config = config_lib.TrainingConfig(batch_size=args.batch, seq_len=seq, fcm_max_ratio=args.fcm,
                                                  lora=lora, optimizer=getattr(args, "optimizer", "adamw"), **chunk)
    return name, mcfg, seq


def targets(name: str, mcfg, seq: int, ours: dict, results: dict) -> dict:
    """The issue's targets that this run speaks to; they count only when measured on an H100 or H200."""
    counts = any(kind in ours["device_kind"] for kind in ("H100", "H200"))
    out = {"counted": counts, "why_not": None if counts else f"measured on {ours['device_kind']}, not an H100/H200"}
    mfu_min = {"760m": 0.50, "124m": 0.40}.get(name)
    if mfu_min and mcfg.dtype == "bfloat16" and (name != "760m" or seq == 2048):
        out["mfu_min"] = mfu_min
        out["mfu_met"] = counts and ours["mfu"] is not None and ours["mfu"] >= mfu_min
    if "ratio_vs_torch" in results:
        out["ratio_vs_torch_min"] = 1.2
        out["ratio_vs_torch_met"] = counts and results["ratio_vs_torch"] >= 1.2
    if name == "760m" and seq >= 8192:
        out["fits_at_8192"] = counts  # it ran to the end without running out of memory
    if "fp8_speedup" in results and name == "760m" and seq == 2048 and mcfg.dtype == "bfloat16":
        out["fp8_speedup_min"] = 1.25  # FP8 against the same step in bfloat16, in the same run
        out["fp8_speedup_met"] = counts and results["fp8_speedup"] >= 1.25
    return out


def run(args) -> tuple[dict, list[tuple[str, str]], str]:
    """(results for the JSON record, table rows, one-line summary)."""
    import model as model_lib
    from layers import attention as attention_lib

    load_start = load_per_core()  # before this run adds its own
    pinned = None
    if args.torch:  # first: JAX takes most of a GPU's memory once it starts
        try:
            import torch
            import transformers  # noqa: F401
        except ImportError as e:
            raise TrainBenchError(f"the PyTorch side needs torch and transformers ({e}); install them "
                                  f"(pip install -r requirements-test.txt) or pass --no-torch") from None
    threads = getattr(args, "threads", None)
    if args.torch or threads is not None:
        pinned = same_threads(threads, args.torch)  # before resolve() starts JAX
    name, mcfg, seq = resolve(args)
    peak_override = args.peak_tflops * 1e12 if args.peak_tflops else None
    others = {}
    if args.torch:
        torch_peak = peak_override
        if torch_peak is None:
            if torch.cuda.is_available():
                torch_peak = devices.peak_flops(torch.cuda.get_device_name())
        which = ["torch"] + ([] if mcfg.alibi_attn else ["hf"])
        for w in which:
            print(f"{w}: {args.warmup} warm-up + {args.steps} steps", flush=True)
            try:
                others[w] = bench_torch(mcfg, args.batch, seq, args, w, torch_peak)
            except torch.cuda.OutOfMemoryError:  # recorded: theirs not fitting is a result too
                torch.cuda.empty_cache()
                others[w] = {"error": "out of memory"}
    try:
        if mcfg.fp8:  # first the same step without FP8, in the same process, on the same device
            print(f"jax without fp8: {args.warmup} warm-up + {args.steps} steps", flush=True)
            others["without fp8"] = bench_jax(dataclasses.replace(mcfg, fp8=False), args.batch, seq, args,
                                              peak_override)
        print(f"jax: {args.warmup} warm-up + {args.steps} steps", flush=True)
        ours = bench_jax(mcfg, args.batch, seq, args, peak_override)
    except Exception as e:  # XLA reports running out of memory as a runtime error
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise TrainBenchError(f"the JAX step does not fit in device memory at batch {args.batch} x context {seq} "
                              f"(try --remat full or a smaller --batch): {str(e).splitlines()[0][:200]}") from None

    results = {"model": name, "device_kind": ours["device_kind"], "platform": ours["platform"],
               "config": dataclasses.asdict(mcfg), "batch": args.batch, "seq": seq,
               "loss_chunk": ours["loss_chunk"], "loss_chunk_setting": args.train_config.loss_chunk,
               "packed": args.packed, "fcm_max_ratio": args.fcm,
               "parameters": model_lib.param_count(mcfg),
               "flops_per_token": model_lib.flops_per_token(mcfg, seq, ours["adapters"]),
               "mfu_formula": "tokens/s * (6 N + 6 L d T) / peak FLOP/s" if ours["adapters"] is None
               else "LoRA: tokens/s * (4 N + 6 L d T + 6 x adapters) / peak FLOP/s",
               "lora": dataclasses.asdict(args.train_config.lora) if args.train_config.lora else None,
               "optimizer": args.train_config.optimizer,
               "jax": ours, **others}
    if "without fp8" in others:  # ours with FP8 against ours without: a speed-up, not another framework
        base = others.pop("without fp8")
        results["without_fp8"] = base
        results["fp8_speedup"] = ours["tokens_per_s"] / base["tokens_per_s"]
    ran = [w for w, r in others.items() if "error" not in r]
    for w in ran:
        results[f"ratio_vs_{w}"] = ours["tokens_per_s"] / others[w]["tokens_per_s"]
    # the machine's 1-minute load average over its cores before and after: above about 0.1 before (or
    # this run's own share, threads / cores, after), other work shared the cores and skewed the times
    results["load_per_core"] = {"start": load_start, "end": load_per_core(), "cores": os.cpu_count()}
    if pinned is not None:
        results["threads"] = pinned
    results["targets"] = targets(name, mcfg, seq, ours, results)

    peak = ours["peak_flops"]
    resolved = attention_lib.resolve_attention(mcfg, masked=bool(args.packed or args.fcm), length=seq)
    attention = mcfg.attention if resolved == mcfg.attention else f"{mcfg.attention} ({resolved})"
    results["attention"] = resolved
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    mfu = lambda r: "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"  # noqa: E731
    rows = [("model", f"{name}: {results['parameters'] / 1e6:.1f}M parameters, {mcfg.N} blocks, "
                      f"d={mcfg.embedding_dim}, {mcfg.positions} positions"),
            ("shape", f"batch {args.batch} x context {seq} = {args.batch * seq} tokens/step, {mcfg.dtype}, "
                      f"remat {mcfg.remat}, attention {attention}, loss_chunk {args.train_config.loss_chunk}"
                      + (f" ({ours['loss_chunk']})" if args.train_config.loss_chunk == "auto" else "")
                      + (f", {args.packed} examples packed a row" if args.packed else "")
                      + (f", FCM up to {args.fcm}" if args.fcm else "")
                      + (", the blocks' projections in FP8" if mcfg.fp8 else "")
                      + (f", LoRA rank {args.lora} on {args.lora_targets} ({ours['adapters']:,} adapter parameters; "
                         f"base in {mcfg.dtype})" if ours["adapters"] else "")),
            ("device", f"{ours['device_kind']} ({ours['platform']})"),
            ("MFU", f"tokens/s x ({'6N' if ours['adapters'] is None else 'LoRA 4N + 6 adapters'} + 6LdT = "
                    f"{results['flops_per_token'] / 1e6:.1f} MFLOP/token) / peak "
                    + (f"{peak / 1e12:.0f} TFLOP/s" + (" (--peak-tflops)" if peak_override else " (device kind)")
                       if peak else "(no peak known for this device: n/a; --peak-tflops sets one)"))]
    without = {"jax without fp8": results["without_fp8"]} if "without_fp8" in results else {}
    for w, r in {"jax (ours)": ours, **without, **others}.items():
        if "error" in r:
            rows.append((w, r["error"]))
            continue
        extra = f", torch.compile {'on' if r.get('compiled') else 'off'}" if "compiled" in r else ""
        if "step_s_pipelined" in r:
            extra += (f"; pipelined as train.py runs: {r['tokens_per_s_pipelined']:,.0f} tokens/s, "
                      f"{r['step_s_pipelined'] * 1e3:.1f} ms a step, MFU {mfu({'mfu': r['mfu_pipelined']})}")
        if r.get("compiled_temp_bytes") is not None:
            extra += f"; compiled step's temporary memory {gib(r['compiled_temp_bytes'])}"
        rows.append((w, f"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_s_median'] * 1e3:.1f} ms median of "
                        f"{r['steps']}, MFU {mfu(r)}, peak memory {gib(r['peak_memory_bytes'])}{extra}"))
    if without:
        rows.append(("fp8 / without", f"{results['fp8_speedup']:.2f}x tokens/s; loss {ours['loss_last']:.4f} after "
                                      f"{ours['loss_steps']} steps on the same batch, "
                                      f"{without['jax without fp8']['loss_last']:.4f} without"))
    for w in ran:
        rows.append((f"ours / {w}", f"{results[f'ratio_vs_{w}']:.2f}x tokens/s"))
    if pinned is not None and ours["platform"] == "cpu":
        rows.append(("threads", f"{pinned['threads']} for both (cores {','.join(map(str, pinned['cores']))}; "
                                f"--threads sets it)"))
    load = results["load_per_core"]
    if load["start"] is not None:
        own = (pinned["threads"] if pinned else len(usable_cores())) / load["cores"]  # what this run adds, at most
        busy = load["start"] > BUSY_LOAD or load["end"] > own + BUSY_LOAD
        rows.append(("machine load", f"{load['start']:.2f} per core before, {load['end']:.2f} after (this run's own "
                                     f"share up to {own:.2f})" + ("; BUSY: other work shared the cores, so these "
                                     "times are not an idle machine's, PyTorch's least of all (its threads wait "
                                     "for each other spinning): rerun when idle, or with --threads 1"
                                     if busy else "; idle")))
    for thread, prof in (ours.get("profile") or {}).get("devices", {}).items():
        rows.append((f"profile: {thread}", f"{prof['total_us'] / 1e3:.1f} ms of device time per step"))
        rows.extend((f"  {name[:60]}", f"{us / 1e3:8.2f} ms {share:6.1%}") for name, us, share in prof["top"][:15])
    profile = ours.get("profile") or {}
    if profile.get("span_us"):
        rows.append(("profile: device busy", f"{profile['busy_us'] / 1e3:.1f} of {profile['span_us'] / 1e3:.1f} ms "
                                             f"a step ({profile['busy_us'] / profile['span_us']:.1%}); the rest waits"))
    if profile.get("by_scope"):
        rows.append(("profile by scope", f"{profile['attributed_us'] / 1e3:.1f} ms named from the step's HLO, "
                                         f"{profile['unattributed_us'] / 1e3:.1f} ms not"))
        rows.extend((f"  {where} ({kind})"[:62], f"{us / 1e3:8.2f} ms {share:6.1%}")
                    for where, kind, us, share in profile["by_scope"][:25])
    batch_kind = (f" packed {args.packed}" if args.packed else "") + (f" fcm {args.fcm}" if args.fcm else "") \
        + (f" lora {args.lora} ({args.lora_targets})" if ours["adapters"] else "") + (" fp8" if mcfg.fp8 else "")
    summary = (f"{name} B={args.batch} T={seq}{batch_kind} {mcfg.dtype} {attention}: {ours['tokens_per_s']:,.0f} tok/s, "
               f"{ours['step_s_median'] * 1e3:.1f} ms/step, MFU {mfu(ours)} "
               f"({mfu({'mfu': ours['mfu_pipelined']})} pipelined), mem {gib(ours['peak_memory_bytes'])}"
               + (f"; fp8 {results['fp8_speedup']:.2f}x the step without" if without else "")
               + "".join(f"; {results[f'ratio_vs_{w}']:.2f}x {w}" for w in ran)
               + "".join(f"; {w}: {others[w]['error']}" for w in others if w not in ran)
               + ("" if ours["platform"] == "gpu" else " (CPU smoke test: no GPU figures)"))
    return results, rows, summary
