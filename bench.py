"""Performance benchmarks. Each subcommand prints a table, writes bench/<name>-<date>-<host>.json
(machine, library versions, the command, the results) and adds a row to bench/RESULTS.md.

    python bench.py data [--workers K] [--batch B] [--seq T] [--repeats N] [--out bench/]
    python bench.py data --remote [--latency-ms 50] [--bandwidth-mbs 200] [--shards 2000] [--seq 1024]
    python bench.py train [--model 124m] [--seq T] [--batch B] [--attention IMPL] [--fp8] [--out bench/]
    python bench.py attention [--impls xla,cudnn,pallas,pallas:128x64x8] [--batch B] [--seq T] [--heads H]
                              [--head-dim D]
    python bench.py recipe [--seeds 0,1,2] [--steps 600] [--adamw-steps 900,1200] [--model SIZE]
    python bench.py serve [--checkpoint runs/default] [--requests 16] [--max-tokens 100] [--clients 1,4,16]

`serve` (bench_serve.py) times serve.py with 1, 4 and 16 clients at once against one at a time and against
sample.py, and the first token of a stream. `recipe` (bench_recipe.py) trains the default job with AdamW and with Muon: validation curves over seeds, the
steps AdamW needs to reach Muon's loss, and the two steps' times alternated. `train` is in bench_train.py (its profile in bench_profile.py) and `attention` in bench_attention.py: tokens/s, MFU and peak memory of train.py's step,
with the same model in PyTorch (and GPT2LMHeadModel for learned positions) on the same device and
batch; and the attention implementations alone (error against the reference, compiled temporary
memory, time of forward + backward), to choose the fastest correct one on a GPU.

`data` measures, in one run on the default corpus (this Python's stdlib sources):
  preparation   data.prepare_default with K threads and an existing tokenizer (no BPE training), against
                the `tokenizers` library's own Tokenizer.encode_batch of the same documents, already in
                memory, on a thread pool of K (RAYON_NUM_THREADS=K, TOKENIZERS_PARALLELISM=true); the
                median of N interleaved repeats of each, and their ratio. Target: ratio >= 0.8.
  loader        Loader.get_batch pinned to one core, for B x T and for 8 x 1024; the median over many
                batches. Tokens counted are B*T, the training targets a batch supplies. Target: 20M tokens/s.
  prefetch      Loader.iterate(prefetch=2) consumed by a loop whose step is a numpy matmul of --step-ms
                (BLAS releases the GIL, as a jitted JAX step does); time blocked in next(). Target: ~0.
"""
from __future__ import annotations

from core import errors  # light: nothing but the standard library

if __name__ == "__main__":
    errors.stop_at_once_while_loading()  # a Ctrl-C while JAX and the rest load: one line, no traceback

import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import sys
import tempfile
import time

import numpy as np

import data  # imports no tokenizer yet: the library's thread pool starts at the first batch encoding
from core.errors import BenchError
from tokendata import loader as loader_lib
from tokendata import shards

ROOT = pathlib.Path(__file__).resolve().parent
PREP_RATIO_TARGET = 0.8  # of the tokenizers library's own batch encoding
LOADER_TARGET = 20e6  # tokens/s on one core


# ---------------------------------------------------------------------------------------------
# What ran where

def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# environment variables that change what a benchmark measures (XLA flags, memory fraction, devices)
ENV_PREFIXES = ("XLA_", "JAX_", "CUDA_", "NVIDIA_", "NCCL_", "PYTORCH_", "TORCH", "OMP_")


def _machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": platform.node(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "usable_cores": cores,
            "platform": platform.platform(), "python": platform.python_version(),
            # other work on the machine skews every number here; this shows it afterwards
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}}


def _versions(*modules: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for module in modules:
        try:
            found[module] = version(module)
        except PackageNotFoundError:
            found[module] = None
    return found


def _record(name: str, out: pathlib.Path, argv: list[str], results: dict, summary: str,
            libraries: tuple[str, ...] = ("numpy", "tokenizers")) -> pathlib.Path:
    """Writes OUT/<name>-<date>-<host>.json and puts a row at the top of OUT/RESULTS.md's table."""
    now = datetime.datetime.now().astimezone()
    machine = _machine()
    command = "python bench.py " + shlex.join(argv)
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in machine["host"]) or "host"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{now:%Y%m%d-%H%M%S}-{host}.json"
    record = {"benchmark": name, "date": now.isoformat(timespec="seconds"), "command": command,
              "machine": machine, "versions": _versions(*libraries), "results": results}
    path.write_text(json.dumps(record, indent=1) + "\n")

    table = out / "RESULTS.md"
    header = ["# Benchmark results", "",
              "Every recorded run, newest first. Full numbers: the JSON file named in each row "
              "(kept locally, not in git).", "",
              "| date | benchmark | machine | command | results | file |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines = table.read_text().splitlines() if table.exists() else header
    # the table is the one under this header row: other tables' separators may look like its own
    if not any(a == header[-2] and b == header[-1] for a, b in zip(lines, lines[1:])):
        raise BenchError(f"{table} has no results table; move it aside and run again")
    where = (f"{results['device_kind']}" if results.get("platform") == "gpu"
             else f"{machine['cpu']}, {machine['usable_cores']} cores")  # the device that was measured
    flags = os.environ.get("XLA_FLAGS")  # they change what is measured: shown with the command
    shown = f"XLA_FLAGS={shlex.quote(flags)} {command}" if flags else command
    row = f"| {now:%Y-%m-%d %H:%M} | {name} | {machine['host']}: {where} | `{shown}` | {summary} | {path.name} |"
    at = next(i for i in range(len(lines) - 1) if lines[i] == header[-2] and lines[i + 1] == header[-1]) + 2
    table.write_text("\n".join(lines[:at] + [row] + lines[at:]) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# python bench.py data

def _prepare_throughput(args, tokenizer: str, work: pathlib.Path) -> dict:
    from tokenizers import Tokenizer
    files = data.default_corpus_files()
    # the documents prepare reads: whole files as UTF-8, empty ones left out (they add no document)
    docs = [text for text in (p.read_bytes().decode("utf-8") for p in files) if text]
    mbytes = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    reference = Tokenizer.from_file(tokenizer)
    encoders = {"encode_batch": reference.encode_batch}
    if hasattr(reference, "encode_batch_fast"):  # no offsets; data.py uses it where the library has it
        encoders["encode_batch_fast"] = reference.encode_batch_fast

    times: dict[str, list[float]] = {"prepare": [], **{k: [] for k in encoders}}
    tokens = {}
    for repeat in range(args.repeats):  # interleaved, so a slow spell of the machine hits both alike
        start = time.perf_counter()
        index = data.prepare_default(work / "prepared", tokenizer=tokenizer, workers=args.workers,
                                     overwrite=True, progress=False)
        times["prepare"].append(time.perf_counter() - start)
        tokens["prepare"] = index["tokens"]
        os.environ["TOKENIZERS_PARALLELISM"] = "true"  # prepare restores what it changed; be explicit
        for name, encode in encoders.items():
            start = time.perf_counter()
            encodings = encode(docs, add_special_tokens=False)
            times[name].append(time.perf_counter() - start)
            tokens[name] = sum(len(e.ids) for e in encodings) + len(docs)  # + one end-of-text per document
            del encodings  # millions of Encoding objects: free them before the next timing
        print(f"  repeat {repeat + 1}/{args.repeats}: " +
              ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), file=sys.stderr, flush=True)
    if len(set(tokens.values())) != 1:
        raise BenchError(f"prepare and the tokenizers library disagree on the token count: {tokens}")

    result = {"documents": len(docs), "input_MB": mbytes, "tokens": tokens["prepare"],
              "workers": args.workers, "repeats": args.repeats, "statistic": "median",
              "thread_control": f"RAYON_NUM_THREADS={os.environ['RAYON_NUM_THREADS']} set before the library's "
                                f"thread pool started; TOKENIZERS_PARALLELISM=true for the reference "
                                f"(prepare sets it false and runs {args.workers} threads of its own)"}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        result[name] = {"seconds": seconds, "median_s": median, "MB_per_s": mbytes / median,
                        "tokens_per_s": tokens[name] / median}
    for name in encoders:
        result[f"ratio_vs_{name}"] = result[name]["median_s"] / result["prepare"]["median_s"]
        result[f"best_ratio_vs_{name}"] = min(times[name]) / min(times["prepare"])
    return result


def _loader_throughput(directory: pathlib.Path, shapes: list[tuple[int, int]], seconds: float) -> dict:
    # one core: the main thread is pinned (Linux pins the calling thread), and numpy runs there
    saved = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    if saved:
        os.sched_setaffinity(0, {min(saved)})
    try:
        results = {}
        for batch, seq in shapes:
            loader = loader_lib.TextLoader(shards.open_data(directory), "train", seq, batch, seed=0)
            for step in range(20):  # warm the page cache and the permutation's per-epoch keys
                loader.get_batch(step)
            times, step, deadline = [], 0, time.perf_counter() + seconds
            while time.perf_counter() < deadline or len(times) < 200:
                start = time.perf_counter()
                loader.get_batch(step)
                times.append(time.perf_counter() - start)
                step += 1
            median = statistics.median(times)
            results[f"{batch}x{seq}"] = {"batch": batch, "seq": seq, "batches": len(times),
                                         "median_batch_us": median * 1e6,
                                         "tokens_per_s": batch * seq / median,
                                         "mean_tokens_per_s": batch * seq * len(times) / sum(times)}
        results["pinned_to_core"] = min(saved) if saved else None
        return results
    finally:
        if saved:
            os.sched_setaffinity(0, saved)


def _calibrated_step(step_ms: float):
    """A stand-in for a training step: float32 matmuls (BLAS releases the GIL) lasting about step_ms."""
    a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
    a @ a
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ a
    count = max(1, round(step_ms / 1e3 / ((time.perf_counter() - start) / reps)))

    def step() -> None:
        for _ in range(count):
            a @ a
    return step


def _prefetch_wait(directory: pathlib.Path, batch: int, seq: int, step_ms: float, steps: int) -> dict:
    loader = loader_lib.TextLoader(shards.open_data(directory), "train", seq, batch, seed=0)
    train_step = _calibrated_step(step_ms)
    batches = loader.iterate(0, prefetch=2)
    waits, step_times = [], []
    try:
        for _ in range(steps + 1):
            start = time.perf_counter()
            next(batches)
            waits.append(time.perf_counter() - start)
            start = time.perf_counter()
            train_step()
            step_times.append(time.perf_counter() - start)
    finally:
        batches.close()
    first, waits = waits[0], waits[1:]  # the first batch is made while the caller waits: no prefetch yet
    return {"batch": batch, "seq": seq, "prefetch": 2, "steps": steps,
            "step_ms_median": statistics.median(step_times) * 1e3,
            "first_wait_ms": first * 1e3, "wait_ms_median": statistics.median(waits) * 1e3,
            "wait_ms_p99": float(np.percentile(waits, 99)) * 1e3, "wait_ms_max": max(waits) * 1e3,
            "wait_share": sum(waits) / (sum(waits) + sum(step_times))}


def bench_data(args, argv: list[str]) -> int:
    args.seq = args.seq if args.seq is not None else 1024 if args.remote else 128
    if args.remote:  # bench_remote.py: the loader against an object store
        from benchmarks import bench_remote
        if args.latency_ms < 0 or args.bandwidth_mbs <= 0 or min(args.shards, args.shard_tokens, args.remote_steps) < 1:
            raise BenchError("--latency-ms must be >= 0, --bandwidth-mbs positive, --shards, --shard-tokens and "
                             "--remote-steps at least 1")
        results, rows, summary = bench_remote.run(args, data.prepare)
        _print_rows(rows)
        path = _record("data-remote", pathlib.Path(args.out), argv, results, summary,
                       ("numpy", "fsspec", "gcsfs", "gcp-storage-emulator"))
        print(f"\n-> {path}, {pathlib.Path(args.out) / 'RESULTS.md'}")
        return 0
    for flag in ("workers", "batch", "seq", "repeats", "steps"):
        if getattr(args, flag) < 1:
            raise BenchError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.step_ms <= 0 or args.loader_seconds <= 0:
        raise BenchError("--step-ms and --loader-seconds must be positive")
    # the library's thread pool (rayon) reads RAYON_NUM_THREADS once, when it first starts, so it is
    # set before anything here tokenizes; prepare leaves an existing value alone, so both use K threads
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    tokenizer = pathlib.Path(args.tokenizer or data.DEFAULT_DATA_DIR / "tokenizer.json")
    if not tokenizer.is_file():
        raise BenchError(f"tokenizer {tokenizer} not found; run `python data.py` first or pass --tokenizer")

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = pathlib.Path(tmp)
        print(f"preparation: {args.workers} thread(s), {args.repeats} repeats", file=sys.stderr, flush=True)
        if args.train_tokenizer:  # once, for scale: what a first `python data.py` adds by training the BPE
            start = time.perf_counter()
            data.prepare_default(work / "trained", workers=args.workers, progress=False)
            results["prepare_with_bpe_training_s"] = time.perf_counter() - start
        results["prepare"] = _prepare_throughput(args, str(tokenizer), work)
        print("loader: one core", file=sys.stderr, flush=True)
        results["loader"] = _loader_throughput(work / "prepared", [(args.batch, args.seq), (8, 1024)],
                                               args.loader_seconds)
        print(f"prefetch: {args.steps} steps of {args.step_ms:g} ms", file=sys.stderr, flush=True)
        results["prefetch"] = _prefetch_wait(work / "prepared", args.batch, args.seq, args.step_ms,
                                             args.steps)

    p, loader, wait = results["prepare"], results["loader"], results["prefetch"]
    shapes = [k for k in loader if "x" in k]
    ok = {"prepare_ratio": p["ratio_vs_encode_batch"] >= PREP_RATIO_TARGET,
          "loader": all(loader[k]["tokens_per_s"] >= LOADER_TARGET for k in shapes)}
    results["targets"] = {"prepare_ratio_min": PREP_RATIO_TARGET, "loader_tokens_per_s_min": LOADER_TARGET,
                          "met": ok}

    rows = [("input", f"{p['documents']} documents, {p['input_MB']:.2f} MB, {p['tokens']:,} tokens")]
    if "prepare_with_bpe_training_s" in results:
        rows.append(("prepare incl. BPE training (1 run)", f"{results['prepare_with_bpe_training_s']:.2f} s"))
    for name in [k for k in ("prepare", "encode_batch", "encode_batch_fast") if k in p]:
        label = "data.prepare" if name == "prepare" else f"tokenizers {name}"
        rows.append((f"{label}, {args.workers} thread(s)", f"{p[name]['median_s']:.2f} s median, "
                     f"{p[name]['MB_per_s']:.2f} MB/s, {p[name]['tokens_per_s'] / 1e6:.2f}M tokens/s"))
    rows.append(("prepare / encode_batch (target >= 0.8)",
                 f"{p['ratio_vs_encode_batch']:.2f} ({'met' if ok['prepare_ratio'] else 'MISSED'}; "
                 f"best-of-{args.repeats} {p['best_ratio_vs_encode_batch']:.2f})"))
    if "ratio_vs_encode_batch_fast" in p:
        rows.append(("prepare / encode_batch_fast", f"{p['ratio_vs_encode_batch_fast']:.2f}"))
    for k in shapes:
        r = loader[k]
        verdict = "met" if r["tokens_per_s"] >= LOADER_TARGET else "MISSED"
        rows.append((f"loader get_batch {k}, one core (target 20M)",
                     f"{r['tokens_per_s'] / 1e6:.1f}M tokens/s ({verdict}), {r['median_batch_us']:.0f} us/batch "
                     f"median of {r['batches']}"))
    rows.append((f"prefetch=2 wait, {wait['batch']}x{wait['seq']}, {wait['step_ms_median']:.0f} ms steps",
                 f"median {wait['wait_ms_median']:.3f} ms, p99 {wait['wait_ms_p99']:.3f} ms, "
                 f"max {wait['wait_ms_max']:.3f} ms over {wait['steps']} steps "
                 f"({wait['wait_share']:.3%} of the loop; first batch {wait['first_wait_ms']:.2f} ms)"))
    _print_rows(rows)

    summary = (f"prepare {p['prepare']['MB_per_s']:.2f} MB/s = {p['ratio_vs_encode_batch']:.2f}x tokenizers "
               f"encode_batch (K={args.workers}); loader " +
               ", ".join(f"{k} {loader[k]['tokens_per_s'] / 1e6:.1f}M tok/s" for k in shapes) +
               f" (1 core); prefetch wait median {wait['wait_ms_median']:.3f} ms, max {wait['wait_ms_max']:.3f} ms")
    path = _record("data", pathlib.Path(args.out), argv, results, summary)
    print(f"\n-> {path}, {pathlib.Path(args.out) / 'RESULTS.md'}")
    return 0


# ---------------------------------------------------------------------------------------------
# python bench.py train  (bench_train.py)

TRAIN_LIBRARIES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                   "flax", "optax", "numpy", "torch",
                   "triton", "transformers")  # None where not installed (the CUDA ones on a CPU)


def _bench_step(kind: str, args, argv: list[str]) -> int:
    """`train` or `attention`: run bench_train.py's benchmark, print its rows, record it under --out."""
    from benchmarks import bench_attention as attention_lib
    from benchmarks import bench_train as train_lib
    results, rows, summary = (train_lib.run if kind == "train" else attention_lib.run_attention)(args)
    _print_rows(rows)
    path = _record(kind, pathlib.Path(args.out), argv, results, summary, TRAIN_LIBRARIES)
    print(f"\n-> {path}, {pathlib.Path(args.out) / 'RESULTS.md'}")
    return 0


def bench_train(args, argv: list[str]) -> int:
    return _bench_step("train", args, argv)


def bench_attention(args, argv: list[str]) -> int:
    return _bench_step("attention", args, argv)


def _bench_of(name: str, doc: str):
    """The subcommand that runs benchmarks/bench_<name>.py's run(args) and records what it returns under --out."""
    def bench(args, argv: list[str]) -> int:
        import importlib

        results, rows, summary = importlib.import_module(f"benchmarks.bench_{name}").run(args)
        _print_rows(rows)
        path = _record(name, pathlib.Path(args.out), argv, results, summary, TRAIN_LIBRARIES)
        print(f"\n-> {path}, {pathlib.Path(args.out) / 'RESULTS.md'}")
        return 0

    bench.__doc__ = doc
    return bench


bench_recipe = _bench_of("recipe", "What a step buys with AdamW and with Muon (bench_recipe.py), recorded under --out.")
bench_serve = _bench_of("serve", "serve.py's tokens/s with clients at once (bench_serve.py), recorded under --out.")
bench_dpo = _bench_of("dpo", "A DPO step against a prompt/completion step (bench_dpo.py), recorded under --out.")


def bench_mixture(args, argv: list[str]) -> int:
    """A mixture's batch against one source's (bench_mixture.py, handed data.py's preparation), recorded under --out."""
    from benchmarks import bench_mixture as mixture_bench

    results, rows, summary = mixture_bench.run(args, data.prepare, data.DEFAULT_DATA_DIR)
    _print_rows(rows)
    path = _record("mixture", pathlib.Path(args.out), argv, results, summary, ("numpy",))
    print(f"\n-> {path}, {pathlib.Path(args.out) / 'RESULTS.md'}")
    return 0


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows)
    print()
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


# ---------------------------------------------------------------------------------------------
# Command line

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = errors.ArgumentParser(error=BenchError, description="Performance benchmarks, recorded in bench/.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p = commands.add_parser("data", help="preparation throughput, loader throughput, prefetch waiting",
                            description="Data pipeline benchmark on the default corpus (see the module docstring).")
    p.add_argument("--workers", type=int, default=cores, help=f"tokenizer threads for both sides (default {cores})")
    p.add_argument("--batch", type=int, default=32, help="batch size of the default job's shape (default 32)")
    p.add_argument("--seq", type=int, help="sequence length of the default job's shape (default 128; 1024 with --remote)")
    p.add_argument("--repeats", type=int, default=5, help="preparation repeats; the median is reported")
    p.add_argument("--tokenizer", help="tokenizer.json to prepare with (default: the one in data/pystdlib)")
    p.add_argument("--train-tokenizer", action=argparse.BooleanOptionalAction, default=True,
                   help="also time one preparation that trains the BPE (default on)")
    p.add_argument("--loader-seconds", type=float, default=3.0, help="time per loader shape (default 3)")
    p.add_argument("--step-ms", type=float, default=50.0, help="simulated training step (default 50 ms)")
    p.add_argument("--steps", type=int, default=100, help="simulated training steps (default 100)")
    p.add_argument("--remote", action="store_true", help="instead: the loader reading a bucket of the test GCS "
                   "server with a network's latency and bandwidth (bench_remote.py; --seq defaults to 1024)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="--remote: each read's latency (default 50)")
    p.add_argument("--bandwidth-mbs", type=float, default=200.0, help="--remote: each read's MB/s (default 200)")
    p.add_argument("--shards", type=int, default=2000, help="--remote: token shards in the index (default 2000)")
    p.add_argument("--shard-tokens", type=int, default=16384, help="--remote: tokens a shard (default 16384)")
    p.add_argument("--remote-steps", type=int, default=200, help="--remote: steps timed per shape (default 200)")
    p.add_argument("--out", default=str(ROOT / "bench"), help="where results are recorded (default bench/)")
    p.set_defaults(run=bench_data)

    p = commands.add_parser("train", help="training step: tokens/s, MFU, memory; PyTorch side by side",
                            description="Times the jitted training step (see bench_train.py's docstring).")
    p.add_argument("--model", default="124m", help="a size of conf/model_config.yaml (default 124m)")
    p.add_argument("--seq", type=int, help="context length T (default: the model's block_size)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype: float32 | bfloat16 | float16 (default bfloat16)")
    p.add_argument("--remat", default="none", help="rematerialisation: none | full | save_matmuls (default none)")
    p.add_argument("--attention", default="auto",
                   help="auto | xla | dot_product | cudnn | pallas | splash (default auto: what training picks on this "
                        "backend)")
    p.add_argument("--alibi", action=argparse.BooleanOptionalAction, default=None,
                   help="force ALiBi on or off (default: the size's setting)")
    p.add_argument("--loss-chunk", type=int, help="training.loss_chunk: tokens of the loss at a time, 0 for the "
                   "whole logits (default: the training default)")
    p.add_argument("--packed", type=int, default=0, metavar="N",
                   help="a fine-tuning batch instead of plain tokens: N prompt/completion examples packed in each "
                        "row, attention kept inside each (default 0: plain tokens)")
    p.add_argument("--fcm", type=float, default=0.0, help="training.fcm_max_ratio: forgetful causal masking "
                   "(default 0: off)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="a LoRA step instead: adapters of this rank on a frozen random base held in the compute "
                        "dtype (needs --no-torch; default 0: full training)")
    p.add_argument("--lora-targets", default="q,v", help="--lora's targets, from q,k,v,o,mlp (default q,v)")
    p.add_argument("--fp8", action="store_true",
                   help="the blocks' projections in FP8 (model.fp8), timed beside the same step without it in the same "
                        "run (needs --no-torch)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="training.optimizer of the timed step (default adamw)")
    p.add_argument("--steps", type=int, default=20, help="timed steps; the median is reported (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included (default 3)")
    p.add_argument("--peak-tflops", type=float, help="peak FLOP/s for MFU, in TFLOP/s (default: by device kind)")
    p.add_argument("--profile", metavar="DIR", help="after timing, trace --profile-steps more steps with jax.profiler "
                   "into DIR (Perfetto) and record each device operation's time per step")
    p.add_argument("--profile-steps", type=int, default=3, help="steps traced by --profile (default 3)")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the PyTorch model (and GPT2LMHeadModel for learned positions); default on")
    p.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the PyTorch models (default: on a GPU only)")
    p.add_argument("--threads", type=int, help="CPU cores (and threads) for both ours and PyTorch, the first K this "
                   "process may use (default: all of them)")
    p.add_argument("--out", default=str(ROOT / "bench"), help="where results are recorded (default bench/)")
    p.set_defaults(run=bench_train)

    p = commands.add_parser("attention", help="attention implementations: error, memory, time of forward + backward",
                            description="Causal ALiBi attention alone, each --impls against the XLA reference.")
    p.add_argument("--impls", default="xla,dot_product,cudnn,pallas",
                   help="comma-separated (default: all); pallas:FWDxBWD[xWARPS[xSTAGES]] sets the kernel's block sizes "
                        "(and warps), e.g. pallas:64x32,pallas:128x64x8 to compare settings")
    p.add_argument("--batch", type=int, default=4, help="batch (default 4)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--heads", type=int, default=16, help="heads (default 16, as 760m)")
    p.add_argument("--head-dim", type=int, default=96, help="head size (default 96, as 760m)")
    p.add_argument("--dtype", default="bfloat16", help="input dtype (default bfloat16)")
    p.add_argument("--alibi", action=argparse.BooleanOptionalAction, default=True, help="ALiBi bias (default on)")
    p.add_argument("--packed", type=int, default=0, metavar="N",
                   help="N examples packed in each row, attention kept inside each (default 0: whole rows)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--out", default=str(ROOT / "bench"), help="where results are recorded (default bench/)")
    p.set_defaults(run=bench_attention)

    from benchmarks import bench_recipe as recipe_lib  # light: its JAX loads when the timing starts
    p = commands.add_parser("recipe", help="AdamW against Muon on the default job: validation loss, tokens to "
                            "equal loss, step time", description="See bench_recipe.py's docstring.")
    recipe_lib.add_arguments(p)
    p.set_defaults(run=bench_recipe)

    from benchmarks import bench_serve as serve_lib  # light: JAX and httpx load when it runs
    p = commands.add_parser("serve", help="serve.py: tokens/s with 1, 4, 16 clients at once against one at a time",
                            description="See bench_serve.py's docstring.")
    serve_lib.add_arguments(p)
    p.set_defaults(run=bench_serve)

    from benchmarks import bench_mixture as mixture_lib  # light: numpy and the loaders load when it runs
    p = commands.add_parser("mixture", help="a 3-source mixture's batch against a one-source batch, one core",
                            description="See bench_mixture.py's docstring.")
    mixture_lib.add_arguments(p)
    p.set_defaults(run=bench_mixture)

    from benchmarks import bench_dpo as dpo_lib  # light: JAX loads when it runs
    p = commands.add_parser("dpo", help="a DPO step (reference precomputed, or in the step) against a "
                            "prompt/completion step on the same tokens", description="See bench_dpo.py's docstring.")
    dpo_lib.add_arguments(p)
    p.set_defaults(run=bench_dpo)
    args = parser.parse_args(argv)
    try:
        return args.run(args, argv)
    except OSError as e:  # e.g. an --out that cannot be written
        raise BenchError(str(e)) from None


def cli(argv: list[str] | None = None) -> int:
    """main() with user errors as one `error: ...` line on stderr and exit status 2."""
    return errors.run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
