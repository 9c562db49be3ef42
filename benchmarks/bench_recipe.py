"""`bench.py recipe`: what a step buys with each optimizer, on the default job (or any --model and --steps).

    python bench.py recipe [--seeds 0,1,2] [--steps 600] [--adamw-steps 900,1200] [--model small]

Each run is `python train.py` itself, in a temporary run directory, on conf/config.yaml's job with
`training.optimizer` and the recipe's own overrides (--adamw, --muon: KEY=VALUE lists); nothing else
differs. It reports:

  curves        the validation loss at every evaluation (training.eval_every) of each optimizer, by seed,
                and their means over the seeds
  tokens        the steps AdamW needs to reach Muon's final loss: AdamW trained for --steps and each of
                --adamw-steps (its schedule spans each run's own length, as a run that long would), its
                final losses interpolated linearly in the steps; the ratio to --steps is Muon's saving in
                tokens (tokens-to-equal-loss). Below the longest run's loss nothing is extrapolated
  step time     each optimizer's jitted step (step.build, the same program train.py runs) timed in turns in
                one process, --time-rounds rounds of --time-steps steps each, the medians' ratio

The runs are deterministic (the batch is a function of the seed and the step), so the losses do not
depend on the machine's load; the step times do: run it on an idle machine.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from core.errors import BenchError

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIMIZERS = ("adamw", "muon")


def overrides(args, optimizer: str, seed: int, steps: int) -> list[str]:
    """The train.py overrides of one run: the optimizer, the recipe's own keys, the seed and the steps."""
    own = args.adamw if optimizer == "adamw" else args.muon
    model = [f"model={args.model}"] if args.model else []
    return [f"training.optimizer={optimizer}", *own, *model, f"seed={seed}", f"training.steps={steps}",
            "wandb.mode=disabled", *args.set]


def train(args, work: pathlib.Path, optimizer: str, seed: int, steps: int) -> dict:
    """One run of train.py: {step: validation loss} at each evaluation, and its wall time."""
    run_dir = work / f"{optimizer}-seed{seed}-{steps}"
    command = [sys.executable, str(ROOT / "train.py"), f"run_dir={run_dir}", *overrides(args, optimizer, seed, steps)]
    print(f"  {optimizer} seed {seed}, {steps} steps ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BenchError(f"train.py {' '.join(command[2:])} failed (status {done.returncode}): {last}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"val_loss": {r["step"]: r["val_loss"] for r in rows if "val_loss" in r},
            "wall_s": time.perf_counter() - started}


def steps_to_reach(loss: float, finals: dict[int, float]) -> float | None:
    """The steps at which AdamW's final loss (`finals`: its runs' steps -> final validation loss) reaches
    `loss`, linearly interpolated between the two runs around it; None beyond the longest run."""
    points = sorted(finals.items())
    if points[0][1] <= loss:
        return float(points[0][0])
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if l1 <= loss:
            return s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)
    return None


def step_times(args) -> dict[str, list[float]]:
    """Each optimizer's step (the default job's, as train.py builds it), alternated: seconds a step, by round."""
    import jax
    import numpy as np

    import sharding as sharding_lib
    from training import config as config_lib
    from training import step as step_lib

    built, states, batches = {}, {}, {}
    for optimizer in OPTIMIZERS:
        cfg = config_lib.load_config(overrides=[o for o in overrides(args, optimizer, 0, args.steps)
                                                if not o.startswith("training.steps=")])
        t, sh = cfg.training, cfg.sharding
        mesh = sharding_lib.make_mesh(sh.data, sh.fsdp, sh.tensor)
        built[optimizer] = step_lib.build(cfg.model, t, mesh, sh.zero_stage, cfg.seed)
        states[optimizer] = built[optimizer].init()
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (t.batch_size, cfg.seq_len + 1))
        batches[optimizer] = jax.device_put(tokens.astype(np.int32), built[optimizer].batch_sharding)
    times = {o: [] for o in OPTIMIZERS}
    for round_ in range(args.time_rounds + 1):  # the first round compiles and warms up
        for optimizer in OPTIMIZERS:
            state = states[optimizer]
            started = time.perf_counter()
            for _ in range(args.time_steps):
                state, metrics = built[optimizer].train_step(state, batches[optimizer])
            jax.block_until_ready(metrics)
            states[optimizer] = state
            if round_:
                times[optimizer].append((time.perf_counter() - started) / args.time_steps)
    return times


def run(args) -> tuple[dict, list[tuple[str, str]], str]:
    """(results, rows to print, the RESULTS.md summary)."""
    if args.steps < 1 or any(s <= args.steps for s in args.adamw_steps):
        raise BenchError("--steps must be >= 1 and every --adamw-steps longer than --steps")
    with tempfile.TemporaryDirectory(prefix="bench-recipe-") as tmp:
        work = pathlib.Path(tmp)
        curves = {o: {seed: train(args, work, o, seed, args.steps) for seed in args.seeds} for o in OPTIMIZERS}
        longer = {s: train(args, work, "adamw", args.seeds[0], s) for s in args.adamw_steps}
    times = step_times(args) if args.time_rounds else {}
    final = {o: {seed: run["val_loss"][max(run["val_loss"])] for seed, run in curves[o].items()} for o in OPTIMIZERS}
    mean = {o: statistics.fmean(final[o].values()) for o in OPTIMIZERS}
    first = args.seeds[0]
    finals = {args.steps: final["adamw"][first], **{s: r["val_loss"][max(r["val_loss"])] for s, r in longer.items()}}
    reach = steps_to_reach(final["muon"][first], finals)
    step_ms = {o: 1e3 * statistics.median(v) for o, v in times.items()}
    results = {
        "steps": args.steps, "seeds": args.seeds, "model": args.model, "adamw": args.adamw, "muon": args.muon,
        "set": args.set, "curves": {o: {str(seed): {str(k): v for k, v in r["val_loss"].items()}
                                        for seed, r in curves[o].items()} for o in OPTIMIZERS},
        "final_val_loss": {o: {str(k): v for k, v in final[o].items()} for o in OPTIMIZERS},
        "mean_final_val_loss": mean,
        "muon_better_every_seed": all(final["muon"][s] < final["adamw"][s] for s in args.seeds),
        "adamw_final_by_steps": {str(k): v for k, v in finals.items()},
        "adamw_steps_to_muon_loss": reach,
        "tokens_to_equal_loss_ratio": None if reach is None else reach / args.steps,
        "wall_s": {o: {str(k): r["wall_s"] for k, r in curves[o].items()} for o in OPTIMIZERS},
        "step_ms": step_ms, "step_time_ratio": step_ms["muon"] / step_ms["adamw"] if times else None,
    }
    rows = []
    for o in OPTIMIZERS:
        evals = sorted(next(iter(curves[o].values()))["val_loss"])
        for k in evals:
            losses = [curves[o][s]["val_loss"][k] for s in args.seeds]
            rows.append((f"{o} val loss at step {k}",
                         f"{statistics.fmean(losses):.4f} (seeds {', '.join(f'{x:.4f}' for x in losses)})"))
    rows.append(("adamw final val loss by its steps", ", ".join(f"{k}: {v:.4f}" for k, v in sorted(finals.items()))))
    ratio = results["tokens_to_equal_loss_ratio"]
    rows.append((f"adamw steps to muon's {args.steps}-step loss",
                 f"{reach:.0f} ({ratio:.2f}x)" if reach is not None else f"more than {max(finals)}"))
    if times:
        rows.append(("step time", f"adamw {step_ms['adamw']:.1f} ms, muon {step_ms['muon']:.1f} ms "
                                  f"({results['step_time_ratio']:.2f}x)"))
    summary = (f"{args.model or 'default job'}, {args.steps} steps, seeds {','.join(map(str, args.seeds))}: val loss "
               f"adamw {mean['adamw']:.3f}, muon {mean['muon']:.3f}; adamw needs "
               + (f"{ratio:.2f}x the tokens" if ratio is not None else f"> {max(finals) / args.steps:.2f}x the tokens")
               + (f"; step time {results['step_time_ratio']:.2f}x" if times else ""))
    return results, rows, summary


def add_arguments(p) -> None:
    seeds = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--seeds", type=seeds, default=[0, 1, 2], help="seeds, comma-separated (default 0,1,2)")
    p.add_argument("--steps", type=int, default=600, help="steps of each run (default 600, the default job's)")
    p.add_argument("--adamw-steps", type=seeds, default=[900, 1200],
                   help="longer AdamW runs (first seed) for the steps it needs to reach Muon's loss (default 900,1200)")
    p.add_argument("--model", default=None, help="a size of conf/model_config.yaml (default: the default job's)")
    p.add_argument("--adamw", nargs="*", default=["training.lr=3e-3", "training.min_lr=3e-4"], metavar="KEY=VALUE",
                   help="AdamW's own overrides (default: the rates the default job had with AdamW)")
    p.add_argument("--muon", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Muon's own overrides (default: none, conf/config.yaml's)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for both (e.g. a smaller job)")
    p.add_argument("--time-rounds", type=int, default=5, help="alternated timing rounds, 0 for none (default 5)")
    p.add_argument("--time-steps", type=int, default=20, help="steps a timing round (default 20)")
    p.add_argument("--out", default=str(ROOT / "bench"), help="where results are recorded (default bench/)")

