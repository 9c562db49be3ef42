"""Tests of LoRA fine-tuning (training.lora): adapters on a frozen base.

- a new adapter is PEFT's (A kaiming-uniform, B zero), its factors named for sharding as their kernel;
  adapters with B = 0 leave the model exactly as it was, for the fused q/k/v weight and for grouped-query
  attention's separate ones;
- the merged weights (lora.merge, rundir's load_params) are kernel + (alpha / r) * A @ B, written out
  here, an untargeted slice of a fused weight untouched, and give the unmerged model's logits;
- the step trains adapters only, from the base's loss; on 8 simulated devices, at every ZeRO stage and with
  tensor parallelism, it equals one device's; the frozen base stays bit for bit what it was; a base held
  in bfloat16 computes with those weights;
- through train.py from an imported LLaMA: the first loss is transformers', only adapters are checkpointed,
  the loss falls, --resume is exact, another base is refused in one line, and sample.py, eval.py and the
  export read the run as its merged model.
"""
import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers
import yaml
from flax import nnx

import convert_torch as ct
import eval as eval_lib
import model
import sample
import sharding
import train
from inference import decoding
from interop import hf_layouts
from layers import lora as lora_lib
from layers import loss as loss_lib
from store import rundir, runlock, weights
from test_convert import TOL, tokens
from test_families import SMALL, SWITCHES, V, hf_logits, random_hf
from test_train import corpus, deterministic, restore, rows, tiny  # noqa: F401  (corpus is a fixture)
from tokendata import loader, shards
from training import config
from training import step as step_lib

GPT2 = SMALL  # the fused q/k/v weight (d, 3, H, D), learned positions
LLAMA = {**SMALL, **SWITCHES["llama"]}  # separate q (d, H, D) and k/v (d, 2, K, D) weights, SwiGLU's gate
# the Dense modules of one block that each target adapts, by model.py's names (attention, MLP)
ADAPTED = {"q": {("attn", "c_attn"), ("attn", "c_q")}, "k": {("attn", "c_attn"), ("attn", "c_kv")},
           "v": {("attn", "c_attn"), ("attn", "c_kv")}, "o": {("attn", "c_proj")},
           "mlp": {("mlp", "c_fc"), ("mlp", "c_gate"), ("mlp", "c_proj")}}
FUSED = {"c_attn": ("q", "k", "v"), "c_kv": ("k", "v")}  # weights holding several projections along dim 1


def shapes(cfg, lora=None) -> dict:
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: model.GPT(cfg, lora=lora, rngs=nnx.Rngs(params=0)))))


def random_params(cfg, seed, lora=None, std=0.1) -> dict:
    """Random parameters of GPT(cfg, lora), adapters included (B too), as numpy: no compilation."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: rng.normal(0, std, a.shape).astype(np.float32), shapes(cfg, lora))


@functools.cache
def jitted_logits(cfg, lora_fields):
    """The jitted logits(params, tokens) of GPT(cfg, LoRAConfig(*lora_fields)) (one compilation per model
    and shape; a model run eagerly compiles op by op, which is slower)."""
    lora = None if lora_fields is None else config.LoRAConfig(*lora_fields[:3], list(lora_fields[3]))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model.GPT(cfg, lora=lora, rngs=nnx.Rngs(params=0))))

    def call(params, toks):
        state = jax.tree.map(lambda v: v, abstract)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)(toks)

    return jax.jit(call)


def logits(cfg, params, toks, lora=None) -> np.ndarray:
    """The logits of GPT(cfg, lora) holding `params`, jitted."""
    key = None if lora is None else (lora.rank, lora.alpha, lora.dropout, tuple(lora.targets))
    return np.asarray(jitted_logits(cfg, key)(params, np.asarray(toks)))


def eager_logits(cfg, params, toks, lora=None) -> np.ndarray:
    """logits, op by op: the adapters' products are then operations of their own. (Jitted, XLA may merge
    the products sharing an input, x @ kernel and x @ A, into one, whose sums round otherwise: ~1e-7.)"""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model.GPT(cfg, lora=lora, rngs=nnx.Rngs(params=0))))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return np.asarray(nnx.merge(graphdef, state)(jnp.asarray(toks)))


def greedy(cfg, params, prompt: list, new: int, width: np.ndarray) -> list:
    """Greedy decoding by recomputing the whole sequence for every token, without a cache. The sequence
    runs as row 0 of `width` (B, T) (T >= the final length; causal: what follows a position changes
    nothing there), so that every call has one shape."""
    seq = np.array(width)
    seq[0, :len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + new):
        seq[0, t] = logits(cfg, params, seq)[0, t - 1, :V].argmax()
    return seq[0, len(prompt):len(prompt) + new].tolist()


def expected_dense(cfg, lora) -> set:
    """(block, module, weight) of every adapted Dense, from ADAPTED and the model's layout."""
    names = set().union(*(ADAPTED[t] for t in lora.targets))
    present = {("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")}
    present |= {("attn", "c_attn")} if cfg.kv_heads == cfg.num_head else {("attn", "c_q"), ("attn", "c_kv")}
    if cfg.activation == "swiglu":
        present.add(("mlp", "c_gate"))
    return {(i, *n) for i in range(cfg.N) for n in names & present}


def merged_by_formula(cfg, lora, base, adapters) -> dict:
    """kernel + (alpha / rank) * A @ B for every adapted kernel, B's slices of untargeted projections zero."""
    out = jax.tree.map(np.array, base)
    for i, block in adapters["blocks"].items():
        for part, modules in block.items():
            for name, f in modules.items():
                b = np.array(f["lora_b"], np.float64)  # (r, out dims...)
                if name in FUSED:
                    for s, target in enumerate(FUSED[name]):
                        if target not in lora.targets:
                            b[:, s] = 0
                a = np.asarray(f["lora_a"], np.float64)  # (in dims..., r)
                kernel = out["blocks"][i][part][name]["kernel"]
                update = (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)).reshape(kernel.shape)
                out["blocks"][i][part][name]["kernel"] = (kernel + lora.alpha / lora.rank * update).astype(np.float32)
    return out


# ----------------------------------------------------------------------------------------------
# The model with adapters


# the layouts, each with targets that leave one projection of a fused weight out (k of GPT-2's q/k/v, v of
# LLaMA's k/v), and the logits' tokens
LAYOUTS = {"gpt2": (GPT2, config.LoRAConfig(rank=3, alpha=5.0, targets=["q", "v", "mlp"])),
           "llama": (LLAMA, config.LoRAConfig(rank=3, alpha=5.0, targets=["q", "k", "o", "mlp"]))}
TOKS = tokens(16, vocab=V)


def test_a_new_adapter_is_peft_s_and_changes_nothing():
    lora = config.LoRAConfig(rank=4, alpha=8.0, targets=["q", "v"])
    for shape, axes, n_in, slices in [((32, 3, 4, 8), ("embed", None, "heads", "kv"), 1, (1.0, 0.0, 1.0)),
                                      ((4, 8, 32), ("heads", "kv", "embed"), 2, None)]:
        dense = model.Dense(shape, axes, n_in, std=0.02, bias=True, dtype=jnp.float32, rngs=nnx.Rngs(params=0),
                            lora=lora, lora_slices=slices)
        a, b = np.asarray(dense.lora_a[...]), np.asarray(dense.lora_b[...])
        assert a.shape == (*shape[:n_in], 4) and b.shape == (4, *shape[n_in:])
        bound = 1 / np.sqrt(np.prod(shape[:n_in]))  # PEFT's kaiming_uniform_(a=sqrt(5)) of (r, fan_in), B zero
        assert 0.8 * bound < np.abs(a).max() <= bound and np.abs(a).mean() == pytest.approx(bound / 2, rel=0.15)
        assert not b.any()
        # the factors are placed as their kernel: the kernel's axis names, none for the rank
        assert dense.lora_a.get_metadata("axes") == (*axes[:n_in], None)
        assert dense.lora_b.get_metadata("axes") == (None, *axes[n_in:])
        x = np.random.default_rng(0).normal(size=(2, 5, *shape[:n_in])).astype(np.float32)
        spec = "btd,dshc->btshc" if n_in == 1 else "bthc,hcd->btd"
        want = np.einsum(spec, x, np.asarray(dense.kernel[...])) + np.asarray(dense.bias[...])
        np.testing.assert_allclose(np.asarray(dense(spec, x)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adapters_with_b_zero_leave_the_model_exactly_as_it_was(layout):
    cfg, lora = model.GPTConfig(**LAYOUTS[layout][0]), LAYOUTS[layout][1]
    base, adapters = lora_lib.split(random_params(cfg, 1, lora))
    assert jax.tree.structure(base) == jax.tree.structure(shapes(cfg))  # the base model's own tree, adapters beside
    found = {(i, part, name) for i, block in adapters["blocks"].items() for part, mods in block.items()
             for name in mods}
    assert found == expected_dense(cfg, lora)
    adapters = jax.tree_util.tree_map_with_path(lambda p, x: x if p[-1].key == "lora_a" else 0 * x, adapters)
    np.testing.assert_array_equal(eager_logits(cfg, lora_lib.join(base, adapters), TOKS, lora),
                                  eager_logits(cfg, base, TOKS))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_merged_weights_are_the_formula_and_give_the_adapted_models_logits(layout):
    cfg, lora = model.GPTConfig(**LAYOUTS[layout][0]), LAYOUTS[layout][1]
    # random A and B, B's unchosen slices too: the mask must hide them
    base, adapters = lora_lib.split(random_params(cfg, 1, lora))
    merged = jax.tree.map(np.asarray, lora_lib.merge(lora_lib.join(base, adapters), model.adapted_kernels(cfg, lora)))
    want = merged_by_formula(cfg, lora, base, adapters)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    fused = "c_attn" if "c_attn" in base["blocks"][0]["attn"] else "c_kv"
    untouched = FUSED[fused].index("k" if "k" not in lora.targets else "v")  # not targeted: exactly the base's
    np.testing.assert_array_equal(merged["blocks"][0]["attn"][fused]["kernel"][:, untouched],
                                  base["blocks"][0]["attn"][fused]["kernel"][:, untouched])
    np.testing.assert_allclose(logits(cfg, merged, TOKS), logits(cfg, lora_lib.join(base, adapters), TOKS, lora),
                               atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------
# PEFT adapters: every transformers layout, each with a projection of a fused q/k/v weight left out

PEFT_CASES = {  # layout -> (the model, its targets, the modules of a block PEFT must adapt, transformers' names)
    "gpt2": (GPT2, ["q", "v", "mlp"], {"attn.c_attn", "mlp.c_fc", "mlp.c_proj"}),  # Conv1D (in, out); k's columns 0
    "bloom": ({**SMALL, "alibi_attn": True, "embed_norm": True}, ["k", "o"],  # rows ordered (H, 3, D)
              {"self_attention.query_key_value", "self_attention.dense"}),
    "gpt_neox": ({**SMALL, **SWITCHES["neox"]}, ["q", "k", "v", "o", "mlp"],
                 {"attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"}),
    "gptj": ({**SMALL, **SWITCHES["gptj"]}, ["q", "v", "o"], {"attn.q_proj", "attn.v_proj", "attn.out_proj"}),
    "opt": ({**SMALL, **SWITCHES["opt"]}, ["v", "mlp"], {"self_attn.v_proj", "fc1", "fc2"}),
    "llama": (LLAMA, ["q", "k", "o", "mlp"],  # q from c_q, k from c_kv (whose v is left out)
              {"self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"}),
}


def peft_logits(base_dir, adapter_dir, toks) -> tuple[np.ndarray, set]:
    """The logits of transformers' model at base_dir with the adapter loaded by peft's own loader, and the
    modules PEFT adapted."""
    tuned = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir),
                                           adapter_dir).eval()
    adapted = {k.split(".lora_")[0] for k in peft.get_peft_model_state_dict(tuned)}
    saved = {k.split(".lora_")[0] for k in safetensors.numpy.load_file(adapter_dir / ct.ADAPTER_WEIGHTS)}
    assert adapted == saved  # PEFT adapted the modules the file holds and no other (those would be PEFT's init)
    return hf_logits(tuned, toks), adapted


@pytest.mark.parametrize("layout", list(PEFT_CASES))
def test_peft_loads_the_exported_adapter_as_the_adapted_model(layout, tmp_path):
    switches, targets, modules = PEFT_CASES[layout]
    cfg, lora = model.GPTConfig(**switches), config.LoRAConfig(rank=3, alpha=5.0, dropout=0.1, targets=targets)
    base, adapters = lora_lib.split(random_params(cfg, 2, lora, std=0.2))  # B too: a trained adapter
    assert ct.export(base, cfg, tmp_path / "base", fmt="hf") == layout
    assert ct.export_adapter(adapters, cfg, lora, tmp_path / "adapter") == layout
    meta = json.loads((tmp_path / "adapter" / ct.ADAPTER_CONFIG).read_text())
    assert (meta["r"], meta["lora_alpha"], meta["fan_in_fan_out"]) == (3, 5.0, layout == "gpt2")
    got, adapted = peft_logits(tmp_path / "base", tmp_path / "adapter", TOKS)
    n = hf_layouts.LAYOUTS[layout]
    assert adapted == {f"base_model.model.{n['P']}{n['h']}.{i}.{m}" for i in range(cfg.N) for m in modules}
    want = logits(cfg, lora_lib.join(base, adapters), TOKS, lora)[..., :V]
    assert np.abs(want - logits(cfg, base, TOKS)[..., :V]).max() > 0.1  # the adapters change the model
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)  # every real logit


# ----------------------------------------------------------------------------------------------
# The step: adapters trained, the base frozen, on any mesh

LORA_STEP = config.LoRAConfig(rank=4, alpha=8.0, dropout=0.1, targets=["q", "v", "o", "mlp"])


def training_config(lora) -> config.TrainingConfig:
    return config.TrainingConfig(steps=10, batch_size=8, seq_len=16, lr=1e-2, min_lr=1e-2, warmup_steps=0,
                                 loss_chunk=0, init_from="base", lora=lora)


@pytest.fixture(scope="module")
def step_case():
    """(config, base params, batch, the run on one device: losses, adapters, base after)."""
    cfg = model.GPTConfig(**{**GPT2, "N": 1})  # one block: every weight kind, less to compile
    base = random_params(cfg, 1, std=0.02)
    batch = np.asarray(jax.random.randint(jax.random.key(2), (8, 17), 0, V), np.int32)
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    return cfg, base, batch, run_steps(cfg, base, batch, one, 0)


def run_steps(cfg, base, batch, mesh, stage, lora=LORA_STEP, steps=3):
    """Losses of `steps` LoRA steps on the same batch, the adapters after them, and the placed base after them."""
    fns = step_lib.build(cfg, training_config(lora), mesh, stage)
    state, placed = fns.init(), fns.place_base(base)
    losses = []
    for _ in range(steps):
        state, metrics = fns.train_step(state, sharding.place_batch(batch, mesh, 8), placed)
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state["params"]), jax.device_get(placed)


def test_the_step_trains_adapters_only_from_the_base_model(step_case):
    cfg, base, batch, (losses, adapters, base_after) = step_case
    for a, b in zip(jax.tree.leaves(base_after), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)  # not donated, never updated
    assert {path[-1].key for path, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]} == {"lora_a", "lora_b"}
    # step 0 is the base model (B = 0; the adapters' dropout changes nothing then), through model.py's loss
    # (another compiled program: float32 sums in another order)
    loss0, _ = loss_lib.cross_entropy(logits(cfg, base, batch[:, :-1]), batch[:, 1:])
    assert losses[0] == pytest.approx(float(loss0), abs=1e-5)
    assert losses[2] < losses[1] < losses[0]  # one batch, learnt
    # k's slice of the fused weight is not targeted: its B never moves from zero
    for block in adapters["blocks"].values():
        b = block["attn"]["c_attn"]["lora_b"]  # (r, 3, H, D)
        assert not b[:, 1].any() and b[:, 0].any() and b[:, 2].any()


@pytest.mark.parametrize("sizes, stage", [((8, 1, 1), 0), ((4, 1, 2), 1), ((2, 4, 1), 2), ((2, 2, 2), 3)],
                         ids=["data8-zero0", "data4-tensor2-zero1", "data2-fsdp4-zero2", "data2-fsdp2-tensor2-zero3"])
def test_every_zero_stage_and_tensor_parallelism_equal_one_device(step_case, sizes, stage):
    cfg, base, batch, (ref_losses, ref_adapters, _) = step_case
    mesh = sharding.make_mesh(*sizes)
    fns = step_lib.build(cfg, training_config(LORA_STEP), mesh, stage)
    if stage == 3:  # the base is sharded as a full run's params would be: over data x fsdp, and heads over tensor
        spec = fns.base_sharding["blocks"][0]["attn"]["c_attn"]["kernel"].spec
        assert spec == jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None)
    losses, adapters, base_after = run_steps(cfg, base, batch, mesh, stage)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    # three AdamW updates of ~1e-2 each (lr 1e-2): float32 sums in another order move them by a few 1e-6
    for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(ref_adapters), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(jax.tree.leaves(base_after), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_bfloat16_base_computes_with_its_rounded_weights(step_case):
    cfg, base, batch, _ = step_case
    lora = dataclasses.replace(LORA_STEP, base_dtype="bfloat16")
    one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    fns = step_lib.build(cfg, training_config(lora), one, 0)
    placed = jax.device_get(fns.place_base(base))
    for path, x in jax.tree_util.tree_flatten_with_path(placed)[0]:
        matrix = x.ndim >= 2 and path[-1].key not in ("bias", "scale")  # kernels, embeddings; not norms, biases
        assert x.dtype == (jnp.bfloat16 if matrix else np.float32), jax.tree_util.keystr(path)
    # the loss is the float32 model's with those weights rounded to bfloat16, and adapters (float32) beside
    adapters = lora_lib.split(random_params(cfg, 2, lora))[1]
    loss_sum, n = fns.eval_step(adapters, {"tokens": batch, "weights": np.ones((8, 16), np.float32)}, placed)
    rounded = jax.tree.map(lambda x: np.asarray(x, np.float32), placed)
    want, _ = loss_lib.cross_entropy(logits(cfg, lora_lib.join(rounded, adapters), batch[:, :-1], lora), batch[:, 1:])
    assert float(loss_sum / n) == pytest.approx(float(want), abs=1e-5)
    exact, _ = loss_lib.cross_entropy(logits(cfg, lora_lib.join(base, adapters), batch[:, :-1], lora), batch[:, 1:])
    assert float(want) != float(exact)  # the rounding shows


# ----------------------------------------------------------------------------------------------
# train.py, from an imported LLaMA (grouped-query attention), through every reader

LORA_ARGS = ("training.lora.rank=4", "training.lora.alpha=8", "training.lora.dropout=0.1",
             "training.lora.targets=[q,k,v,o,mlp]")
MESH_ARGS = ("sharding.data=2", "sharding.fsdp=2", "sharding.tensor=2", "sharding.zero_stage=3")


def import_llama(corpus, directory, seed):  # noqa: F811
    """A random transformers LLaMA of the corpus's vocabulary, imported as a run directory: (run dir, model)."""
    hf = random_hf("llama", directory / "hf", seed=seed)
    shutil.copyfile(corpus / "tokenizer.json", directory / "hf" / "tokenizer.json")
    ct.import_hf(directory / "hf", directory / "run")
    return directory / "run", hf


def lora_args(run_dir, corpus, base, *extra):  # noqa: F811
    return [a for a in tiny(run_dir, corpus) if a != "model=test"] + [f"training.init_from={base}", *LORA_ARGS,
                                                                      *MESH_ARGS, *extra]


@pytest.fixture(scope="module")
def lora_run(corpus, tmp_path_factory):  # noqa: F811
    """(base run, transformers model, LoRA run trained 8 steps with checkpoints 4 and 8, the base's bytes before)."""
    root = tmp_path_factory.mktemp("lora")
    base, hf = import_llama(corpus, root / "base", seed=0)
    before = {p: p.read_bytes() for p in base.rglob("*") if p.is_file()}
    assert train.main(lora_args(root / "run", corpus, base, "training.lr=5e-2")) == 0
    return base, hf, root / "run", before


def test_training_checkpoints_adapters_over_an_untouched_base(lora_run, corpus):  # noqa: F811
    base, hf, run, before = lora_run
    assert {p: p.read_bytes() for p in base.rglob("*") if p.is_file() and p.name != runlock.LOCK} == \
        {p: b for p, b in before.items() if p.name != runlock.LOCK}
    record = json.loads((run / weights.LORA_BASE).read_text())
    assert (record["init_from"], record["step"]) == (str(base), 0)
    # the first loss is the base model's: transformers' on the same batch
    batch = loader.TextLoader(shards.open_data(corpus), "train", 32, 8, seed=0).get_batch(0)
    with torch.no_grad():
        ids = torch.tensor(batch, dtype=torch.long)
        want = float(torch.nn.functional.cross_entropy(hf(input_ids=ids[:, :-1]).logits.reshape(-1, V),
                                                       ids[:, 1:].reshape(-1)))
    got = rows(run)
    assert got[0]["loss"] == pytest.approx(want, abs=1e-4)
    val = [r["val_loss"] for r in got if "val_loss" in r]  # steps 4 and 8, on the same validation sample
    assert val[1] < val[0] < got[0]["loss"] - 0.1, (val, got[0]["loss"])  # the adapters learn
    # a checkpoint holds the adapters and their optimizer state, nothing of the base
    state = restore(run, 8)
    names = {path[-1].key for path, _ in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    assert names == {"lora_a", "lora_b"}
    moments = [path for path, x in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0] if np.ndim(x)]
    assert {path[-1].key for path in moments} == {"lora_a", "lora_b"}  # beside AdamW's scalar counts
    assert len(moments) == 2 * len(jax.tree.leaves(state["params"]))  # mu and nu


@pytest.fixture(scope="module")
def windows(corpus):  # noqa: F811
    """16 windows of 32 tokens spread over the validation split (16, 33): what eval.py --lengths 32
    --max-tokens 512 scores, and one shape for every logits compared below."""
    (batch,) = loader.eval_windows(shards.open_data(corpus), "val", 32, 16, max_windows=16)
    return batch


def test_readers_get_the_merged_model(lora_run, windows):
    base, _, run, _ = lora_run
    cfg = rundir.Run(run).record.config()
    base_params, _ = rundir.Run(base).weights.load_params()
    adapters = jax.tree.map(np.asarray, restore(run, 8)["params"])  # as orbax saved them, block keys as strings
    adapters = {"blocks": {int(i): b for i, b in adapters["blocks"].items()}}
    want = merged_by_formula(cfg.model, cfg.training.lora, base_params, adapters)
    params, step = rundir.Run(run).weights.load_params()
    assert step == 8 and jax.tree.structure(params) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    toks = windows[:, :-1]
    merged_logits = logits(cfg.model, params, toks)
    np.testing.assert_allclose(merged_logits, logits(cfg.model, lora_lib.join(base_params, adapters), toks,
                                                     cfg.training.lora), atol=1e-5, rtol=0)
    m, _ = rundir.Run(run).weights.load_model()  # what sample.py and eval.py load
    np.testing.assert_array_equal(logits(cfg.model, nnx.to_pure_dict(nnx.state(m)), toks), merged_logits)


def test_init_from_a_lora_run_says_it_trains_the_merged_model_whole(lora_run, corpus, tmp_path, capsys):  # noqa: F811
    """training.init_from a LoRA run without training.lora of its own: a full fine-tune of its merged model,
    said in one line at the start (naming the base and how to train an adapter instead); the parameters it
    starts from are the merged ones (a step at learning rate 0 keeps them)."""
    base, _, run, _ = lora_run
    tuned = tmp_path / "tuned"
    capsys.readouterr()
    assert train.main([a for a in tiny(tuned, corpus) if a != "model=test"] + [
        f"training.init_from={run}", "training.steps=1", "training.warmup_steps=0", "checkpoint.every=1",
        "training.lr=0", "training.min_lr=0"]) == 0
    assert (f"parameters from {run}, a LoRA run: its merged weights (its base {base} with the adapters folded in), "
            f"every one of them trained from here (a full fine-tune); to train an adapter on them instead, set "
            f"training.lora.rank (and the other training.lora.* keys)") in capsys.readouterr().out.splitlines()
    merged, started = rundir.Run(run).weights.load_params()[0], rundir.Run(tuned).weights.load_params()[0]
    for a, b in zip(jax.tree.leaves(started), jax.tree.leaves(merged), strict=True):
        np.testing.assert_array_equal(a, b)
    # a LoRA run whose base is gone: one line, not the readers' --base (train.py has none), and nothing made
    gone = shutil.copytree(run, tmp_path / "lora-copy")
    record = json.loads((gone / weights.LORA_BASE).read_text())
    (gone / weights.LORA_BASE).write_text(json.dumps({**record, "init_from": str(tmp_path / "no-base")}))
    capsys.readouterr()
    assert train.cli([a for a in tiny(tmp_path / "again", corpus) if a != "model=test"] + [
        f"training.init_from={gone}", "training.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: training.init_from: the base model (training.init_from={tmp_path / 'no-base'}) "
                          f"of this LoRA run: ") and err.count("\n") == 1, err
    assert err.endswith("if the base moved, give its new place: move it back where the LoRA run records it, or "
                        "start from that base itself\n") and "--base" not in err, err
    assert not (tmp_path / "again").exists()


def test_sample_eval_and_export_read_a_lora_run(lora_run, windows, corpus, tmp_path, capsys):  # noqa: F811
    base, _, run, _ = lora_run
    cfg = rundir.Run(run).record.config()
    merged, _ = rundir.Run(run).weights.load_params()  # checked against the formula above
    # sample.py: greedy decoding is the merged model's, recomputed here without a cache
    tok = rundir.Run(run).record.tokenizer()
    prompt = " the cat sat"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    capsys.readouterr()
    assert sample.cli(["--checkpoint", str(run), "--prompt", prompt, "--temperature", "0",
                       "--max-new-tokens", "4"]) == 0
    new = decoding.truncate(np.asarray(greedy(cfg.model, merged, ids, 4, windows[:, :-1])), shards.eot_id_of(tok))
    assert capsys.readouterr().out.splitlines()[1] == tok.decode(ids + list(new))
    # eval.py: the merged model's loss on those windows
    assert eval_lib.cli(["--checkpoint", str(run), "--data", str(corpus), "--lengths", "32",
                         "--max-tokens", "512"]) == 0
    (row,) = json.loads((run / "eval" / "step8.json").read_text())["perplexity"]["rows"]
    merged_logits = logits(cfg.model, merged, windows[:, :-1])
    want, _ = loss_lib.cross_entropy(merged_logits, windows[:, 1:])
    assert row["windows"] == 16 and row["loss"] == pytest.approx(float(want), abs=1e-5)
    # the export (transformers' LLaMA layout) is the merged model
    assert ct.cli(["--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    np.testing.assert_allclose(hf_logits(hf, windows[:, :-1]), merged_logits[..., :V], atol=TOL, rtol=0)
    # and as a PEFT adapter, on the transformers model the base was imported from
    capsys.readouterr()
    assert ct.cli(["--checkpoint", str(run), "--out", str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert "peft.PeftModel.from_pretrained" in capsys.readouterr().out
    got, adapted = peft_logits(base.parent / "hf", tmp_path / "adapter", windows[:, :-1])
    assert len(adapted) == cfg.model.N * 7  # q, k, v, o and the three of SwiGLU's MLP
    np.testing.assert_allclose(got, merged_logits[..., :V], atol=TOL, rtol=0)
    # a run without adapters has none to export: one line, nothing written
    capsys.readouterr()
    assert ct.cli(["--checkpoint", str(base), "--out", str(tmp_path / "none"), "--format", "peft"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not a LoRA run" in err, err
    assert not (tmp_path / "none").exists()


def test_resume_is_exact_from_the_same_base_anywhere(lora_run, tmp_path):
    base, _, run, _ = lora_run
    crashed, moved = tmp_path / "crashed", tmp_path / "moved"
    shutil.copytree(run, crashed)
    shutil.rmtree(crashed / "checkpoints" / "8")  # stopped before its step-8 checkpoint
    shutil.copytree(base, moved)  # a copy of the base elsewhere is the same base
    assert train.main(["--resume", f"run_dir={crashed}", f"training.init_from={moved}"]) == 0
    assert [deterministic(r) for r in rows(crashed)] == [deterministic(r) for r in rows(run)]
    for a, b in zip(jax.tree.leaves(restore(crashed, 8)), jax.tree.leaves(restore(run, 8)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert json.loads((crashed / weights.LORA_BASE).read_text())["init_from"] == str(moved)


@pytest.fixture(scope="module")
def other_base(corpus, tmp_path_factory):  # noqa: F811
    """A run directory of the LoRA run's base model with other weights (the same shapes)."""
    other, _ = import_llama(corpus, tmp_path_factory.mktemp("other"), seed=1)
    return other


def test_another_base_or_other_adapters_are_refused_on_resume(lora_run, other_base, tmp_path, capsys):
    base, _, run, _ = lora_run
    other = other_base  # the same model, other weights
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    kept = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != runlock.LOCK}
    capsys.readouterr()
    for overrides, words in [([f"training.init_from={other}"], [str(other), str(base), "is not the base"]),
                             (["training.lora.rank=8"], ["cannot change training.lora", "rank 4", "rank 8"]),
                             (["training.lora=null"], ["cannot change training.lora", "null"])]:
        assert train.cli(["--resume", f"run_dir={copy}", "training.steps=9", *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and all(w in err for w in words), err
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != runlock.LOCK} == kept


def test_every_reader_refuses_a_run_whose_base_was_replaced_or_is_gone(lora_run, other_base, corpus,  # noqa: F811
                                                                     tmp_path, capsys):
    """sample.py, eval.py and every export (--format peft, whose adapters alone need no base to be written,
    included) check the base as a resume does: another model at the recorded place (the same architecture,
    other weights), or none, is one line naming it, and nothing is written. A model that no transformers
    layout expresses is refused by --format peft in its own terms, not --format hf's."""
    base, _, run, _ = lora_run
    copy, moved = tmp_path / "run", tmp_path / "base"
    shutil.copytree(run, copy)
    shutil.copytree(base, moved)
    record = json.loads((copy / weights.LORA_BASE).read_text())
    (copy / weights.LORA_BASE).write_text(json.dumps({**record, "init_from": str(moved)}))  # its base is now there
    other = other_base
    readers = {"sample.py": lambda: sample.cli(["--checkpoint", str(copy), "--prompt", " the"]),
               "eval.py": lambda: eval_lib.cli(["--checkpoint", str(copy), "--data", str(corpus), "--lengths", "32"]),
               **{f"--format {fmt}": functools.partial(ct.cli, ["--checkpoint", str(copy), "--out",
                                                                 str(tmp_path / fmt), "--format", fmt])
                  for fmt in ("hf", "peft")}}
    for state, words in [("replaced", [str(moved), "is not the base this LoRA run's adapters were trained on"]),
                         ("gone", [f"the base model (training.init_from={moved}) of this LoRA run"])]:
        shutil.rmtree(moved)
        if state == "replaced":
            shutil.copytree(other, moved)
        kept = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != runlock.LOCK}
        for reader, read in readers.items():
            capsys.readouterr()
            assert read() == 2, (state, reader)
            err = capsys.readouterr().err
            assert err.startswith("error: ") and err.count("\n") == 1 and all(w in err for w in words), (reader, err)
        assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != runlock.LOCK} == kept
        assert not (tmp_path / "hf").exists() and not (tmp_path / "peft").exists()
    # a model without a transformers layout (LLaMA's, with a LayerNorm after the embedding)
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    saved["model"]["embed_norm"] = True
    (copy / "config.yaml").write_text(yaml.safe_dump(saved))
    capsys.readouterr()
    assert ct.cli(["--checkpoint", str(copy), "--out", str(tmp_path / "peft"), "--format", "peft"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot export the adapters with --format peft: ") and "embed_norm: true" in err \
        and "--format hf" not in err and err.count("\n") == 1, err


def test_the_readers_take_a_moved_base_from_base(lora_run, corpus, tmp_path, capsys):  # noqa: F811
    """A LoRA run whose base moved since it trained (config.yaml and lora_base.json name a place where nothing
    is now): every reader's line names --base, and with --base at the new place each reads the run as
    before (sample.py's greedy text is the one it gives with the base in place); a resume's line names
    training.init_from; --base on a run that is no LoRA run is refused."""
    base, _, run, _ = lora_run
    copy, gone, moved = tmp_path / "run", tmp_path / "gone", tmp_path / "moved"
    shutil.copytree(run, copy)
    shutil.copytree(base, moved)
    record = json.loads((copy / weights.LORA_BASE).read_text())
    (copy / weights.LORA_BASE).write_text(json.dumps({**record, "init_from": str(gone)}))
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    saved["training"]["init_from"] = str(gone)
    (copy / "config.yaml").write_text(yaml.safe_dump(saved))
    greedy_args = ["--prompt", " the cat", "--temperature", "0", "--max-new-tokens", "4"]
    capsys.readouterr()
    assert sample.cli(["--checkpoint", str(run), *greedy_args]) == 0
    in_place = capsys.readouterr().out.splitlines()[1]  # the text, after the sample's header line
    readers = {"sample.py": (sample.cli, ["--checkpoint", str(copy), *greedy_args]),
               "eval.py": (eval_lib.cli, ["--checkpoint", str(copy), "--data", str(corpus), "--lengths", "32",
                                          "--max-tokens", "512"]),
               **{f"--format {fmt}": (ct.cli, ["--checkpoint", str(copy), "--out", str(tmp_path / fmt), "--format",
                                               fmt]) for fmt in ("hf", "peft")}}
    for reader, (cli, argv) in readers.items():
        assert cli(argv) == 2, reader
        err = capsys.readouterr().err
        assert err.startswith(f"error: the base model (training.init_from={gone}) of this LoRA run: ") and \
            err.endswith("; if the base moved, give its new place: --base DIR\n") and err.count("\n") == 1, err
        assert cli([*argv, "--base", str(moved)]) == 0, reader
        out = capsys.readouterr().out
        if reader == "sample.py":
            assert out.splitlines()[1] == in_place
        if reader == "--format peft":  # the base it names to load the adapter on is where it is now
            assert f"the model {moved} was imported from" in out
    assert (copy / "eval" / "step8.json").is_file() and (tmp_path / "hf" / "config.json").is_file()
    assert train.cli(["--resume", f"run_dir={copy}", "training.steps=9"]) == 2
    assert capsys.readouterr().err == (
        f"error: training.init_from: {gone} is not a run directory: config.yaml not found in it; if it moved since "
        f"this run started, give its new place: --resume training.init_from=DIR\n")
    assert sample.cli(["--checkpoint", str(moved), "--prompt", "a", "--base", str(base)]) == 2
    assert capsys.readouterr().err == (
        f"error: --base {base}: {moved} is not a LoRA run (its training.lora is null): its checkpoints hold its whole "
        f"model, with no base to point at; leave --base out\n")


def test_config_checks():
    with pytest.raises(config.ConfigError, match="^training.lora needs training.init_from"):
        config.load_config(overrides=["training.lora.rank=4"])
    for override, message in [("training.lora.rank=0", "training.lora.rank must be >= 1, got 0"),
                              ("training.lora.targets=[q,x]", "training.lora.targets: unknown target 'x'"),
                              ("training.lora.targets=[]", "training.lora.targets: no target"),
                              ("training.lora.dropout=1", r"training.lora.dropout must be in \[0, 1\)"),
                              ("training.lora.base_dtype=int8", "training.lora.base_dtype must be null or one of"),
                              ("training.lora.bogus=1", "unknown key training.lora.bogus; valid keys of training.lora: "
                                                        "rank, alpha, dropout, targets, base_dtype")]:
        with pytest.raises(config.ConfigError, match=message):
            config.load_config(overrides=["training.init_from=runs/base", override])
    cfg = config.load_config(overrides=["training.init_from=runs/base", "training.lora={rank: 2, targets: [o]}",
                                        "training.lora.alpha=4"])
    assert cfg.training.lora == config.LoRAConfig(rank=2, alpha=4.0, targets=["o"])
    assert config.from_saved(config.to_dict(cfg)).training.lora == cfg.training.lora  # config.yaml round trip
    assert config.load_config().training.lora is None  # the default: every weight trained
