"""`bench.py mixture`: a mixture's batch against a one-source batch, on one core.

    python bench.py mixture [--batches 16,256] [--seq 128] [--rounds 7] [--seconds 0.5]

This Python's stdlib sources, split in three and prepared with the default corpus's tokenizer
(data/pystdlib/tokenizer.json: `python data.py` makes it), are three sources; the mixture takes them at
weights 0.5, 0.3 and 0.2 (data.mixture), the one-source loader the first alone. For each batch size, the
two loaders' get_batch are timed in turn over --rounds rounds of --seconds each (successive steps, as
training reads them), on one core, and the ratio of their batches/s is the median of the rounds' ratios.
The goal: the mixture >= 0.95x the one-source loader.
"""
from __future__ import annotations

import os
import pathlib
import statistics
import tempfile
import time

from core.errors import BenchError

ROOT = pathlib.Path(__file__).resolve().parent.parent
WEIGHTS = (0.5, 0.3, 0.2)
GOAL = 0.95


def add_arguments(p) -> None:
    batches = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--batches", type=batches, default=[16, 256], help="batch sizes (default 16,256)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128, the default job's)")
    p.add_argument("--rounds", type=int, default=7, help="alternated rounds per batch size (default 7)")
    p.add_argument("--seconds", type=float, default=0.5, help="seconds each loader runs in a round (default 0.5)")
    p.add_argument("--out", default=str(ROOT / "bench"), help="where results are recorded (default bench/)")


def rate(loader, start: int, seconds: float) -> tuple[float, int]:
    """Batches/s of get_batch over successive steps from `start` for about `seconds`; and the next step."""
    step, began = start, time.perf_counter()
    while time.perf_counter() - began < seconds:
        loader.get_batch(step)
        step += 1
    return (step - start) / (time.perf_counter() - began), step


def run(args, prepare, default_data_dir: pathlib.Path) -> tuple[dict, list[tuple[str, str]], str]:
    """(results, rows to print, the RESULTS.md summary); `prepare` is data.py's, `default_data_dir` where the
    default corpus is prepared (its tokenizer prepares the three sources)."""
    from tokendata import corpus, loader, mixture, shards

    if not args.batches or min(args.batches) < 1 or args.seq < 1 or args.rounds < 1 or args.seconds <= 0:
        raise BenchError("--batches, --seq and --rounds must be >= 1 and --seconds positive")
    tokenizer = default_data_dir / "tokenizer.json"
    if not tokenizer.is_file():
        raise BenchError(f"{tokenizer} not found: run `python data.py` (or `python train.py`) first")
    files = corpus.default_corpus_files()
    saved = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    results = {"weights": WEIGHTS, "seq": args.seq, "rounds": args.rounds, "seconds": args.seconds}
    with tempfile.TemporaryDirectory(prefix="bench-mixture-") as tmp:
        names = ("a", "b", "c")
        for i, name in enumerate(names):
            prepare([str(f) for f in files[i::3]], pathlib.Path(tmp) / name, tokenizer=str(tokenizer),
                         val_fraction=0.01, progress=False)
        opened = {name: shards.open_data(pathlib.Path(tmp) / name) for name in names}
        if saved:
            os.sched_setaffinity(0, {min(saved)})
        try:
            for batch in args.batches:
                one = loader.open_loader(opened["a"], "train", args.seq, batch, seed=0)
                mix = mixture.open_mixture(opened, [(0, list(WEIGHTS))], args.seq, batch, seed=0)
                rate(one, 0, args.seconds / 4)  # warm both: the page cache, the permutations' keys
                rate(mix, 0, args.seconds / 4)
                ratios, ones, mixes, at_one, at_mix = [], [], [], 0, 0
                for _ in range(args.rounds):
                    r1, at_one = rate(one, at_one, args.seconds)
                    r2, at_mix = rate(mix, at_mix, args.seconds)
                    ones.append(r1)
                    mixes.append(r2)
                    ratios.append(r2 / r1)
                results[f"batch {batch}"] = {"one_source_batches_per_s": ones, "mixture_batches_per_s": mixes,
                                             "ratios": ratios, "ratio_median": statistics.median(ratios)}
        finally:
            if saved:
                os.sched_setaffinity(0, saved)
    rows, parts = [], []
    for batch in args.batches:
        r = results[f"batch {batch}"]
        rows.append((f"batch {batch} x {args.seq}", f"one source {statistics.median(r['one_source_batches_per_s']):,.0f} "
                     f"batches/s, mixture of 3 {statistics.median(r['mixture_batches_per_s']):,.0f}: "
                     f"{r['ratio_median']:.2f}x (goal >= {GOAL}x)"))
        parts.append(f"batch {batch} {r['ratio_median']:.2f}x")
    summary = f"a 3-source mixture's batch against one source's, one core: {', '.join(parts)} (goal >= {GOAL}x)"
    return results, rows, summary
