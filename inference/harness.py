"""The zero-shot benchmarks through lm-evaluation-harness: a JAX adapter, and the scoring of tokens it
shares with eval.py's perplexity.

`--tasks` alone runs the reference set (LAMBADA, PIQA, Winogrande, HellaSwag); `--tasks a,b` runs any
tasks or groups lm-evaluation-harness knows, including task YAML files under `--include-path` (the
harness's own mechanism for local data, e.g. a `dataset_path: json` task whose `data_files` point at
local JSON Lines). The model is wrapped in `JaxLM`, the harness's language-model interface: requests
are tokenized with the run's tokenizer, sorted into a few padded length buckets and scored in
fixed-shape batches, so only a handful of shapes are compiled. The reference columns (LAMBADA ppl and
acc, PIQA acc, Winogrande acc, HellaSwag acc_norm) head the table (`task_table`); every metric goes
into the results JSON.

The tasks are built, their data loaded, before the model loads (`load_tasks`): an unknown task or
data that cannot be had stops the command with one line before any work. Before that the Hugging
Face Hub is asked once (corpus.hub_offline): when it does not answer, only datasets in the local cache
load, and a task whose data is not cached stops at once; with nothing cached at all, before lm-eval
indexes its task files (check_task_data).

The only file of the project that imports lm_eval; eval.py's command line runs it.
"""
from __future__ import annotations

import difflib
import pathlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from core import storage
from core.errors import EvalError
from inference import decoding
from model import GPT
from tokendata.corpus import hub_offline

# (task, metric, column): the reference system's result table.
REFERENCE_COLUMNS = (("lambada_openai", "perplexity", "LAMBADA ppl"), ("lambada_openai", "acc", "LAMBADA acc"),
                     ("piqa", "acc", "PIQA acc"), ("winogrande", "acc", "Winogrande acc"),
                     ("hellaswag", "acc_norm", "HellaSwag acc_norm"))
MIN_BUCKET = 16  # the shortest padded request length; buckets double from here up to max_length


# ----------------------------------------------------------------------------------------------
# Scoring tokens: one jitted function, used by the adapter and by eval.py's perplexity


def make_scorer(model: GPT) -> Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """score(inputs (B, L), targets (B, L)) -> (log p(target | prefix) (B, L) float32, target is argmax (B, L)).

    Log-probabilities are over the real vocabulary (the model gives its padding rows no probability),
    as in training's loss and in the exported models. One compilation per (B, L) shape.
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def score(state, inputs, targets):
        logits = nnx.merge(graphdef, state)(inputs)  # (B, L, V_padded) float32
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, L)
        logp = picked - jax.nn.logsumexp(logits, axis=-1)
        return logp, jnp.argmax(logits, axis=-1) == targets

    def run(inputs, targets):
        logp, greedy = score(state, jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32))
        return np.asarray(logp), np.asarray(greedy)

    return run


# ----------------------------------------------------------------------------------------------
# The lm-evaluation-harness adapter


class JaxLM(TemplateLM):
    """lm-evaluation-harness's language-model interface over a GPT and its tokenizer.

    Requests are turned into tokens by the harness's own TemplateLM, the code path of its Hugging
    Face backend: whitespace at the end of a context (spaces, newlines, tabs) moves into the
    continuation, the pair is split where the whole string's tokens split, and an empty context is
    the end-of-text token. So every request is scored on the split `lm_eval --model hf` would use.
    Requests longer than `max_length` keep their last `max_length` tokens, and rolling log-likelihoods
    are scored in windows of `max_length`. It defaults to the model's block_size, the length every
    `convert_torch.py --format hf` export names as its tokenizer's model_max_length (and as its
    config.json's position count where the layout has one), so lm-eval's HF backend on the export,
    at its default, scores the same windows. Scoring is batched in length buckets (16, 32, 64, ... up to max_length), each with a
    fixed number of rows (batch_tokens // bucket), so the number of compiled shapes is the number of
    buckets used.
    """

    def __init__(self, model: GPT, tokenizer, *, eot_id: int, max_length: int | None = None,
                 batch_tokens: int = 16384, max_gen_toks: int = 256, progress: bool = True):
        super().__init__()
        self.model, self.tokenizer, self.eot_id = model, tokenizer, eot_id
        cfg = model.config
        self.max_length = max_length or cfg.block_size
        if cfg.max_length is not None and self.max_length > cfg.max_length:
            raise EvalError(f"--max-length {self.max_length} exceeds block_size {cfg.block_size} of this "
                            "learned-position model")
        self.batch_tokens, self.max_gen_toks, self.progress = batch_tokens, max_gen_toks, progress
        self.scorer = make_scorer(model)
        buckets, b = [], MIN_BUCKET
        while b < self.max_length:
            buckets.append(b)
            b *= 2
        self.buckets = buckets + [self.max_length]

    # -- tokens ------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:  # also the prefix token: it conditions the first token of a document
        return self.eot_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens is not False).ids

    # -- scoring -----------------------------------------------------------------------------

    def score_tokens(self, pairs: Sequence[tuple[list[int], list[int]]], desc: str | None = None
                     ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation is the greedy one) per (context, continuation) ids."""
        items = []  # (bucket, original index, inputs, targets, number of continuation tokens)
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                raise EvalError("lm-eval asked to score an empty continuation")
            tokens = (list(ctx) + list(cont))[-(self.max_length + 1):]
            n_cont = min(len(cont), len(tokens) - 1)
            inputs, targets = tokens[:-1], tokens[1:]
            bucket = next(b for b in self.buckets if b >= len(inputs))
            items.append((bucket, i, inputs, targets, n_cont))
        items.sort(key=lambda item: (item[0], -len(item[2])))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        bar = tqdm(total=len(items), desc=desc, unit="request", leave=False,
                   disable=None if self.progress and desc else True)  # None: on a terminal only
        start = 0
        while start < len(items):
            bucket = items[start][0]
            rows = max(1, self.batch_tokens // bucket)
            chunk = [it for it in items[start:start + rows] if it[0] == bucket]
            inputs = np.zeros((rows, bucket), np.int32)  # right padding: causal attention never sees it
            targets = np.zeros((rows, bucket), np.int32)
            for r, (_, _, inp, tgt, _) in enumerate(chunk):
                inputs[r, :len(inp)], targets[r, :len(tgt)] = inp, tgt
            logp, greedy = self.scorer(inputs, targets)
            for r, (_, i, inp, _, n_cont) in enumerate(chunk):
                span = slice(len(inp) - n_cont, len(inp))
                results[i] = (float(logp[r, span].astype(np.float64).sum()), bool(greedy[r, span].all()))
            start += len(chunk)
            bar.update(len(chunk))
        bar.close()
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """TemplateLM's tokenized requests ((context, continuation), context ids, continuation ids) -> scores."""
        results = self.score_tokens([(ctx, cont) for _, ctx, cont in requests],
                                    desc=None if disable_tqdm else "loglikelihood")
        for (strings, _, _), answer in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document scored in disjoint windows of max_length tokens, the first conditioned on end-of-text."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, req in enumerate(requests):
            for window in get_rolling_token_windows(token_list=self.tok_encode(req.args[0]),
                                                    prefix_token=self.prefix_token_id,
                                                    max_seq_len=self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        scores = self.score_tokens(windows, desc=None if disable_tqdm else "loglikelihood_rolling")
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, if the task asks) continuations, cut at the first stop string.

        The cached decoding loop of sample.py runs on batches of requests whose contexts have
        the same token length and the same generation settings.
        """
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        eot_text = self.tokenizer.decode([self.eot_id], skip_special_tokens=False)
        groups: dict[tuple, list[tuple[int, list[int]]]] = {}
        settings = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = tuple(handle_stop_sequences(kwargs.get("until"), eos=eot_text))
            new = int(kwargs["max_gen_toks"])
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            ids = self.tok_encode(context) or [self.eot_id]
            if self.model.config.max_length is not None:  # keep room for the new tokens inside block_size
                if new >= self.max_length:
                    raise EvalError(f"max_gen_toks {new} leaves no room for context in max_length {self.max_length}")
                ids = ids[-(self.max_length - new):]
            key = (len(ids), new, temperature)
            groups.setdefault(key, []).append((i, ids))
            settings[i] = until
        graphdef, state = nnx.split(self.model)
        out: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", leave=False,
                   disable=True if disable_tqdm or not self.progress else None)  # None: on a terminal only
        rows = max(1, self.batch_tokens // self.max_length)
        for (_, new, temperature), members in groups.items():
            fn = decoding.make_generate(graphdef, self.model.config, new, temperature=temperature, eot_id=self.eot_id)
            for first in range(0, len(members), rows):
                chunk = members[first:first + rows]
                prompt = jnp.asarray(np.array([ids for _, ids in chunk], np.int32))  # (b, T0)
                tokens, _ = fn(state, prompt, jax.random.key(first))
                for (i, _), row in zip(chunk, np.asarray(tokens)):
                    text = self.tokenizer.decode(decoding.truncate(row, self.eot_id))
                    cut = min((text.find(s) for s in settings[i] if s and s in text), default=len(text))
                    out[i] = text[:cut]
                bar.update(len(chunk))
        bar.close()
        return out


def check_task_data(tasks: Sequence[str]) -> None:
    """Stop at once when no task of lm-eval's own can get its data: the Hub does not answer (or offline
    mode is set) and the local dataset cache holds no dataset. load_tasks asks it before lm-eval indexes
    its ~15,000 task files (10-30 s), unless tasks come from --include-path; with something cached,
    building the tasks finds out whether it is these tasks' data."""
    offline = hub_offline()
    if offline is None:
        return
    import datasets.config

    cache = pathlib.Path(datasets.config.HF_DATASETS_CACHE)
    if cache.is_dir() and any(p.is_dir() and p.name != "downloads" and not p.name.startswith((".", "_"))
                              for p in cache.iterdir()):
        return  # something is cached: building the tasks finds out whether it is these tasks' data
    raise EvalError(f"cannot load the data of {', '.join(tasks)}: {offline}, and the local dataset cache "
                    f"{cache} holds no dataset (connect once to cache it, or give local task files with "
                    "--include-path)")


class Tasks:
    """lm-eval's tasks of a request, built (their documents loaded) by `load_tasks`: the `names` asked for,
    the `manager` that found them, and `built`, the tasks and groups themselves, for run_tasks."""

    def __init__(self, names: Sequence[str], manager, built: list):
        self.names, self.manager, self.built = list(names), manager, built


def load_tasks(names: Sequence[str], include_path: str | None = None) -> Tasks:
    """The tasks `names` (lm-eval's own, or YAML files under `include_path`) built with their data, or an
    EvalError in one line: an unknown name, data that cannot be loaded (offline and not in the local
    cache, a missing file). eval.py asks for them before the model loads and before any perplexity, so
    that a request that cannot run stops before the work, whatever the dataset cache holds."""
    if include_path is None:
        check_task_data(names)  # nothing cached and offline: at once, before lm-eval's index
    elif not pathlib.Path(include_path).is_dir():
        raise EvalError(f"--include-path {include_path} is not a directory")
    from lm_eval.tasks import TaskManager  # (its import alone indexes nothing, but takes seconds)

    manager = TaskManager(include_path=include_path)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            raise EvalError(f"unknown task {name!r}" + (f"; did you mean {', '.join(close)}?" if close else
                                                         "; `lm-eval ls tasks` lists them"))
    offline = hub_offline()  # the Hub asked once; unreachable, its datasets come from the local cache at once
    try:
        loaded = manager.load(list(names))
    except (OSError, ConnectionError) as e:  # datasets and huggingface_hub report missing data this way
        reason = storage.one_line(e)
        if offline:
            raise EvalError(f"cannot load the data of {', '.join(names)}: {reason}; {offline}, and only datasets "
                            "in the local cache load (or give local task files with --include-path)") from None
        raise EvalError(f"cannot load the data of {', '.join(names)}: {reason} (offline? give local task files "
                        "with --include-path)") from None
    # what was asked for, as lm-eval built it: the groups inside no other group, the tasks inside no group
    groups = loaded["groups"].values()
    inner_groups = {id(g) for group in groups for g in group.get_all_groups()}
    grouped = {id(t) for group in groups for t in group.get_all_tasks()}
    built = [g for g in groups if id(g) not in inner_groups] + \
        [t for t in loaded["tasks"].values() if id(t) not in grouped]
    return Tasks(names, manager, built)


def run_tasks(lm: JaxLM, tasks: Tasks, *, limit: float | None = None, num_fewshot: int | None = None,
              seed: int = 0) -> dict:
    """lm-eval's results for the tasks load_tasks built: {task: {metric: value}}."""
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=tasks.built, task_manager=tasks.manager, limit=limit,
                                  num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=False,
                                  random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                  fewshot_random_seed=seed)
    results = {}
    for task, metrics in out["results"].items():
        results[task] = {k.split(",")[0]: v for k, v in metrics.items()
                         if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
        results[task]["samples"] = out.get("n-samples", {}).get(task, {}).get("effective")
    return results


def task_table(results: dict) -> list[tuple[str, float]]:
    """(column, value) rows: the reference columns first (where their task ran), then every other metric."""
    rows, used = [], set()
    for task, metric, column in REFERENCE_COLUMNS:
        if metric in results.get(task, {}):
            rows.append((column, results[task][metric]))
            used.add((task, metric))
    for task in sorted(results):
        for metric, value in results[task].items():
            if metric != "samples" and (task, metric) not in used and value is not None:
                rows.append((f"{task} {metric}", value))
    return rows
