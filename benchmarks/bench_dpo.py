"""`bench.py dpo`: a DPO step against a prompt/completion step on the same tokens.

    python bench.py dpo [--model NAME] [--batch 16] [--seq 128] [--rounds 5] [--steps 5]

The default job's model (conf/config.yaml; --model a named size of conf/model_config.yaml instead),
built as train.py builds it (step.build, every device of this machine), steps three ways on random tokens, each sequence a prompt (its first half) and a response
(the second half, in the loss):

  prompt/completion   2 x --batch rows, the next-token loss on the responses
  DPO, precomputed    --batch rows of pairs (a chosen and a rejected side each: the same tokens), the
                      reference's log-probabilities given with the batch (training.dpo.precompute_reference)
  DPO, in the step    the same, the reference's forward pass in the step (its frozen copy of the weights)

alternated in --rounds rounds of --steps steps after a first round that compiles. The goals: the
precomputed DPO step within 1.1x of the prompt/completion step, the in-step one within 1.5x.
"""
from __future__ import annotations

import pathlib
import statistics
import time

from core.errors import BenchError

ROOT = pathlib.Path(__file__).resolve().parent.parent

VARIANTS = ("prompt/completion", "DPO, precomputed", "DPO, in the step")
GOALS = {"DPO, precomputed": 1.1, "DPO, in the step": 1.5}


def add_arguments(p) -> None:
    p.add_argument("--model", help="a named size of conf/model_config.yaml (default: conf/config.yaml's model)")
    p.add_argument("--batch", type=int, default=16, help="rows of pairs (prompt/completion: twice as many rows)")
    p.add_argument("--seq", type=int, default=128, help="tokens a sequence (default 128, the default job's)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, each variant once a round (default 5)")
    p.add_argument("--steps", type=int, default=5, help="steps a variant runs in a round (default 5)")
    p.add_argument("--out", default=str(ROOT / "bench"), help="where results are recorded (default bench/)")


def batches(rng, batch: int, seq: int, vocab: int) -> dict:
    import numpy as np

    from tokendata.loader import pair_slots

    weights = np.zeros((batch, 2, seq), np.float32)
    weights[..., seq // 2:] = 1.0
    pairs = {"tokens": rng.integers(0, vocab, (batch, 2, seq + 1)).astype(np.int32), "weights": weights,
             "segments": np.ones((batch, 2, seq), np.int32)}
    flat = {k: v.reshape(2 * batch, -1) for k, v in pairs.items()}
    ref = rng.normal(-float(seq), 1.0, (batch, 2, pair_slots(seq))).astype(np.float32)
    return {"prompt/completion": flat, "DPO, precomputed": {**pairs, "ref": ref}, "DPO, in the step": pairs}


def run(args) -> tuple[dict, list[tuple[str, str]], str]:
    import jax
    import numpy as np

    import sharding as sharding_lib
    from training import config as config_lib
    from training import step as step_lib

    if min(args.batch, args.seq, args.rounds, args.steps) < 1:
        raise BenchError("--batch, --seq, --rounds and --steps must be >= 1")
    common = [f"training.seq_len={args.seq}", "training.init_from=unused",
              *([f"model={args.model}"] if args.model else [])]
    settings = {"prompt/completion": [f"training.batch_size={2 * args.batch}"],
                "DPO, precomputed": [f"training.batch_size={args.batch}", "training.objective=dpo",
                                     "training.dpo.precompute_reference=true"],
                "DPO, in the step": [f"training.batch_size={args.batch}", "training.objective=dpo"]}
    built, states, data, frozen = {}, {}, {}, {}
    rng = np.random.default_rng(0)
    for name in VARIANTS:
        cfg = config_lib.load_config(overrides=[*common, *settings[name]])
        sh = cfg.sharding
        mesh = sharding_lib.make_mesh(sh.data, sh.fsdp, sh.tensor)
        built[name] = fns = step_lib.build(cfg.model, cfg.training, mesh, sh.zero_stage, cfg.seed)
        states[name] = fns.init()
        data[name] = jax.device_put(batches(rng, args.batch, args.seq, cfg.model.vocab_size)[name], fns.batch_sharding)
        frozen[name] = (jax.tree.map(lambda x: x.copy(), states[name]["params"]),) if fns.frozen_kind else ()
    times = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds + 1):  # the first round compiles
        for name in VARIANTS:
            state = states[name]
            started = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = built[name].train_step(state, data[name], *frozen[name])
            jax.block_until_ready(metrics)
            states[name] = state
            if round_:
                times[name].append((time.perf_counter() - started) / args.steps)
    median = {name: statistics.median(t) for name, t in times.items()}
    base = median["prompt/completion"]
    tokens = 2 * args.batch * args.seq
    results = {"batch_pairs": args.batch, "seq": args.seq, "tokens_per_step": tokens, "devices": jax.device_count(),
               "step_s": times, "step_s_median": median,
               "ratio": {name: median[name] / base for name in VARIANTS}, "goals": GOALS}
    rows = [(name, f"{median[name] * 1e3:.1f} ms a step of {tokens:,} tokens, {median[name] / base:.2f}x"
             + (f" (goal <= {GOALS[name]}x)" if name in GOALS else "")) for name in VARIANTS]
    summary = (f"DPO step against prompt/completion on {tokens:,} tokens: precomputed reference "
               f"{median['DPO, precomputed'] / base:.2f}x (goal 1.1x), reference in the step "
               f"{median['DPO, in the step'] / base:.2f}x (goal 1.5x)")
    return results, rows, summary
