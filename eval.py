"""Evaluation of a run: perplexity against context length, and zero-shot benchmarks through lm-eval.

    python eval.py --checkpoint RUN_DIR [--step N] [--lengths 1x,2x,4x,8x] [--max-tokens N]
                   [--tasks [LIST]] [--limit N] [--include-path DIR] [--num-fewshot K]
                   [--max-length L] [--batch-tokens N] [--attention IMPL] [--no-perplexity]

Perplexity: the run's validation split is cut into non-overlapping windows of each evaluation
length L and every token of a window is scored once, with as much context as the window gives it
(the ALiBi paper's "nonoverlapping" evaluation). Lengths are multiples of the training context
(`2x`) or token counts (`512`); the default is 1x, 2x, 4x and 8x. A learned-position model has
no embedding past its block_size: the default lengths stop there (with a message), an explicit
longer one is an error. `--max-tokens N` scores N // L windows at each length, spread evenly over the split
(N at least the longest L: below it, a length would score more than was asked).
The table is printed, added to RUN_DIR/eval/step<N>.json, drawn as RUN_DIR/eval/step<N>-perplexity.png,
and logged to the run's wandb project when it has one. Every row records what it measured (data,
split and its size, max_tokens where that cut the split short): a new row replaces only the row of
its length measured the same way, and rows measured otherwise stay in their own series, one line each
in the plot.

Zero-shot benchmarks: `--tasks` alone runs the reference set (LAMBADA, PIQA, Winogrande,
HellaSwag); `--tasks a,b` runs any tasks or groups lm-evaluation-harness knows, including task
YAML files under `--include-path`. harness.py wraps the model for the harness (`JaxLM`) and runs
the tasks; the reference columns head the printed table, and every metric goes into the JSON.

Progress bars (ours, lm-eval's, the datasets library's) are drawn on a terminal only: a redirected
log gets the results and no bars.

User errors (a missing run, an unknown task, a length the model cannot take, a --batch-tokens whose
logits exceed the device's memory) end in one `error: ...` line on stderr and exit status 2.
"""
from __future__ import annotations

import math
import os
import sys

from core import errors  # light: nothing but the standard library

if __name__ == "__main__":
    errors.stop_at_once_while_loading()  # a Ctrl-C while JAX and the rest load: one line, no traceback
    if not sys.stderr.isatty():  # a log, not a terminal: no progress bars of lm-eval's (tqdm), the datasets
        # library's or the Hub's in it (each reads its variable once, when first imported: so here, first)
        for name in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
            os.environ.setdefault(name, "1")

DEFAULT_LENGTHS = "1x,2x,4x,8x"
DEFAULT_TASKS = ("lambada_openai", "piqa", "winogrande", "hellaswag")  # --tasks alone


def parse_args(argv):
    p = errors.ArgumentParser(error=errors.EvalError, description="Perplexity against context length, and zero-shot benchmarks, for a trained run.")
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR",
                   help="run directory (config, checkpoints, tokenizer)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step; default the last")
    p.add_argument("--base", metavar="BASE_DIR", help="a LoRA run's base model (a run directory) where it is now, if it moved since the run trained (default: where the run's lora_base.json records it)")
    p.add_argument("--data", default=None, help="prepared data directory; default the run's own")
    p.add_argument("--split", default="val", help="split scored for perplexity (default: %(default)s)")
    p.add_argument("--lengths", default=None, help=f"evaluation lengths: multiples of the training context "
                                                   f"or token counts (default {DEFAULT_LENGTHS})")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens per length")
    p.add_argument("--no-perplexity", action="store_true", help="skip the perplexity table")
    p.add_argument("--tasks", nargs="?", const=",".join(DEFAULT_TASKS), default=None,
                   help=f"lm-eval tasks, comma-separated; alone: {','.join(DEFAULT_TASKS)}")
    p.add_argument("--include-path", default=None, help="directory of extra lm-eval task YAML files")
    p.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    p.add_argument("--max-length", type=int, default=None, help="longest request the adapter scores, and the "
                   "window of rolling log-likelihoods (default: the model's block_size, as lm-eval's HF backend "
                   "reads it from a --format hf export)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per scoring batch (default: %(default)s)")
    p.add_argument("--attention", default=None, metavar="IMPL",
                   help="attention implementation, one of model.attention's (default: the run's own where it runs "
                        "compiled on this machine, else auto: e.g. a run trained with cudnn, read on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed for few-shot sampling and sampled generation, "
                                                              "0 to 2**32 - 1 (default: %(default)s)")
    args = p.parse_args(argv)
    if not 0 <= args.seed < 2**32:  # lm-eval seeds numpy's global generator with it, which takes 32 bits
        raise errors.EvalError(f"--seed must be in 0..2**32 - 1, got {args.seed}")
    for name in ("max_tokens", "max_length", "batch_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise errors.EvalError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.limit is not None and not (math.isfinite(args.limit) and args.limit > 0
                                       and (args.limit < 1 or args.limit == int(args.limit))):
        raise errors.EvalError(f"--limit must be a count of examples (1, 2, ...) or a fraction between 0 and 1, got "
                               f"{args.limit:g}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise errors.EvalError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.lengths is not None and not args.lengths.strip():
        raise errors.EvalError("--lengths is empty: give lengths like 1x,2x or 512, or leave it out for "
                               f"{DEFAULT_LENGTHS}")
    if args.no_perplexity and args.tasks is None:
        raise errors.EvalError("--no-perplexity without --tasks leaves nothing to evaluate")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise errors.EvalError(f"--include-path {args.include_path} is not a directory")
    return args


if __name__ == "__main__":
    errors.parse_before_loading(parse_args)  # --help and argument mistakes: at once, before JAX loads

import pathlib
import re
import time
from typing import Iterable, Sequence

import jax
import numpy as np
from tqdm import tqdm

import data
from core import storage
from core.errors import DataError, EvalError, RunError
from inference import decoding, harness
from layers import attention as attention_lib
from store import record, rundir
from tokendata import loader, shards
from training import plots

# ----------------------------------------------------------------------------------------------
# Perplexity against evaluation length


def parse_lengths(text: str, train_len: int) -> list[int]:
    """'1x,2x,512' -> [train_len, 2 * train_len, 512], sorted, without repeats."""
    lengths = set()
    for item in text.split(","):
        item = item.strip().lower()
        try:
            value = round(float(item[:-1]) * train_len) if item.endswith("x") else int(item)
        except (ValueError, OverflowError):  # not a number, or inf / nan
            raise EvalError(f"--lengths item {item!r} is neither a multiple like 2x nor a token count") from None
        if value < 1:
            raise EvalError(f"--lengths item {item!r} gives {value} tokens; lengths must be positive")
        lengths.add(value)
    if not lengths:
        raise EvalError("--lengths is empty")
    return sorted(lengths)


def window_loss(scorer, windows: Iterable[np.ndarray], rows: int, total: int | None = None,
                desc: str | None = None) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens) over windows (b, L+1), each scored as inputs [:-1] -> targets [1:].

    Batches are padded to `rows` rows (padding rows are not counted), so one shape is compiled.
    """
    nll, n = 0.0, 0
    # a bar on a terminal only (disable=None: none when stderr is a file or a pipe)
    with tqdm(total=total, desc=desc, unit="window", disable=True if desc is None else None, leave=False) as bar:
        for batch in windows:
            b = len(batch)
            if b < rows:
                batch = np.concatenate([batch, np.zeros((rows - b, batch.shape[1]), batch.dtype)])
            logp, _ = scorer(batch[:, :-1], batch[:, 1:])
            nll -= float(logp[:b].astype(np.float64).sum())
            n += b * (batch.shape[1] - 1)
            bar.update(b)
    return nll, n


def perplexity_table(scorer, data: shards.DataDir, lengths: Sequence[int], train_len: int, *, split: str = "val",
                     batch_tokens: int = 16384, max_tokens: int | None = None, progress: bool = True) -> list[dict]:
    """One row per length: {length, multiple, tokens, windows, loss, ppl, split_tokens, max_tokens}.

    Every window of the split is scored once, or with `max_tokens` (at least the longest length: check_max_tokens)
    max_tokens // length windows spread evenly over the split (loader.spread). A row says what it measured:
    the split's size, and max_tokens where that cut the windows short (None: the whole split).
    """
    check_max_tokens(max_tokens, lengths)
    table = []
    for length in lengths:
        rows = max(1, batch_tokens // length)
        max_windows = None if max_tokens is None else max_tokens // length
        try:
            split_tokens = data.splits.get(split, {}).get("tokens", 0)
            all_windows = (split_tokens - 1) // length
            batches = loader.eval_windows(data, split, length, rows, max_windows=max_windows)
            nll, n = window_loss(scorer, batches, rows, total=min(all_windows, max_windows or all_windows),
                                 desc=f"ppl @ {length}" if progress else None)
        except DataError as e:
            raise EvalError(str(e)) from None
        loss = nll / n
        cut = max_windows is not None and max_windows < all_windows
        table.append({"length": length, "multiple": length / train_len, "tokens": n, "windows": n // length,
                      "loss": loss, "ppl": math.exp(loss), "split_tokens": split_tokens,
                      "max_tokens": max_tokens if cut else None})
    return table


def check_max_tokens(max_tokens: int | None, lengths: Sequence[int]) -> None:
    """--max-tokens holds one window of every length, or an EvalError naming the smallest that does: below
    the longest, that length's row would score a whole window, more than was asked."""
    if max_tokens is not None and lengths and max_tokens < max(lengths):
        raise EvalError(f"--max-tokens {max_tokens} is less than one window of {max(lengths)} tokens, the longest of "
                        f"the evaluation lengths ({', '.join(map(str, sorted(lengths)))}): give --max-tokens "
                        f"{max(lengths)} or more, or shorter --lengths")


def check_batch_tokens(batch_tokens: int, model_cfg) -> None:
    """--batch-tokens whose scoring batch's float32 logits (batch_tokens x the padded vocabulary) fit the
    device, or an EvalError naming the most that do, before anything is allocated."""
    memory, what = decoding.device_memory()
    per_token = model_cfg.padded_vocab_size * 4
    if batch_tokens * per_token > memory:
        raise EvalError(f"--batch-tokens {batch_tokens:,}: a scoring batch's logits alone take "
                        f"{batch_tokens * per_token / decoding.GiB:,.1f} GiB ({model_cfg.padded_vocab_size:,} float32 "
                        f"logits a token), more than the {memory / decoding.GiB:,.1f} GiB of {what}; at most "
                        f"--batch-tokens {memory // per_token:,}")


# What a perplexity row measured: rows that agree on all of these are one series (one line of the plot);
# a row of another series is never replaced by, nor drawn with, a new one. A row written before rows
# recorded their split's size and max_tokens counts as measured on an unknown amount.
# (rundir.MEASURED: rundir.py checks them in the results file it reads and writes)
UNKNOWN = "unknown"


def measured(row: dict) -> tuple:
    """The row's series: its values of rundir.MEASURED (UNKNOWN where the row does not record one)."""
    return tuple(row.get(key, UNKNOWN) for key in rundir.MEASURED)


def amount(row: dict) -> str:
    """How much of its split a row that records it scored, in words: 'whole split', '--max-tokens 100'."""
    return "whole split" if row["max_tokens"] is None else f"--max-tokens {row['max_tokens']}"


def scored(row: dict) -> str:
    """What one row scored: 'whole split', or '3 of 188 windows, spread over the split (--max-tokens 100)'."""
    if row.get("max_tokens") is not None:
        return (f"{row['windows']} of {(row['split_tokens'] - 1) // row['length']} windows, spread over the split "
                f"({amount(row)})")
    return amount(row)


# ----------------------------------------------------------------------------------------------
# Command line


def run_data(run: rundir.Run, cfg, override: str | None) -> dict[str, shards.DataDir]:
    """The prepared data to score, opened, by source name: --data (name ""), else the directory the run
    trained on (""), or each source of a mixture run; each with the run's tokenizer."""
    recorded = run.record.data()
    if override is not None and not override.strip():  # (it scored the run's own data, as if --data were not given)
        raise EvalError("--data is empty: give a prepared data directory, or leave --data out to score the run's own")
    try:
        if override is None and isinstance(recorded.get("mixture"), dict):
            sources = {name: open_scored(run, recorded, str(source.get("dir")) if isinstance(source, dict) else "")
                       for name, source in recorded["mixture"].items()}
            run.record.check_mixture(sources)  # each source the one it trained on, as a resume checks it
            return sources
        corpus = open_scored(run, recorded, str(override or own_location(run, cfg)))
        if override is None:
            run.record.check_data(corpus)  # the run's own data, unchanged since it trained on it
        return {"": corpus}
    except RunError as e:
        raise EvalError(f"{e} (eval.py scores the run on the data it trained on, or on --data DIR)") from None


def own_location(run: rundir.Run, cfg) -> str:
    """Where the run's own (single) corpus is, as it recorded it."""
    return str(run.record.data().get("dir") or cfg.data.dir or data.DEFAULT_DATA_DIR)


def resolved(location: str) -> str:
    """A data directory's location as it is named in results: a URL as given, a local path made absolute."""
    return location if storage.is_url(location) else str(pathlib.Path(storage.local_path(location)).resolve())


def plot_label(name: str, corpus: str, own: str | None) -> str:
    """What a perplexity plot's file name and title add for the data scored: a mixture source's name, the
    directory's own name for --data other than the run's (so that it never replaces the run's own plot), else
    nothing."""
    if name or own is None or corpus == resolved(own):
        return name
    return "data-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", pathlib.PurePath(corpus.rstrip("/")).name or "data")


def open_scored(run: rundir.Run, recorded: dict, location: str) -> shards.DataDir:
    """A text directory to score the run on, opened and checked against the run's tokenizer. A local one is
    named by its absolute path."""
    location = resolved(location)
    try:
        corpus = shards.open_data(location)
    except DataError as e:
        raise EvalError(f"{e} (point --data at the run's prepared data)") from None
    if corpus.kind != "text":
        raise EvalError(f"{location} holds {corpus.kind} data, not running text: train.py's validation loss "
                        "scores it; give --data a text corpus for perplexity, or --no-perplexity")
    if recorded.get("tokenizer_sha256") and corpus.tokenizer_sha256 != recorded["tokenizer_sha256"]:
        raise EvalError(f"{location} was tokenized with another tokenizer than {run}'s; its perplexity would "
                        "mean nothing")
    return corpus


def merge_perplexity(section: dict | None, rows: list[dict], train_len: int) -> dict:
    """The results file's perplexity section with `rows` (each naming its data and split) merged in.

    Every row names what it measured (rundir.MEASURED); there is one row per series and length: a length
    measured again the same way replaces its row, every other row is kept, in its own series. Rows of
    files written before rows named their data take the section's data and split.
    """
    section = section or {}
    merged = {}
    for row in section.get("rows", []):
        row = {"data": section.get("data"), "split": section.get("split"), **row}
        merged[measured(row) + (row["length"],)] = row
    for row in rows:  # each names its data and split
        merged[measured(row) + (row["length"],)] = row
    return {"train_len": train_len, "rows": [merged[key] for key in sorted(merged, key=_series_order)]}


def _series_order(key: tuple) -> tuple:
    """Sort key of (data, split, split_tokens, max_tokens, length): by data and split, then the whole
    split before the larger --max-tokens before smaller ones before unknown amounts, then by length."""
    data_dir, split, split_tokens, max_tokens, length = key
    rank = (0, 0) if max_tokens is None else (1, -max_tokens) if isinstance(max_tokens, int) else (2, 0)
    return str(data_dir), str(split), str(split_tokens), rank, length


def log_wandb(cfg, run: rundir.Run, step: int, table: list[dict] | None, tasks: dict | None,
              png: bytes | None) -> None:
    """Into the training run's wandb run (resumed by its id) when it had one, else a new `eval` run."""
    import io

    import wandb
    from PIL import Image

    wandb_run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, mode=cfg.wandb.mode,
                           dir=None if run.dir.remote else run.dir.location, resume="allow", job_type="eval",
                           id=run.wandb_id(),
                           name=cfg.wandb.name or run.dir.name)
    summary = {}
    if table:  # a key per amount of data: numbers measured on different amounts never replace each other
        summary.update({f"eval/ppl@{r['length']}" + (f"/max_tokens={r['max_tokens']}" if r["max_tokens"] else ""):
                        r["ppl"] for r in table})
        wandb_run.log({"eval/perplexity": wandb.Table(
            columns=["length", "multiple", "windows", "tokens", "max_tokens", "loss", "ppl"],
            data=[[r["length"], r["multiple"], r["windows"], r["tokens"], r["max_tokens"], r["loss"], r["ppl"]]
                  for r in table])})
        if png is not None:
            wandb_run.log({"eval/perplexity_plot": wandb.Image(Image.open(io.BytesIO(png)))})
    for task, metrics in (tasks or {}).items():
        summary.update({f"eval/{task}/{m}": v for m, v in metrics.items() if v is not None})
    summary["eval/step"] = step
    wandb_run.summary.update(summary)
    wandb_run.finish()


def main(argv=None) -> int:
    args = parse_args(argv)
    run_dir = args.checkpoint
    run = rundir.existing(run_dir, args.base)
    cfg = run.record.config()
    try:  # an implementation this machine runs (the run's own may need another machine's GPU)
        attending, note = attention_lib.attention_here(cfg.model, args.attention)
    except ValueError as e:
        raise EvalError(f"--attention {args.attention}: {e}") from None
    if note:
        print(note, file=sys.stderr)
    model_cfg, train_len = cfg.model, cfg.seq_len
    tokenizer = run.record.tokenizer()
    eot_id = shards.eot_id_of(tokenizer)

    lengths = []
    if not args.no_perplexity:
        corpora = run_data(run, cfg, args.data)
        for corpus in corpora.values():
            if args.split not in corpus.splits:  # before the model loads, not in the middle of a progress bar
                raise EvalError(f"{corpus}: no split {args.split!r} (has: {', '.join(corpus.splits)})")
        lengths = parse_lengths(DEFAULT_LENGTHS if args.lengths is None else args.lengths, train_len)
        if model_cfg.max_length is not None and lengths[-1] > model_cfg.max_length:
            if args.lengths is not None:
                raise EvalError(f"length {lengths[-1]} exceeds block_size {model_cfg.block_size}: a learned-position "
                                "model has no position embedding past it (ALiBi models extrapolate)")
            kept = [n for n in lengths if n <= model_cfg.block_size]
            print(f"learned positions: evaluating only up to block_size {model_cfg.block_size} "
                  f"(skipping {', '.join(map(str, sorted(set(lengths) - set(kept))))})", file=sys.stderr)
            lengths = kept
    check_max_tokens(args.max_tokens, lengths)
    check_batch_tokens(args.batch_tokens, model_cfg)
    task_names = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks is not None else []
    if args.tasks is not None and not task_names:
        raise EvalError("--tasks is empty")
    if task_names and eot_id is None:
        raise EvalError(f"{run.dir.show(record.TOKENIZER)} has no end-of-text token ({', '.join(shards.EOT_CANDIDATES)}), "
                        "which lm-eval's adapter needs as its prefix token")

    # the tasks built, their data loaded: a task that cannot run stops now, not after the model and the perplexity
    to_run = harness.load_tasks(task_names, args.include_path) if task_names else None
    model, step = run.weights.load_model(args.step, attention=attending.attention)
    if not run.dir.remote:
        (pathlib.Path(run.dir.location) / "eval").mkdir(exist_ok=True)
    results_name = rundir.eval_results_name(step)
    run.read_results(results_name)  # a file eval.py cannot add to stops the run before any work
    print(f"{run_dir} step {step}: {model_cfg.N} layers, d={model_cfg.embedding_dim}, "
          f"{model_cfg.positions} positions, trained at context {train_len}; "
          f"{jax.devices()[0].platform} x{jax.device_count()}", file=sys.stderr)

    table, png = None, None
    for name, corpus in (corpora.items() if lengths else ()):  # a mixture run: each source in turn
        data_dir = str(corpus)
        label = plot_label(name, data_dir, None if args.data is None else own_location(run, cfg))
        plot = f"eval/step{step}-perplexity{'-' + label if label else ''}.png"
        t0 = time.perf_counter()
        new_rows = [{"data": data_dir, "split": args.split, **r} for r in perplexity_table(
            harness.make_scorer(model), corpus, lengths, train_len, split=args.split, batch_tokens=args.batch_tokens,
            max_tokens=args.max_tokens)]
        split_tokens = new_rows[0]["split_tokens"]
        print(f"\nperplexity of {name + ' ' if name else ''}{data_dir} split {args.split!r} ({split_tokens:,} tokens), step {step} "
              f"({time.perf_counter() - t0:.1f}s)")
        print(f"{'length':>8} {'x train':>8} {'windows':>8} {'tokens':>11} {'loss':>8} {'ppl':>10}  scored")
        for r in new_rows:
            print(f"{r['length']:>8} {r['multiple']:>8.2f} {r['windows']:>8,} {r['tokens']:>11,} {r['loss']:>8.4f} "
                  f"{r['ppl']:>10.3f}  {scored(r)}")
        saved = run.write_results(results_name, "perplexity",
                              lambda section: merge_perplexity(section, new_rows, train_len))
        SAVED.append(f"the perplexity of {name or data_dir} in {run.dir.show(results_name)}")
        # the plot and wandb show every series of this data and split (as it is now), earlier runs' included,
        # one line per amount of data
        same_data = (data_dir, args.split, split_tokens)
        table = [r for r in saved["rows"] if measured(r)[:3] == same_data and UNKNOWN not in measured(r)]
        series: dict[str, list[dict]] = {}
        for r in table:
            series.setdefault(amount(r), []).append(r)
        written = {measured(r) for r in new_rows}
        new = {measured(n) + (n["length"],) for n in new_rows}
        kept = [str(r["length"]) for r in saved["rows"] if measured(r) in written and measured(r) + (r["length"],) not in new]
        others = sum(measured(r) not in written for r in saved["rows"])
        png = plots.perplexity(series, train_len, f"{run.dir.name} step {step}, {name + ', ' if name else ''}"
                               f"{pathlib.PurePath(data_dir.rstrip('/')).name} split {args.split!r}")
        run.dir.write_bytes(plot, png)
        print(f"-> {run.dir.show(results_name)}: lengths {', '.join(map(str, lengths))} written"
              + (f"; {', '.join(kept)} kept from earlier runs measured the same way" if kept else "")
              + (f"; {others} row{'s' * (others != 1)} measured otherwise (another --max-tokens, data or split) kept "
                 "apart" if others else ""))
        print(f"-> {run.dir.show(plot)}")

    tasks = None
    if task_names:
        lm = harness.JaxLM(model, tokenizer, eot_id=eot_id, max_length=args.max_length, batch_tokens=args.batch_tokens,
                           progress=sys.stderr.isatty())  # bars on a terminal only, not in a log
        t0 = time.perf_counter()
        tasks = harness.run_tasks(lm, to_run, limit=args.limit, num_fewshot=args.num_fewshot, seed=args.seed)
        print(f"\nzero-shot results ({time.perf_counter() - t0:.1f}s)")
        for column, value in harness.task_table(tasks):
            print(f"{column:<32} {value:>10.4f}")
        saved = run.write_results(results_name, "tasks", lambda section: {**(section or {}), **tasks})
        SAVED.append(f"the tasks' results in {run.dir.show(results_name)}")
        kept = sorted(set(saved) - set(tasks))
        print(f"-> {run.dir.show(results_name)}: {', '.join(sorted(tasks))} written"
              + (f"; {', '.join(kept)} kept from earlier runs" if kept else ""))

    if cfg.wandb.mode != "disabled" and os.environ.get("WANDB_MODE") != "disabled":
        log_wandb(cfg, run, step, table, tasks, png)
    return 0


SAVED: list[str] = []  # what this evaluation has written so far, for the line of a stop


def saved_so_far() -> str:
    """What a stop's line adds: the results already saved (each written whole, as soon as complete)."""
    return "; saved before it: " + ", ".join(SAVED) if SAVED else "; no results were saved yet"


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr and exit status 2."""
    # nothing to undo: a Ctrl-C ends it where it stands, saying which results were saved
    return errors.run_cli(main, argv, at_once=True, so_far=saved_so_far)


if __name__ == "__main__":
    sys.exit(cli())
