"""`python bench.py attention`: the attention implementations alone, forward and backward, at one shape:
each one's error against the float64 reference, its peak memory and its median time (bench_train.py's
timing).
"""
from __future__ import annotations

import functools

from benchmarks.bench_train import packed_rows, time_steps
from core.errors import TrainBenchError

IMPLS = ("xla", "dot_product", "cudnn", "pallas", "splash")


def pallas_settings(impl: str) -> dict:
    """An --impls entry -> flash_alibi keyword arguments: {} for a plain name, and for
    `pallas:FWDxBWD[xWARPS[xSTAGES]]` the block sizes (and warps per program, and pipelining stages)."""
    name, _, settings = impl.partition(":")
    if name not in IMPLS:
        raise TrainBenchError(f"unknown --impls entry {impl!r}; choose from {', '.join(IMPLS)} "
                              f"(pallas also as pallas:FWDxBWD[xWARPS[xSTAGES]], e.g. pallas:128x64x8)")
    if not settings:
        return {}
    parts = settings.split("x")
    if name != "pallas" or len(parts) not in (2, 3, 4) or not all(p.isdigit() for p in parts):
        raise TrainBenchError(f"--impls entry {impl!r}: only pallas takes settings, as pallas:FWDxBWD[xWARPS[xSTAGES]] "
                              f"(block sizes and warps powers of two, stages >= 1, e.g. pallas:128x64x8x3)")
    from layers import flash_alibi
    kwargs = dict(zip(("block_fwd", "block_bwd", "num_warps", "num_stages"), map(int, parts)))
    try:
        flash_alibi.check_settings(**{"num_warps": flash_alibi.NUM_WARPS, **kwargs})
    except ValueError as e:
        raise TrainBenchError(f"--impls entry {impl!r}: {e}") from None
    return kwargs


def run_attention(args) -> tuple[dict, list[tuple[str, str]], str]:
    """Each implementation's forward + backward of causal ALiBi attention at (B, T, H, D): its error
    against the XLA reference (computed in float32 from the same inputs), its compiled temporary
    memory, and its median time. (results, table rows, summary)."""
    import jax
    import jax.numpy as jnp

    import model as model_lib
    from layers import attention as attention_lib

    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if not impls:
        raise TrainBenchError(f"--impls names no implementation; choose from {', '.join(IMPLS)}")
    kernel_settings = {impl: pallas_settings(impl) for impl in impls}
    B, T, H, D = args.batch, args.seq, args.heads, args.head_dim
    if min(B, T, H, D, args.steps, args.warmup) < 1:
        raise TrainBenchError("--batch, --seq, --heads, --head-dim, --steps and --warmup must be at least 1")
    if args.dtype not in model_lib.DTYPES:
        raise TrainBenchError(f"--dtype must be one of {', '.join(model_lib.DTYPES)}, got {args.dtype!r}")
    dtype = model_lib.DTYPES[args.dtype]
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in keys)  # g: the output gradient
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    if not 0 <= args.packed <= T:
        raise TrainBenchError(f"--packed must be between 0 and --seq ({T})")
    mask = None
    if args.packed:  # N examples a row: attention stays inside each (attention.Masking, O(T))
        segments = jnp.asarray(packed_rows(B, T, args.packed)["segments"])
        mask = attention_lib.Masking(segments, segments)

    def config(impl, to=args.dtype):
        return model_lib.GPTConfig(num_head=H, embedding_dim=H * D, attention=impl, alibi_attn=args.alibi, dtype=to)

    def fwd_bwd(impl, to=dtype):
        """jit of (q, k, v, g) -> ((sum(y * g), y), (dq, dk, dv)), attention computed in dtype `to`."""
        cfg = config(impl.split(":")[0], jnp.dtype(to).name)
        attend = functools.partial(attention_lib.attention, cfg=cfg, mask=mask)
        if kernel_settings.get(impl):  # pallas:FWDxBWD[xWARPS[xSTAGES]]: the kernel itself, with these settings
            from layers import flash_alibi
            slopes = attention_lib.alibi_slopes(H) if args.alibi else None
            segments = None if mask is None else (mask.q_segments, mask.kv_segments)
            attend = functools.partial(flash_alibi.flash_alibi_attention, slopes=slopes, segments=segments,
                                       **kernel_settings[impl])

        def loss(q, k, v, g):
            y = attend(q.astype(to), k.astype(to), v.astype(to))
            return jnp.sum(y.astype(jnp.float32) * g), y

        # g is an argument: captured, it would be a (B, T, H, D) constant that XLA spends seconds folding
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    (_, y_ref), grads_ref = fwd_bwd("xla", jnp.float32)(q, k, v, g)  # the reference
    results = {"batch": B, "seq": T, "heads": H, "head_dim": D, "dtype": args.dtype, "alibi": args.alibi,
               "device_kind": jax.devices()[0].device_kind, "platform": jax.default_backend(),
               "error": "max |ours - reference| / max |reference|, reference: XLA in float32 on the same inputs",
               "impls": {}}
    results["packed"] = args.packed
    rows = [("shape", f"B={B} T={T} H={H} D={D} {args.dtype}, causal{' + ALiBi' if args.alibi else ''}"
                      + (f", {args.packed} examples packed a row" if args.packed else "")),
            ("device", f"{results['device_kind']} ({results['platform']})")]
    for impl in impls:
        try:
            attention_lib.check_attention_backend(config(impl.split(":")[0]))  # and GPTConfig's own checks
        except ValueError as e:
            results["impls"][impl] = {"unavailable": str(e)}
            rows.append((impl, f"unavailable here: {e}"))
            continue
        step = fwd_bwd(impl)
        memory = step.lower(q, k, v, g).compile().memory_analysis()
        (_, y), grads = step(q, k, v, g)
        rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())  # noqa: E731
        errors = {"out": rel(y, y_ref), **{f"d{n}": rel(a, b) for n, a, b in zip("qkv", grads, grads_ref)}}
        timing = time_steps(lambda: step(q, k, v, g), jax.block_until_ready, args.warmup, args.steps)
        entry = {**timing, **{f"error_{n}": e for n, e in errors.items()},
                 "temp_bytes": getattr(memory, "temp_size_in_bytes", None)}
        resolved = attention_lib.resolve_attention(config(impl.split(":")[0]), masked=mask is not None, length=T)
        entry["runs_as"] = resolved
        results["impls"][impl] = entry
        temp = "n/a" if entry["temp_bytes"] is None else f"{entry['temp_bytes'] / 2**20:.1f} MiB"
        shown = impl if resolved == impl.split(":")[0] else f"{impl} ({resolved})"
        rows.append((shown, f"fwd+bwd {timing['step_s_median'] * 1e3:.2f} ms median of {args.steps}, temporaries "
                           f"{temp}, max rel. error " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())))
    timed = {i: r for i, r in results["impls"].items() if "step_s_median" in r}
    fastest = min(timed, key=lambda i: timed[i]["step_s_median"]) if timed else None
    results["fastest"] = fastest
    summary = f"B={B} T={T} H={H} D={D} {args.dtype}{f' packed {args.packed}' if args.packed else ''}: " + ", ".join(
        f"{i} {r['step_s_median'] * 1e3:.2f} ms / {r['temp_bytes'] / 2**20:.0f} MiB"
        if r.get("temp_bytes") is not None else f"{i} {r['step_s_median'] * 1e3:.2f} ms" for i, r in timed.items())
    if results["platform"] != "gpu":
        summary += " (CPU; pallas in interpret mode: its time means nothing, its memory does)"
    return results, rows, summary
