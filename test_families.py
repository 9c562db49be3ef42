"""The decoder families model.py's switches cover, against transformers: GPT-J, GPT-NeoX (Pythia),
OPT and LLaMA (grouped-query attention).

For each family, a small transformers model is built here at random (weights perturbed away from
their initialisation, so no layout mistake hides behind a near-zero weight) and saved locally:
- its import gives transformers' logits, every real-vocabulary logit, at the full context, and
  cached greedy decoding equals recomputation;
- a JAX model of the family exports to transformers' own class with the same logits and comes
  back with identical parameters and config; the PyTorch module export follows the same switches;
- one fine-tuning step of train.py from the import starts at transformers' loss on the same batch;
- a ZeRO-3 x tensor=2 step on 8 simulated devices equals the single-device step.
Nothing is downloaded: the named sizes are checked against the real models' config.json values,
written out below.
"""
import dataclasses
import json
import pathlib
import shutil

import jax
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

import convert_torch as ct
import model
import sharding
import train
from inference import decoding
from interop import hf_configs, torch_gpt
from layers import loss as loss_lib
from store import rundir
from test_convert import TOL, jax_model, tokens
from test_model import check_chunked_loss
from test_sharding import one_step
from test_train import corpus, rows, tiny  # noqa: F401  (corpus is a fixture)
from tokendata import loader, shards
from training import config

V = 300  # the vocabulary of test_train's corpus tokenizer
# family -> (transformers config class, its small shapes, what model.py's config should read from it)
FAMILIES = {
    "gptj": (transformers.GPTJConfig, dict(n_positions=32, n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
             dict(positions="rotary", rotary_dim=4, rotary_interleaved=True, residual="parallel_shared",
                  attn_bias=False, tie_embeddings=False, head_bias=True, gelu_approximate=True)),
    "neox": (transformers.GPTNeoXConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                              intermediate_size=48, max_position_embeddings=32, rotary_pct=0.5),
             dict(positions="rotary", rotary_dim=4, rotary_interleaved=False, residual="parallel",
                  tie_embeddings=False, gelu_approximate=False, ffn_dim=48)),
    "opt": (transformers.OPTConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48,
                                         max_position_embeddings=32),
            dict(positions="learned", position_offset=2, activation="relu", tie_embeddings=True, ffn_dim=48)),
    "llama": (transformers.LlamaConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                                             rms_norm_eps=1e-5, rope_theta=500.0),
              dict(positions="rotary", rotary_dim=8, norm="rmsnorm", activation="swiglu", kv_heads=2, bias=False,
                   attn_bias=False, tie_embeddings=False, rotary_base=500.0)),
}
# more layouts of the same classes, for the cheaper logit checks
VARIANTS = {
    "neox-sequential-nobias": ("neox", dict(use_parallel_residual=False, attention_bias=False, hidden_act="gelu_new"),
                               dict(residual="sequential", attn_bias=False, gelu_approximate=True)),
    "llama-tied-mha-biases": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                            mlp_bias=True),
                              dict(kv_heads=4, tie_embeddings=True, attn_bias=True, bias=True)),
    "opt-untied-gelu": ("opt", dict(tie_word_embeddings=False, activation_function="gelu"),
                        dict(tie_embeddings=False, activation="gelu", gelu_approximate=False)),
}
CASES = {name: (name, {}, {}) for name in FAMILIES} | VARIANTS
HF_CLASS = {"gptj": "GPTJForCausalLM", "neox": "GPTNeoXForCausalLM", "opt": "OPTForCausalLM",
            "llama": "LlamaForCausalLM"}
# the same families as JAX configs (small shapes), for export
SMALL = dict(vocab_size=V, block_size=16, embedding_dim=32, num_head=4, N=2, alibi_attn=False)
SWITCHES = {
    "gptj": dict(rotary_dim=4, rotary_interleaved=True, residual="parallel_shared", attention_bias=False,
                 tie_embeddings=False, head_bias=True),
    "neox": dict(rotary_dim=2, residual="parallel", gelu_approximate=False, tie_embeddings=False, mlp_dim=40),
    "opt": dict(position_offset=2, activation="relu", mlp_dim=48, layer_norm_epsilon=1e-5),
    "llama": dict(rotary_dim=8, rotary_base=500.0, norm="rmsnorm", activation="swiglu", num_kv_head=2, bias=False,
                  tie_embeddings=False, mlp_dim=40),
}


def random_hf(case: str, directory, seed=0, negative_logits=False, **extra):
    """A transformers model of the case's family with perturbed random weights, saved as safetensors.

    negative_logits: every real logit far below 0, as in a trained model (a padding row at logit 0
    would then take most of the probability): one hidden direction that the final norm turns to a
    large negative value (its bias, or the embedding for RMSNorm) and the output projection reads."""
    family, variant, _ = CASES[case]
    cls, shapes, _ = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = cls(vocab_size=V, bos_token_id=0, eos_token_id=0, pad_token_id=None, **{**shapes, **variant, **extra})
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
        if negative_logits:
            hf.get_output_embeddings().weight[:, 0] = 3.0
            final = {"gptj": lambda: hf.transformer.ln_f, "neox": lambda: hf.gpt_neox.final_layer_norm,
                     "opt": lambda: hf.model.decoder.final_layer_norm, "llama": lambda: None}[family]()
            if final is None:  # RMSNorm: no bias, so a large negative input direction instead
                hf.get_input_embeddings().weight[:, 0] = -10.0
            else:
                final.weight[0], final.bias[0] = 0.0, -14.0 / 3.0
    hf.save_pretrained(directory)
    return hf


def expected_switches(case: str) -> dict:
    family, _, switches = CASES[case]
    return {**FAMILIES[family][2], **switches}


def load_jax(params, cfg: model.GPTConfig) -> model.GPT:
    m = model.GPT(cfg, rngs=nnx.Rngs(params=0))
    state = nnx.state(m)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(m, state)
    return m


def hf_logits(hf, toks) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(toks), dtype=torch.long)).logits.numpy()


def greedy_by_recomputation(m: model.GPT, prompt: np.ndarray, new: int) -> np.ndarray:
    """Greedy decoding without a cache: the whole sequence through the model for every new token.
    (Always at the final length, zeros after the tokens so far: causal, so position t's logits see
    tokens 0..t only, and one shape runs eagerly without a compilation per length.)"""
    B, T0 = prompt.shape
    seq = np.zeros((B, T0 + new), np.int64)
    seq[:, :T0] = prompt
    for t in range(T0, T0 + new):
        seq[:, t] = np.asarray(m(seq))[:, t - 1, :V].argmax(-1)
    return seq[:, T0:]


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_transformers_logits_at_full_context_and_with_a_kv_cache(tmp_path, case):
    hf = random_hf(case, tmp_path / "hf")
    ct.import_hf(tmp_path / "hf", tmp_path / "run")
    cfg, params, step = ct.read_run(tmp_path / "run")
    for name, value in expected_switches(case).items():
        assert getattr(cfg.model, name) == value, name
    m = load_jax(params, cfg.model)
    toks = tokens(32, vocab=V)  # the full context: max_position_embeddings 32
    np.testing.assert_allclose(np.asarray(m(toks))[..., :V], hf_logits(hf, toks), atol=TOL, rtol=0)
    # greedy decoding through the KV cache (sample.py's path) chooses what recomputing the whole
    # sequence chooses, and those are transformers' logits at every generated position
    prompt = toks[:, :4]
    cached = decoding.generate(m, prompt, 28, temperature=0.0)
    np.testing.assert_array_equal(cached, greedy_by_recomputation(m, prompt, 28))
    full = np.concatenate([prompt, cached], axis=1)
    np.testing.assert_allclose(np.asarray(m(full))[..., :V], hf_logits(hf, full), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", list(SWITCHES))
def test_export_to_transformers_and_back_is_exact(tmp_path, family):
    m, params = jax_model(**{**SMALL, **SWITCHES[family]})
    layout = {"neox": "gpt_neox"}.get(family, family)
    assert ct.export(params, m.config, tmp_path / "hf", fmt="hf") == layout
    toks = tokens(16, vocab=V)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == HF_CLASS[family] and hf.config.vocab_size == V
    np.testing.assert_allclose(hf_logits(hf, toks), np.asarray(m(toks))[..., :V], atol=TOL, rtol=0)
    # back through transformers' own config (not the copy of ours the export carries): transformers
    # saves what it loaded, and the import reads that
    hf.config.__dict__.pop("gpt_jax", None)
    hf.save_pretrained(tmp_path / "resaved")
    assert "gpt_jax" not in json.loads((tmp_path / "resaved" / "config.json").read_text())
    ct.import_hf(tmp_path / "resaved", tmp_path / "run")
    cfg, back, _ = ct.read_run(tmp_path / "run")
    assert cfg.model == m.config
    assert jax.tree.structure(back) == jax.tree.structure(params)
    # identical, but for the vocabulary's padding rows: not exported (no logit depends on them), back as zeros
    padded = {"wte", "lm_head", "head_bias"}
    pad = m.config.padded_vocab_size - V
    expected = {k: (np.concatenate([v[:V], np.zeros((pad,) + v.shape[1:], np.float32)]) if k in padded else v)
                for k, v in params.items()}
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(load_jax(back, cfg.model)(toks))[..., :V], np.asarray(m(toks))[..., :V])


@pytest.mark.parametrize("family", list(SWITCHES))
def test_pytorch_module_export_follows_the_switches(tmp_path, family):
    m, params = jax_model(**{**SMALL, **SWITCHES[family]})
    assert ct.export(params, m.config, tmp_path / "pt") == "torch"
    tm = torch_gpt.GPT.from_pretrained(tmp_path / "pt")
    T = 16 if m.config.positions == "learned" else 40  # rotary: past the training context of 16
    toks = tokens(T, vocab=V)
    with torch.no_grad():
        got = tm(torch.tensor(toks)).numpy()
    np.testing.assert_allclose(got, np.asarray(m(toks)), atol=TOL, rtol=0)
    prompt = torch.tensor(toks[:, :4])
    cached = tm.generate(prompt, 12)  # through the module's KV cache
    np.testing.assert_array_equal(cached[:, 4:].numpy(), greedy_by_recomputation(m, toks[:, :4], 12))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_finetuning_step_from_the_import_starts_at_transformers_loss(corpus, tmp_path, family):  # noqa: F811
    hf = random_hf(family, tmp_path / "hf", negative_logits=True)
    shutil.copyfile(corpus / "tokenizer.json", tmp_path / "hf" / "tokenizer.json")
    assert ct.cli(["--import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    imported = rundir.Run(tmp_path / "imported").record.config().model
    same_model = [f"model.{k}={json.dumps(getattr(imported, k))}" for k in model.GPTConfig.PARAMETER_FIELDS]
    run = tmp_path / "ft"
    args = tiny(run, corpus, "training.steps=1", "training.lr=0", "training.min_lr=0", "training.warmup_steps=0",
                f"training.init_from={tmp_path / 'imported'}", *same_model)
    assert train.main(args) == 0
    batch = loader.TextLoader(shards.open_data(corpus), "train", 32, 8, seed=rundir.Run(run).record.config().seed).get_batch(0)  # (8, 33)
    with torch.no_grad():  # the batch's 32 inputs, and their next tokens as targets
        ids = torch.tensor(batch, dtype=torch.long)
        logits = hf(input_ids=ids[:, :-1]).logits
        assert logits.max() < -8  # the model the test means: every real logit far below 0
        expected = float(torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1)))
    assert rows(run)[0]["step"] == 1 and rows(run)[0]["loss"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("family", list(SWITCHES))
def test_zero3_with_tensor_parallelism_equals_one_device(family):
    cfg = model.GPTConfig(**{**SMALL, **SWITCHES[family]})
    params = nnx.to_pure_dict(nnx.state(model.GPT(cfg, rngs=nnx.Rngs(params=jax.random.key(1)))))
    opt_state = optax.adamw(1e-2, eps=1e-3, weight_decay=0.1).init(params)
    toks = np.asarray(jax.random.randint(jax.random.key(2), (8, 17), 0, V), np.int32)
    results = []
    for mesh, stage in [(sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), 0), (sharding.make_mesh(2, 2, 2), 3)]:
        step, state, batch, _ = one_step(mesh, stage, params, opt_state, toks, cfg)
        results.append(jax.device_get(step(state, batch)))
    (ref_loss, ref_g, ref_new), (loss, g, new) = results
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g) + jax.tree.leaves(new), jax.tree.leaves(ref_g) + jax.tree.leaves(ref_new),
                    strict=True):
        # atol: 1e-4 of the updates' scale (lr 1e-2); float32 sums in another order move elements near 0 by ~1e-7
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", list(SWITCHES))
def test_chunked_loss_equals_the_loss_over_the_whole_logits(family):
    """Each family's head (GPT-J's untied lm_head with its bias, NeoX's and LLaMA's untied one, OPT's
    tied embedding), vocabulary 300 padded to 384, loss weights: 3 chunks of 6 positions, the last
    2 padding."""
    check_chunked_loss(model.GPTConfig(**{**SMALL, **SWITCHES[family]}), 4, 16, True, 24)


@pytest.mark.parametrize("impl", ["dot_product", "pallas"])
def test_attention_kernels_take_rotary_and_grouped_query_attention(impl):
    """Rotary embeddings are applied before attention, so every kernel runs without a bias; grouped
    key/value heads are repeated (pallas) or native (dot_product). Same logits and gradients as xla."""
    cfg = model.GPTConfig(**{**SMALL, **SWITCHES["llama"]}, attention="xla")
    ref_model = model.GPT(cfg, rngs=nnx.Rngs(0))
    other = model.GPT(dataclasses.replace(cfg, attention=impl), rngs=nnx.Rngs(0))
    toks = tokens(17, vocab=V)

    def loss_and_grad(m):
        graphdef, state = nnx.split(m)
        f = lambda s: loss_lib.cross_entropy(nnx.merge(graphdef, s)(toks[:, :-1]), toks[:, 1:])[0]  # noqa: E731
        return jax.value_and_grad(f)(state)

    (ref_loss, ref_g), (loss, g) = loss_and_grad(ref_model), loss_and_grad(other)
    np.testing.assert_allclose(np.asarray(other(toks)), np.asarray(ref_model(toks)), atol=1e-5, rtol=0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# the real models' config.json values (the keys that set the architecture)
REAL = {
    "pythia-160m": dict(model_type="gpt_neox", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000,
                        use_parallel_residual=True, vocab_size=50304, hidden_act="gelu", layer_norm_eps=1e-5,
                        tie_word_embeddings=False),
    "opt-125m": dict(model_type="opt", hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
                     max_position_embeddings=2048, vocab_size=50272, activation_function="relu",
                     do_layer_norm_before=True, word_embed_proj_dim=768, enable_bias=True),
    "gpt-j-6b": dict(model_type="gptj", n_embd=4096, n_layer=28, n_head=16, n_positions=2048, rotary_dim=64,
                     vocab_size=50400, activation_function="gelu_new", layer_norm_epsilon=1e-5, n_inner=None,
                     tie_word_embeddings=False),
    "tinyllama-1_1b": dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                           num_hidden_layers=22, num_key_value_heads=4, max_position_embeddings=2048,
                           rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, vocab_size=32000,
                           tie_word_embeddings=False, hidden_act="silu"),
    "llama-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                     num_hidden_layers=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                     rope_theta=10000.0, rope_scaling=None, vocab_size=32000, tie_word_embeddings=False,
                     hidden_act="silu"),
}


@pytest.mark.parametrize("name", list(REAL))
def test_named_sizes_are_the_real_models(name):
    """`model=NAME` gives the architecture the import reads from the real config.json, and as many
    parameters as transformers builds for it (on the meta device: no memory)."""
    named = config.load_config(overrides=[f"model={name}"]).model
    imported, layout = hf_configs.config_from_hf(REAL[name], name)
    for field in model.GPTConfig.PARAMETER_FIELDS:
        assert getattr(named, field) == getattr(imported, field), field
    meta = {k: v for k, v in REAL[name].items() if k != "model_type"}
    hf_cfg = transformers.AutoConfig.for_model(REAL[name]["model_type"],
                                               **{**meta, "vocab_size": imported.padded_vocab_size})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    n_hf = sum(p.numel() for p in hf.parameters())  # shared (tied) parameters once
    assert model.param_count(dataclasses.replace(named, vocab_size=named.padded_vocab_size)) == n_hf


@pytest.mark.parametrize("family, extra, reason", [
    ("opt", dict(do_layer_norm_before=False), "post-LayerNorm blocks"),
    ("opt", dict(word_embed_proj_dim=16), "an embedding projection"),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type 'linear'"),
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("gptj", dict(activation_function="relu"), "activation_function 'relu'"),
], ids=["opt-post-ln", "opt-projection", "llama-scaled-rope", "llama-gelu", "gptj-relu"])
def test_import_refuses_what_model_py_cannot_express(tmp_path, capsys, family, extra, reason):
    random_hf(family, tmp_path / "hf", **extra)
    capsys.readouterr()
    assert ct.cli(["--import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "cannot be expressed by model.py" in err and reason in err, err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def llama_with(directory, **fields) -> pathlib.Path:
    """A saved random LLaMA (rope_parameters: default, base 500) whose config.json then gets `fields`."""
    random_hf("llama", directory)
    path = directory / "config.json"
    meta = json.loads(path.read_text())
    assert meta["rope_parameters"] == {"rope_theta": 500.0, "rope_type": "default"} and "rope_scaling" not in meta
    path.write_text(json.dumps({**meta, **fields}))
    return path


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0},
                                          {"rope_type": "dynamic", "factor": 2.0}],
                         ids=["linear", "linear-older-key", "dynamic"])
def test_import_refuses_rope_scaling_beside_default_rope_parameters(tmp_path, capsys, rope_scaling):
    path = llama_with(tmp_path / "hf", rope_scaling=rope_scaling)
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    # transformers applies the scaling: the model it loads is not the one with plain rotary embeddings
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").rope_parameters["rope_type"] == kind
    capsys.readouterr()
    assert ct.cli(["--import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"error: {path}: this LLaMA cannot be expressed by model.py: rope_scaling "
                                       f"with rope_type {kind!r} (scaled rotary embeddings; model.py has the plain "
                                       f"ones only)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("fields", [dict(rope_scaling=None), dict(rope_scaling={"rope_type": "default"}),
                                    dict(rope_scaling={"type": "default", "rope_theta": 300.0})],
                         ids=["null", "default", "default-older-key-own-base"])
def test_rope_scaling_without_scaling_imports_as_transformers_reads_it(tmp_path, fields):
    """Where rope_scaling is set, transformers reads it instead of rope_parameters (whose base of 500 then
    no longer applies); the import gives transformers' logits in every case."""
    llama_with(tmp_path / "hf", **fields)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ct.import_hf(tmp_path / "hf", tmp_path / "run")
    cfg, params, _ = ct.read_run(tmp_path / "run")
    toks = tokens(32, vocab=V)
    np.testing.assert_allclose(np.asarray(load_jax(params, cfg.model)(toks))[..., :V], hf_logits(hf, toks),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("overrides, reason", [
    (dict(rotary_dim=4, num_kv_head=2), "maps to GPT-NeoX, which cannot express num_kv_head: 2"),
    (dict(rotary_dim=4, rotary_interleaved=True), "maps to GPT-J, which cannot express residual: sequential"),
    (dict(num_kv_head=2), "maps to GPT-2, which cannot express num_kv_head: 2"),
    (dict(rotary_dim=4, norm="rmsnorm", activation="swiglu"), "rotary_dim: 4 (LLaMA rotates whole heads)"),
    (dict(head_bias=True), "head_bias: true"),
], ids=["neox-gqa", "gptj-sequential", "gpt2-gqa", "llama-partial-rotary", "gpt2-head-bias"])
def test_export_refuses_what_the_layout_cannot_express(tmp_path, overrides, reason):
    m, params = jax_model(**{**SMALL, **overrides})
    with pytest.raises(ct.ConvertError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        ct.export(params, m.config, tmp_path / "hf", fmt="hf")
    assert not (tmp_path / "hf").exists()


def test_the_standalone_torch_config_mirrors_model_py():
    """torch_gpt.py stands alone beside an export, so TorchGPTConfig repeats GPTConfig's architecture
    fields (same names, order and defaults; GPTConfig's REQUIRED_FIELDS without one) and derived sizes,
    and PADDED_LOGIT and the vocabulary's padding multiple; they must not drift apart."""
    jax_only = {"dtype", "remat", "attention", "fp8"}
    mirror = dataclasses.fields(torch_gpt.TorchGPTConfig)
    assert [f.name for f in mirror] == [f.name for f in dataclasses.fields(model.GPTConfig) if f.name not in jax_only]
    defaults = {f.name: f.default for f in dataclasses.fields(model.GPTConfig)}
    for f in mirror:
        if f.name in model.GPTConfig.REQUIRED_FIELDS:
            assert f.default is dataclasses.MISSING, f.name
        else:
            assert f.default == defaults[f.name] and type(f.default) is type(defaults[f.name]), f.name
    assert torch_gpt.PADDED_LOGIT == loss_lib.PADDED_LOGIT and torch_gpt.VOCAB_MULTIPLE == model.VOCAB_MULTIPLE
    for switches in [dict(alibi_attn=True, embed_norm=True), {}, *SWITCHES.values(), dict(vocab_size=50257),
                     dict(mlp_dim=40, num_kv_head=1, attention_bias=False, bias=True)]:
        cfg = model.GPTConfig(**{**SMALL, **switches})
        torch_cfg = torch_gpt.TorchGPTConfig.from_dict(dataclasses.asdict(cfg))
        for name in ("positions", "kv_heads", "ffn_dim", "attn_bias", "head_dim", "padded_vocab_size"):
            assert getattr(torch_cfg, name) == getattr(cfg, name), name


def test_tensor_parallelism_must_split_the_key_value_heads():
    cfg = model.GPTConfig(**{**SMALL, **SWITCHES["llama"]})  # 4 query heads, 2 key/value heads
    mesh = sharding.make_mesh(2, 1, 4)
    with pytest.raises(sharding.ShardingError, match=r"model.num_kv_head \(2\) is not divisible by the tensor axis"):
        sharding.check_model(mesh, cfg.axis_sizes)
