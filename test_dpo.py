"""Tests of preference tuning (training.objective=dpo, data.py --format preference).

- the pairs as prepared: TRL's tokenization of the same records, token for token; truncation (prompt from the
  left, responses from the right) and the skipped pairs (empty, identical), counted;
- against TRL's DPOTrainer, on a transformers LLaMA with trained-looking weights (made here, imported through
  convert_torch.py as users do): the first step's gradient of every weight within 1e-5 of TRL's, and the loss
  and every reward metric of each of three AdamW steps within 1e-4; the first loss log 2 (policy = reference);
- the loss with label smoothing against the formula written out here;
- a precomputed reference gives the steps of the in-step one, and is read back (not recomputed) on --resume;
  a kill -9 during a run resumes to the uninterrupted run's parameters, bit for bit;
- LoRA: the reference is the base (its log-probabilities those of transformers' base model), only adapters move;
- every refusal is one line; sample.py and the transformers export read a DPO run like any other.
"""
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import convert_torch as ct
import data
import sample
import train
from core import errors
from interop import hf_layouts
from test_families import random_hf
from test_train import corpus, deterministic, restore, rows  # noqa: F401  (corpus is a fixture)
from tokendata import corpus as corpus_lib
from tokendata import loader, preference_data, shards
from training import dpo as dpo_lib
from training import dpo_reference
from training import step as step_lib

WORDS = "the a cat dog bird sat ran on under mat tree red blue small big quick slow and then".split()
BETA = 0.1
LR = 5e-3
STEPS = 3
TRAIN_PAIRS = 8  # one batch: every step sees every training pair, as TRL's single batch does
# the transformers model's chat template (its tokenizer_config.json's), which the import brings into the run
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
            "<assistant>{% endif %}")


def phrase(rng, low, high):
    return " ".join(rng.choice(WORDS) for _ in range(rng.integers(low, high + 1)))


def make_pairs(path: pathlib.Path, val_fraction: float) -> list[dict]:
    """JSON Lines of pairs, exactly TRAIN_PAIRS of them (and 3 for validation) falling in the training split by
    data.py's rule (corpus.in_val of the record's name); responses start with a space, so that the prompt and a
    response encoded apart are the tokens of both encoded together, as TRL encodes them."""
    rng = np.random.default_rng(0)
    records, train_n, val_n, number = [], 0, 0, 0
    while train_n < TRAIN_PAIRS or val_n < 3:
        number += 1
        rec = {"prompt": phrase(rng, 2, 6), "chosen": " " + phrase(rng, 1, 6), "rejected": " " + phrase(rng, 1, 6)}
        held = corpus_lib.in_val(f"{path.name}:{number}", val_fraction)
        if rec["chosen"] == rec["rejected"] or (held and val_n >= 3) or (not held and train_n >= TRAIN_PAIRS):
            rec = {"prompt": "skipped", "chosen": "", "rejected": " x"}  # an empty response: skipped, counted
        else:
            val_n, train_n = val_n + held, train_n + (not held)
            rec["train"] = not held
        records.append(rec)
    records += [{"prompt": "the", "chosen": "", "rejected": " cat"},  # skipped: an empty response,
                {"prompt": "a", "chosen": " dog", "rejected": " dog"}]  # and the same response twice
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "train"}) + "\n" for r in records))
    return records


@pytest.fixture(scope="module")
def setup(corpus, tmp_path_factory):  # noqa: F811
    """(root, base run, transformers model, the records, preference data dir)."""
    root = tmp_path_factory.mktemp("dpo")
    hf = random_hf("llama", root / "hf", seed=1, negative_logits=True)
    shutil.copyfile(corpus / "tokenizer.json", root / "hf" / "tokenizer.json")
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    ct.import_hf(root / "hf", root / "base")
    records = make_pairs(root / "pairs.jsonl", 0.25)
    assert data.main(["--format", "preference", "--input", str(root / "pairs.jsonl"), "--out", str(root / "prefs"),
                      "--tokenizer", str(root / "base"), "--seq-len", "32", "--val-fraction", "0.25"]) == 0
    return root, root / "base", hf, records, root / "prefs"


def dpo_args(run_dir, prefs, base, *extra):
    return [f"run_dir={run_dir}", f"data.dir={prefs}", f"training.init_from={base}", "training.objective=dpo",
            "training.optimizer=adamw", f"training.steps={STEPS}", f"training.batch_size={TRAIN_PAIRS}",
            "training.seq_len=32", "training.warmup_steps=0", "training.schedule=constant", f"training.lr={LR}",
            "training.weight_decay=0", "training.b2=0.999", "training.grad_clip=null", "training.log_every=1",
            "training.eval_every=100", "training.eval_windows=8", "checkpoint.every=100", "data.batching=padding",
            f"training.dpo.beta={BETA}", *extra]


def hf_tokenizer(base):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(base / "tokenizer.json"),
                                               eos_token=shards.EOT_TOKEN, pad_token=shards.EOT_TOKEN)
    return tok


def trl_trainer(setup, tmp_path, steps=STEPS):
    import datasets
    import trl
    root, base, _, records, _ = setup
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", torch_dtype=torch.float32)
    rows_ = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in records if r.get("train")]
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=TRAIN_PAIRS,
                         max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                         weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1e9,
                         beta=BETA, max_length=None, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                         save_strategy="no", bf16=False, fp16=False, dataloader_drop_last=False)
    return trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows_),
                          processing_class=hf_tokenizer(base))


def our_pairs(prefs, split="train", seq_len=32) -> list[tuple[list[int], list[int]]]:
    """The split's (chosen, rejected) sequences as prepared, token ids."""
    pairs = loader.Pairs(shards.open_data(prefs), split, seq_len)
    ex = pairs.examples
    seqs = [ex.stream.read_spans([(int(ex.starts[e]), int(ex.lengths[e]))])[0].tolist() for e in range(len(ex))]
    return [(seqs[2 * j], seqs[2 * j + 1]) for j in range(len(pairs))]


def test_pairs_are_trls_tokens_and_the_counts_are_said(setup, tmp_path, capsys):
    root, base, _, records, prefs = setup
    index = json.loads((prefs / "index.json").read_text())
    assert index["kind"] == "preference" and index["splits"]["train"]["pairs"] == TRAIN_PAIRS
    assert index["empty"] == sum(r["chosen"] == "" for r in records) > 0 and index["identical"] == 1
    trainer = trl_trainer(setup, tmp_path, steps=1)
    ds = trainer.train_dataset
    theirs = sorted((p + c, p + r) for p, c, r in zip(ds["prompt_ids"], ds["chosen_ids"], ds["rejected_ids"]))
    assert sorted(our_pairs(prefs)) == theirs  # TRL appends the end-of-text token as we do
    # truncation: the prompt from the left (to half the room), the responses from the right, each closed by END
    counts = {"empty": 0, "identical": 0, "truncated_prompts": 0, "truncated_responses": 0}
    (c, cm), (r, rm) = preference_data.fit_pair(list(range(10, 30)), list(range(40, 52)), [7], 0, 16, counts)
    assert c == list(range(22, 30)) + list(range(40, 48)) and r == list(range(22, 30)) + [7, 0]
    assert cm == [0] * 8 + [1] * 7 + [2] and rm == [0] * 8 + [1, 2] and counts["truncated_prompts"] == 1
    assert preference_data.fit_pair([1, 2], [5, 6], [5, 6], 0, 8, counts) is None and counts["identical"] == 1
    # the same response twice after truncation: skipped too
    assert preference_data.fit_pair(list(range(8)), [5] * 9 + [1], [5] * 9 + [2], 0, 8, counts) is None


def test_the_first_gradient_equals_trls(setup, tmp_path):
    root, base, hf, _, prefs = setup
    trainer = trl_trainer(setup, tmp_path, steps=1)
    model = trainer.model
    model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    grads = {}
    for dtype in (torch.float32, torch.float64):  # TRL in float32, as it trains, and in float64: the truth
        model.to(dtype).zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        grads[dtype] = {k: p.grad.detach().double().numpy() for k, p in model.named_parameters()}
        assert float(loss) == pytest.approx(np.log(2), abs=1e-6)  # the policy is the reference
    theirs, truth = grads[torch.float32], grads[torch.float64]

    cfg, params, _ = ct.read_run(base)
    mcfg = cfg.model
    token_logps = step_lib.make_token_logps(mcfg)
    objective = dpo_lib.make_objective(token_logps, cfg.training.dpo_settings, lambda p, _: p, lambda _, ref: ref)
    rows_ = loader.open_loader(shards.open_data(prefs), "train", 32, TRAIN_PAIRS, batching="padding").get_batch(0)
    rows_.pop("pairs")
    params = jax.tree.map(jnp.asarray, params)

    def mean_loss(p):
        total, sums = objective(p, rows_, None, params)
        return total / sums["n"], sums

    (ours, sums), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    assert float(sums["n"]) == TRAIN_PAIRS and float(ours) == np.float32(np.log(2))  # log 2 for every pair
    fmt = hf_layouts.hf_format(mcfg)
    mapped = hf_layouts.to_torch_tensors(jax.tree.map(np.asarray, grads), mcfg, fmt)
    relative = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    keys = sorted(truth)
    assert set(keys) <= set(mapped)  # every weight transformers trains has its gradient here
    whole = lambda g: np.concatenate([np.ravel(g[k]) for k in keys])  # noqa: E731
    assert relative(whole(mapped), whole(truth)) <= 1e-5  # the whole gradient, as the update sees it
    # each weight's: float32 sums of two near-equal gradients (chosen's minus rejected's, at step 0) leave up to
    # 5e-5 in TRL's own float32 gradient of a few weights; here within 2e-5, or 3x TRL's own error
    for key in keys:
        assert relative(mapped[key], truth[key]) <= max(2e-5, 3 * relative(theirs[key], truth[key])), key
    compared = len(keys)
    assert compared == len(theirs)


def test_three_steps_equal_trls(setup, tmp_path):
    root, base, _, _, prefs = setup
    trainer = trl_trainer(setup, tmp_path)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "rewards/chosen" in h]
    assert train.main(dpo_args(tmp_path / "run", prefs, base)) == 0
    ours = rows(tmp_path / "run")
    assert len(theirs) == len(ours) == STEPS
    assert ours[0]["loss"] == np.float32(np.log(2)) and ours[0]["rewards/margins"] == 0.0
    for mine, them in zip(ours, theirs):
        for key in ("loss", *dpo_lib.METRICS):
            assert mine[key] == pytest.approx(them[key], rel=1e-4, abs=1e-4), (mine["step"], key)
    assert ours[-1]["rewards/margins"] > 0.01  # it learned something to compare


def test_label_smoothing_is_the_conservative_loss():
    rng = np.random.default_rng(0)
    policy, ref = rng.normal(-20, 3, (3, 2, 4)).astype(np.float32), rng.normal(-20, 3, (3, 2, 4)).astype(np.float32)
    counts = np.ones((3, 2, 4), np.float32)
    counts[2, :, 3] = 0  # an empty slot
    beta, eps = 0.3, 0.2
    total, sums = dpo_lib.pair_sums(jnp.asarray(policy), jnp.asarray(ref), jnp.asarray(counts), beta, eps)
    d = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])
    log_sig = lambda x: -np.logaddexp(0, -x)  # noqa: E731
    want = -(1 - eps) * log_sig(beta * d) - eps * log_sig(-beta * d)
    valid = counts[:, 0] > 0
    assert float(total) == pytest.approx(float(want[valid].sum()), rel=1e-6) and float(sums["n"]) == 11
    margin = beta * d
    assert float(sums["rewards/margins"]) == pytest.approx(float(margin[valid].sum()), rel=1e-5)
    assert float(sums["rewards/accuracies"]) == float((margin[valid] > 0).sum())


@pytest.fixture(scope="module")
def precomputed(setup, tmp_path_factory):
    root, base, _, _, prefs = setup
    run = tmp_path_factory.mktemp("pre") / "run"
    args = dpo_args(run, prefs, base, "training.dpo.precompute_reference=true", "training.steps=6",
                    "checkpoint.every=3", "data.batching=packing")
    assert train.main(args) == 0
    return run, args


def test_a_precomputed_reference_trains_as_the_in_step_one(setup, precomputed, tmp_path):
    root, base, _, _, prefs = setup
    run, args = precomputed
    table = np.load(run / dpo_reference.REFERENCE_FILE)
    assert table["train"].shape == (TRAIN_PAIRS, 2) and (table["train"] < 0).all()
    assert (run / "loss.png").stat().st_size > 0
    in_step = [a for a in args if "precompute" not in a and not a.startswith("run_dir=")]
    assert train.main([f"run_dir={tmp_path / 'b'}", *in_step]) == 0
    for a, b in zip(rows(run), rows(tmp_path / "b")):
        for key in ("loss", *dpo_lib.METRICS):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=2e-6), key
    assert rows(run)[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)


def test_a_kill_during_a_precomputed_run_resumes_bit_exact(setup, precomputed, tmp_path):
    root, base, _, _, prefs = setup
    run, args = precomputed
    killed = tmp_path / "killed"
    argv = [a if not a.startswith("run_dir=") else f"run_dir={killed}" for a in args]
    proc = subprocess.Popen([sys.executable, "train.py", *argv, "checkpoint.async_save=false"],
                            cwd=pathlib.Path(__file__).parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240  # the table is written before the first step: kill at a moment of the steps
    while not (killed / dpo_reference.REFERENCE_FILE).is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(float(np.random.default_rng().uniform(0, 1.5)))
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL and not (killed / "checkpoints" / "6").exists()
    before = (killed / dpo_reference.REFERENCE_FILE).read_bytes()
    assert train.main(["--resume", f"run_dir={killed}", "checkpoint.async_save=false"]) == 0
    assert (killed / dpo_reference.REFERENCE_FILE).read_bytes() == before  # read back, not recomputed
    a, b = restore(run, 6), restore(killed, 6)
    assert jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))
    assert [deterministic(r) for r in rows(killed)] == [deterministic(r) for r in rows(run)]


def test_lora_dpo_keeps_the_base_as_reference(setup, tmp_path):
    root, base, hf, _, prefs = setup
    run = tmp_path / "lora"
    assert train.main(dpo_args(run, prefs, base, "training.lora.rank=4", "training.lora.targets=[q,v,mlp]",
                               "training.dpo.precompute_reference=true", "training.steps=2")) == 0
    table = np.load(run / dpo_reference.REFERENCE_FILE)["train"]
    # the reference is transformers' base model: its summed response log-probabilities of each pair
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", torch_dtype=torch.float32).eval()
    masks = loader.Pairs(shards.open_data(prefs), "train", 32).examples
    for j, (c, r) in enumerate(our_pairs(prefs)):
        for side, seq in enumerate((c, r)):
            e = 2 * j + side
            mask = masks.masks.read_spans([(int(masks.starts[e]), int(masks.lengths[e]))])[0]
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0].double()
            lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()
            want = float(lp[mask[1:] > 0].sum())
            assert table[j, side] == pytest.approx(want, abs=1e-4 * max(1.0, abs(want))), (j, side)
    state = restore(run, 2)
    leaves = jax.tree_util.tree_flatten_with_path(state["params"])[0]
    assert leaves and all(str(path[-1].key) in ("lora_a", "lora_b") for path, _ in leaves)
    # its adapters in PEFT's layout, on transformers' base, give the merged run's log-probabilities
    import peft
    assert ct.main(["--checkpoint", str(run), "--format", "peft", "--out", str(tmp_path / "adapter")]) == 0
    tuned = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    cfg, merged, _ = ct.read_run(run)
    toks = np.asarray([[5, 9, 33, 2, 17, 40, 8]], np.int32)
    ours = step_lib.make_token_logps(cfg.model)(jax.tree.map(jnp.asarray, merged), jnp.asarray(toks))
    with torch.no_grad():
        theirs = torch.log_softmax(tuned(torch.tensor(toks[:, :-1], dtype=torch.long)).logits.double(), -1)
    want = theirs[0].gather(1, torch.tensor(toks[0, 1:], dtype=torch.long)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(np.asarray(ours)[0], want, atol=1e-4)
    _, base_params, _ = ct.read_run(base)
    before = step_lib.make_token_logps(cfg.model)(jax.tree.map(jnp.asarray, base_params), jnp.asarray(toks))
    assert float(np.abs(np.asarray(before) - np.asarray(ours)).max()) > 1e-3  # the adapters moved it


def test_sample_eval_and_export_read_a_dpo_run(setup, precomputed, corpus, tmp_path, capsys):  # noqa: F811
    import eval as eval_lib
    root, base, _, _, prefs = setup
    run, _ = precomputed
    assert ct.main(["--checkpoint", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    cfg, params, _ = ct.read_run(run)
    toks = np.asarray([[5, 9, 33, 2, 17, 40]], np.int32)
    logps = step_lib.make_token_logps(cfg.model)(jax.tree.map(jnp.asarray, params), jnp.asarray(toks))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor(toks[:, :-1], dtype=torch.long)).logits.double(), -1)
    want = ref[0].gather(1, torch.tensor(toks[0, 1:], dtype=torch.long)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(np.asarray(logps)[0], want, atol=1e-4)
    # sample.py's greedy response (a DPO run prints the response alone, as a prompt/completion run does) is the
    # exported model's, through transformers' own generation
    tok = hf_tokenizer(base)
    prompt = tok("the cat sat", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    eot = tok.convert_tokens_to_ids(shards.EOT_TOKEN)
    out = out[:out.index(eot)] if eot in out else out
    assert sample.main(["--checkpoint", str(run), "--prompt", "the cat sat", "--max-new-tokens", "6",
                        "--temperature", "0"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("-" * 10) and printed[1] == tok.decode(out)
    # eval.py: perplexity on running text of the run's tokenizer; its own data (pairs) is not running text
    assert errors.run_cli(eval_lib.main, ["--checkpoint", str(run)]) == 2
    assert "holds preference data, not running text" in capsys.readouterr().err
    assert eval_lib.main(["--checkpoint", str(run), "--data", str(corpus), "--max-tokens", "512"]) == 0
    assert "perplexity" in capsys.readouterr().out


def without(args, *keys) -> list[str]:
    return [a for a in args if a.partition("=")[0] not in keys]


def one_line(capsys, fn, argv) -> str:
    assert errors.run_cli(fn, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_refusals_are_one_line(setup, corpus, tmp_path, capsys):  # noqa: F811
    root, base, _, _, prefs = setup
    src = root / "pairs.jsonl"
    line = one_line(capsys, data.main, ["--format", "preference", "--input", str(src), "--out", str(tmp_path / "x"),
                                        "--seq-len", "32"])
    assert "--tokenizer" in line
    (tmp_path / "same.jsonl").write_text(json.dumps({"prompt": "a", "chosen": " b", "rejected": " b"}) + "\n")
    line = one_line(capsys, data.main, ["--format", "preference", "--input", str(tmp_path / "same.jsonl"), "--out",
                                        str(tmp_path / "y"), "--tokenizer", str(base), "--seq-len", "32",
                                        "--val-fraction", "0"])
    assert "same response twice" in line and not (tmp_path / "y").exists()
    (tmp_path / "other.jsonl").write_text(json.dumps({"q": "a", "good": " b", "bad": " c"}) + "\n")
    line = one_line(capsys, data.main, ["--format", "preference", "--input", str(tmp_path / "other.jsonl"), "--out",
                                        str(tmp_path / "z"), "--tokenizer", str(base), "--seq-len", "32",
                                        "--val-fraction", "0"])
    assert "--prompt-field" in line and "has: q, good, bad" in line
    run = tmp_path / "r"
    assert "needs training.init_from" in one_line(capsys, train.main,
                                                  without(dpo_args(run, prefs, base), "training.init_from"))
    assert "label_smoothing must be in [0, 0.5)" in one_line(
        capsys, train.main, dpo_args(run, prefs, base, "training.dpo.label_smoothing=0.5"))
    assert "python data.py --format preference" in one_line(
        capsys, train.main, [a if not a.startswith("data.dir") else f"data.dir={corpus}" for a in dpo_args(run, prefs, base)])
    assert "training.objective=dpo" in one_line(
        capsys, train.main, without(dpo_args(run, prefs, base), "training.objective", "training.dpo.beta"))
    assert "training.objective is lm" in one_line(capsys, train.main,
                                                  without(dpo_args(run, prefs, base), "training.objective"))
    assert not run.exists()


def test_a_damaged_reference_table_is_one_line(setup, precomputed, tmp_path, capsys):
    root, base, _, _, prefs = setup
    run, _ = precomputed
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / dpo_reference.REFERENCE_FILE).write_bytes(b"not a table")
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    line = one_line(capsys, train.main, ["--resume", f"run_dir={copy}", "training.steps=7"])
    assert dpo_reference.REFERENCE_FILE in line and "remove it" in line
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_zero_3_and_tensor_parallelism_train_as_one_mesh_axis(setup, tmp_path):
    root, base, _, _, prefs = setup
    args = dpo_args(tmp_path / "a", prefs, base, "training.steps=2")
    assert train.main(args) == 0
    assert train.main(without(args, "run_dir") + [f"run_dir={tmp_path / 'b'}", "sharding.data=2", "sharding.fsdp=2",
                                                  "sharding.tensor=2", "sharding.zero_stage=3",
                                                  "training.micro_batches=2"]) == 0
    # the first step's gradient norm within float32 sums' reach; after AdamW's first update (about lr x the
    # gradient's sign for every weight) the next step's loss within 1e-3
    (a1, a2), (b1, b2) = rows(tmp_path / "a"), rows(tmp_path / "b")
    for key in ("loss", "grad_norm", *dpo_lib.METRICS):
        assert a1[key] == pytest.approx(b1[key], rel=1e-5, abs=1e-6), key
    assert a2["loss"] == pytest.approx(b2["loss"], rel=1e-3) and a2["loss"] < a1["loss"]


def test_the_plan_counts_the_reference_and_both_sides(capsys):
    def plan(*extra):
        assert train.main(["--plan", "model=124m", "training.init_from=runs/x", "training.batch_size=8", *extra]) == 0
        out = capsys.readouterr().out
        gib = {line[:43].strip(): float(line[43:].split()[0]) for line in out.splitlines()
               if line.startswith("  ") and "GiB" in line[43:55]}
        return out, gib

    lm, lm_terms = plan()
    dpo, dpo_terms = plan("training.objective=dpo")
    pre, pre_terms = plan("training.objective=dpo", "training.dpo.precompute_reference=true")
    assert dpo_terms["DPO reference model"] == dpo_terms["parameters"] and "DPO reference model" not in pre_terms
    assert "16 sequence(s) per device" in dpo and "8 sequence(s) per device" in lm
    assert dpo_terms["logits and loss"] == pytest.approx(2 * lm_terms["logits and loss"], rel=1e-3)
    assert dpo_terms["total"] == pytest.approx(pre_terms["total"] + dpo_terms["parameters"], abs=0.011)


def test_conversations_render_with_the_plain_or_the_runs_template(setup, tmp_path):
    from core import chat
    root, base, _, _, _ = setup
    talk = [("the cat", "sat on a mat", "ran"), ("a dog", "ran under the tree", "sat"), ("red", "blue", "green bird")]
    (tmp_path / "talk.jsonl").write_text("".join(json.dumps({
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": q}],
        "chosen": [{"role": "assistant", "content": c}], "rejected": [{"role": "assistant", "content": r}]}) + "\n"
        for q, c, r in talk))
    tok = shards.load_tokenizer_file(base / "tokenizer.json")
    eot = shards.eot_id_of(tok)
    enc = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    shutil.copytree(base, tmp_path / "plain", ignore=shutil.ignore_patterns(chat.CHAT_TEMPLATE))
    for source, head, reply in (
            (tmp_path / "plain", lambda q: chat.plain_template([{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": q}]), lambda a: " " + a),
            (base, lambda q: f"<system>be brief\n<user>{q}\n<assistant>", lambda a: a + "\n")):
        out = tmp_path / f"talk-{source.name}"
        preference_data.prepare([str(tmp_path / "talk.jsonl")], out, seq_len=64, tokenizer=str(source),
                                val_fraction=0, progress=False)
        want = sorted((enc(head(q)) + enc(reply(c)) + [eot], enc(head(q)) + enc(reply(r)) + [eot]) for q, c, r in talk)
        assert sorted(our_pairs(out, seq_len=64)) == want, source.name


def test_a_resume_with_the_reference_in_the_step_is_exact(setup, tmp_path):
    root, base, _, _, prefs = setup
    args = dpo_args(tmp_path / "a", prefs, base, "training.steps=4", "checkpoint.every=2", "data.batching=packing")
    assert train.main(args) == 0
    resumed = without(args, "run_dir", "training.steps") + [f"run_dir={tmp_path / 'b'}", "training.steps=2"]
    assert train.main(resumed) == 0
    assert train.main(["--resume", f"run_dir={tmp_path / 'b'}", "training.steps=4"]) == 0  # init_from read again
    a, b = restore(tmp_path / "a", 4), restore(tmp_path / "b", 4)
    assert jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))
    trained = lambda run: [{k: v for k, v in deterministic(r).items() if not k.startswith("val_")}  # noqa: E731
                           for r in rows(run)]  # (the shorter run evaluated at its own last step, 2)
    assert trained(tmp_path / "a") == trained(tmp_path / "b")


def test_two_processes_train_as_one(setup, precomputed, tmp_path):
    """2 processes x 4 CPU devices with a precomputed reference (each computes its rows' share, process 0
    writes the table): the steps of 1 process x 8 devices."""
    from test_multihost import finish, two_processes
    run, args = precomputed
    multi = tmp_path / "multi"
    outs = finish(two_processes(without(args, "run_dir") + [f"run_dir={multi}"], devices=4))
    assert "2 process(es)" in outs[0][0]
    np.testing.assert_array_equal(np.load(multi / dpo_reference.REFERENCE_FILE)["train"],
                                  np.load(run / dpo_reference.REFERENCE_FILE)["train"])
    for a, b in zip(rows(run), rows(multi)):
        for key in ("loss", *dpo_lib.METRICS):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_an_imported_chat_template_goes_on_to_the_tuned_run(setup, precomputed):
    from core import chat
    root, base, _, _, _ = setup
    run, _ = precomputed
    assert (base / chat.CHAT_TEMPLATE).read_text() == TEMPLATE  # from tokenizer_config.json, as transformers has it
    assert (run / chat.CHAT_TEMPLATE).read_text() == TEMPLATE  # serve.py renders the tuned run's chats with it
