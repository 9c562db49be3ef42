"""`python bench.py train --profile`: where a training step's device time goes, by kernel and by model part.

    profile_steps   runs steps under jax.profiler and sums the Perfetto trace's device time per operation,
                    per device thread, with the device's busy time against the step's span (the gaps
                    between kernels)
    hlo_operations  the compiled step's HLO read: each operation's model part (model.py's and step.py's
                    named scopes, SCOPES), forward or backward, and kind (matmul, attention, reduction, ...)
    attribute       the trace's time summed by those

bench_train.py runs it for `--profile`; knows nothing of the model beyond the scope names.
"""
from __future__ import annotations


def profile_steps(run, steps: int, directory, top: int = 30, hlo: str | None = None) -> dict:
    """Runs run(), which runs `steps` steps, under jax.profiler (a Perfetto trace under `directory`, for
    ui.perfetto.dev) and sums the trace's device time per operation: {"trace", "devices": {thread:
    {"total_us", "top": [[name, us, share], ...]}}}, per device thread (on a GPU: the CUDA streams, the
    kernels). On the CPU, the host's XLA threads. With `hlo`, the compiled step's HLO text, also
    "by_scope": the same time summed by what each operation computes (`attribute`)."""
    import collections
    import gzip
    import json
    import pathlib

    import jax

    directory = pathlib.Path(directory)
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        run()
    traces = sorted(directory.rglob("perfetto_trace.json.gz"), key=lambda f: f.stat().st_mtime)
    if not traces:
        return {"trace": None, "devices": {}}
    with gzip.open(traces[-1]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = [e for e in events if e.get("ph") == "M"]  # metadata: the names of processes and threads
    processes = {e["pid"]: e["args"]["name"] for e in names if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in names if e.get("name") == "thread_name"}
    on_device = any(name.startswith("/device:") for name in processes.values())
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    timed = []  # (the operation's HLO name where the trace gives it, the event's name, microseconds per step)
    intervals = []  # (start, end) of every timed event, microseconds
    for e in events:
        if e.get("ph") != "X":
            continue
        process, thread = processes.get(e["pid"], ""), threads.get((e["pid"], e.get("tid")), "")
        if (process.startswith("/device:") if on_device else thread.startswith("tf_XLA")):
            us = float(e.get("dur", 0.0)) / steps
            sums[f"{process} {thread}".strip()][e["name"]] += us
            timed.append(((e.get("args") or {}).get("hlo_op"), e["name"], us))
            intervals.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    devices = {}
    for thread, ops in sums.items():
        total = sum(ops.values())
        devices[thread] = {"total_us": total,
                           "top": [[name, us, us / total] for name, us in ops.most_common(top)]}
    out = {"trace": str(traces[-1]), "steps": steps, "per": "step", "devices": devices, **busy(intervals, steps)}
    if hlo is not None:
        out.update(attribute(timed, hlo_operations(hlo)))
    return out


def busy(intervals, steps: int) -> dict:
    """{"span_us": first start to last end, "busy_us": the time at least one of `intervals` (start, end)
    runs, each per step}: span - busy is the time the device waits between kernels."""
    if not intervals:
        return {"span_us": 0.0, "busy_us": 0.0}
    covered, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered, reach = covered + end - start, end
        elif end > reach:
            covered, reach = covered + end - reach, end
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    return {"span_us": span / steps, "busy_us": covered / steps}


# model.py's and step.py's named scopes (jax.named_scope), which the compiled step's operations carry
# in their op_name metadata: a profile is summed by them
SCOPES = ("embed", "block", "ln_1", "attn", "qkv", "attention", "out", "ln_2", "mlp", "fc", "activation",
          "proj", "ln_f", "loss", "optimizer")


def hlo_operations(hlo: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (where it comes from, what kind of work it is)} for every instruction of an
    HLO module's text (jax's Compiled.as_text()), fused computations and loop bodies included.

    Where: "forward", "backward" (autodiff's transpose) or "recompute" (remat's second forward pass) and
    the named scopes of its op_name, e.g. "backward block/mlp/activation", "update optimizer"; the loss
    is "loss" alone, since the chunked loss computes its gradients in its forward pass. Kind: matmul, attention (cuDNN), Pallas kernel,
    reduction, elementwise, copy, collective, or the HLO opcode; None for a loop or call, whose body's
    operations are timed on their own."""
    import re

    ops = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)", line)
        if not m:
            continue
        name, rest = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', rest)
        op_name = op_name.group(1).split(";")[0] if op_name else ""
        scopes = [word for word in re.findall(r"\w+", op_name) if word in SCOPES]
        scopes = [w for i, w in enumerate(scopes) if i == 0 or scopes[i - 1] != w]
        if "loss" in scopes:
            where = "loss"
        elif "optimizer" in scopes:
            where = "update optimizer"
        elif "rematted_computation" in op_name:  # a block's forward pass again, under remat, for its backward
            where = f"recompute {'/'.join(scopes) or '(unscoped)'}"
        else:
            where = f"{'backward' if 'transpose(' in op_name else 'forward'} {'/'.join(scopes) or '(unscoped)'}"
        ops[name] = (where, _operation_kind(name, rest))
    return ops


def _operation_kind(name: str, rest: str) -> str | None:
    import re

    opcode = re.search(r" ([a-z][a-z0-9\-]*)\(", " " + rest)
    opcode = opcode.group(1) if opcode else "?"
    if opcode in ("while", "call", "conditional"):
        return None  # what runs inside is timed on its own (the CPU's trace times the loop too)
    text = rest.lower()
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        target = target.group(1).lower() if target else ""
        if "fmha" in target:
            return "attention (cuDNN)"
        if "cudnn$norm" in target:
            return "norm (cuDNN)"
        if "cudnn" in target:
            return "cuDNN"
        if "gemm" in target or "cublas" in target or "matmul" in target:
            return "matmul"
        if "triton" in target or "mosaic" in target or "pallas" in target:
            return "Pallas kernel"
        return "custom call"
    if opcode == "fusion":
        if "kind=kcustom" in text:
            if "gemm" in text or "gemm" in name:
                return "matmul"
            if "fmha" in text:
                return "attention (cuDNN)"
            if "cudnn" in text:
                return "cuDNN fusion"
            return "Triton fusion" if "triton" in text else "custom fusion"
        if "kind=kinput" in text:  # reductions, and XLA's scatters and transposes, which it emits alike
            return "scatter" if "scatter" in name else "copy" if "transpose" in name else "reduction"
        if "kind=koutput" in text:
            return "matmul"
        return "elementwise"
    if opcode in ("dot", "convolution"):
        return "matmul"
    if opcode in ("copy", "transpose", "copy-start", "copy-done"):
        return "copy"
    if opcode.startswith(("all-", "reduce-scatter", "collective")):
        return "collective"
    return opcode


def attribute(timed, operations: dict) -> dict:
    """Device time per (where, kind) from `timed`, (HLO name or None, event name, microseconds) per
    trace event, and `hlo_operations`' table. An event is named by its HLO operation where the trace
    says it (GPU kernels carry "hlo_op"), else by its own name (XLA's kernels are named after their
    fusion, with "_" for "."); a loop's own event is left out. {"by_scope": [[where, kind, us, share],
    ...] largest first, "attributed_us", "unattributed_us"}."""
    import collections
    import re

    sums, unattributed = collections.Counter(), 0.0
    for hlo_op, name, us in timed:
        key = next((k for k in (hlo_op, name, re.sub(r"_(\d+)$", r".\1", name or "")) if k in operations), None)
        if key is None:
            unattributed += us
        elif operations[key][1] is not None:
            sums[operations[key]] += us
    total = sum(sums.values())
    return {"by_scope": [[where, kind, us, us / total] for (where, kind), us in sums.most_common()],
            "attributed_us": total, "unattributed_us": unattributed}
