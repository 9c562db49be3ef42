"""Tests of eval.py (perplexity against context length, the command line) and harness.py (the
lm-evaluation-harness adapter).

Expectations come from second code paths: the model's full forward pass on each unpadded
sequence with `jax.nn.log_softmax` (no buckets, no batching), the validation tokens read straight
from the shard files with numpy, accuracies computed in the test from those scores with the
harness's metric definitions written out, and sample.py's generation.
"""
import json
import math
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lm_eval.api.instance import Instance

import eval as E
import sample
import train
from conftest import xla_flags
from inference import decoding, harness
from store import rundir
from test_sample import assert_help_shows_defaults
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)
from tokendata import shards

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):  # noqa: F811
    """A `test`-size ALiBi run trained for a few steps (block_size 64, trained at context 32)."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    assert train.main(tiny(run_dir, corpus, "training.steps=40", "training.eval_every=40",
                           "checkpoint.every=40")) == 0
    return run_dir


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory, corpus):  # noqa: F811
    """The same size with GPT-2's learned positions (block_size 64), trained for a few steps."""
    run_dir = tmp_path_factory.mktemp("eval") / "learned"
    assert train.main(tiny(run_dir, corpus, "model.alibi_attn=false", "model.embed_norm=false",
                           "training.steps=20", "training.eval_every=20", "checkpoint.every=20")) == 0
    return run_dir


@pytest.fixture(scope="module")
def loaded(run):
    model, _ = rundir.Run(run).weights.load_model()
    tokenizer = rundir.Run(run).record.tokenizer()
    eot = next(tokenizer.token_to_id(t) for t in shards.EOT_CANDIDATES if tokenizer.token_to_id(t) is not None)
    return model, tokenizer, eot


_FORWARD = {}


def forward_logits(model, tokens):
    """The model's logits (T, V_padded) for a sequence of T tokens: one unbatched forward pass.

    The sequence sits at the start of a zero buffer of 128 tokens (block_size for learned positions),
    so that one compiled forward pass serves every length: the model is causal
    (test_model.test_causal), so later zeros change nothing.
    """
    if id(model) not in _FORWARD:
        graphdef, state = nnx.split(model)
        _FORWARD[id(model)] = (jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)), state)
    forward, state = _FORWARD[id(model)]
    buffer = np.zeros((1, 128 if model.config.alibi_attn else model.config.block_size), np.int32)
    buffer[0, :len(tokens)] = tokens
    return forward(state, jnp.asarray(buffer))[0, :len(tokens)]


def direct_logprobs(model, tokens):
    """log p(tokens[i+1] | tokens[:i+1]) for every i, and whether it is the argmax."""
    logits = forward_logits(model, tokens[:-1])  # (T, V_padded)
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    targets = np.asarray(tokens[1:])
    return logp[np.arange(len(targets)), targets], np.asarray(jnp.argmax(logits, -1)) == targets


def expected_pair(model, ctx, cont, max_length):
    tokens = (ctx + cont)[-(max_length + 1):]
    logp, greedy = direct_logprobs(model, tokens)
    n = min(len(cont), len(tokens) - 1)
    return float(logp[-n:].sum()), bool(greedy[-n:].all())


# ----------------------------------------------------------------------------------------------
# The adapter's scores


def test_loglikelihood_equals_direct_token_logprobs(loaded):
    model, tokenizer, eot = loaded
    # batch_tokens 64: buckets 16, 32, 64 hold 4, 2 and 1 rows, so requests spill over several batches
    lm = harness.JaxLM(model, tokenizer, eot_id=eot, max_length=64, batch_tokens=64, progress=False)
    assert lm.buckets == [16, 32, 64]
    rng = np.random.default_rng(0)
    shapes = [(1, 1), (3, 5), (15, 1), (16, 1), (14, 4),  # (14, 4): the context fits bucket 16, the request needs 32
              (10, 7), (30, 3), (31, 2), (33, 1), (20, 20), (50, 14), (60, 30), (100, 10), (5, 70)]
    pairs = [(rng.integers(0, 300, a).tolist(), rng.integers(0, 300, b).tolist()) for a, b in shapes]
    got = lm.score_tokens(pairs)
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        want_logp, want_greedy = expected_pair(model, ctx, cont, 64)
        assert logp == pytest.approx(want_logp, abs=2e-4, rel=1e-5)
        assert greedy == want_greedy
    # a continuation the model would produce greedily is reported as greedy
    ctx = rng.integers(0, 300, 12).tolist()
    nxt = int(np.argmax(np.asarray(model(jnp.asarray([ctx], jnp.int32))[0, -1, :300])))
    assert lm.score_tokens([(ctx, [nxt])])[0][1] is True


def test_loglikelihood_requests_split_text_where_the_whole_string_splits(loaded):
    """The harness's rule, written out: trailing whitespace of the context (any kind) joins the
    continuation, the tokens split where the context's own tokens end, an empty context is end-of-text."""
    model, tokenizer, eot = loaded
    lm = harness.JaxLM(model, tokenizer, eot_id=eot, max_length=32, batch_tokens=128, progress=False)
    requests = [("alpha beta gamma", " delta"), ("alpha beta gamma ", "delta epsilon"), ("alpha beta.\n", "gamma"),
                ("alpha\t", "beta"), ("alpha:\n  \t", "beta gamma"), ("", "alpha beta")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, args, i) for i, args in enumerate(requests)])
    for (context, continuation), (logp, _) in zip(requests, got):
        if context:
            stripped = context.rstrip(" \t\n")
            context, continuation = stripped, context[len(stripped):] + continuation
            whole = tokenizer.encode(context + continuation).ids
            n_ctx = len(tokenizer.encode(context).ids)
            ctx, cont = whole[:n_ctx], whole[n_ctx:]
        else:  # an empty context is conditioned on the end-of-text token
            ctx, cont = [eot], tokenizer.encode(continuation).ids
        assert logp == pytest.approx(expected_pair(model, ctx, cont, 32)[0], abs=2e-4)


def test_rolling_loglikelihood_equals_the_perplexity_computation(loaded):
    """A document scored by loglikelihood_rolling = the non-overlapping window loss on [eot] + its tokens."""
    model, tokenizer, eot = loaded
    rng = random.Random(3)
    text = " ".join(rng.choice(WORDS) for _ in range(60))
    while True:  # lengthen the document until its token count has a divisor L in [16, 32]
        tokens = tokenizer.encode(text).ids
        L = next((d for d in range(16, 33) if len(tokens) % d == 0), None)
        if L:
            break
        text += " " + rng.choice(WORDS)
    lm = harness.JaxLM(model, tokenizer, eot_id=eot, max_length=L, batch_tokens=4 * L, progress=False)
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]

    stream = np.asarray([eot] + tokens, np.int32)
    windows = np.stack([stream[i * L: i * L + L + 1] for i in range(len(tokens) // L)])  # (n, L + 1)
    nll, n = E.window_loss(harness.make_scorer(model), [windows], rows=len(windows))
    assert n == len(tokens)
    assert got == pytest.approx(-nll, rel=1e-5)
    # and both equal the direct sum over the windows
    direct = sum(direct_logprobs(model, w.tolist())[0].sum() for w in windows)
    assert got == pytest.approx(float(direct), rel=1e-5)


def val_stream(corpus) -> np.ndarray:
    """The validation split's tokens, read straight from its shard files."""
    index = shards.open_data(corpus).index
    return np.concatenate([np.fromfile(corpus / s["file"], dtype=np.dtype(index["dtype"]).newbyteorder("<"))
                           for s in index["splits"]["val"]["shards"]]).astype(np.int32)


def window_nll(model, stream, length: int, windows: int) -> float:
    """Summed negative log-likelihood of `windows` of the non-overlapping windows of `length`, each unbatched:
    all n of them, or windows k * n // windows for k < windows (spread from the first to near the last)."""
    n = (len(stream) - 1) // length
    picked = range(n) if windows >= n else [k * n // windows for k in range(windows)]
    return -sum(float(direct_logprobs(model, stream[i * length: i * length + length + 1].tolist())[0].sum())
                for i in picked)


def test_perplexity_table_scores_every_validation_token_once(run, loaded, corpus):  # noqa: F811
    model = loaded[0]
    stream = val_stream(corpus)
    table = E.perplexity_table(harness.make_scorer(model), shards.open_data(corpus), [32, 48], 32, batch_tokens=200, progress=False)
    for row in table:
        L = row["length"]
        n_windows = (len(stream) - 1) // L
        assert row["tokens"] == n_windows * L and row["windows"] == n_windows
        nll = window_nll(model, stream, L, n_windows)
        assert row["loss"] == pytest.approx(nll / row["tokens"], rel=1e-5)
        assert row["ppl"] == pytest.approx(np.exp(nll / row["tokens"]), rel=1e-5)
        assert row["multiple"] == L / 32


def test_generate_until_matches_sample_generation(loaded):
    model, tokenizer, eot = loaded
    lm = harness.JaxLM(model, tokenizer, eot_id=eot, max_length=64, batch_tokens=256, progress=False)
    contexts = ["alpha beta", "gamma delta epsilon zeta", "alpha beta"]
    kwargs = {"until": ["theta"], "max_gen_toks": 12, "do_sample": False}
    got = lm.generate_until([Instance("generate_until", {}, (c, dict(kwargs)), i) for i, c in enumerate(contexts)])
    for context, text in zip(contexts, got):
        ids = tokenizer.encode(context).ids
        new = decoding.generate(model, np.asarray([ids]), 12, temperature=0.0, eot_id=eot)[0]
        want = tokenizer.decode(decoding.truncate(new, eot))
        want = want[:want.find("theta")] if "theta" in want else want
        assert text == want
    assert got[0] == got[2]


# ----------------------------------------------------------------------------------------------
# The same requests through lm-eval's own Hugging Face backend, on the exported model

# Contexts ending in a newline, a tab, indentation or mixed whitespace, empty contexts (one whose
# continuation starts with the end-of-text token itself), multi-token continuations, a context longer
# than max_length; the harness moves all trailing whitespace of a context into the continuation.
PARITY_REQUESTS = [
    ("alpha beta gamma", " delta"),
    ("alpha beta gamma ", "delta epsilon"),
    ("alpha beta gamma.\n", "delta epsilon zeta."),
    ("alpha beta.\n\n", "gamma"),
    ("alpha\tbeta\t", "gamma delta"),
    ("def alpha():\n    ", "return beta"),
    ("alpha beta \n  \t", " gamma\n"),
    ("alpha beta\r\n", "gamma"),
    ("", "alpha beta gamma delta"),
    ("", "\n\talpha"),
    ("", "<|endoftext|>alpha beta"),
    (".\n".join(" ".join(WORDS[i:i + 4]) for i in range(0, 40, 3)) + ".\n", "alpha beta gamma delta"),
]
ROLLING_TEXTS = ["alpha beta\n\tgamma", "\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(8)), ""]


def write_rolling_task(root: pathlib.Path, rng: random.Random, n_docs: int = 3) -> list[str]:
    """A wikitext-style task (rolling log-likelihood of whole documents; word perplexity) as local JSON Lines
    + YAML under root; returns its documents."""
    root.mkdir(parents=True, exist_ok=True)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 90))) for _ in range(n_docs)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "tiny_rolling.yaml").write_text(f"""task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'docs.jsonl'}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    return docs


@pytest.mark.parametrize("layout", ["bloom", "gpt2"])
def test_loglikelihoods_equal_lm_evals_hf_backend_on_the_export(layout, run, learned_run, tmp_path):
    """Every request's log-likelihood and is_greedy, and every rolling log-likelihood, from JaxLM equal
    those of lm-eval's HFLM on the model exported with `convert_torch.py --format hf`; and with both sides
    at their defaults, a rolling-loglikelihood task over documents longer than the model's block_size
    gives the same word perplexity through `eval.py --tasks` as through HFLM on the export."""
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    import convert_torch

    run_dir = {"bloom": run, "gpt2": learned_run}[layout]
    assert convert_torch.cli(["--checkpoint", str(run_dir), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    model, _ = rundir.Run(run_dir).weights.load_model()
    tokenizer = rundir.Run(run_dir).record.tokenizer()
    eot = tokenizer.token_to_id("<|endoftext|>")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.model_type == layout
    if hf.config.vocab_size > model.config.vocab_size:  # an export that keeps the padding rows: drop them
        hf.resize_token_embeddings(model.config.vocab_size)
    reference = HFLM(pretrained=hf, tokenizer=transformers.AutoTokenizer.from_pretrained(tmp_path / "hf"),
                     max_length=32, batch_size=4, device="cpu")
    lm = harness.JaxLM(model, tokenizer, eot_id=eot, max_length=32, batch_tokens=128, progress=False)

    requests = list(PARITY_REQUESTS)
    with torch.no_grad():
        # continuations the model itself would produce, so that is_greedy is also compared where it is true
        for context in ("alpha beta gamma", "alpha beta\n", ""):
            ids = lm.tok_encode(context) or [eot]
            for _ in range(3):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            requests.append((context, tokenizer.decode(ids[-3:])))
        instances = [Instance("loglikelihood", {}, args, i) for i, args in enumerate(requests)]
        want = reference.loglikelihood(instances, disable_tqdm=True)
        want_rolling = reference.loglikelihood_rolling(
            [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(ROLLING_TEXTS)], disable_tqdm=True)
    got = lm.loglikelihood(instances)
    for args, (logp, greedy), (want_logp, want_greedy) in zip(requests, got, want):
        assert logp == pytest.approx(want_logp, abs=1e-4), args
        assert greedy == want_greedy, args
    assert any(greedy for _, greedy in want)
    got_rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i)
                                            for i, t in enumerate(ROLLING_TEXTS)])
    assert len(tokenizer.encode(ROLLING_TEXTS[1]).ids) > 2 * 32  # several windows
    assert got_rolling == pytest.approx(want_rolling, abs=1e-4)

    # default settings on both sides, neither told a length: documents longer than block_size, scored in
    # rolling windows by JaxLM and by HFLM on the export
    docs = write_rolling_task(tmp_path / "tasks", random.Random(7))
    assert all(len(tokenizer.encode(d).ids) > 2 * model.config.block_size for d in docs)  # several windows each
    doc_requests = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)]
    reference = HFLM(pretrained=hf, tokenizer=transformers.AutoTokenizer.from_pretrained(tmp_path / "hf"),
                     batch_size=4, device="cpu")
    with torch.no_grad():
        want_docs = reference.loglikelihood_rolling(doc_requests, disable_tqdm=True)
    default_lm = harness.JaxLM(model, tokenizer, eot_id=eot, batch_tokens=128, progress=False)
    assert default_lm.loglikelihood_rolling(doc_requests) == pytest.approx(want_docs, abs=1e-4)
    if layout != "bloom":  # the command line once (the harness indexes its whole task list each time)
        return
    # and through eval.py's command line, as a wikitext-style task: the harness's metrics, written out
    shutil.copytree(run_dir, tmp_path / "run")
    assert E.cli(["--checkpoint", str(tmp_path / "run"), "--no-perplexity", "--tasks", "tiny_rolling",
                  "--include-path", str(tmp_path / "tasks"), "--batch-tokens", "512"]) == 0
    step = rundir.Run(run_dir).record.config().training.steps
    got_task = json.loads((tmp_path / "run" / "eval" / f"step{step}.json").read_text())["tasks"]["tiny_rolling"]
    words, n_bytes = sum(len(re.split(r"\s+", d)) for d in docs), sum(len(d.encode()) for d in docs)
    assert got_task["samples"] == len(docs)
    assert got_task["word_perplexity"] == pytest.approx(math.exp(-sum(want_docs) / words), rel=1e-5)
    assert got_task["bits_per_byte"] == pytest.approx(-sum(want_docs) / n_bytes / math.log(2), rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Tasks through the harness, end to end


def write_tasks(root: pathlib.Path, rng: random.Random):
    """A 2-4-way multiple-choice task and a LAMBADA-style last-word task, as local JSON Lines + YAML."""
    mc, lam = [], []
    for i in range(12):
        choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(2, 4))]
        mc.append({"q": " ".join(rng.choice(WORDS) for _ in range(5)), "choices": choices,
                   "label": rng.randrange(len(choices))})
        lam.append({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))})
    for name, rows in (("mc", mc), ("lam", lam)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{q}}}}"
doc_to_target: label
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    (root / "tiny_lambada.yaml").write_text(f"""task: tiny_lambada
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'lam.jsonl'}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return mc, lam


def test_local_tasks_end_to_end_give_hand_computed_accuracy(run, loaded, tmp_path):
    """`python eval.py --tasks` on two local tasks: the accuracies computed by hand; its stderr, a pipe
    here as in a redirected log, holds no progress bar (lm-eval's, the datasets library's or ours)."""
    model, tokenizer, eot = loaded
    mc, lam = write_tasks(tmp_path, random.Random(5))
    done = subprocess.run([sys.executable, str(pathlib.Path(E.__file__)), "--checkpoint", str(run), "--no-perplexity",
                           "--tasks", "tiny_mc,tiny_lambada", "--include-path", str(tmp_path), "--max-length", "32"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "it/s" not in done.stderr, done.stderr
    results = json.loads((run / "eval" / "step40.json").read_text())["tasks"]

    def encode_pair(context, continuation):  # the harness's target delimiter is one space
        whole = tokenizer.encode(context + continuation).ids
        n = len(tokenizer.encode(context).ids)
        return whole[:n], whole[n:]

    acc, acc_norm = [], []
    for doc in mc:
        lls = np.array([expected_pair(model, *encode_pair(doc["q"], " " + c), 32)[0] for c in doc["choices"]])
        acc.append(np.argmax(lls) == doc["label"])
        acc_norm.append(np.argmax(lls / np.array([len(c) for c in doc["choices"]])) == doc["label"])
    assert results["tiny_mc"]["acc"] == pytest.approx(np.mean(acc))
    assert results["tiny_mc"]["acc_norm"] == pytest.approx(np.mean(acc_norm))
    assert results["tiny_mc"]["samples"] == len(mc)

    scores = [expected_pair(model, *encode_pair(" ".join(d["text"].split(" ")[:-1]), " " + d["text"].split(" ")[-1]),
                            32) for d in lam]
    assert results["tiny_lambada"]["acc"] == pytest.approx(np.mean([g for _, g in scores]))
    assert results["tiny_lambada"]["perplexity"] == pytest.approx(np.exp(-np.mean([s for s, _ in scores])), rel=1e-4)
    assert "tiny_mc acc" in done.stdout and "tiny_lambada perplexity" in done.stdout


def test_reference_columns_lead_the_task_table():
    results = {"piqa": {"acc": 0.6, "acc_norm": 0.61, "samples": 10}, "lambada_openai": {"perplexity": 40.0, "acc": 0.3},
               "hellaswag": {"acc": 0.3, "acc_norm": 0.35}, "winogrande": {"acc": 0.52}, "other": {"f1": 0.5}}
    rows = harness.task_table(results)
    assert [c for c, _ in rows[:5]] == ["LAMBADA ppl", "LAMBADA acc", "PIQA acc", "Winogrande acc", "HellaSwag acc_norm"]
    assert [v for _, v in rows[:5]] == [40.0, 0.3, 0.6, 0.52, 0.35]
    assert ("other f1", 0.5) in rows and ("piqa acc_norm", 0.61) in rows


# ----------------------------------------------------------------------------------------------
# The command line and ALiBi's extrapolation


def test_cli_writes_table_json_and_plot(run, capsys):
    assert E.cli(["--checkpoint", str(run), "--max-tokens", "400", "--batch-tokens", "256"]) == 0
    saved = json.loads((run / "eval" / "step40.json").read_text())["perplexity"]
    assert [r["length"] for r in saved["rows"]] == [32, 64, 128, 256]  # 1x..8x of the training context 32
    assert saved["train_len"] == 32 and all(r["tokens"] <= 400 for r in saved["rows"])
    assert (run / "eval" / "step40-perplexity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out, err = capsys.readouterr()
    for r in saved["rows"]:
        assert f"{r['ppl']:.3f}" in out
    assert "\r" not in err and "ppl @" not in err  # stderr is no terminal here: no progress bar in it


def test_another_corpus_gets_its_own_plot_and_an_empty_data_is_refused(run, corpus, tmp_path, capsys):  # noqa: F811
    """eval.py --data OTHER draws eval/stepN-perplexity-data-OTHER.png, its title naming that corpus, and leaves
    the run's own plot as it was (it was overwritten); --data '' is one line (it scored the run's own data)."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(run, run_dir, ignore=shutil.ignore_patterns("eval"))
    shutil.copytree(corpus, other)
    args = ["--checkpoint", str(run_dir), "--lengths", "32", "--max-tokens", "200"]
    assert E.main(args) == 0
    own = (run_dir / "eval" / "step40-perplexity.png").read_bytes()
    assert E.main([*args, "--data", str(other)]) == 0
    assert (run_dir / "eval" / "step40-perplexity.png").read_bytes() == own
    assert (run_dir / "eval" / "step40-perplexity-data-other.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert E.main([*args, "--data", str(corpus)]) == 0  # the run's own data, named: its own plot
    assert sorted(p.name for p in (run_dir / "eval").glob("*.png")) == ["step40-perplexity-data-other.png",
                                                                         "step40-perplexity.png"]
    capsys.readouterr()
    assert E.cli([*args, "--data", ""]) == 2
    assert capsys.readouterr().err == ("error: --data is empty: give a prepared data directory, or leave --data out "
                                       "to score the run's own\n")


@pytest.mark.parametrize("when", ["after the perplexity was saved", "before anything was saved"])
def test_a_stop_says_which_results_were_saved(run, tmp_path, when):
    """python eval.py stopped by Ctrl-C (a hook sends it as the perplexity's plot is drawn, its results written,
    or as the model loads): its line says which results it had saved and where (it said `error: interrupted` alone),
    status 130, and what it says was saved is in the results file."""
    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir, ignore=shutil.ignore_patterns("eval"))
    hook = ("import os, runpy, signal, sys\n"
            "from store import rundir, weights\n"
            + ("from training import plots\n"  # drawn once the results are written
               "draw = plots.perplexity\n"
               "def hooked(*a, **k):\n"
               "    os.kill(os.getpid(), signal.SIGINT)\n"
               "    return draw(*a, **k)\n"
               "plots.perplexity = hooked\n" if when.startswith("after") else
               "load = weights.Weights.load_model\n"
               "def hooked(self, *a, **k):\n"
               "    os.kill(os.getpid(), signal.SIGINT)\n"
               "    return load(self, *a, **k)\n"
               "weights.Weights.load_model = hooked\n")
            + "sys.argv[0] = 'eval.py'\nrunpy.run_path('eval.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", hook, "--checkpoint", str(run_dir), "--lengths", "32,64",
                           "--max-tokens", "200"], cwd=pathlib.Path(__file__).parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    if when.startswith("after"):
        results = run_dir / "eval" / "step40.json"
        assert last == (f"error: interrupted; saved before it: the perplexity of "
                        f"{json.loads(results.read_text())['perplexity']['rows'][0]['data']} in {results}"), last
    else:
        assert last == "error: interrupted; no results were saved yet", last


def test_results_of_several_runs_merge_by_length(run, corpus, tmp_path, capsys):  # noqa: F811
    """A second evaluation of a step adds to eval/stepN.json: a length measured again the same way replaces
    its row; every other row (other lengths, another split, a row that does not record how much it
    scored), the tasks and anything else in the file are kept."""
    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir, ignore=shutil.ignore_patterns("eval"))
    results, plot = run_dir / "eval" / "step40.json", run_dir / "eval" / "step40-perplexity.png"
    data_dir = str(pathlib.Path(corpus).resolve())
    split_tokens = shards.open_data(corpus).index["splits"]["val"]["tokens"]
    # a row of a file from before rows named their data or amount, and a row measured as --max-tokens 320 does
    unrecorded = {"length": 48, "multiple": 1.5, "tokens": 96, "windows": 2, "loss": 3.0, "ppl": 20.0855}
    stale = {"data": data_dir, "split": "val", "split_tokens": split_tokens, "max_tokens": 320,
             "length": 64, "multiple": 2.0, "tokens": 320, "windows": 5, "loss": 3.0, "ppl": 20.0855}
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps({"perplexity": {"data": data_dir, "split": "val", "train_len": 32,
                                                  "rows": [unrecorded, stale]},
                                   "tasks": {"tiny_mc": {"acc": 0.5, "samples": 12}}, "note": "mine"}))

    def evaluate(*argv):
        capsys.readouterr()
        assert E.cli(["--checkpoint", str(run_dir), "--batch-tokens", "256", *argv]) == 0
        saved = json.loads(results.read_text())
        rows = {(r["split"], r.get("max_tokens", "?"), r["length"]): r for r in saved["perplexity"]["rows"]}
        assert len(rows) == len(saved["perplexity"]["rows"]) and all(r["data"] == data_dir for r in rows.values())
        assert saved["tasks"] == {"tiny_mc": {"acc": 0.5, "samples": 12}} and saved["note"] == "mine"
        return rows, capsys.readouterr().out

    rows, out = evaluate("--lengths", "32,64", "--max-tokens", "320")
    assert set(rows) == {("val", "?", 48), ("val", 320, 32), ("val", 320, 64)}
    assert rows["val", "?", 48] == {"data": data_dir, "split": "val", **unrecorded}  # kept apart, as it was
    assert rows["val", 320, 64]["loss"] != 3.0 and rows["val", 320, 64]["tokens"] == 320  # measured again: replaced
    assert f"-> {results}: lengths 32, 64 written; 1 row measured otherwise (another --max-tokens, data or " \
           "split) kept apart\n" in out
    assert f"-> {plot}" in out and plot.read_bytes()[:4] == b"\x89PNG"
    first = rows

    rows, out = evaluate("--lengths", "64,128", "--max-tokens", "320")
    assert set(rows) == {("val", "?", 48), ("val", 320, 32), ("val", 320, 64), ("val", 320, 128)}
    assert rows["val", 320, 32] == first["val", 320, 32] and rows["val", "?", 48] == first["val", "?", 48]
    assert rows["val", 320, 128]["tokens"] == 2 * 128  # 320 // 128 windows
    assert "lengths 64, 128 written; 32 kept from earlier runs measured the same way; 1 row measured otherwise" in out

    rows, out = evaluate("--lengths", "32", "--split", "train", "--max-tokens", "320")
    assert set(rows) == {("train", 320, 32), *first, ("val", 320, 128)}
    assert rows["val", 320, 32] == first["val", 320, 32] and rows["val", "?", 48] == first["val", "?", 48]
    assert "lengths 32 written; 4 rows measured otherwise (another --max-tokens, data or split) kept apart" in out

    # a results file eval.py cannot add to stops it with one line, before any work, touching nothing
    results.write_text("{not json")
    before = plot.read_bytes()
    assert E.cli(["--checkpoint", str(run_dir), "--lengths", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {results} is not an eval.py results file: unreadable JSON")
    assert not any(line.startswith("Traceback") for line in err)
    assert results.read_text() == "{not json" and plot.read_bytes() == before


def test_evaluations_of_different_amounts_of_data_are_kept_apart(run, loaded, corpus, tmp_path, capsys,  # noqa: F811
                                                                  monkeypatch):
    """The whole split at 1x and 2x, then --max-tokens 100 at 1x and 1.5x: the second evaluation measures
    less data, so it neither replaces nor joins the first one's rows. The file, the printed table and the
    plot say which amount each number measured, and the plot draws one line per amount."""
    import matplotlib.axes

    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir, ignore=shutil.ignore_patterns("eval"))
    results = run_dir / "eval" / "step40.json"
    data_dir, model = str(pathlib.Path(corpus).resolve()), loaded[0]
    stream = val_stream(corpus)
    split_tokens = len(stream)
    lines = []  # (x, y, label) of every line the plot draws

    def plot(self, x, y, *args, **kwargs):
        lines.append((list(x), list(y), kwargs.get("label")))
        return original(self, x, y, *args, **kwargs)

    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)

    def evaluate(*argv):
        capsys.readouterr()
        lines.clear()
        assert E.cli(["--checkpoint", str(run_dir), "--batch-tokens", "256", *argv]) == 0
        rows = json.loads(results.read_text())["perplexity"]["rows"]
        return {(r.get("max_tokens"), r["length"]): r for r in rows}, capsys.readouterr().out

    whole = {L: (split_tokens - 1) // L for L in (32, 64)}  # every window of the split
    capped = {32: 100 // 32, 48: 100 // 48}  # at most 100 tokens per length: 3 and 2 windows
    first, _ = evaluate("--lengths", "1x,2x")
    rows, out = evaluate("--lengths", "32,48", "--max-tokens", "100")

    assert set(rows) == {(None, 32), (None, 64), (100, 32), (100, 48)} and len(rows) == 4
    for (max_tokens, L), windows in [*(((None, L), w) for L, w in whole.items()),
                                     *(((100, L), w) for L, w in capped.items())]:
        row = rows[max_tokens, L]
        assert (row["data"], row["split"], row["split_tokens"]) == (data_dir, "val", split_tokens)
        assert (row["windows"], row["tokens"]) == (windows, windows * L)
    for L, windows in capped.items():  # windows spread over the split (the whole split's loss has its own test)
        assert rows[100, L]["loss"] == pytest.approx(window_nll(model, stream, L, windows) / (windows * L), rel=1e-5)
    assert rows[None, 32] == first[None, 32] and rows[None, 64] == first[None, 64]  # untouched by the second run

    # the printed table: the rows just measured, each with its windows, tokens and what it scored
    for L, windows in capped.items():
        ppl = rows[100, L]["ppl"]
        assert re.search(rf"^ +{L} +{L / 32:.2f} +{windows} +{windows * L} +[0-9.]+ +{ppl:.3f} +"
                         rf"{windows} of {(split_tokens - 1) // L} windows, spread over the split \(--max-tokens 100\)$",
                         out, re.M), out
    assert f"split 'val' ({split_tokens:,} tokens)" in out
    assert "lengths 32, 48 written; 2 rows measured otherwise (another --max-tokens, data or split) kept apart\n" in out

    # the plot: one line per amount, each through its own lengths only
    assert sorted(lines, key=str) == sorted([([32, 64], [rows[None, L]["ppl"] for L in (32, 64)], "whole split"),
                                             ([32, 48], [rows[100, L]["ppl"] for L in (32, 48)], "--max-tokens 100")],
                                            key=str)


def test_learned_positions_stop_at_block_size(learned_run, capsys):
    run_dir = learned_run
    capsys.readouterr()
    assert E.cli(["--checkpoint", str(run_dir), "--max-tokens", "200"]) == 0  # block_size 64: 1x and 2x of 32 only
    assert "evaluating only up to block_size 64 (skipping 128, 256)" in capsys.readouterr().err
    rows = json.loads((run_dir / "eval" / "step20.json").read_text())["perplexity"]["rows"]
    assert [r["length"] for r in rows] == [32, 64]
    assert E.cli(["--checkpoint", str(run_dir), "--lengths", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exceeds block_size 64" in err[0]


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "{missing}"], "not found"),
    # (with an --include-path, as offline with an empty dataset cache the data's absence is said first)
    (["--checkpoint", "{run}", "--tasks", "no_such_task_xyz", "--include-path", "{here}"],
     "unknown task 'no_such_task_xyz'"),
    (["--checkpoint", "{run}", "--lengths", "2y"], "--lengths item '2y'"),
    (["--checkpoint", "{run}", "--lengths", "infx"], "--lengths item 'infx' is neither"),
    (["--checkpoint", "{run}", "--lengths", ""], "--lengths is empty"),
    (["--checkpoint", "{run}", "--tasks", "x", "--limit", "-1"], "--limit must be a count of examples"),
    (["--checkpoint", "{run}", "--tasks", "x", "--limit", "0"], "--limit must be a count of examples"),
    (["--checkpoint", "{run}", "--tasks", "x", "--limit", "nan"], "or a fraction between 0 and 1, got nan"),
    (["--checkpoint", "{run}", "--tasks", "x", "--limit", "1.5"], "got 1.5"),
    (["--checkpoint", "{run}", "--tasks", "x", "--num-fewshot", "-2"], "--num-fewshot must be >= 0, got -2"),
    (["--checkpoint", "{run}", "--step", "7"], "no checkpoint for step 7"),
    (["--checkpoint", "{run}", "--no-perplexity"], "nothing to evaluate"),
    (["--checkpoint", "{run}", "--include-path", "{missing}", "--tasks", "x", "--no-perplexity"], "not a directory"),
    (["--checkpoint", "{run}", "--split", "nosuch"], "no split 'nosuch' (has: train, val)"),
    (["--checkpoint", "{run}", "--seed", str(2**70), "--tasks", "x"], "--seed must be in 0..2**32 - 1, got 1180591"),
    (["--checkpoint", "{run}", "--seed", "-1", "--tasks", "x"], "--seed must be in 0..2**32 - 1, got -1"),
    # below one window: each length would score a whole window anyway (1x..8x of 32 here)
    (["--checkpoint", "{run}", "--max-tokens", "10"], "--max-tokens 10 is less than one window of 256 tokens, the "
                                                      "longest of the evaluation lengths (32, 64, 128, 256): give "
                                                      "--max-tokens 256 or more"),
    (["--checkpoint", "{run}", "--lengths", "32,64", "--max-tokens", "63"], "one window of 64 tokens"),
    (["--checkpoint", "{run}", "--batch-tokens", str(10**20)], "--batch-tokens 100,000,000,000,000,000,000: a "
                                                               "scoring batch's logits alone take"),
])
def test_user_errors_are_one_line(run, tmp_path, capsys, argv, message):
    argv = [a.format(run=run, missing=tmp_path / "missing", here=tmp_path) for a in argv]
    assert E.cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]
    assert not any(line.startswith("Traceback") for line in err)
    if "unknown task" not in message:  # found before any work: nothing but the line (a task after the run's header)
        assert len(err) == 1, err


def test_help_shows_the_defaults(capsys):
    assert_help_shows_defaults(E.parse_args, ["--checkpoint", "RUN"], capsys)


def test_tasks_offline_fail_at_once_in_one_line(run, tmp_path, offline_user):
    """Offline with an empty cache, a Hub task stops with one line naming the Hub that did not answer and
    the empty cache, before the model loads and before lm-eval indexes its task files (seconds): no
    warning of the Hugging Face libraries' retries, no traceback. With something in the cache (not this
    task's data), the task's data is looked for before the model loads and before any perplexity: the
    same kind of line, alone, and no perplexity computed."""
    eval_py = pathlib.Path(E.__file__)
    code = ("import atexit, runpy, sys; atexit.register(lambda: print('indexed:', 'lm_eval.tasks' in sys.modules, "
            f"file=sys.stderr)); sys.path.insert(0, {str(eval_py.parent)!r}); sys.argv = ['eval.py', '--checkpoint', {str(run)!r}, '--tasks', "
            f"'lambada_openai,piqa', '--no-perplexity']; runpy.run_path({str(eval_py)!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=offline_user, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    cache = pathlib.Path(offline_user["HF_HOME"]) / "datasets"
    assert result.stderr.splitlines() == [
        f"error: cannot load the data of lambada_openai, piqa: the Hugging Face Hub at {offline_user['HF_ENDPOINT']} "
        f"does not answer ([Errno 111] Connection refused), and the local dataset cache {cache} holds no dataset "
        "(connect once to cache it, or give local task files with --include-path)", "indexed: False"]

    (cache / "someone___other_dataset").mkdir(parents=True)  # a cache with something in it
    result = subprocess.run([sys.executable, str(eval_py), "--checkpoint", str(run), "--tasks", "lambada_openai",
                             "--max-tokens", "256"], cwd=tmp_path, env=offline_user, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr  # no model, no perplexity
    assert result.stderr.startswith("error: cannot load the data of lambada_openai: ")
    assert f"; the Hugging Face Hub at {offline_user['HF_ENDPOINT']} does not answer (" in result.stderr
    assert result.stderr.endswith("and only datasets in the local cache load (or give local task files with "
                                  "--include-path)\n")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN runs here")
def test_a_run_trained_with_cudnn_is_read_where_there_is_no_gpu(run, corpus, tmp_path, capsys):  # noqa: F811
    """A run trained on a GPU (model.attention: cudnn, bfloat16) evaluated on this machine: eval.py says
    in one line that it reads it with auto instead, and scores what the bfloat16 model computes with the
    reference attention (the windows scored one by one); --attention cudnn is refused in one line.
    sample.py, whose cached attention is always the reference, generates from it as from its xla twin."""
    def gpu_run(name, attention):
        run_dir = tmp_path / name
        shutil.copytree(run, run_dir, ignore=shutil.ignore_patterns("eval"))
        config = run_dir / "config.yaml"
        text = config.read_text()
        assert text.count("\n  dtype: float32\n") == text.count("\n  attention: auto\n") == 1
        config.write_text(text.replace("\n  dtype: float32\n", "\n  dtype: bfloat16\n")
                          .replace("\n  attention: auto\n", f"\n  attention: {attention}\n"))
        return run_dir

    run_dir = gpu_run("cudnn", "cudnn")
    argv = ["--checkpoint", str(run_dir), "--lengths", "32", "--max-tokens", "320", "--batch-tokens", "256"]
    capsys.readouterr()
    assert E.cli(argv) == 0
    assert ("model.attention=cudnn needs an NVIDIA GPU (cuDNN); this JAX runs on cpu: reading this run with "
            "attention=auto (xla) instead (--attention chooses another)\n") in capsys.readouterr().err
    row, = json.loads((run_dir / "eval" / "step40.json").read_text())["perplexity"]["rows"]
    model, _ = rundir.Run(run_dir).weights.load_model(attention="xla")
    assert model.config.dtype == "bfloat16" and row["windows"] == 10
    assert row["loss"] == pytest.approx(window_nll(model, val_stream(corpus), 32, 10) / row["tokens"], rel=1e-3)

    assert E.cli([*argv, "--attention", "cudnn"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --attention cudnn: model.attention=cudnn needs an NVIDIA GPU (cuDNN); this JAX runs on cpu: use "
        "attention=xla, dot_product or pallas"]

    texts = []
    for run_dir in (run_dir, gpu_run("xla", "xla")):
        assert sample.cli(["--checkpoint", str(run_dir), "--prompt", "alpha beta", "--max-new-tokens", "8",
                           "--temperature", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].count("alpha beta") == 1


def test_alibi_perplexity_at_twice_the_training_context(tmp_path, corpus):  # noqa: F811
    """The default `small` ALiBi model, trained at context 64 for 100 steps, is no worse at 128 than 1.1x.
    (`python train.py` on one device, compiled as users' is, with LLVM's optimisations: the suite's unoptimised
    code on its 8 simulated devices takes twice as long over 100 steps of this model.)"""
    run_dir = tmp_path / "small"
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices=1, optimised=True)}
    done = subprocess.run([sys.executable, str(pathlib.Path(train.__file__)), f"run_dir={run_dir}", f"data.dir={corpus}",
                           "model=small", "training.steps=100", "training.batch_size=8", "training.seq_len=64",
                           "training.warmup_steps=30", "training.eval_every=100", "training.eval_windows=8",
                           "checkpoint.every=100"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    model, _ = rundir.Run(run_dir).weights.load_model()
    one, two = E.perplexity_table(harness.make_scorer(model), shards.open_data(corpus), [64, 128], 64, progress=False)
    assert one["ppl"] < 0.5 * shards.open_data(corpus).index["vocab_size"]  # it learned something
    assert two["ppl"] <= 1.1 * one["ppl"], (one, two)


# ----------------------------------------------------------------------------------------------
# Weights & Biases: training and evaluation report to one run


class FakeWandb:
    """Stands in for the `wandb` module (tests stay offline): records each run's init arguments,
    logged rows and summary."""

    def __init__(self):
        self.runs = []

    def init(self, **kwargs):
        run = type("Run", (), {})()
        run.kwargs, run.rows, run.summary, run.finished = kwargs, [], {}, False
        run.log = lambda row, step=None: run.rows.append((dict(row), step))
        run.finish = lambda: setattr(run, "finished", True)
        self.runs.append(run)
        return run

    @staticmethod
    def Table(columns, data):  # noqa: N802 (wandb's names)
        return {"columns": columns, "data": data}

    @staticmethod
    def Image(image):  # noqa: N802
        return {"image_size": image.size}


def test_training_and_evaluation_log_to_one_wandb_run(tmp_path, corpus, monkeypatch):  # noqa: F811
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "run"
    assert train.main(tiny(run_dir, corpus, "wandb.mode=offline")) == 0
    [trained] = fake.runs
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    assert trained.kwargs["id"] == run_id and trained.kwargs["mode"] == "offline" and trained.finished
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert trained.rows == [(row, row["step"]) for row in metrics]
    assert trained.summary == json.loads((run_dir / "summary.json").read_text())

    assert E.cli(["--checkpoint", str(run_dir), "--lengths", "32,64", "--max-tokens", "256"]) == 0
    [_, evaluated] = fake.runs
    assert evaluated.kwargs["id"] == run_id and evaluated.kwargs["resume"] == "allow" and evaluated.finished
    saved = json.loads((run_dir / "eval" / "step8.json").read_text())["perplexity"]["rows"]
    tables = [row["eval/perplexity"] for row, _ in evaluated.rows if "eval/perplexity" in row]
    assert tables == [{"columns": ["length", "multiple", "windows", "tokens", "max_tokens", "loss", "ppl"],
                       "data": [[r["length"], r["multiple"], 256 // r["length"], 256, 256, r["loss"], r["ppl"]]
                                for r in saved]}]
    assert any("eval/perplexity_plot" in row for row, _ in evaluated.rows)
    assert evaluated.summary == {"eval/step": 8, **{f"eval/ppl@{r['length']}/max_tokens=256": r["ppl"] for r in saved}}
