"""Tests of prompt/completion fine-tuning (finetune_data.py, the masked model path, train.py,
sample.py) and of forgetful causal masking (attention.attention_mask, train.py's step)."""
import itertools
import json
import shlex
import os
import pathlib
import random
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer

import data
import model as model_lib
import sample
import train
from conftest import xla_flags
from inference import decoding
from layers import attention as attention_lib
from layers import loss as loss_lib
from store import rundir
from test_train import corpus, rows, tiny  # noqa: F401  (corpus is a fixture)
from tokendata import finetune_data, loader, shards
from training import config

REPO = pathlib.Path(__file__).resolve().parent
WORDS = "red blue green cat dog sun moon tree".split()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reversal_pairs():
    """Every 3-word list over WORDS and its reverse, shuffled: (train, held-out)."""
    lists = list(itertools.product(WORDS, repeat=3))
    random.Random(0).shuffle(lists)
    pairs = [{"in_text": " " + " ".join(xs) + " =", "out_text": " " + " ".join(reversed(xs))} for xs in lists]
    return pairs[40:], pairs[:40]


@pytest.fixture(scope="module")
def reversal(tmp_path_factory):
    root = tmp_path_factory.mktemp("reversal")
    train_pairs, held = reversal_pairs()
    finetune_data.prepare([str(write_jsonl(root / "train.jsonl", train_pairs))], root / "data", seq_len=32,
                          vocab_size=300, val_fraction=0.1, progress=False)
    return root, held


# ----------------------------------------------------------------------------------------------
# Preparation: the mask covers exactly the completion and the end-of-text token


def test_mask_covers_completion_and_end_of_text(tmp_path):
    rng = random.Random(1)
    records = [{"q": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) + ":",
                "a": " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))} for _ in range(60)]
    records.append({"q": " ".join(WORDS * 3), "a": " sun"})  # too long: its prompt loses tokens on the left
    records.append({"q": "x", "a": " " + " ".join(WORDS * 3)})  # the completion alone does not fit: skipped
    lines = [json.dumps(r) for r in records] + ["not json", json.dumps({"q": "no answer"})]
    src = tmp_path / "pairs.jsonl"
    src.write_text("\n".join(lines) + "\n")
    seq_len = 15
    index = finetune_data.prepare([str(src)], tmp_path / "d", seq_len=seq_len, vocab_size=300, val_fraction=0.0,
                                  in_field="q", out_field="a", progress=False)
    assert [(s["input"], s["reason"]) for s in index["skipped_inputs"]] == [  # the invalid records, by line
        (f"{src}:{len(records) + 1}", "not a JSON object with string fields 'q' and 'a'"),
        (f"{src}:{len(records) + 2}", "not a JSON object with string fields 'q' and 'a' (has: q)")]

    # the expectation, from the tokenizer alone
    tok = Tokenizer.from_file(str(tmp_path / "d" / "tokenizer.json"))
    eot = tok.token_to_id(shards.EOT_TOKEN)
    want_tokens, want_mask, want_targets, truncated, skipped = [], [], [], 0, 0
    for r in records:
        p, c = tok.encode(r["q"], add_special_tokens=False).ids, tok.encode(r["a"], add_special_tokens=False).ids
        if len(c) + 1 > seq_len + 1:
            skipped += 1
            continue
        if len(p) + len(c) + 1 > seq_len + 1:
            p, truncated = p[len(p) + len(c) + 1 - (seq_len + 1):], truncated + 1
        want_tokens += p + c + [eot]
        want_mask += [0] * len(p) + [1] * len(c) + [2]
        want_targets.append(c + [eot])
    assert (truncated, skipped) == (1, 1) and index["skipped_records"] == 2
    assert (index["truncated"], index["skipped"], index["examples"]) == (1, 1, len(records) - 1)

    split = index["splits"]["train"]
    tokens = np.concatenate([np.fromfile(tmp_path / "d" / s["file"], "<u2") for s in split["shards"]])
    mask = np.concatenate([np.fromfile(tmp_path / "d" / s["file"], np.uint8) for s in split["mask_shards"]])
    assert tokens.tolist() == want_tokens
    assert mask.tolist() == want_mask
    # the baseline of the loss: the unigram entropy of the completion and end-of-text tokens alone
    in_loss = np.asarray(want_tokens)[np.asarray(want_mask) > 0]
    p = np.unique(in_loss, return_counts=True)[1] / len(in_loss)
    assert index["loss_unigram_entropy"] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-9)

    # the loader's weights pick exactly each example's completion and end-of-text, as targets
    for batching in ("packing", "padding"):
        got = []
        for batch in loader.eval_examples(shards.open_data(tmp_path / "d"), "train", seq_len, 4, batching=batching):
            for toks, w, seg in zip(batch["tokens"], batch["weights"], batch["segments"]):
                targets, tseg = toks[1:], seg
                for s in range(1, seg.max() + 1):
                    got.append(targets[(w > 0) & (tseg == s)].tolist())
        assert got == want_targets, batching
    rows_padding = sum(len(b["tokens"]) for b in loader.eval_examples(shards.open_data(tmp_path / "d"), "train", seq_len, 4,
                                                                              batching="padding"))
    rows_packing = sum(len(b["tokens"]) for b in loader.eval_examples(shards.open_data(tmp_path / "d"), "train", seq_len, 4))
    greedy, used = 1, 0  # rows when whole examples fill rows of seq_len + 1 tokens in order
    for n in np.diff(np.flatnonzero(np.asarray(want_mask) == 2), prepend=-1).tolist():
        greedy, used = (greedy + 1, n) if used + n > seq_len + 1 else (greedy, used + n)
    assert rows_padding == len(want_targets) and rows_packing == greedy < rows_padding


def test_an_invalid_utf8_byte_costs_only_its_own_pair(tmp_path, capsys):
    pairs = [{"in_text": f"caf\u00e9 {i} =", "out_text": f" {i}"} for i in range(1, 51)]
    lines = [json.dumps(p, ensure_ascii=False).encode() for p in pairs]
    lines[9] = lines[9].replace(b"caf\xc3\xa9", b"caf\xe9")  # pair 10: a Latin-1 byte, not UTF-8
    src = tmp_path / "pairs.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    assert data.cli(["--format", "prompt_completion", "--input", str(src), "--out", str(tmp_path / "d"),
                     "--seq-len", "32", "--vocab-size", "300", "--val-fraction", "0"]) == 0
    assert f"1 invalid records skipped ({src}:10; listed in" in capsys.readouterr().out
    index = shards.open_data(tmp_path / "d").index
    at = lines[9].index(b"\xe9") + 1  # only ASCII before it: its byte offset is its character position
    assert index["skipped_inputs"] == [{"input": f"{src}:10", "reason": f"not UTF-8: byte 0xe9 at character {at}"}]
    # the other 49 pairs, each as the tokenizer encodes it: prompt, completion, end-of-text
    tok = Tokenizer.from_file(str(tmp_path / "d" / "tokenizer.json"))
    want = [t for p in pairs[:9] + pairs[10:] for t in tok.encode(p["in_text"], add_special_tokens=False).ids
            + tok.encode(p["out_text"], add_special_tokens=False).ids + [tok.token_to_id(shards.EOT_TOKEN)]]
    from test_data import split_stream
    assert index["examples"] == 49 and split_stream(tmp_path / "d", "train").tolist() == want


def test_a_few_pairs_always_get_a_validation_example(tmp_path):
    import hashlib
    pairs = [{"in_text": f" {w} =", "out_text": f" {w}{w}"} for w in WORDS[:3]]
    src = write_jsonl(tmp_path / "p.jsonl", pairs)
    ranks = sorted((int.from_bytes(hashlib.blake2b(f"p.jsonl:{n}".encode(), digest_size=8).digest(), "little"), n)
                   for n in (1, 2, 3))  # records are named FILE:LINE
    index = finetune_data.prepare([str(src)], tmp_path / "d", seq_len=32, vocab_size=300, progress=False,
                                  val_fraction=ranks[0][0] / 2**64 / 2)  # below every record's hash
    assert index["val_extra"] == f"p.jsonl:{ranks[0][1]}"
    assert (index["splits"]["train"]["examples"], index["splits"]["val"]["examples"]) == (2, 1)
    tok = Tokenizer.from_file(str(tmp_path / "d" / "tokenizer.json"))
    held = pairs[ranks[0][1] - 1]
    (val,) = loader.eval_examples(shards.open_data(tmp_path / "d"), "val", 32, 1)
    assert tok.decode(val["tokens"][0].tolist()).startswith(held["in_text"] + held["out_text"])
    with pytest.raises(data.DataError, match="one document.*--val-fraction"):
        finetune_data.prepare([str(write_jsonl(tmp_path / "one.jsonl", pairs[:1]))], tmp_path / "e", seq_len=16,
                              vocab_size=300, progress=False)
    assert not (tmp_path / "e").exists()


def test_pairs_that_could_not_train_are_refused_in_one_line(tmp_path):
    """Pairs are refused at preparation, in one line naming the option that changes it and leaving
    nothing: records with other field names (those found named, with --in-field and --out-field), a
    validation split whose every record is too long for --seq-len (training would find no example in it),
    and completions that are all empty (nothing for the loss to learn)."""
    def refused(name, records, *extra):
        src = write_jsonl(tmp_path / f"{name}.jsonl", records)
        res = subprocess.run([sys.executable, "data.py", "--format", "prompt_completion", "--input", str(src),
                              "--out", str(tmp_path / name), "--vocab-size", "300", *extra], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert not (tmp_path / name).exists() and not list(tmp_path.glob(f"{name}.tmp-*"))
        return lines[0]

    line = refused("fields", [{"question": f"q{i}", "answer": f" a{i}"} for i in range(5)], "--seq-len", "16")
    assert "(has: question, answer)" in line and "--in-field" in line and "--out-field" in line

    # the one record that fits --seq-len 10 is none of those held out for validation (a 64-bit hash of
    # FILE:LINE below 5% of 2^64, or else the lowest one), so the validation split has no example
    import hashlib
    rank = {n: int.from_bytes(hashlib.blake2b(f"long.jsonl:{n}".encode(), digest_size=8).digest(), "little")
            for n in range(1, 7)}
    held = {n for n, r in rank.items() if r < 0.05 * 2**64} or {min(rank, key=rank.get)}
    fits = min(set(rank) - held)
    records = [{"in_text": f"q{n}", "out_text": " a" * (3 if n == fits else 40)} for n in range(1, 7)]
    line = refused("long", records, "--seq-len", "10")
    assert "no validation example" in line and "--seq-len 10" in line and "--val-fraction" in line

    line = refused("empty", [{"in_text": f"q{i}", "out_text": ""} for i in range(5)], "--seq-len", "16")
    assert "every completion" in line and "is empty (field 'out_text')" in line and "--out-field" in line


def test_a_split_without_examples_is_named_when_read(tmp_path):
    """Pairs prepared with --val-fraction 0 hold no validation example: reading that split is one DataError
    naming it (the example bounds of an empty split used to hold one start, and training failed on
    `zero-size array to reduction operation maximum`)."""
    src = write_jsonl(tmp_path / "p.jsonl", [{"in_text": f"q{i}", "out_text": f" a{i}"} for i in range(12)])
    finetune_data.prepare([str(src)], tmp_path / "pairs", seq_len=16, vocab_size=300, val_fraction=0.0,
                          progress=False)
    opened = shards.open_data(tmp_path / "pairs")
    assert len(loader.Examples(opened, "val")) == 0
    with pytest.raises(data.DataError, match=r"pairs: split 'val' has no examples; prepare with a larger --val-fraction$"):
        loader.validation_sample(opened, 16, 2, 4)


def test_pairs_without_a_tokenizer_say_the_trained_one_fits_no_existing_run(reversal, tmp_path, capsys):
    """Fine-tuning pairs need the base model's tokenizer: without --tokenizer one is trained, and a line on
    stdout says what that data can train and how to prepare it for an existing run; with it, no such line."""
    root, _ = reversal
    pairs = [{"in_text": f" {w} =", "out_text": f" {w}{w}"} for w in WORDS]
    src = write_jsonl(tmp_path / "p.jsonl", pairs)
    argv = ["--format", "prompt_completion", "--input", str(src), "--seq-len", "16", "--val-fraction", "0.3"]
    assert data.cli([*argv, "--out", str(tmp_path / "new"), "--vocab-size", "300"]) == 0
    vocab = shards.open_data(tmp_path / "new").vocab_size
    note = [line for line in capsys.readouterr().out.splitlines() if "--tokenizer" in line]
    assert note == [f"note: no --tokenizer, so a new BPE tokenizer (vocab {vocab}) was trained on these pairs: this "
                    f"data trains a model from scratch, or fine-tunes only a model trained with this tokenizer; to "
                    f"fine-tune an existing run, prepare it with --tokenizer RUN_DIR"]
    assert data.cli([*argv, "--out", str(tmp_path / "given"), "--tokenizer", str(root / "data")]) == 0
    assert "--tokenizer" not in capsys.readouterr().out


def test_loader_is_a_function_of_the_step(reversal):
    root, _ = reversal
    a = loader.PromptCompletionLoader(shards.open_data(root / "data"), "train", 32, 8, seed=3)
    b = loader.PromptCompletionLoader(shards.open_data(root / "data"), "train", 32, 8, seed=3)
    later = a.get_batch(57)  # several epochs in, computed first
    for step in (0, 1, 57):
        for k, v in a.get_batch(step).items():
            np.testing.assert_array_equal(v, b.get_batch(step)[k])
    np.testing.assert_array_equal(later["tokens"], b.get_batch(57)["tokens"])
    # an epoch shows every example exactly once (one a row with padding; these examples are distinct)
    padded = loader.PromptCompletionLoader(shards.open_data(root / "data"), "train", 32, 1, seed=3, batching="padding")
    ex = padded.examples
    assert set(ex.lengths.tolist()) == {8}  # three words, " =", three words, end-of-text
    every = sorted(tuple(ex.stream.shards[0][s:s + 8].tolist()) for s in ex.starts)
    epoch = sorted(tuple(padded.get_batch(s)["tokens"][0, :8].tolist()) for s in range(len(ex)))
    assert epoch == every and len(set(every)) == len(every)


def test_data_cli_errors(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"in_text": "a", "out_text": "b"}])
    res = subprocess.run([sys.executable, "data.py", "--format", "prompt_completion", "--input", str(src),
                          "--out", str(tmp_path / "d")], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: --format prompt_completion needs --input, --out and --seq-len"]
    res = subprocess.run([sys.executable, "data.py", "--format", "prompt_completion", "--input", str(src),
                          "--out", str(tmp_path / "d"), "--seq-len", "8", "--tokenizer", str(tmp_path / "none")],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "tokenizer" in res.stderr
    assert not (tmp_path / "d").exists()


def test_a_file_given_as_the_data_says_the_command_that_prepares_it(tmp_path, capsys, monkeypatch):
    """data.dir (or eval.py --data) a file, not a prepared directory: one line with the data.py command that
    prepares it, --format prompt_completion for pairs (records without a `text` field); the command given
    for documents prepares them."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"in_text": "a b", "out_text": " c"}])
    text = write_jsonl(tmp_path / "notes.jsonl", [{"text": " ".join(random.Random(i).choices(WORDS, k=60))}
                                                  for i in range(20)])  # documents
    monkeypatch.chdir(tmp_path)
    assert train.cli([f"run_dir={tmp_path / 'run'}", f"data.dir={pairs}"]) == 2
    assert capsys.readouterr().err == (
        f"error: {pairs} is a file, not a prepared data directory: data.py prepares it into one (`python data.py "
        f"--format prompt_completion --input {pairs} --out data/pairs --tokenizer RUN_DIR --seq-len T`: RUN_DIR the "
        f"run it fine-tunes, whose tokenizer the pairs need, T the context it trains at); then give that directory "
        f"(data/pairs) instead\n")
    assert train.cli([f"run_dir={tmp_path / 'run'}", f"data.dir={text}"]) == 2
    command = f"python data.py --input {text} --out data/notes"
    assert capsys.readouterr().err == (f"error: {text} is a file, not a prepared data directory: data.py prepares it "
                                       f"into one (`{command}`); then give that directory (data/notes) instead\n")
    assert not (tmp_path / "run").exists()
    assert data.cli([*command.split()[2:], "--vocab-size", "300"]) == 0
    assert shards.open_data(tmp_path / "data" / "notes").index["splits"]["train"]["tokens"] > 0


def test_damaged_prompt_completion_data_is_named(reversal, tmp_path):
    """A token id outside the vocabulary, a loss-mask byte that is no mask value, a truncated mask shard:
    each a DataError naming the file, from the loader, the validation batches, opening, and --verify."""
    from test_data import overwrite_token, shard_path
    root, _ = reversal
    out = tmp_path / "d"
    shutil.copytree(root / "data", out)
    vocab = json.loads((out / "index.json").read_text())["vocab_size"]
    tokens = shard_path(out, "train", 0)
    overwrite_token(tokens, 3, 65535)
    message = rf"{tokens.name}: token 3 \(at byte 6\) is id 65535, outside the vocabulary of {vocab}"
    train_loader = loader.PromptCompletionLoader(shards.open_data(out), "train", 32, 8, seed=0)
    with pytest.raises(data.DataError, match=message):
        for step in range(len(train_loader.examples)):  # more than an epoch's rows
            train_loader.get_batch(step)
    with pytest.raises(data.DataError, match=message):
        list(loader.eval_examples(shards.open_data(out), "train", 32, 8))

    mask = shard_path(out, "val", 0, "mask_shards")
    mask_bytes = mask.read_bytes()
    mask.write_bytes(mask_bytes[:4] + b"\x09" + mask_bytes[5:])
    with pytest.raises(data.DataError, match=rf"{mask.name}: byte 4 is 9, not a loss-mask value"):
        list(loader.eval_examples(shards.open_data(out), "val", 32, 8))
    assert [line.split(":")[0] for line in shards.verify(out)[0]] == [str(tokens), str(mask)]
    mask.write_bytes(mask_bytes[:-1])
    with pytest.raises(data.DataError, match=rf"{mask.name}: expected {len(mask_bytes)} bytes "
                                             rf"\({len(mask_bytes)} loss-mask bytes\), found {len(mask_bytes) - 1}"):
        shards.open_data(out).index  # what train.py opens first: every shard's size, loss masks included


def test_train_refuses_examples_longer_than_the_context(reversal, tmp_path, capsys):
    """Examples prepared for a longer context than the run trains at (8 tokens: 3 words, '=', 3 words and
    end-of-text, prepared with --seq-len 32) are never cut by the loader: the start is refused, naming the
    context they were prepared for and both fixes, and the longer context it names trains."""
    root, _ = reversal
    assert train.cli(tiny(tmp_path / "run", root / "data", "training.seq_len=6")) == 2
    assert capsys.readouterr().err == (
        f"error: {root / 'data'}: an example of 8 tokens does not fit training.seq_len 6 (by default the model's "
        f"context; the data was prepared with --seq-len 32): prepare it again with --seq-len 6 (prompts then lose "
        f"tokens from the left, and examples whose completion does not fit are skipped), or train with "
        f"training.seq_len=7 where the model takes that context\n")
    assert not (tmp_path / "run").exists()
    assert train.cli(tiny(tmp_path / "run", root / "data", "training.seq_len=7", "training.steps=1")) == 0


# ----------------------------------------------------------------------------------------------
# Packing: examples in one row never see each other


@pytest.mark.parametrize("alibi", [True, False])
def test_packed_examples_do_not_attend_to_each_other(alibi):
    cfg = model_lib.GPTConfig(vocab_size=64, block_size=32, embedding_dim=32, num_head=4, N=2, alibi_attn=alibi)
    model = model_lib.GPT(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    examples = [rng.integers(1, 64, n) for n in (7, 11, 9)]
    tokens = np.concatenate(examples + [np.zeros(5, int)])[None]  # (1, 32): three examples and padding
    segments = np.repeat([1, 2, 3, 0], [7, 11, 9, 5])[None]

    def packed(tokens):
        seg = jnp.asarray(segments)
        mask = attention_lib.attention_mask(1, 32, segment_ids=seg)
        return np.asarray(model(jnp.asarray(tokens), mask=mask, segment_ids=seg))[0]

    logits = packed(tokens)
    for k, ex in enumerate(examples):
        alone = np.asarray(model(jnp.asarray(ex[None])))[0]  # the example by itself at positions 0..
        np.testing.assert_allclose(logits[segments[0] == k + 1], alone, atol=2e-5)
    changed = tokens.copy()
    changed[0, 7:18] = rng.integers(1, 64, 11)  # a different second example
    after = packed(changed)
    for k in (1, 3):
        np.testing.assert_array_equal(after[segments[0] == k], logits[segments[0] == k])
    assert not np.allclose(after[segments[0] == 2], logits[segments[0] == 2])


def test_default_path_unchanged_without_mask():
    cfg = model_lib.GPTConfig(vocab_size=64, block_size=32, embedding_dim=32, num_head=4, N=2)
    model = model_lib.GPT(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 16)))
    one = jnp.full((2, 16), 7, jnp.int32)  # every key in the query's segment: the masked path, the same attention
    everything = attention_lib.Masking(one, one)
    np.testing.assert_allclose(model(tokens, mask=everything), model(tokens), atol=1e-5)
    assert attention_lib.attention_mask(2, 16) is None


# ----------------------------------------------------------------------------------------------
# Fine-tuning end to end: a tiny model learns to reverse word lists it never saw


def test_finetuned_model_reverses_held_out_lists(reversal, tmp_path, capsys):
    root, held = reversal
    run_dir = tmp_path / "run"
    # learned positions: a 2-layer model finds "the k-th word from the end" by position easily; the
    # packed rows check that positions restart at every example
    model_args = ("model.embedding_dim=64", "model.alibi_attn=false")
    # 400 steps: `python train.py` on one device, compiled as users' is, with LLVM's optimisations (the
    # suite's unoptimised code on its 8 simulated devices takes twice as long)
    done = subprocess.run([sys.executable, str(REPO / "train.py"), *tiny(
        run_dir, root / "data", *model_args, "training.seq_len=32", "training.batch_size=16", "training.steps=400",
        "training.lr=1e-2", "training.warmup_steps=20", "training.weight_decay=0", "training.log_every=10",
        "training.eval_every=200", "checkpoint.every=400")], env={**os.environ, "XLA_FLAGS": xla_flags(1, True)},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = rows(run_dir)
    assert metrics[-1]["val_loss"] < 0.05 < metrics[0]["loss"]  # completion tokens only: nearly certain
    model, _ = rundir.Run(run_dir).weights.load_model()
    tok = rundir.Run(run_dir).record.tokenizer()
    eot = tok.token_to_id(shards.EOT_TOKEN)
    prompts = np.asarray([tok.encode(p["in_text"], add_special_tokens=False).ids for p in held])  # (40, 4)
    out = decoding.generate(model, prompts, 6, temperature=0, eot_id=eot)  # greedy, one batch
    right = sum(tok.decode(decoding.truncate(row, eot)) == p["out_text"] for row, p in zip(out, held))
    assert right >= 0.8 * len(held), f"{right}/{len(held)} held-out lists reversed"

    # the summary compares the validation loss with the unigram entropy of the tokens it counts, the
    # completions of the train split (from the shard and mask files here), not of every token
    summary = json.loads((run_dir / "summary.json").read_text())
    index = json.loads((root / "data" / "index.json").read_text())
    split = index["splits"]["train"]
    tokens = np.concatenate([np.fromfile(root / "data" / s["file"], "<u2") for s in split["shards"]])
    mask = np.concatenate([np.fromfile(root / "data" / s["file"], np.uint8) for s in split["mask_shards"]])
    p = np.unique(tokens[mask > 0], return_counts=True)[1] / np.count_nonzero(mask)
    entropy = -(p * np.log(p)).sum()
    assert summary["unigram_entropy"] == pytest.approx(entropy, rel=1e-9)
    assert summary["val_loss_below_unigram"] == pytest.approx(entropy - summary["val_loss"], rel=1e-9)
    assert f"unigram entropy of the completions (the tokens in the loss) {entropy:.4f} nats/token" in done.stdout
    # its next steps name what works for it: eval.py's perplexity refuses prompt/completion data
    suggested = next(line for line in done.stdout.splitlines() if "python eval.py" in line)
    command = shlex.split(suggested.split("#")[0].split("next:")[-1])
    assert command[:2] == ["python", "eval.py"] and "--no-perplexity" in command, suggested
    import eval as eval_lib
    eval_lib.parse_args(command[2:])  # the command line eval.py takes
    assert eval_lib.cli(["--checkpoint", str(run_dir)]) == 2  # what it suggested before: refused
    capsys.readouterr()

    # sample.py prints the completion alone for a fine-tuned run
    assert sample.cli(["--checkpoint", str(run_dir), "--prompt", held[0]["in_text"], "--temperature", "0",
                       "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("---------- sample 1/1") and printed[1] == held[0]["out_text"]

    # a further run starting from this one (training.init_from) begins where it ended
    again = tmp_path / "again"
    assert train.main(tiny(again, root / "data", *model_args, "training.seq_len=32", "training.steps=1",
                           f"training.init_from={run_dir}")) == 0
    assert rows(again)[0]["loss"] < 0.05
    # and resumes from its own checkpoint once that run moved away: init_from is read no more
    run_dir.rename(tmp_path / "moved")
    assert train.main(["--resume", f"run_dir={again}", "training.steps=2"]) == 0
    assert [r["step"] for r in rows(again) if "loss" in r][-1] == 2


def test_finetune_with_fcm_resumes_exactly(reversal, tmp_path):
    """Packed prompt/completion batches, FCM and two micro-batches: a run stopped after its step-4
    checkpoint and resumed repeats steps 5..8 of the straight run (the batch and the FCM mask are
    functions of the step)."""
    root, _ = reversal
    args = ("training.fcm_max_ratio=0.5", "training.micro_batches=2", "training.batch_size=16")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert train.main(tiny(straight, root / "data", *args)) == 0
    shutil.copytree(straight, crashed)
    shutil.rmtree(crashed / "checkpoints" / "8")  # the crash came before the step-8 checkpoint
    assert train.main(["--resume", f"run_dir={crashed}"]) == 0
    timeless = lambda r: {k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "time_s")}  # noqa: E731
    assert [timeless(r) for r in rows(crashed)] == [timeless(r) for r in rows(straight)]


# ----------------------------------------------------------------------------------------------
# Forgetful causal masking


def test_fcm_mask_fraction_and_first_token():
    B, T, max_ratio = 4000, 24, 0.4
    masking = attention_lib.attention_mask(B, T, fcm_key=jax.random.key(0), fcm_max_ratio=max_ratio)
    assert masking.q_segments.shape == masking.kv_segments.shape == (B, T)  # O(T): two id vectors a row
    mask = np.asarray(masking.dense())  # (B, T, T): query i sees key j (causality aside)
    i, j = np.tril_indices(T, -1)
    assert mask[:, :, 0].all()  # the first token is always visible
    # a hidden token is hidden from every query, its own included (the paper's per-key masking)
    assert (np.diagonal(mask, axis1=1, axis2=2) == mask[:, -1, :]).all()
    assert not np.diagonal(mask, axis1=1, axis2=2).all()
    # the same keys are hidden from every query: a key's visibility does not depend on the query after it
    for b in range(5):
        past = np.where(np.tril(np.ones((T, T), bool), -1), mask[b], True)
        hidden = ~past
        assert (hidden.any(axis=0) == hidden[-1]).all()
    # per sequence, the hidden share of its past keys (positions 1..) is r ~ U(0, max): mean max/2
    past = (j > 0)
    hidden = ~mask[:, i[past], j[past]]  # (B, pairs)
    per_seq = hidden.mean(axis=1)
    assert abs(per_seq.mean() - max_ratio / 2) < 0.01
    # and r is spread uniformly on [0, max]: the share of hidden keys 1..T-2 seen by the last query, with
    # each key hidden with probability r, has variance Var(r) + E[r (1 - r)] / n = m^2/12 + (m/2 - m^2/3) / n
    n, m = T - 2, max_ratio
    last = (~mask[:, -1, 1:T - 1]).mean(axis=1)  # (B,)
    want = m**2 / 12 + (m / 2 - m**2 / 3) / n
    assert abs(last.var() - want) < 0.15 * want
    # with segments: each segment's first token stays visible, and segments stay apart
    seg = jnp.asarray(np.repeat([[1, 2, 3]], 64, 0).repeat(8, 1))  # (64, 24)
    m = np.asarray(attention_lib.attention_mask(64, T, segment_ids=seg, fcm_key=jax.random.key(1),
                                                fcm_max_ratio=0.9).dense())
    assert m[:, 8:16, 8].all() and m[:, 16:, 16].all() and not m[:, 8:, :8].any()
    assert attention_lib.attention_mask(2, T, fcm_key=jax.random.key(0), fcm_max_ratio=0.0) is None


def test_fcm_training_learns_and_evaluation_is_unaffected(corpus, tmp_path):  # noqa: F811
    fcm = tmp_path / "fcm"
    common = ("training.steps=60", "training.eval_every=60", "checkpoint.every=60", "training.log_every=1")
    assert train.main(tiny(fcm, corpus, *common, "training.fcm_max_ratio=0.5")) == 0
    got = rows(fcm)
    # the model learns under the mask
    assert np.mean([r["loss"] for r in got[-5:]]) < got[0]["loss"] - 1.0
    # the mask is in the training step: from the trained weights, a step with it starts from a higher loss
    # than one without. A fresh model's loss barely depends on its attention (a first step from scratch with
    # and without the mask agree to ~1e-5, and can round alike), nor does a model of this corpus (word
    # salad: ~2e-3 here), but that is 100x more than what two compilations of one step differ by (~1e-6)
    first = {}
    for name, ratio in [("plain", 0.0), ("masked", 0.5)]:
        assert train.main(tiny(tmp_path / name, corpus, *common, "training.steps=1", f"training.init_from={fcm}",
                               f"training.fcm_max_ratio={ratio}")) == 0
        first[name] = rows(tmp_path / name)[0]["loss"]
    assert first["masked"] > first["plain"] + 1e-4, first
    # the validation loss is the plain model's: recomputed here without any mask
    cfg = rundir.Run(fcm).record.config()
    params, _ = rundir.Run(fcm).weights.load_params()
    model = nnx.eval_shape(lambda: model_lib.GPT(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    model = nnx.merge(graphdef, state)
    losses, counts = [], []
    for tokens in loader.eval_windows(shards.open_data(corpus), "val", cfg.seq_len, 8, max_windows=cfg.training.eval_windows):
        logits = model(jnp.asarray(tokens[:, :-1]))
        loss, n = loss_lib.cross_entropy(logits, jnp.asarray(tokens[:, 1:]))
        losses.append(float(loss) * float(n))
        counts.append(float(n))
    assert abs(sum(losses) / sum(counts) - got[-1]["val_loss"]) < 1e-4


LORA_BASE = ["model=test", "training.init_from=base"]  # model test: d 32, 4 heads of 8, MLP 128
CONFIG_MISTAKES = {  # id: (config file text or None for the default, overrides, the error's text)
    "fcm ratio": (None, ["training.fcm_max_ratio=1.5"], "training.fcm_max_ratio must be in"),
    "batching": (None, ["data.batching=stack"], "data.batching must be one of packing, padding"),
    # a rank at or above the narrower side of an adapted weight: min over the targets of min(in, out), less one
    "lora rank 100000": (None, [*LORA_BASE, "training.lora.rank=100000"],
                         "training.lora.rank 100000 is at or above min(in, out) = 32 of the adapted q weight "
                         "(32 x 32): the largest useful rank is 31"),
    "lora rank 32": (None, [*LORA_BASE, "training.lora.rank=32"], "min(in, out) = 32 of the adapted q weight"),
    "lora rank, grouped k": (None, [*LORA_BASE, "model.num_kv_head=1", "training.lora.targets=[q,k]",
                                    "training.lora.rank=8"],  # k: d x (1 head of 8)
                             "min(in, out) = 8 of the adapted k weight (32 x 8): the largest useful rank is 7"),
    "lora rank, narrow mlp": (None, [*LORA_BASE, "model.mlp_dim=16", "training.lora.targets=[o,mlp]",
                                     "training.lora.rank=20"],
                              "min(in, out) = 16 of the adapted mlp weight (32 x 16): the largest useful rank is 15"),
    # a section given as something else is refused, not replaced by an override's one key
    "section a number": ("training: 5\n", ["training.steps=3"], "training must be a mapping of steps, batch_size"),
    "nested section a number": ("training:\n  lora: 5\n", [*LORA_BASE, "training.lora.rank=4"],
                                "training.lora must be a mapping of rank, alpha, dropout, targets, base_dtype, got 5"),
}


@pytest.mark.parametrize("case", list(CONFIG_MISTAKES))
def test_config_checks(case, tmp_path):
    text, overrides, message = CONFIG_MISTAKES[case]
    path = config.DEFAULT_CONFIG
    if text is not None:
        path = tmp_path / "config.yaml"
        path.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load_config(path, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_largest_useful_lora_rank_is_taken():
    """The rank each refusal above names is accepted (the largest below min(in, out) of every target)."""
    for overrides, rank in [([], 31), (["model.num_kv_head=1", "training.lora.targets=[q,k]"], 7),
                            (["model.mlp_dim=16", "training.lora.targets=[o,mlp]"], 15)]:
        cfg = config.load_config(overrides=[*LORA_BASE, *overrides, f"training.lora.rank={rank}"])
        assert cfg.training.lora.rank == rank


def test_padding_on_text_data_is_said_and_changes_nothing(corpus, capsys):  # noqa: F811
    """data.batching=padding on text data (windows of one stream: no examples to pad) is one line from the
    loader of process 0, and the batches are those of the default."""
    padded = loader.open_loader(shards.open_data(corpus), "train", 16, 4, seed=1, batching="padding")
    out = capsys.readouterr().out
    assert out == (f"note: data.batching=padding applies to prompt/completion data only; {corpus} is text, read "
                   "as windows of one token stream (no examples to pad)\n")
    packed = loader.open_loader(shards.open_data(corpus), "train", 16, 4, seed=1)
    assert all((padded.get_batch(s) == packed.get_batch(s)).all() for s in range(3))
    loader.open_loader(shards.open_data(corpus), "train", 16, 4, seed=1, batching="padding", process_index=1, process_count=2)
    assert capsys.readouterr().out == ""  # said once, by the first process
