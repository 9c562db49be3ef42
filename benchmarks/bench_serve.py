"""`bench.py serve`: serve.py's tokens/s with clients at once against one at a time, on a trained run.

    python bench.py serve [--checkpoint runs/default] [--requests 16] [--max-tokens 100] [--clients 1,4,16]

It starts `python serve.py` on the run (a free port on 127.0.0.1, compiled at start), warms it with one
request, then sends the same --requests greedy completions (prompts "the 0", "the 1", ...; --max-tokens new
tokens each, the end-of-text token ignored by counting what `usage` reports) in four ways:

  sequential    one client, one request after another
  N clients     N clients at once, the requests shared among them, for each N of --clients
  sample.py     the same completions through sample.py's generation (decoding.Generation.chunks, one
                prompt at a time, in this process): what a single client is compared with
  first token   the time from sending a short streamed request to its first event, median of 10

Aggregate tokens/s is the completion tokens of all requests over the wall time; the ratios are to the
sequential figure (the goal: 16 clients >= 4x) and, for one client, to sample.py's (>= 0.9x).
"""
from __future__ import annotations

import pathlib
import statistics
import subprocess
import sys
import threading
import time

from core.errors import BenchError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def add_arguments(p) -> None:
    clients = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--checkpoint", default="runs/default", help="the run to serve (default runs/default: "
                                                                 "`python train.py` makes it)")
    p.add_argument("--requests", type=int, default=16, help="completions in each measurement (default 16)")
    p.add_argument("--max-tokens", type=int, default=100, help="new tokens a completion (default 100)")
    p.add_argument("--clients", type=clients, default=[1, 4, 16], help="clients at once (default 1,4,16)")
    p.add_argument("--out", default=str(ROOT / "bench"), help="where results are recorded (default bench/)")


def run(args) -> tuple[dict, list[tuple[str, str]], str]:
    import httpx

    if not (pathlib.Path(args.checkpoint) / "config.yaml").is_file():
        raise BenchError(f"--checkpoint {args.checkpoint}: no run there (python train.py makes runs/default)")
    if args.requests < 1 or args.max_tokens < 1 or not args.clients or min(args.clients) < 1:
        raise BenchError("--requests, --max-tokens and --clients must be >= 1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--checkpoint", args.checkpoint, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("serving "):
        proc.kill()
        raise BenchError(f"serve.py did not start: {(line + proc.stderr.read()).strip().splitlines()[-1]}")
    url = line.split(" at ")[1].split()[0]
    proc.stdout.readline()
    prompts = [f"the {i}" for i in range(args.requests)]
    try:
        with httpx.Client(timeout=600) as c:
            def complete(prompt):
                r = c.post(url + "/completions", json={"prompt": prompt, "max_tokens": args.max_tokens,
                                                       "temperature": 0})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

            complete("warm")
            for n in sorted(set(args.clients)):  # every batch width once before timing
                _together(complete, prompts[:n], n)
            began = time.perf_counter()
            tokens = sum(complete(p) for p in prompts)
            sequential = tokens / (time.perf_counter() - began)
            together = {}
            for n in args.clients:
                began = time.perf_counter()
                tokens = _together(complete, prompts, n)
                together[n] = tokens / (time.perf_counter() - began)
            firsts = []
            for i in range(10):
                began = time.perf_counter()
                with c.stream("POST", url + "/completions", json={"prompt": f"a {i}", "max_tokens": 8,
                                                                  "stream": True}) as s:
                    lines = s.iter_lines()
                    next(x for x in lines if x)
                    firsts.append(time.perf_counter() - began)
                    for _ in lines:
                        pass
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    alone = _sample_py(args, prompts)
    results = {"sequential_tokens_per_s": sequential, "clients_tokens_per_s": {str(n): v for n, v in together.items()},
               "sample_py_tokens_per_s": alone, "first_token_ms_median": 1e3 * statistics.median(firsts),
               "requests": args.requests, "max_tokens": args.max_tokens, "checkpoint": args.checkpoint}
    rows = [("one client at a time", f"{sequential:,.0f} tokens/s")]
    rows += [(f"{n} client{'s' if n > 1 else ''} at once", f"{v:,.0f} tokens/s, {v / sequential:.2f}x sequential")
             for n, v in together.items()]
    rows += [("sample.py, one prompt at a time", f"{alone:,.0f} tokens/s"),
             ("first token of a short stream", f"{results['first_token_ms_median']:.0f} ms (median of 10)")]
    if 1 in together:
        rows.append(("one client / sample.py", f"{together[1] / alone:.2f}x"))
    most = max(args.clients)
    summary = (f"{most} clients {together[most] / sequential:.2f}x sequential ({together[most]:,.0f} vs "
               f"{sequential:,.0f} tok/s), 1 client {together.get(1, sequential) / alone:.2f}x sample.py, first "
               f"token {results['first_token_ms_median']:.0f} ms")
    return results, rows, summary


def _together(complete, prompts: list[str], clients: int) -> int:
    """The prompts completed by `clients` threads at once, each taking the next; their completion tokens."""
    todo, counted, lock = list(prompts), [], threading.Lock()

    def work():
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop(0)
            counted.append(complete(prompt))

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counted)


def _sample_py(args, prompts: list[str]) -> float:
    """sample.py's generation of the same greedy completions, one prompt at a time: new tokens/s."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from inference.decoding import make_generate, truncate
    from store import rundir
    from tokendata import shards

    run = rundir.existing(args.checkpoint)
    cfg, tokenizer = run.record.config().model, run.record.tokenizer()
    eot = shards.eot_id_of(tokenizer)
    graphdef, state = nnx.split(run.weights.load_model()[0])
    key = jax.random.key(0)
    compiled, tokens, took = {}, 0, 0.0
    for prompt in ["warm"] + prompts:
        ids = jnp.asarray([tokenizer.encode(prompt, add_special_tokens=False).ids], jnp.int32)
        if ids.shape[1] not in compiled:  # sample.py compiles once before it times
            compiled[ids.shape[1]] = make_generate(graphdef, cfg, args.max_tokens, temperature=0.0,
                                                   eot_id=eot).compile(state, ids, key)
        began = time.perf_counter()
        for done in compiled[ids.shape[1]].chunks(state, ids, key):
            pass
        out = done.tokens()
        if prompt != "warm":
            took += time.perf_counter() - began
            tokens += len(truncate(np.asarray(out)[0], eot))
    return tokens / took
