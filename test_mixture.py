"""Pretraining on a mixture of corpora (data.mixture, data.stages): the blocks' exact counts, the batch at
a step against a computation from scratch, resumes across a change of weights (a real SIGKILL among
them), each source's validation loss against the model's logits, and every refusal."""
import json
import math
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
import eval as E
import train
from store import rundir
from test_train import WORDS, deterministic, restore, rows
from tokendata import finetune_data, loader, mixture, shards
from tokendata.permutation import permute
from training import config

REPO = pathlib.Path(__file__).resolve().parent
OTHER = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def write_docs(directory: pathlib.Path, words, docs: int, seed: int) -> pathlib.Path:
    directory.mkdir(parents=True)
    for i in range(docs):
        rng = random.Random(seed + i)
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 12))) + "." for _ in range(30)]
        (directory / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return directory


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two text directories with one tokenizer (trained on the first): "web" (word salad) and "code"
    (Greek letters); and "tiny", prepared with that tokenizer from a single short document."""
    root = tmp_path_factory.mktemp("mixture")
    data.prepare([str(write_docs(root / "src-web", WORDS, 30, 0))], root / "web", vocab_size=300,
                 val_fraction=0.3, progress=False)
    data.prepare([str(write_docs(root / "src-code", OTHER, 30, 100))], root / "code",
                 tokenizer=str(root / "web" / "tokenizer.json"), val_fraction=0.3, progress=False)
    (root / "src-tiny").mkdir()
    (root / "src-tiny" / "a.txt").write_text("the cat.\n")
    (root / "src-tiny" / "b.txt").write_text("a dog.\n")
    data.prepare([str(root / "src-tiny")], root / "tiny", tokenizer=str(root / "web" / "tokenizer.json"),
                 val_fraction=0.5, progress=False)
    return root


def mixed(run_dir, root, *extra, steps: int = 8):
    """A few-second mixture run of the `test` model: web 0.8 and code 0.2, then code alone from step 5."""
    return [f"run_dir={run_dir}", "model=test", f"training.steps={steps}", "training.batch_size=8",
            "training.seq_len=32", "training.warmup_steps=2", "training.lr=1e-2", "training.min_lr=1e-3",
            "training.log_every=1", "training.eval_every=4", "training.eval_windows=8", "checkpoint.every=2",
            "checkpoint.keep=10", f"data.mixture.web.dir={root / 'web'}", "data.mixture.web.weight=0.8",
            f"data.mixture.code.dir={root / 'code'}", "data.mixture.code.weight=0.2", *extra]


STAGED = "data.stages=[{step: 5, weights: {web: 0, code: 1}}]"


@pytest.fixture(scope="module")
def straight(sources, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "straight"
    assert train.main(mixed(run_dir, sources, STAGED)) == 0
    return run_dir


# ----------------------------------------------------------------------------------------------
# The blocks and the batch, from scratch


def largest_remainder(weights, k):
    """The rounding written out: floor(k w / W) each, then +1 for the largest fractional parts (ties: the
    earlier source)."""
    quotas = [k * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    for i in sorted(range(len(weights)), key=lambda i: (counts[i] - quotas[i], i))[:k - sum(counts)]:
        counts[i] += 1
    return counts


def test_every_block_holds_the_rounded_counts_exactly():
    assert largest_remainder([0.8, 0.2], 64) == [51, 13]  # 51.2, 12.8: the larger remainder gets the extra one
    assert largest_remainder([1, 1, 1], 64) == [22, 21, 21]  # a tie goes to the earlier source
    for weights in ([0.8, 0.2], [1, 1, 1], [0.05, 3, 0, 0.7], [1e-3, 1.0]):
        batch_size, block = 24, 64
        schedule = mixture.Schedule([(0, weights), (11, weights[::-1])], batch_size, seed=7, block=block)
        src, _ = schedule.locate(np.arange(40 * batch_size))
        first = src[:11 * batch_size]  # stage one: 264 samples, 4 whole blocks
        for b in range(4):
            assert np.bincount(first[b * block:(b + 1) * block], minlength=len(weights)).tolist() == \
                largest_remainder(weights, block)
        later = src[11 * batch_size:]  # stage two starts at a block of its own
        for b in range(len(later) // block):
            assert np.bincount(later[b * block:(b + 1) * block], minlength=len(weights)).tolist() == \
                largest_remainder(weights[::-1], block)
        assert mixture.apportion(weights, block) == largest_remainder(weights, block)


def reference(stages, batch_size, block, seed, n):
    """(source, its sequence index) of global samples 0..n-1, counted from scratch one sample at a time: a
    block's slots q hold each source's count of slots in turn, sample p of the block takes the source of
    slot permute(p), and each source hands out its next sequence; a stage starts a new block."""
    starts = [step * batch_size for step, _ in stages] + [None]
    taken = [0] * len(stages[0][1])
    out = []
    for t, (step, weights) in enumerate(stages):
        owner = [s for s, c in enumerate(largest_remainder(weights, block)) for _ in range(c)]  # slot q -> source
        key = mixture.source_seed(seed, f"blocks from step {step}")
        g = starts[t]
        while len(out) < n and (starts[t + 1] is None or g < starts[t + 1]):
            b, p = divmod(g - starts[t], block)
            s = owner[int(permute(np.asarray([p]), block, key, b)[0])]
            out.append((s, taken[s]))
            taken[s] += 1
            g += 1
    return out[:n]


def test_the_batch_at_a_step_is_a_computation_from_scratch(sources):
    """Each row of the mixture's batch at step s is the sequence from-scratch bookkeeping says, read from
    its source's shard bytes: window permute(i % n, n, seed_s, i // n) of that source's own order."""
    stages = [(0, [0.8, 0.2]), (3, [0.0, 1.0]), (7, [0.5, 0.5])]
    seq, batch_size, block, seed = 16, 10, 16, 5
    opened = {name: shards.open_data(sources / name) for name in ("web", "code")}
    mix = mixture.Mixture({n: loader.TextLoader(d, "train", seq, batch_size, seed=mixture.source_seed(seed, n))
                           for n, d in opened.items()}, stages, batch_size, seed=seed, block=block)
    streams = {n: np.concatenate([np.fromfile(sources / n / s["file"], np.uint16)
                                  for s in d.index["splits"]["train"]["shards"]]) for n, d in opened.items()}
    expected = reference(stages, batch_size, block, seed, 12 * batch_size)
    for step in range(12):
        got = mix.get_batch(step)
        for row, (s, i) in zip(got, expected[step * batch_size:(step + 1) * batch_size]):
            name = ("web", "code")[s]
            n = (len(streams[name]) - 1) // seq
            w = int(permute(np.asarray([i % n]), n, mixture.source_seed(seed, name), i // n)[0])
            np.testing.assert_array_equal(row, streams[name][w * seq:w * seq + seq + 1])
    taken = np.bincount([s for s, _ in expected], minlength=2)
    assert list(mix.taken(12).values()) == taken.tolist()  # the tokens and epochs the log shows
    # no sequence of a source skipped or taken twice across the changes of weights (blocks cut short)
    src, index = mix.schedule.locate(np.arange(7 * batch_size))
    for s in (0, 1):
        assert sorted(index[src == s].tolist()) == list(range(int((src == s).sum())))
    # what comes before a change of weights does not depend on it: the run without the later stages
    alone = mixture.Schedule(stages[:1], batch_size, seed=seed, block=block).locate(np.arange(3 * batch_size))
    np.testing.assert_array_equal(np.stack(alone), np.stack(mix.schedule.locate(np.arange(3 * batch_size))))


def test_two_processes_read_disjoint_rows_whose_union_is_the_global_batch(sources):
    opened = {name: shards.open_data(sources / name) for name in ("web", "code")}

    def mix(p, count):
        loaders = {n: loader.TextLoader(d, "train", 16, 8, seed=mixture.source_seed(1, n)) for n, d in opened.items()}
        return mixture.Mixture(loaders, [(0, [0.3, 0.7])], 8, seed=1, process_index=p, process_count=count)

    whole, halves = mix(0, 1), [mix(0, 2), mix(1, 2)]
    for step in (0, 5, 31):
        parts = [h.get_batch(step) for h in halves]
        assert all(len(part) == 4 for part in parts)
        np.testing.assert_array_equal(np.concatenate(parts), whole.get_batch(step))


def test_prompt_completion_sources_mix_as_their_rows(tmp_path):
    """A fine-tuning mixture: each row is its source's packed row, as its own loader gives it."""
    tok = None
    dirs = {}
    for name, words in (("qa", WORDS), ("chat", OTHER)):
        rng = random.Random(name)
        pairs = [{"in_text": " ".join(rng.choices(words, k=4)), "out_text": " " + " ".join(rng.choices(words, k=3))}
                 for _ in range(40)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
        finetune_data.prepare([str(path)], tmp_path / name, seq_len=32, vocab_size=300, tokenizer=tok,
                              val_fraction=0.2, progress=False)
        tok = tok or str(tmp_path / "qa" / "tokenizer.json")
        dirs[name] = shards.open_data(tmp_path / name)
    loaders = {n: loader.open_loader(d, "train", 32, 6, seed=mixture.source_seed(2, n)) for n, d in dirs.items()}
    mix = mixture.Mixture(loaders, [(0, [0.5, 0.5])], 6, seed=2)
    batch = mix.get_batch(3)
    src, index = mix.schedule.locate(np.arange(18, 24))
    for r, (s, i) in enumerate(zip(src, index)):
        one = loaders[mix.names[s]].rows_at(np.asarray([i]))
        for k in ("tokens", "weights", "segments"):
            np.testing.assert_array_equal(batch[k][r], one[k][0])


# ----------------------------------------------------------------------------------------------
# Training on a mixture


def test_a_mixture_run_logs_each_sources_numbers(straight, sources, capsys):
    """metrics.jsonl, the summary and the recorded shares name each source; each source's validation loss
    is the loss of its own validation windows computed here from the model's logits."""
    logged = rows(straight)
    last = logged[-1]
    assert {"val_loss/web", "val_loss/code", "val_ppl/web", "val_ppl/code", "val_loss_mean", "tokens/web",
            "tokens/code", "epochs/web", "epochs/code"} <= set(last)
    # tokens per source: the schedule's counts, 8 sequences of 32 tokens a step
    reference_counts = np.bincount([s for s, _ in reference([(0, [0.8, 0.2]), (5, [0, 1])], 8, mixture.BLOCK,
                                                            config.load_config().seed, 8 * 8)], minlength=2)
    assert (last["tokens/web"], last["tokens/code"]) == tuple(int(c) * 32 for c in reference_counts)
    assert last["tokens/web"] + last["tokens/code"] == last["tokens"]
    # the validation loss of each source, from the logits of the step-8 model on its own sample
    model, step = rundir.Run(straight).weights.load_model()
    assert step == 8
    total, count = 0.0, 0
    for name in ("web", "code"):
        d = shards.open_data(sources / name)
        stream = np.concatenate([np.fromfile(sources / name / s["file"], np.uint16)
                                 for s in d.index["splits"]["val"]["shards"]])
        n = (len(stream) - 1) // 32
        picked = (np.arange(8) * n) // 8 if n > 8 else np.arange(n)  # training.eval_windows=8, spread evenly
        windows = np.stack([stream[w * 32:w * 32 + 33] for w in picked]).astype(np.int32)
        logits = np.asarray(model(jnp.asarray(windows[:, :-1])), np.float64)[..., :d.vocab_size]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        nll = -np.take_along_axis(logp, windows[:, 1:, None].astype(np.int64), -1)
        np.testing.assert_allclose(last[f"val_loss/{name}"], nll.mean(), rtol=2e-5)
        total, count = total + nll.sum(), count + nll.size
    np.testing.assert_allclose(last["val_loss"], total / count, rtol=2e-5)  # token-weighted
    np.testing.assert_allclose(last["val_loss_mean"], (last["val_loss/web"] + last["val_loss/code"]) / 2)
    summary = json.loads((straight / "summary.json").read_text())
    assert set(summary["sources"]) == {"web", "code"}
    assert summary["sources"]["code"]["val_loss"] == last["val_loss/code"]
    recorded = json.loads((straight / "data.json").read_text())
    assert recorded["stages"] == [{"step": 0, "shares": {"web": 819 / 1024, "code": 205 / 1024}},
                                  {"step": 5, "shares": {"web": 0.0, "code": 1.0}}]
    assert list(recorded["mixture"]) == ["web", "code"]


def test_a_run_killed_and_resumed_is_exact_across_a_stage_change(straight, sources, tmp_path):
    """python train.py, SIGKILLed at a random moment after its checkpoint of step 2 or 4, then --resume:
    the logged steps and the step-8 state equal the straight run's, across the change of weights at 5."""
    run_dir = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *mixed(run_dir, sources, STAGED)],
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "2" / "commit_success.txt").exists() and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    time.sleep(random.Random(0).uniform(0.0, 0.5))
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert train.main(["--resume", f"run_dir={run_dir}"]) == 0
    assert [deterministic(r) for r in rows(run_dir)] == [deterministic(r) for r in rows(straight)]
    for x, y in zip(jax.tree.leaves(restore(straight, 8)), jax.tree.leaves(restore(run_dir, 8)), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("edit", ["a source pointed at another directory", "a fingerprint zeroed"])
def test_eval_checks_each_source_of_a_mixture_run_as_a_resume_does(straight, sources, tmp_path, capsys, edit):
    """eval.py on a mixture run whose data.json was edited: one source's dir pointed at another prepared
    directory, or its content_sha256 zeroed. It scored the other directory under the source's name (status 0);
    now one line naming the source, as --resume refuses it, and nothing written."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir, ignore=shutil.ignore_patterns("eval"))
    recorded = json.loads((run_dir / "data.json").read_text())
    if edit.startswith("a source pointed"):
        recorded["mixture"]["code"]["dir"] = str(sources / "tiny")
    else:
        recorded["mixture"]["code"]["content_sha256"] = "0" * 64
    (run_dir / "data.json").write_text(json.dumps(recorded))
    assert E.cli(["--checkpoint", str(run_dir), "--lengths", "32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.mixture.code.dir ") and "is not the data this run trained on as 'code'" in err
    assert err.count("\n") == 1 and not (run_dir / "eval").exists(), err


def test_a_resume_that_changes_the_weights_from_its_step_on_is_the_run_that_had_them_from_the_start(
        straight, sources, tmp_path, capsys):
    """A run without stages, stopped after its checkpoint of step 4 and resumed with a stage from step 5
    on, equals the straight run that had that stage from the start."""
    run_dir = tmp_path / "first"
    assert train.main(mixed(run_dir, sources)) == 0
    for step in (6, 8):  # as if stopped after step 4
        shutil.rmtree(run_dir / "checkpoints" / str(step))
    (run_dir / "summary.json").unlink()
    capsys.readouterr()
    assert train.main(["--resume", f"run_dir={run_dir}", STAGED]) == 0
    said = "".join(capsys.readouterr())  # the change named from the run's own (no stages: []) to the new stages
    assert "--resume changes data.stages [] -> [{'step': 5, 'weights': {'web': 0" in said, said
    assert [deterministic(r) for r in rows(run_dir)] == [deterministic(r) for r in rows(straight)]
    for x, y in zip(jax.tree.leaves(restore(straight, 8)), jax.tree.leaves(restore(run_dir, 8)), strict=True):
        np.testing.assert_array_equal(x, y)
    # what was trained keeps its weights: changing them before the restored step is refused in one line
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "8")
    capsys.readouterr()
    assert train.cli(["--resume", f"run_dir={copy}", "data.mixture.web.weight=0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume at step 6 changes data.mixture's weights before it") and err.count("\n") == 1


def test_eval_reports_each_source_of_a_mixture_run(straight, sources, capsys):
    assert E.main(["--checkpoint", str(straight), "--lengths", "32"]) == 0
    out = capsys.readouterr().out
    assert f"perplexity of web {sources / 'web'} split 'val'" in out
    assert f"perplexity of code {sources / 'code'} split 'val'" in out
    results = json.loads((straight / "eval" / "step8.json").read_text())
    assert {r["data"] for r in results["perplexity"]["rows"]} == {str(sources / "web"), str(sources / "code")}
    assert (straight / "eval" / "step8-perplexity-web.png").is_file()


# ----------------------------------------------------------------------------------------------
# Refusals, each one line before anything is written


@pytest.mark.parametrize("extra, words", [
    (["data.mixture.web.weight=-1"], "data.mixture: a weight must be a number >= 0, got web -1.0"),
    (["data.mixture.web.weight=.nan"], "a weight must be a number >= 0, got web nan"),
    (["data.mixture.web.weight=.inf"], "a weight must be a number >= 0, got web inf"),
    (["data.mixture.web.weight=0", "data.mixture.code.weight=0"], "every weight is 0"),
    (["data.mixture.web.weight=1e308", "data.mixture.code.weight=1e308"],
     "data.mixture: the weights add up past the largest number a float holds (web 1e+308, code 1e+308); they are "
     "relative, so scale them down"),
    (["data.stages=[{step: 5, weights: {web: 1, cod: 0}}]"], "weighs 'cod', which is no source of data.mixture"),
    (["data.stages=[{step: 5, weights: {web: 1}}]"], "gives no weight to code"),
    (["data.stages=[{step: 5, weights: {web: 1, code: 0}}, {step: 3, weights: {web: 1, code: 1}}]"],
     "data.stages[1].step must be after the step before (5)"),
    (["data.stages=[{step: 8, weights: {web: 1, code: 0}}]"], "before training.steps (8), got 8"),
    (["data.stages=[{weights: {web: 1, code: 0}}]"],  # no step: it said "must be after the step before (0), got 0"
     "data.stages[0].step must be the step from which its weights apply, 1 to 7 (data.mixture's own weights are "
     "those of step 0), got 0"),
    (["data.dir=/somewhere"], "data.dir (/somewhere) and data.mixture are both given"),
    (["data.max_epochs=0.0001"], "than data.max_epochs (0.0001)"),
    (["data.mixture.tiny.dir={tiny}"], "data.mixture.tiny: {tiny} split 'train': a window of 33 tokens is longer"),
])
def test_a_mixture_that_cannot_be_trained_is_one_line(sources, tmp_path, capsys, extra, words):
    run_dir = tmp_path / "run"
    extra = [e.replace("{tiny}", str(sources / "tiny")) for e in extra]
    assert train.cli(mixed(run_dir, sources, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words.replace("{tiny}", str(sources / "tiny")) in err, err
    assert err.count("\n") == 1 and " 0.00 times" not in err  # (a share of an epoch said as 0.00 times)
    assert not run_dir.exists()


def test_sources_of_another_tokenizer_or_kind_are_refused(sources, tmp_path, capsys):
    other = tmp_path / "other"
    data.prepare([str(write_docs(tmp_path / "src", OTHER, 10, 5))], other, vocab_size=280, val_fraction=0.3,
                 progress=False)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"in_text": f"q {i}", "out_text": " a"}) + "\n" for i in range(30)))
    finetune_data.prepare([str(pairs)], tmp_path / "pc", seq_len=32, tokenizer=str(sources / "web" / "tokenizer.json"),
                          val_fraction=0.2, progress=False)
    for source, words in ((other, "was tokenized with another tokenizer than 'web'"), (tmp_path / "pc",
                          "is prompt_completion data and 'web'")):
        assert train.cli(mixed(tmp_path / "run", sources, f"data.mixture.code.dir={source}")) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
        assert not (tmp_path / "run").exists()


def test_a_resume_on_other_sources_is_refused(straight, sources, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(straight, copy)
    shutil.rmtree(copy / "checkpoints" / "8")
    for extra, words in ((["data.mixture.code.dir=" + str(sources / "web")],
                          f"data.mixture.code.dir {sources / 'web'} is not the data this run trained on as 'code'"),
                         (["data.mixture.more.dir=" + str(sources / "web")], "gives no weight to more"),
                         (["data.mixture.more.dir=" + str(sources / "web"), "data.stages=[]"],
                          "a resume cannot add, remove or reorder sources")):
        before = sorted(p.name for p in copy.rglob("*"))
        assert train.cli(["--resume", f"run_dir={copy}", *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
        assert sorted(p.name for p in copy.rglob("*")) == before


def test_a_source_in_a_bucket_is_read_where_it_is(sources, gcs_bucket, tmp_path):
    """A mixture of a local directory and one in a bucket (the GCS server): the batches are those of the
    same mixture with both local."""
    import fsspec

    fs = fsspec.filesystem("gs")
    fs.put(str(sources / "code"), f"{gcs_bucket[5:]}/code", recursive=True)
    url = f"{gcs_bucket}/code"
    assert train.main(mixed(tmp_path / "remote", sources, f"data.mixture.code.dir={url}", steps=2)) == 0
    assert train.main(mixed(tmp_path / "local", sources, steps=2)) == 0
    assert [deterministic(r) for r in rows(tmp_path / "remote")] == [deterministic(r) for r in rows(tmp_path / "local")]
    assert json.loads((tmp_path / "remote" / "data.json").read_text())["mixture"]["code"]["dir"] == url


def test_a_source_added_on_the_command_line(sources):
    cfg = config.load_config(overrides=[f"data.mixture.web.dir={sources / 'web'}", "data.mixture.web.weight=3",
                                        f"data.mixture.code.dir={sources / 'code'}"])
    assert {n: (s.dir, s.weight) for n, s in cfg.data.mixture.items()} == {
        "web": (str(sources / "web"), 3.0), "code": (str(sources / "code"), 1.0)}
    assert config.mixture_stages(cfg.data) == [(0, [3.0, 1.0])]
    assert config.to_dict(config.load_config())["data"] == {"dir": None, "batching": "packing"}  # as before

