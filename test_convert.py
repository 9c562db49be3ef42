"""Tests of convert_torch.py: PyTorch and Hugging Face exports against the JAX model, GPT-2 import,
the KV-cache generation, round trips, refusals and the command line on a real run directory.

Every model has its parameters perturbed away from the initialisation (LayerNorm scales off 1,
biases off 0, larger weights), so a layout or transposition mistake cannot hide behind near-zero
logits. Hugging Face models are built locally at random; nothing is downloaded.
"""
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

import config
import convert_torch as ct
import data
import eval as E
import model
import train
from test_train import corpus, restore, rows, tiny  # noqa: F401  (corpus is a fixture)

REPO = pathlib.Path(__file__).resolve().parent
TOL = 1e-4
SMALL = dict(vocab_size=300, block_size=16, embedding_dim=32, num_head=4, N=2, layer_norm_epsilon=1e-6)


def jax_model(seed=0, **overrides):
    """(JAX model, its params as a pure dict of numpy arrays) with every parameter perturbed."""
    cfg = model.GPTConfig(**{**SMALL, **overrides})
    m = model.GPT(cfg, rngs=nnx.Rngs(params=seed))
    state = nnx.state(m)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda a: np.asarray(a) + rng.normal(0, 0.1, a.shape).astype(np.float32),
                          nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, params)
    nnx.update(m, state)
    return m, params


def tokens(T, B=2, vocab=300, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, (B, T))


def jax_logits(params, cfg_dict, toks):
    m = model.GPT(model.GPTConfig(**cfg_dict), rngs=nnx.Rngs(params=0))
    state = nnx.state(m)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(m, state)
    return np.asarray(m(toks))


def model_fields(cfg: config.Config) -> dict:
    return {k: v for k, v in config.to_dict(cfg)["model"].items() if k != "name"}


def hf_logits(directory, toks):
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return hf(torch.tensor(toks)).logits.numpy(), hf


@pytest.mark.parametrize("overrides", [
    dict(alibi_attn=False),
    dict(alibi_attn=True, embed_norm=True),
    # no biases, erf GELU, 6 heads (not a power of two: the interleaved ALiBi slopes)
    dict(alibi_attn=True, bias=False, gelu_approximate=False, embedding_dim=48, num_head=6),
], ids=["learned", "alibi", "alibi-nobias-erf-6heads"])
def test_torch_module_matches_jax(tmp_path, overrides):
    m, params = jax_model(**overrides)
    assert ct.export(params, m.config, tmp_path / "out") == "torch"
    # the files carry the real vocabulary: 300 rows, vocab_size 300
    written = load_file(str(tmp_path / "out" / "model.safetensors"))["wte.weight"]
    np.testing.assert_array_equal(written, params["wte"][:300])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["gpt_jax"]["vocab_size"] == 300
    tm = ct.GPT.from_pretrained(tmp_path / "out")
    T = 16 if not m.config.alibi_attn else 4 * 16  # ALiBi beyond the training context
    toks = tokens(T)
    with torch.no_grad():
        got = tm(torch.tensor(toks)).numpy()
    assert got.shape == (2, T, 384)  # like model.py: padded, the padding rows at PADDED_LOGIT
    np.testing.assert_array_equal(got[..., 300:], ct.PADDED_LOGIT)
    np.testing.assert_allclose(got, np.asarray(m(toks)), atol=TOL, rtol=0)


def test_alibi_slopes_are_model_py_slopes():
    for n in (1, 3, 4, 6, 12, 16, 20):
        np.testing.assert_array_equal(ct.alibi_slopes(n).numpy(), model.alibi_slopes(n))


@pytest.mark.parametrize("overrides,layout", [
    (dict(alibi_attn=False), "gpt2"),
    (dict(alibi_attn=False, gelu_approximate=False, bias=False), "gpt2"),
    (dict(alibi_attn=True, embed_norm=True), "bloom"),
    (dict(alibi_attn=True, embed_norm=True, bias=False, num_head=2), "bloom"),
], ids=["gpt2", "gpt2-erf-nobias", "bloom", "bloom-nobias-2heads"])
def test_hf_export_matches_jax(tmp_path, overrides, layout):
    m, params = jax_model(**overrides)
    assert ct.export(params, m.config, tmp_path / "hf", fmt="hf") == layout
    toks = tokens(16)
    got, hf = hf_logits(tmp_path / "hf", toks)
    assert type(hf).__name__ == {"gpt2": "GPT2LMHeadModel", "bloom": "BloomForCausalLM"}[layout]
    assert hf.get_output_embeddings().weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()  # tied
    assert hf.config.vocab_size == 300 and got.shape == (2, 16, 300)  # the real vocabulary only
    np.testing.assert_allclose(got, np.asarray(m(toks))[..., :300], atol=TOL, rtol=0)  # every real logit


def random_gpt2(directory, seed=0, **kw):
    """A transformers GPT2LMHeadModel with random (perturbed) weights, saved as safetensors."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4, layer_norm_epsilon=1e-5) | kw
    cfg = transformers.GPT2Config(**kw)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(directory)
    return hf


def test_import_gpt2_gives_the_same_logits(tmp_path):
    hf = random_gpt2(tmp_path / "gpt2")
    assert ct.cli(["--import-hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "run")]) == 0
    cfg, params, step = ct.read_run(tmp_path / "run")
    assert step == 0 and cfg.model.alibi_attn is False and cfg.model.vocab_size == 300
    assert params["wte"].shape == (384, 32)  # padded to model.py's multiple of 128 with zero rows
    np.testing.assert_array_equal(params["wte"][300:], 0)
    toks = tokens(32)
    with torch.no_grad():
        expected = hf(torch.tensor(toks)).logits.numpy()
    got = jax_logits(params, model_fields(cfg), toks)
    np.testing.assert_allclose(got[..., :300], expected, atol=TOL, rtol=0)


def test_import_refuses_what_model_py_cannot_express(tmp_path, capsys):
    random_gpt2(tmp_path / "relu", activation_function="relu")
    capsys.readouterr()  # transformers' progress bars
    assert ct.cli(["--import-hf", str(tmp_path / "relu"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "activation_function 'relu'" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides", [dict(alibi_attn=False), dict(alibi_attn=True)], ids=["learned", "alibi"])
def test_generate_with_cache_equals_full_recomputation(tmp_path, overrides):
    m, params = jax_model(**overrides)
    ct.export(params, m.config, tmp_path / "out")
    tm = ct.GPT.from_pretrained(tmp_path / "out")
    prompt = torch.tensor(tokens(4))
    new = 12 if not m.config.alibi_attn else 40  # ALiBi: past the training context of 16
    got = tm.generate(prompt, new)
    expected = prompt
    with torch.no_grad():
        for _ in range(new):  # greedy, recomputing the whole sequence every step, no cache
            nxt = tm(expected)[:, -1, :300].argmax(-1, keepdim=True)
            expected = torch.cat([expected, nxt], dim=1)
    assert got.shape == (2, 4 + new)
    assert torch.equal(got, expected)
    # and the recomputation is the JAX model's greedy choice at every position
    np.testing.assert_array_equal(np.asarray(m(got.numpy()))[:, 3:-1, :300].argmax(-1), got[:, 4:].numpy())


@pytest.mark.parametrize("overrides", [
    dict(alibi_attn=False), dict(alibi_attn=False, bias=False), dict(alibi_attn=True, embed_norm=True),
], ids=["gpt2", "gpt2-nobias", "bloom"])
def test_round_trip_jax_hf_jax_is_identical(tmp_path, overrides):
    m, params = jax_model(**overrides)
    ct.export(params, m.config, tmp_path / "hf", fmt="hf")
    ct.import_hf(tmp_path / "hf", tmp_path / "run")
    cfg, back, _ = ct.read_run(tmp_path / "run")
    assert cfg.model == m.config
    assert jax.tree.structure(back) == jax.tree.structure(params)
    # identical, but for the embedding's padding rows: not exported (no logit depends on them), back as zeros
    expected = {**params, "wte": np.concatenate([params["wte"][:300], np.zeros((84, 32), np.float32)])}
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)


def test_hf_refusals(tmp_path):
    cases = [
        (dict(alibi_attn=True, embed_norm=False), "embed_norm: false"),
        (dict(alibi_attn=True, embed_norm=True, gelu_approximate=False), "gelu_approximate: false"),
        (dict(alibi_attn=False, embed_norm=True), "embed_norm: true"),
    ]
    for overrides, reason in cases:
        m, params = jax_model(**overrides)
        with pytest.raises(ct.ConvertError, match=reason):
            ct.export(params, m.config, tmp_path / "hf", fmt="hf")
        assert not (tmp_path / "hf").exists()


def test_key_mismatches_are_listed(tmp_path):
    m, params = jax_model(alibi_attn=False)
    ct.export(params, m.config, tmp_path / "hf", fmt="hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    tensors["transformer.h.0.extra.weight"] = np.zeros(3, np.float32)
    tensors["transformer.ln_f.weight"] = np.zeros(31, np.float32)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ct.ConvertError) as e:
        ct.import_hf(tmp_path / "hf", tmp_path / "run")
    msg = str(e.value)
    assert "missing: transformer.h.1.mlp.c_fc.bias" in msg
    assert "unexpected: transformer.h.0.extra.weight" in msg
    assert "mis-shaped: transformer.ln_f.weight (31,) != expected (32,)" in msg
    # and from the JAX side: a parameter tree of another model
    _, other = jax_model(alibi_attn=False, N=3)
    with pytest.raises(ct.ConvertError, match=r"unexpected: blocks\.2\.attn\.c_attn\.bias"):
        ct.export(other, m.config, tmp_path / "x")


# ----------------------------------------------------------------------------------------------
# A real run directory through the command line


@pytest.fixture(scope="module")
def trained_run(corpus, tmp_path_factory):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("convert") / "run"
    args = tiny(run_dir, corpus, "training.steps=2", "checkpoint.every=1", "training.eval_every=2")
    assert train.main(args) == 0  # model=test: ALiBi with embed_norm, vocabulary 300 from the data
    return run_dir


def test_cli_exports_a_run_to_transformers(trained_run, tmp_path):
    out = tmp_path / "hf"
    result = subprocess.run([sys.executable, "convert_torch.py", "--checkpoint", str(trained_run), "--step", "1",
                             "--out", str(out), "--format", "hf"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    params = restore(trained_run, 1)["params"]
    params = ct.unflatten(ct.flatten(params))
    mcfg = model_fields(config.load_run_config(trained_run))
    toks = tokens(48)
    got, hf = hf_logits(out, toks)
    assert type(hf).__name__ == "BloomForCausalLM" and hf.config.vocab_size == 300
    np.testing.assert_allclose(got, jax_logits(params, mcfg, toks)[..., :300], atol=TOL, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "the cat sat on a mat."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == "<|endoftext|>" and hf.config.eos_token_id == tok.eos_token_id


def test_cli_torch_export_and_errors(trained_run, tmp_path, capsys):
    out = tmp_path / "pt"
    assert ct.cli(["--checkpoint", str(trained_run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    cfg, params, step = ct.read_run(trained_run)
    assert step == 2
    toks = tokens(20)
    with torch.no_grad():
        got = ct.GPT.from_pretrained(out)(torch.tensor(toks)).numpy()
    mcfg = model_fields(cfg)
    np.testing.assert_allclose(got, jax_logits(params, mcfg, toks), atol=TOL, rtol=0)
    capsys.readouterr()
    for argv, reason in [
        (["--checkpoint", str(trained_run), "--out", str(out)], "already exists"),
        (["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "not found"),
        (["--checkpoint", str(trained_run), "--step", "7", "--out", str(tmp_path / "o")], "saved steps: 1, 2"),
        (["--out", str(tmp_path / "o")], "usage"),
    ]:
        assert ct.cli(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and reason in err and err.count("\n") == 1, err
    # --overwrite replaces it
    assert ct.cli(["--checkpoint", str(trained_run), "--step", "1", "--out", str(out), "--overwrite"]) == 0


def test_init_from_starts_a_run_from_the_params(trained_run, corpus, tmp_path, capsys):  # noqa: F811
    # lr 0: the step-1 checkpoint must hold exactly the parameters it started from
    run = tmp_path / "finetune"
    args = tiny(run, corpus, "training.steps=1", "training.lr=0", "training.min_lr=0", "training.warmup_steps=0",
                f"training.init_from={trained_run}")
    assert train.main(args) == 0
    start, end = restore(trained_run, 2)["params"], restore(run, 1)["params"]
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(end)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert train.cli(tiny(tmp_path / "other", corpus, "model.N=3", f"training.init_from={trained_run}")) == 2
    err = capsys.readouterr().err
    assert "training.init_from" in err and "N 2 there, 3 here" in err


def test_imported_gpt2_gives_transformers_loss_in_training_and_eval(corpus, tmp_path):  # noqa: F811
    """A GPT-2 whose real logits all sit near -14 (a padding row at logit 0 would take most of the
    probability): the step-1 training loss and eval.py's perplexity equal transformers' own loss."""
    hf = random_gpt2(tmp_path / "gpt2", n_positions=64)  # vocabulary 300, the corpus tokenizer's
    with torch.no_grad():  # a shared embedding direction that ln_f's bias turns against every token
        hf.transformer.wte.weight[:, 0] = 3.0
        hf.transformer.ln_f.weight[0], hf.transformer.ln_f.bias[0] = 0.0, -14.0 / 3.0
    hf.save_pretrained(tmp_path / "gpt2")
    shutil.copyfile(corpus / "tokenizer.json", tmp_path / "gpt2" / "tokenizer.json")
    assert ct.cli(["--import-hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "imported")]) == 0
    run = tmp_path / "ft"
    args = tiny(run, corpus, "training.steps=1", "training.lr=0", "training.min_lr=0", "training.warmup_steps=0",
                f"training.init_from={tmp_path / 'imported'}", "model=test", "model.alibi_attn=false",
                "model.embed_norm=false", "model.layer_norm_epsilon=1e-5")
    assert train.main(args) == 0

    def hf_loss(windows):  # transformers' mean next-token loss over windows (b, T + 1)
        with torch.no_grad():
            out = hf(input_ids=torch.tensor(windows, dtype=torch.long), labels=torch.tensor(windows, dtype=torch.long))
        assert out.logits.max() < -8  # the model the test means: every real logit far below 0
        return float(out.loss)

    # (a) training: the loss logged at step 1 is that of the first batch, before any update
    first = data.Loader(corpus, "train", 32, 8, seed=config.load_run_config(run).seed).get_batch(0)
    assert rows(run)[0]["step"] == 1 and rows(run)[0]["loss"] == pytest.approx(hf_loss(first), abs=1e-4)
    # (b) eval.py: perplexity at length 32 over the first 8 windows of the validation split
    assert E.cli(["--checkpoint", str(run), "--lengths", "32", "--max-tokens", "256", "--batch-tokens", "256"]) == 0
    table = json.loads((run / "eval" / "step1.json").read_text())["perplexity"]["rows"]
    index = data.load_index(corpus)
    val = np.concatenate([np.fromfile(corpus / s["file"], dtype=np.dtype(index["dtype"]).newbyteorder("<"))
                          for s in index["splits"]["val"]["shards"]]).astype(np.int64)
    windows = np.stack([val[i * 32: i * 32 + 33] for i in range(8)])
    assert table[0]["tokens"] == 256 and table[0]["loss"] == pytest.approx(hf_loss(windows), abs=1e-4)
    # and lr 0 kept exactly the imported parameters
    _, imported, _ = ct.read_run(tmp_path / "imported")
    tuned = ct.unflatten(ct.flatten(restore(run, 1)["params"]))
    for a, b in zip(jax.tree.leaves(imported), jax.tree.leaves(tuned)):
        np.testing.assert_array_equal(a, b)
