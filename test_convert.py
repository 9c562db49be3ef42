"""Tests of convert_torch.py: PyTorch and Hugging Face exports against the JAX model, GPT-2 import,
the KV-cache generation, round trips, refusals and the command line on a real run directory.

Every model has its parameters perturbed away from the initialisation (LayerNorm scales off 1,
biases off 0, larger weights), so a layout or transposition mistake cannot hide behind near-zero
logits. Hugging Face models are built locally at random; nothing is downloaded.
"""
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest
import torch
import transformers
import yaml
from flax import nnx
from safetensors.numpy import load_file, save_file

import convert_torch as ct
import data
import eval as E
import model
import train
from interop import hf_layouts, torch_gpt
from layers import attention
from store import rundir
from test_data import PLACES, bad_place, kill_at_random_moments, make_docs, one_error_line, write_text_files
from test_train import corpus, restore, rows, tiny  # noqa: F401  (corpus is a fixture)
from tokendata import loader, shard_writer, shards
from training import config

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


def python_without(blocked, code, cwd, *args):
    """Run `code` in a fresh Python in which importing any of the `blocked` top-level modules fails."""
    guard = (f"import importlib.abc, sys\nBLOCKED = {sorted(blocked)!r}\n"
             "class Blocker(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path, target=None):\n"
             "        if name.split('.')[0] in BLOCKED:\n"
             "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
             "sys.meta_path.insert(0, Blocker())\n")
    return subprocess.run([sys.executable, "-c", guard + code, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def tree(root) -> dict:
    """Every file under root and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(pathlib.Path(root).rglob("*")) if p.is_file()}


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
    tm = torch_gpt.GPT.from_pretrained(tmp_path / "out")
    T = 16 if not m.config.alibi_attn else 4 * 16  # ALiBi beyond the training context
    toks = tokens(T)
    with torch.no_grad():
        got = tm(torch.tensor(toks)).numpy()
    assert got.shape == (2, T, 384)  # like model.py: padded, the padding rows at PADDED_LOGIT
    np.testing.assert_array_equal(got[..., 300:], torch_gpt.PADDED_LOGIT)
    np.testing.assert_allclose(got, np.asarray(m(toks)), atol=TOL, rtol=0)


def test_each_loader_says_which_export_it_needs(tmp_path):
    """torch_gpt's from_pretrained given what is no --format torch export (a run directory, a --format hf
    export, a transformers model, a directory without config.json, none) says in one line what it is and the
    convert_torch.py command that writes what it loads; transformers, given a --format torch export, stops
    (never loads it with other weights), and the export's config.json names both loaders."""
    m, params = jax_model(alibi_attn=False)  # GPT-2's layout
    ct.export(params, m.config, tmp_path / "pt")
    layout = ct.export(params, m.config, tmp_path / "hf", "hf")
    run = tmp_path / "run"  # what a run directory holds, as far as a loader can see
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    writes = "python convert_torch.py --checkpoint RUN_DIR --format torch --out DIR"
    for directory, line in [
        (run, f"{run} is a run directory, not an export: export it first (python convert_torch.py --checkpoint {run} "
              f"--format torch --out DIR), then load DIR"),
        (tmp_path / "hf", f"{tmp_path / 'hf'} is a --format hf export (transformers' {layout} layout): load it with "
                          f"transformers.AutoModelForCausalLM.from_pretrained, or export the run for this file with {writes}"),
        (plain, f"{plain} is no export of this toolkit (its config.json has no gpt_jax): a transformers model loads "
                f"with transformers.AutoModelForCausalLM.from_pretrained; this file loads what {writes} writes"),
        (run / "checkpoints", f"{run / 'checkpoints'} has no config.json: it holds no export; this file loads what "
                              f"{writes} writes"),
        (tmp_path / "none", f"{tmp_path / 'none'}: no such directory; give the --out of {writes}")]:
        with pytest.raises(torch_gpt.LoadError) as e:
            torch_gpt.GPT.from_pretrained(directory)
        assert str(e.value) == line
    with pytest.raises(ValueError, match="model_type"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pt")
    assert json.loads((tmp_path / "pt" / "config.json").read_text())["load_with"] == (
        "torch_gpt.GPT.from_pretrained(DIR) (interop/torch_gpt.py, copied beside it); transformers loads --format hf "
        "exports: python convert_torch.py --checkpoint RUN_DIR --format hf --out DIR")
    assert torch_gpt.GPT.from_pretrained(tmp_path / "pt").config.N == m.config.N  # what it loads, it loads


def test_alibi_slopes_are_model_py_slopes():
    for n in (1, 3, 4, 6, 12, 16, 20):
        np.testing.assert_array_equal(torch_gpt.alibi_slopes(n).numpy(), attention.alibi_slopes(n))


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
    random_gpt2(tmp_path / "silu", activation_function="silu")
    capsys.readouterr()  # transformers' progress bars
    assert ct.cli(["--import-hf", str(tmp_path / "silu"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "activation_function 'silu'" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_import_without_a_tokenizer_warns_and_says_what_to_pass(tmp_path, capsys):
    random_gpt2(tmp_path / "gpt2")  # weights and config only
    capsys.readouterr()
    assert ct.cli(["--import-hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert "(step 0), context 32 tokens" in out and "training.seq_len=N" in out  # random_gpt2's n_positions
    warnings = [line for line in err.splitlines() if "tokenizer" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "has no tokenizer" in warnings[0]
    assert "python data.py --tokenizer" in warnings[0]
    assert not (tmp_path / "run" / "tokenizer.json").exists() and ct.read_run(tmp_path / "run")[2] == 0


@pytest.fixture(scope="module")
def valid_hf(tmp_path_factory):
    """Small checkpoints that import, to break one thing in: a GPT-2 and a LLaMA saved by transformers, and
    our own BLOOM-layout and PyTorch exports (their config.json carries the JAX config under gpt_jax)."""
    root = tmp_path_factory.mktemp("valid")
    random_gpt2(root / "gpt2")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=32)).save_pretrained(root / "llama")
    m, params = jax_model(alibi_attn=True, embed_norm=True)
    ct.export(params, m.config, root / "bloom-export", fmt="hf")
    ct.export(params, m.config, root / "torch-export")
    return root


def _with(**fields):
    return lambda meta: {**meta, **fields}


def _with_gpt_jax(**fields):
    return lambda meta: {**meta, "gpt_jax": {**meta["gpt_jax"], **fields}}


BAD_CONFIGS = {  # id: (base, the change to its config.json (raw bytes, or a function of it), the error after PATH: )
    "not-json": ("gpt2", b'{"model_type": "gpt2",', " is not readable JSON (Expecting property name"),
    "not-utf8": ("gpt2", b'{"model_type": "gpt2\xff"}', " is not readable JSON ('utf-8' codec can't decode"),
    "list": ("gpt2", b'[{"model_type": "gpt2"}]', ' must hold a JSON object of the model\'s settings, got '
                                                   '[{"model_type": "gpt2"}]'),
    "heads-0": ("llama", _with(num_attention_heads=0), ": num_attention_heads must be a positive integer, got 0"),
    "hidden-size-string": ("llama", _with(hidden_size="32"), ': hidden_size must be a positive integer, got "32"'),
    "n-layer-null": ("gpt2", _with(n_layer=None), ": n_layer must be a positive integer, got null"),
    "n-embd-float": ("gpt2", _with(n_embd=32.0), ": n_embd must be a positive integer, got 32.0"),
    "vocab-true": ("gpt2", _with(vocab_size=True), ": vocab_size must be a positive integer, got true"),
    "positions-negative": ("gpt2", _with(n_positions=-1), ": n_positions must be a positive integer, got -1"),
    "kv-heads-string": ("llama", _with(num_key_value_heads="2"),
                        ': num_key_value_heads must be a positive integer or null, got "2"'),
    "mlp-size-null": ("llama", _with(intermediate_size=None), ": intermediate_size must be a positive integer, got null"),
    "eps-string": ("gpt2", _with(layer_norm_epsilon="1e-5"), ': layer_norm_epsilon must be a positive number, got "1e-5"'),
    "eps-nan": ("llama", _with(rms_norm_eps=float("nan")), ": rms_norm_eps must be a positive number, got NaN"),
    "activation-list": ("gpt2", _with(activation_function=["gelu"]), ': activation_function must be a string, got ["gelu"]'),
    "tie-string": ("llama", _with(tie_word_embeddings="false"), ': tie_word_embeddings must be true or false, got "false"'),
    "model-type-number": ("gpt2", _with(model_type=2), ": model_type must be a string, got 2"),
    "rope-scaling-string": ("llama", _with(rope_scaling="linear"), ': rope_scaling must be an object or null, got "linear"'),
    "rope-parameters-list": ("llama", _with(rope_parameters=[10000.0]),
                             ": rope_parameters must be an object or null, got [10000.0]"),
    "rope-theta-string": ("llama", _with(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
                          ': rope_parameters.rope_theta must be a positive number, got "1e4"'),
    "rope-type-null": ("llama", _with(rope_parameters={"rope_type": None, "rope_theta": 1e4}),
                       ": rope_parameters.rope_type must be a string, got null"),
    "gpt-jax-string": ("bloom-export", _with(gpt_jax="small"),
                       ': gpt_jax (the exported JAX model config) must be an object, got "small"'),
    "gpt-jax-unknown-key": ("bloom-export", _with_gpt_jax(heads=4),
                            ": gpt_jax (the exported JAX model config) is not a valid model config: unknown key "
                            "model.heads; valid keys of model: vocab_size, block_size,"),
    "gpt-jax-wrong-type": ("bloom-export", _with_gpt_jax(num_head="4"),
                           ": gpt_jax (the exported JAX model config) is not a valid model config: model.num_head "
                           "must be int, got '4' (str)"),
    "gpt-jax-zero": ("torch-export", _with_gpt_jax(N=0), ": gpt_jax (the exported JAX model config) is not a valid "
                                                         "model config: model.N must be a positive integer, got 0"),
    "gpt-jax-incomplete": ("bloom-export", lambda meta: {**meta, "gpt_jax": {"vocab_size": 300}},
                           ": gpt_jax (the exported JAX model config) lacks block_size, embedding_dim, num_head, N"),
    "gpt-jax-model-type": ("bloom-export", _with(model_type="t5"), ": an export's config.json (it has gpt_jax) with "
                                                                   "model_type 't5', not one of the layouts"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_malformed_config_json_is_one_line_naming_the_field(valid_hf, tmp_path, capsys, case):
    base, change, message = BAD_CONFIGS[case]
    shutil.copytree(valid_hf / base, tmp_path / "hf")
    config_json = tmp_path / "hf" / "config.json"
    raw = change if isinstance(change, bytes) else json.dumps(change(json.loads(config_json.read_text()))).encode()
    config_json.write_bytes(raw)
    before = tree(tmp_path)
    capsys.readouterr()
    assert ct.cli(["--import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {config_json}{message}") and err.count("\n") == 1, err
    assert "Traceback" not in err and tree(tmp_path) == before  # nothing written at --out, nothing changed


def test_an_unreadable_tokenizer_is_refused_before_anything_is_written(valid_hf, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    def tokenizers_reads(directory, name) -> bool:
        try:
            if name == "tokenizer.json":
                Tokenizer.from_file(str(directory / name))
            else:
                models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt"))
            return True
        except Exception:
            return False

    for name, content in [("tokenizer.json", b'{"version": "1.0", "model":'), ("tokenizer.json", b'{"version": "1.0"}'),
                          ("tokenizer.json", b"\xff\xfe"), ("vocab.json", b'{"a": 0, "b":'), ("vocab.json", b'["a"]')]:
        shutil.rmtree(tmp_path / "hf", ignore_errors=True)
        shutil.copytree(valid_hf / "gpt2", tmp_path / "hf")
        (tmp_path / "hf" / name).write_bytes(content)
        (tmp_path / "hf" / "merges.txt").write_text("#version: 0.2\na b\n")
        assert not tokenizers_reads(tmp_path / "hf", name)  # the library that would load it cannot
        before = tree(tmp_path)
        capsys.readouterr()
        assert ct.cli(["--import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(tmp_path / "hf" / name) in err and err.count("\n") == 1, err
        assert tree(tmp_path) == before


def test_a_pytorch_export_imports_back_identically(valid_hf, tmp_path):
    """--import-hf also reads a --format torch export (its config.json says format: torch, no model_type)."""
    ct.import_hf(valid_hf / "torch-export", tmp_path / "run")
    cfg, back, step = ct.read_run(tmp_path / "run")
    m, params = jax_model(alibi_attn=True, embed_norm=True)
    assert step == 0 and cfg.model == m.config
    expected = {**params, "wte": np.concatenate([params["wte"][:300], np.zeros((84, 32), np.float32)])}
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("umask", [0o027, 0o002], ids=["umask027", "umask002"])
def test_written_files_and_directories_follow_the_umask(valid_hf, corpus, tmp_path, umask):  # noqa: F811
    """Exports (both formats), an imported run, a run's lock and a data directory: every file gets
    0o666 and every directory 0o777, less the umask, as open() and mkdir() give them."""
    m, params = jax_model(alibi_attn=True, embed_norm=True)
    write_text_files(tmp_path / "texts", make_docs(8))
    out = tmp_path / "out"
    old = os.umask(umask)
    try:
        ct.export(params, m.config, out / "hf", fmt="hf", tokenizer=corpus / "tokenizer.json")
        ct.export(params, m.config, out / "pt", tokenizer=corpus / "tokenizer.json")
        ct.import_hf(valid_hf / "gpt2", out / "run")
        with rundir.Run(out / "run").writer("a test"):
            pass
        data.prepare([str(tmp_path / "texts")], out / "data", vocab_size=260, val_fraction=0.3, progress=False)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o7777 for p in out.rglob("*")}
    assert {"hf/model.safetensors", "hf/tokenizer_config.json", "pt/model.safetensors", "run/config.yaml",
            "run/.lock", "data/index.json"} <= modes.keys()
    expected = {name: (0o777 if (out / name).is_dir() else 0o666) & ~umask for name in modes}
    assert modes == expected


def test_an_imported_run_carries_the_config_files_settings(valid_hf, tmp_path):
    """Its config.yaml: the imported model, and conf/config.yaml's values for the rest (the training
    context left to the model)."""
    ct.import_hf(valid_hf / "gpt2", tmp_path / "run")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    conf = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())
    assert saved["training"] == {**conf["training"], "seq_len": None}
    for section in ("checkpoint", "sharding", "wandb"):
        assert saved[section] == conf[section], section
    # data: conf's, less the mixture's keys it leaves unset (a one-directory run's config.yaml is as before)
    assert saved["data"] == {k: v for k, v in conf["data"].items() if k in saved["data"]}
    assert {k: conf["data"][k] for k in conf["data"].keys() - saved["data"].keys()} == {
        "mixture": None, "stages": [], "max_epochs": None}
    assert saved["seed"] == conf["seed"] and saved["run_dir"] == str(tmp_path / "run")
    assert saved["model"]["name"] == "imported-gpt2" and saved["model"]["block_size"] == 32


def test_unreadable_hf_weights_are_one_error_line(tmp_path, capsys):
    class Code:  # what a pickle can smuggle in: a call made while loading
        def __reduce__(self):
            return (print, ("this ran while loading",))

    random_gpt2(tmp_path / "damaged")
    raw = (tmp_path / "damaged" / "model.safetensors").read_bytes()
    (tmp_path / "damaged" / "model.safetensors").write_bytes(raw[: len(raw) // 2])  # cut short
    random_gpt2(tmp_path / "pickle")
    (tmp_path / "pickle" / "model.safetensors").unlink()
    torch.save({"transformer.wte.weight": torch.zeros(3), "x": Code()}, tmp_path / "pickle" / "pytorch_model.bin")
    capsys.readouterr()
    for name, reason in [("damaged", "as safetensors (Error while deserializing"), ("pickle", "Unsupported global")]:
        assert ct.cli(["--import-hf", str(tmp_path / name), "--out", str(tmp_path / "run")]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: ") and reason in captured.err and captured.err.count("\n") == 1
        assert "this ran" not in captured.out and not (tmp_path / "run").exists()


def test_out_overlapping_the_source_is_refused_and_nothing_deleted(trained_run, tmp_path, capsys):
    run = tmp_path / "src" / "run"
    shutil.copytree(trained_run, run)
    random_gpt2(tmp_path / "src" / "gpt2")
    before = tree(tmp_path)
    capsys.readouterr()
    for source, flag in [(run, "--checkpoint"), (tmp_path / "src" / "gpt2", "--import-hf")]:
        for out, relation in [(source, "is"), (source.parent, "contains"), (source / "checkpoints", "lies inside"),
                              (source / "new", "lies inside"), (source / "checkpoints" / "99", "lies inside")]:
            for overwrite in (["--overwrite"], []):  # a new --out inside the source is refused too
                assert ct.cli([flag, str(source), "--out", str(out), *overwrite]) == 2
                err = capsys.readouterr().err
                assert err == f"error: --out {out} {relation} the source directory {source}; choose an --out " \
                              f"outside it (nothing was written or deleted)\n"
    assert tree(tmp_path) == before


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
    """ROOT/gpt2-a, gpt2-b: transformers GPT-2 directories of different weights (about 500 kB, more than the
    full disk's 256 KiB) with a tokenizer; ROOT/run-a, run-b: the run directories imported from them."""
    root = tmp_path_factory.mktemp("gpt2-runs")
    tok = shard_writer.train_tokenizer(iter(["the cat sat on the mat"] * 10), 300)
    for seed, name in [(0, "a"), (1, "b")]:
        random_gpt2(root / f"gpt2-{name}", seed=seed, n_embd=64)
        tok.save(str(root / f"gpt2-{name}" / "tokenizer.json"))
        assert ct.cli(["--import-hf", str(root / f"gpt2-{name}"), "--out", str(root / f"run-{name}")]) == 0
    return root


def convert_argv(kind: str, runs: pathlib.Path, out, *extra) -> list[str]:
    """convert_torch.py's arguments exporting run-b to `out`, or importing gpt2-b into `out`."""
    source = ["--checkpoint", str(runs / "run-b")] if kind == "export" else ["--import-hf", str(runs / "gpt2-b")]
    return [*source, "--out", str(out), *extra]


@pytest.mark.parametrize("kind", ["export", "import"])
@pytest.mark.parametrize("out", ["", ".", "..", "/", "HOME"])
def test_an_out_holding_the_working_or_home_directory_is_refused(gpt2_runs, tmp_path, monkeypatch, capsys, kind, out):
    """`--out .` (or '', an ancestor, /, ~) with --overwrite would replace the directory the user is in.
    Here that is itself an export (a run directory for an import), as when one runs inside one: still refused."""
    here = tmp_path / "work" / "here"
    if kind == "export":
        assert ct.cli(["--checkpoint", str(gpt2_runs / "run-a"), "--out", str(here)]) == 0
    else:
        shutil.copytree(gpt2_runs / "run-a", here)
    (tmp_path / "work" / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    monkeypatch.setenv("HOME", str(here))
    before = tree(tmp_path)
    capsys.readouterr()
    status = ct.cli(convert_argv(kind, gpt2_runs, here if out == "HOME" else out, "--overwrite"))
    reason = {"": "--out is empty", ".": "is the current directory", "..": "contains the current directory",
              "/": "contains the source directory", "HOME": "is the current directory"}[out]
    one_error_line(capsys, status, reason)
    assert tree(tmp_path) == before
    monkeypatch.chdir(tmp_path)  # elsewhere, the home directory is still never replaced
    one_error_line(capsys, ct.cli(convert_argv(kind, gpt2_runs, here, "--overwrite")), "is the home directory")
    assert tree(tmp_path) == before


def test_overwrite_replaces_only_the_tools_own_output(gpt2_runs, tmp_path, capsys):
    data_dir, export, run = tmp_path / "data", tmp_path / "export", tmp_path / "run"
    data_dir.mkdir()
    (data_dir / "index.json").write_text("{}")
    assert ct.cli(["--checkpoint", str(gpt2_runs / "run-a"), "--out", str(export)]) == 0
    shutil.copytree(gpt2_runs / "run-a", run)
    before = tree(tmp_path)
    capsys.readouterr()
    for kind, out, words in [
        ("export", data_dir, f"--out {data_dir} holds index.json and is not an export of convert_torch.py"),
        ("export", run, f"--out {run} holds checkpoints/, config.yaml, format.json and 1 more and is not an export"),
        ("import", export, f"--out {export} holds config.json, model.safetensors, tokenizer.json and is not a "
                           f"run directory"),
    ]:
        one_error_line(capsys, ct.cli(convert_argv(kind, gpt2_runs, out, "--overwrite")), words)
    assert tree(tmp_path) == before
    # its own kind of output holding anything else (a user's notes, a training's metrics and checkpoints): refused,
    # naming what replacing it would delete
    (export / "README.md").write_text("my notes")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "checkpoints" / "500").mkdir()
    before = tree(tmp_path)
    for kind, out, words in [
        ("export", export, f"--out {export} is an export of convert_torch.py (a config.json with gpt_jax) but also "
                           "holds README.md, which --overwrite would delete"),
        ("import", run, f"--out {run} is a run directory (one with config.yaml) but also holds checkpoints/, "
                        "metrics.jsonl, which --overwrite would delete"),
    ]:
        one_error_line(capsys, ct.cli(convert_argv(kind, gpt2_runs, out, "--overwrite")), words)
    assert tree(tmp_path) == before and (run / "checkpoints" / "500").is_dir()
    (export / "README.md").unlink()
    (run / "metrics.jsonl").unlink()
    (run / "checkpoints" / "500").rmdir()
    # its own kind of output is replaced: run-b's export over run-a's, gpt2-b's import over run-a's copy
    assert ct.cli(convert_argv("export", gpt2_runs, export, "--overwrite")) == 0
    assert ct.cli(convert_argv("import", gpt2_runs, run, "--overwrite")) == 0
    b = ct.read_run(gpt2_runs / "run-b")[1]
    np.testing.assert_array_equal(ct.read_run(run)[1]["wte"], b["wte"])
    exported = load_file(str(export / "model.safetensors"))[hf_layouts.embedding_key("torch")]
    np.testing.assert_array_equal(exported, b["wte"][:300])  # the real vocabulary's rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "export", "run"]


def test_an_import_never_replaces_a_run_while_it_is_written(gpt2_runs, tmp_path, capsys):
    """--import-hf --overwrite onto a run directory that a process writes (train.py holds its lock):
    refused with one line naming the writer; once the writer is gone, replaced."""
    run = tmp_path / "run"
    shutil.copytree(gpt2_runs / "run-a", run)
    with rundir.Run(run).writer("train.py"):
        before = tree(tmp_path)
        capsys.readouterr()
        one_error_line(capsys, ct.cli(convert_argv("import", gpt2_runs, run, "--overwrite")),
                       f"run directory {run} is in use by train.py (pid {os.getpid()} on ")
        assert tree(tmp_path) == before
    assert ct.cli(convert_argv("import", gpt2_runs, run, "--overwrite")) == 0
    np.testing.assert_array_equal(ct.read_run(run)[1]["wte"], ct.read_run(gpt2_runs / "run-b")[1]["wte"])


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("kind", ["export", "import"])
def test_converting_onto_a_bad_place_is_one_line_and_leaves_nothing(gpt2_runs, tmp_path, request, monkeypatch,
                                                                   capsys, kind, place):
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # a failed import sets its own: put it back
    out, extra, words = bad_place(request, tmp_path, place)
    before = tree(tmp_path)
    capsys.readouterr()
    one_error_line(capsys, ct.cli(convert_argv(kind, gpt2_runs, out, *extra)), *words)
    assert tree(tmp_path) == before
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["f.txt"] + {"read-only": ["ro", "kept.txt"], "read-only-overwrite": ["ro", "kept.txt"],
                     "full-disk": ["full"]}.get(place, []))  # no staging directory, no parent made for it


@pytest.mark.parametrize("kind", ["export", "import"])
def test_overwrite_killed_at_random_moments_keeps_the_old_or_the_new_output(gpt2_runs, tmp_path, kind):
    """A real convert_torch.py --overwrite, killed outright at random moments while it writes: each time --out
    holds the old output or the new one, whole (an export byte for byte; an import's checkpoint loads with its
    weights); never missing, never partial. A rerun then completes and leaves nothing else behind."""
    old = ["--checkpoint", str(gpt2_runs / "run-a")] if kind == "export" else ["--import-hf", str(gpt2_runs / "gpt2-a")]
    assert ct.cli([*old, "--out", str(tmp_path / "kept")]) == 0
    # the new output, written here, timing its write: while its staging directory .ref.tmp-PID exists
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            if any(p.name.startswith(".ref.tmp-") for p in tmp_path.iterdir()):
                seen.append(time.monotonic())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert ct.cli(convert_argv(kind, gpt2_runs, tmp_path / "ref")) == 0
    finally:
        done.set()
        watcher.join()
    window = seen[-1] - seen[0] if seen else 0.0
    argv = [sys.executable, str(REPO / "convert_torch.py"), *convert_argv(kind, gpt2_runs, "out", "--overwrite")]
    if kind == "export":
        expected = {"old": tree(tmp_path / "kept"), "new": tree(tmp_path / "ref")}
        assert expected["old"] != expected["new"]
    else:
        expected = {"old": ct.read_run(gpt2_runs / "run-a")[1]["wte"], "new": ct.read_run(gpt2_runs / "run-b")[1]["wte"]}

    def check():
        if kind == "export":
            found = tree(tmp_path / "out")
            return next(name for name, files in expected.items() if files == found)
        wte = ct.read_run(tmp_path / "out")[1]["wte"]  # a run without its checkpoint would not load
        return next(name for name, want in expected.items() if np.array_equal(wte, want))

    def reset():  # the old output in place again, and a trial's leftovers, if any, kept
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        shutil.copytree(tmp_path / "kept", tmp_path / "out")

    outcomes = kill_at_random_moments(argv, tmp_path, lambda pid: tmp_path / f".out.tmp-{pid}", window, 3, reset,
                                      check)
    print(f"{kind}: write window {window:.2f}s, outcomes {dict(outcomes)}")
    assert sum(outcomes.values()) == 3
    assert ct.cli(convert_argv(kind, gpt2_runs, tmp_path / "out", "--overwrite")) == 0  # the rerun, here
    assert check() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "out", "ref"]


STOPPED_AT = """
import gc, os, runpy, signal, sys
moment = sys.argv.pop(1)
from core import outputs
from store import weights
import safetensors.numpy

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT, its Python handler run at the next line of Python
    for _ in range(1000):
        pass

if moment == "reading":  # as the checkpoint starts to be read
    load_params = weights.Weights.load_params
    def load(*args, **kwargs):
        ctrl_c()
        return load_params(*args, **kwargs)
    weights.Weights.load_params = load
elif moment == "gc":  # inside a garbage collector callback (JAX has one), as the export starts writing
    save_file, armed = safetensors.numpy.save_file, []
    def callback(phase, info):
        if armed and phase == "start":
            armed.clear()
            ctrl_c()
    gc.callbacks.append(callback)
    def save(*args, **kwargs):
        armed.append(True)
        gc.collect()
        return save_file(*args, **kwargs)
    safetensors.numpy.save_file = save
else:  # just after the new output is swapped into place
    exchange = outputs.exchange
    def swap(a, b):
        swapped = exchange(a, b)
        ctrl_c()
        return swapped
    outputs.exchange = swap
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("moment", ["reading", "gc", "commit"])
def test_ctrl_c_during_an_export_writes_nothing_or_the_whole_export_and_says_which(gpt2_runs, tmp_path, moment):
    """A real Ctrl-C (SIGINT) to a real convert_torch.py --overwrite: before the new export is in place, it
    stops with one line and exit status 130, the old export as it was (also from inside a garbage collector
    callback, where a KeyboardInterrupt is printed and dropped: the export went on and printed its success);
    from the swap on, the export completes, says so, and then that the stop came after it. No traceback."""
    assert ct.cli(["--checkpoint", str(gpt2_runs / "run-a"), "--out", str(tmp_path / "out")]) == 0
    old = tree(tmp_path / "out")
    done = subprocess.run([sys.executable, "-c", STOPPED_AT, moment, str(REPO / "convert_torch.py"),
                           *convert_argv("export", gpt2_runs, "out", "--overwrite")], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    if moment == "commit":
        assert done.stdout.startswith(f"wrote step 0 of {gpt2_runs / 'run-b'} to out")
        assert done.stderr == "stopped by SIGINT after out was complete: it is written whole\n"
        new = load_file(str(tmp_path / "out" / "model.safetensors"))[hf_layouts.embedding_key("torch")]
        np.testing.assert_array_equal(new, ct.read_run(gpt2_runs / "run-b")[1]["wte"][:300])
    else:
        assert (done.stdout, done.stderr) == ("", "error: stopped by SIGINT; nothing was written (--out out is as "
                                                  "it was)\n")
        assert tree(tmp_path / "out") == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging directory left


def test_help_and_export_need_no_torch(tmp_path):
    m, params = jax_model(alibi_attn=True, embed_norm=True)
    np.savez(tmp_path / "params.npz", **hf_layouts.flatten(params))
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(m.config)))
    code = textwrap.dedent("""
        repo, tmp = sys.argv[1:]
        try:
            import torch
            sys.exit("torch was importable")
        except ImportError:
            pass
        import json, runpy
        sys.path.insert(0, repo)  # as `python convert_torch.py` puts the script's directory first
        sys.argv = ["convert_torch.py", "--help"]
        try:
            runpy.run_path(f"{repo}/convert_torch.py", run_name="__main__")
        except SystemExit as e:
            assert e.code == 0, e.code
        import numpy as np
        import convert_torch as ct
        from interop import hf_layouts
        params = hf_layouts.unflatten(dict(np.load(f"{tmp}/params.npz")))
        ct.export(params, json.load(open(f"{tmp}/config.json")), f"{tmp}/hf", fmt="hf")
    """)
    result = python_without({"torch"}, code, tmp_path, REPO, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ") and "--import-hf HF_DIR" in result.stdout
    ct.export(params, m.config, tmp_path / "expected", fmt="hf")  # here, with torch
    assert tree(tmp_path / "hf") == tree(tmp_path / "expected")


@pytest.mark.parametrize("alibi", [False, True], ids=["learned", "alibi"])
def test_hf_length_is_the_training_context_for_every_layout(corpus, tmp_path, alibi):  # noqa: F811
    """The tokenizer's model_max_length is block_size (16 here) for every layout, so lm-eval's HF backend
    scores windows of the training context whether config.json names a length (GPT-2's n_positions) or
    not (BLOOM's); for an ALiBi model it is no limit of the model, which runs (and matches JAX) at 180 tokens."""
    from lm_eval.models.huggingface import HFLM

    m, params = jax_model(alibi_attn=alibi, embed_norm=alibi)
    ct.export(params, m.config, tmp_path / "hf", fmt="hf", tokenizer=corpus / "tokenizer.json")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.model_max_length == 16
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert HFLM(pretrained=hf, tokenizer=tok, batch_size=1, device="cpu").max_length == 16
    if alibi:
        ids = tok(" ".join(["the cat sat on a mat"] * 30))["input_ids"]
        assert len(ids) >= 180
        with torch.no_grad():
            got = hf(torch.tensor([ids])).logits.numpy()
        np.testing.assert_allclose(got, np.asarray(m(np.asarray([ids])))[..., :300], atol=TOL, rtol=0)


@pytest.mark.parametrize("overrides", [dict(alibi_attn=False), dict(alibi_attn=True)], ids=["learned", "alibi"])
def test_generate_with_cache_equals_full_recomputation(tmp_path, overrides):
    m, params = jax_model(**overrides)
    ct.export(params, m.config, tmp_path / "out")
    tm = torch_gpt.GPT.from_pretrained(tmp_path / "out")
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


def test_exports_that_kept_the_padding_rows_still_load(tmp_path):
    """Files written with all 384 rows of the padded embedding load as those with the 300 real ones."""
    m, params = jax_model(alibi_attn=False)
    ct.export(params, m.config, tmp_path / "pt")
    ct.export(params, m.config, tmp_path / "hf", fmt="hf")
    for directory, key in [(tmp_path / "pt", "wte.weight"), (tmp_path / "hf", "transformer.wte.weight")]:
        tensors = load_file(str(directory / "model.safetensors"))
        tensors[key] = params["wte"]  # (384, 32)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    toks = tokens(16)
    with torch.no_grad():
        got = torch_gpt.GPT.from_pretrained(tmp_path / "pt")(torch.tensor(toks)).numpy()
    np.testing.assert_allclose(got, np.asarray(m(toks)), atol=TOL, rtol=0)
    ct.import_hf(tmp_path / "hf", tmp_path / "run")
    back = ct.read_run(tmp_path / "run")[1]["wte"]
    np.testing.assert_array_equal(back, np.concatenate([params["wte"][:300], np.zeros((84, 32), np.float32)]))
    # every vocabulary tensor of a torch export (untied head, head bias) padded: imported as the real rows
    m, params = jax_model(tie_embeddings=False, head_bias=True)
    params = jax.tree.map(np.asarray, params)
    ct.export(params, m.config, tmp_path / "pt2")
    tensors = load_file(str(tmp_path / "pt2" / "model.safetensors"))
    for key, name in [("wte.weight", "wte"), ("lm_head.weight", "lm_head"), ("head_bias", "head_bias")]:
        tensors[key] = params[name]  # (384, ...): model.py's padding rows kept
        assert tensors[key].shape[0] == 384
    save_file(tensors, str(tmp_path / "pt2" / "model.safetensors"), metadata={"format": "pt"})
    ct.import_hf(tmp_path / "pt2", tmp_path / "run2")
    back = ct.read_run(tmp_path / "run2")[1]
    for name in ("wte", "lm_head", "head_bias"):
        np.testing.assert_array_equal(back[name][:300], params[name][:300])
        assert back[name].shape[0] == 384 and not np.any(back[name][300:])


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
    params = hf_layouts.unflatten(hf_layouts.flatten(params))
    mcfg = model_fields(rundir.Run(trained_run).record.config())
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
        got = torch_gpt.GPT.from_pretrained(out)(torch.tensor(toks)).numpy()
    mcfg = model_fields(cfg)
    expected = jax_logits(params, mcfg, toks)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
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


def test_torch_gpt_alone_beside_an_export_needs_nothing_of_the_repository(tmp_path):
    """The README's promise: torch_gpt.py copied next to an export is all of this repository that loading
    it needs (torch, numpy and safetensors installed; no JAX). In a fresh Python that cannot see the
    repository, it loads the export of a model with many switches set (ALiBi with embed_norm, RMSNorm,
    SwiGLU, grouped-query attention, parallel residual, a separate output with a bias) and gives the
    JAX model's logits."""
    fresh = tmp_path / "elsewhere"
    fresh.mkdir()
    shutil.copyfile(REPO / "interop" / "torch_gpt.py", fresh / "torch_gpt.py")
    m, params = jax_model(alibi_attn=True, embed_norm=True, norm="rmsnorm", activation="swiglu", num_kv_head=2,
                          residual="parallel", tie_embeddings=False, head_bias=True, mlp_dim=48)
    ct.export(params, m.config, fresh / "export")
    toks = tokens(24)  # past the training context of 16
    np.save(fresh / "tokens.npy", toks)
    code = textwrap.dedent("""
        import importlib.util, sys
        for project in ("model", "core", "interop", "convert_torch"):  # the repository is out of sight
            assert importlib.util.find_spec(project) is None, (project, sys.path)
        import numpy as np, torch
        from torch_gpt import GPT
        model = GPT.from_pretrained("export")
        with torch.no_grad():
            np.save("logits.npy", model(torch.from_numpy(np.load("tokens.npy"))).numpy())
    """)
    result = python_without({"jax", "jaxlib", "flax", "optax", "orbax"}, code, fresh)
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(np.load(fresh / "logits.npy"), np.asarray(m(toks)), atol=TOL, rtol=0)


def test_a_run_directory_given_as_a_file_url(trained_run, tmp_path, capsys):
    """run_dir=file:///x trains (storage reads file:// as a local path); eval.py, sample.py and the
    export read such a run directory too, its tokenizer included."""
    url = f"file://{trained_run}"
    assert rundir.existing(url).record.config() == rundir.Run(trained_run).record.config()
    assert ct.cli(["--checkpoint", url, "--out", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == (trained_run / "tokenizer.json").read_bytes()
    assert ct.cli(["--checkpoint", str(trained_run), "--out", str(tmp_path / "plain")]) == 0
    from_url, plain = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("export", "plain"))
    assert from_url.keys() == plain.keys()
    for key in plain:
        np.testing.assert_array_equal(from_url[key], plain[key])


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


def test_the_fine_tuning_commands_the_import_prints_run_as_printed(corpus, tmp_path):  # noqa: F811
    """convert_torch.py --import-hf prints the data and training commands that fine-tune the import, in
    full and with LoRA. Run as printed (only the text files' placeholder filled in and the runs shortened),
    each run takes the imported model without restating it and starts from its parameters (LoRA's B is
    zero at step 0): its first loss is transformers' own on that batch."""
    hf = random_gpt2(tmp_path / "gpt2")  # context 32, vocabulary 300: the corpus tokenizer's
    shutil.copyfile(corpus / "tokenizer.json", tmp_path / "gpt2" / "tokenizer.json")

    def run(command: str, *extra: str) -> str:
        assert command.startswith("python "), command
        script, _, rest = command[len("python "):].partition(" ")
        line = f"{sys.executable} {REPO / script} {rest} {' '.join(extra)}"
        result = subprocess.run(line, shell=True, cwd=tmp_path, capture_output=True, text=True)
        assert result.returncode == 0, (line, result.stderr)
        return result.stdout

    out = run("python convert_torch.py --import-hf gpt2 --out runs/gpt2-base")
    commands = [line.strip() for line in out.splitlines() if line.startswith("  python ")]
    assert [c.split()[1] for c in commands] == ["data.py", "train.py", "train.py"], out
    prepare, finetune, lora = commands
    assert "'TEXT/*.txt'" in prepare and "training.lora.rank=8" in lora
    # fine-tuning's peak learning rates (about 1e-4 in full, 1e-3 for LoRA), not the from-scratch default's
    default = config.load_config().training.lr
    for command, lr in [(finetune, 1e-4), (lora, 1e-3)]:
        training = config.load_config(overrides=[a for a in command.split()[2:]
                                                 if a.startswith("training.") and "init_from" not in a]
                                      + ["training.init_from=runs/base"]).training
        assert training.lr == lr < default and training.warmup_steps < training.steps, command
    run(prepare.replace("'TEXT/*.txt'", str(corpus.parent / "src")))
    imported = rundir.Run(tmp_path / "runs" / "gpt2-base").record.config().model
    data_dir = tmp_path / "data" / "gpt2-base"
    for command, name in [(finetune, "gpt2-base-tuned"), (lora, "gpt2-base-lora")]:
        run(command, "training.steps=1", "training.batch_size=8", "training.lr=0", "training.min_lr=0",
            "training.warmup_steps=0", "training.eval_windows=8")
        tuned = tmp_path / "runs" / name
        assert rundir.Run(tuned).record.config().model == imported  # not the config file's `small`
        batch = loader.TextLoader(shards.open_data(data_dir), "train", 32, 8, seed=rundir.Run(tuned).record.config().seed).get_batch(0)
        with torch.no_grad():  # the batch's 32 inputs, and their next tokens as targets
            ids = torch.tensor(batch, dtype=torch.long)
            logits = hf(input_ids=ids[:, :-1]).logits
            expected = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 300), ids[:, 1:].reshape(-1)))
        assert rows(tuned)[0]["step"] == 1 and rows(tuned)[0]["loss"] == pytest.approx(expected, abs=1e-4)
    assert rundir.Run(tmp_path / "runs" / "gpt2-base-lora").record.config().training.lora.rank == 8


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
    first = loader.TextLoader(shards.open_data(corpus), "train", 32, 8, seed=rundir.Run(run).record.config().seed).get_batch(0)
    assert rows(run)[0]["step"] == 1 and rows(run)[0]["loss"] == pytest.approx(hf_loss(first), abs=1e-4)
    # (b) eval.py: perplexity at length 32 over 8 windows spread over the validation split: k * n // 8
    assert E.cli(["--checkpoint", str(run), "--lengths", "32", "--max-tokens", "256", "--batch-tokens", "256"]) == 0
    table = json.loads((run / "eval" / "step1.json").read_text())["perplexity"]["rows"]
    index = shards.open_data(corpus).index
    val = np.concatenate([np.fromfile(corpus / s["file"], dtype=np.dtype(index["dtype"]).newbyteorder("<"))
                          for s in index["splits"]["val"]["shards"]]).astype(np.int64)
    n = (len(val) - 1) // 32
    windows = np.stack([val[i * 32: i * 32 + 33] for i in (k * n // 8 for k in range(8))])
    assert table[0]["tokens"] == 256 and table[0]["loss"] == pytest.approx(hf_loss(windows), abs=1e-4)
    # and lr 0 kept exactly the imported parameters
    _, imported, _ = ct.read_run(tmp_path / "imported")
    tuned = hf_layouts.unflatten(hf_layouts.flatten(restore(run, 1)["params"]))
    for a, b in zip(jax.tree.leaves(imported), jax.tree.leaves(tuned)):
        np.testing.assert_array_equal(a, b)


def test_a_run_whose_tokenizer_was_replaced_is_refused_by_every_reader(trained_run, tmp_path, capsys):
    """RUN/tokenizer.json is checked against the sha256 data.json records: with another tokenizer in its
    place (one id moved), sample.py would print garbage and an export would carry it. Each reader says
    so in one line, and the export writes nothing."""
    import sample

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    tok = json.loads((run / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: still a valid tokenizer, another one
    (run / "tokenizer.json").write_text(json.dumps(tok))
    recorded = json.loads((run / "data.json").read_text())["tokenizer_sha256"]
    for cli, argv in ((sample.cli, ["--checkpoint", str(run), "--prompt", "the cat"]),
                      (ct.cli, ["--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]),
                      (E.cli, ["--checkpoint", str(run), "--lengths", "32"])):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {run / 'tokenizer.json'} is not the tokenizer this run trained with") \
            and f"records {recorded[:16]}..." in err and err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists()


def test_file_urls_name_the_local_directory_for_writers_and_urls_no_store_can_hold_are_refused(
        trained_run, corpus, tmp_path, monkeypatch, capsys):
    """--out file:///x writes /x (it was written under the current directory, into ./file:/x, while the
    command printed the URL); memory:// (this process's own store) as --out or run_dir, and a bucket path
    with `..`, are one line each, at once, with nothing written."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    source = corpus.parent / "src"
    assert data.cli(["--input", str(source), "--out", f"file://{tmp_path / 'prepared'}", "--tokenizer",
                     str(corpus), "--val-fraction", "0.3"]) == 0
    assert shards.open_data(tmp_path / "prepared").index["documents"] > 0
    assert ct.cli(["--checkpoint", str(trained_run), "--out", f"file://{tmp_path / 'export'}"]) == 0
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert list(work.iterdir()) == []  # nothing under the current directory
    capsys.readouterr()
    for cli, argv, words in (
            (data.cli, ["--input", str(source), "--out", "memory://bucket/x"], "--out memory://bucket/x: memory:// "
                                                                                "cannot hold it"),
            (ct.cli, ["--checkpoint", str(trained_run), "--out", "memory://bucket/x"], "memory:// cannot hold it"),
            (train.cli, tiny("memory://bucket/run", corpus), "run_dir: run directory memory://bucket/run: memory:// "
                                                              "cannot hold it"),
            (data.cli, ["--input", str(source), "--out", "gs://bucket/x/../y"], "gs://bucket/x/../y: a bucket has no "
                                                                                 "relative paths")):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
    assert list(work.iterdir()) == []
