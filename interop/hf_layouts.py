"""The transformers layouts: tensor names both ways, and what a layout cannot express.

Every tensor of an export is one entry of a layout table (LAYOUTS: this project's own "torch" layout,
torch_gpt.py's state dict, and the GPT-2, BLOOM, GPT-J, GPT-NeoX, OPT and LLaMA layouts of
transformers): `to_torch_tensors` and `from_torch_tensors` map a model.py parameter tree to a layout's
tensors and back, each tensor exactly once, listing missing, unexpected and mis-shaped keys.
`hf_format` names the layout that expresses a model.GPTConfig exactly, or refuses with the reasons;
hf_configs.py writes that layout's config.json and reads one back. Exports and imports
(convert_torch.py) are built on these.
"""
from __future__ import annotations

import math

import numpy as np

from core.errors import ConvertError
from interop.torch_gpt import key_problems
from model import GPTConfig

# ----------------------------------------------------------------------------------------------
# Layouts: each entry maps one JAX parameter (a dotted path into the pure dict) to one tensor.
# (jax_path or None, key, to_torch(array) -> array, from_torch(array) -> array, torch shape).
# A None path is a zero tensor the layout needs but the model does not have (bias=False). A path
# ending in #i is part i of a fused weight (q, k, v of c_attn; k, v of c_kv): its index along the
# fused axis (1 of a kernel, 0 of a bias), for layouts that keep them as separate tensors.

# Per layout: the key prefix of the body, the names of its parts, and how q, k, v are stored:
# "3hd" one fused weight, rows (3, H, D); "h3d" one fused weight, rows (H, 3, D); "split" three.
LAYOUTS = {
    "torch": dict(P="", wte="wte", wpe="wpe", en="embed_norm", h="blocks", ln1="ln_1", ln2="ln_2",
                  qkv="attn.c_attn", q="attn.c_q", kv="attn.c_kv", proj="attn.c_proj", fc="mlp.c_fc",
                  gate="mlp.c_gate", fc2="mlp.c_proj", lnf="ln_f", head="lm_head", fused="3hd"),
    "gpt2": dict(P="transformer.", wte="wte", wpe="wpe", h="h", ln1="ln_1", ln2="ln_2", qkv="attn.c_attn",
                 proj="attn.c_proj", fc="mlp.c_fc", fc2="mlp.c_proj", lnf="ln_f", head="lm_head", fused="3hd"),
    "bloom": dict(P="transformer.", wte="word_embeddings", en="word_embeddings_layernorm", h="h",
                  ln1="input_layernorm", ln2="post_attention_layernorm", qkv="self_attention.query_key_value",
                  proj="self_attention.dense", fc="mlp.dense_h_to_4h", fc2="mlp.dense_4h_to_h", lnf="ln_f",
                  head="lm_head", fused="h3d"),
    "gptj": dict(P="transformer.", wte="wte", h="h", ln1="ln_1", q="attn.q_proj", k="attn.k_proj",
                 v="attn.v_proj", proj="attn.out_proj", fc="mlp.fc_in", fc2="mlp.fc_out", lnf="ln_f",
                 head="lm_head", fused="split"),
    "gpt_neox": dict(P="gpt_neox.", wte="embed_in", h="layers", ln1="input_layernorm",
                     ln2="post_attention_layernorm", qkv="attention.query_key_value", proj="attention.dense",
                     fc="mlp.dense_h_to_4h", fc2="mlp.dense_4h_to_h", lnf="final_layer_norm", head="embed_out",
                     fused="h3d"),
    "opt": dict(P="model.decoder.", wte="embed_tokens", wpe="embed_positions", h="layers", ln1="self_attn_layer_norm",
                ln2="final_layer_norm", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                proj="self_attn.out_proj", fc="fc1", fc2="fc2", lnf="final_layer_norm", head="lm_head",
                fused="split"),
    "llama": dict(P="model.", wte="embed_tokens", h="layers", ln1="input_layernorm", ln2="post_attention_layernorm",
                  q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", proj="self_attn.o_proj",
                  fc="mlp.up_proj", gate="mlp.gate_proj", fc2="mlp.down_proj", lnf="norm", head="lm_head",
                  fused="split"),
}
# The biases a layout always has, written as zeros when the model has none (which is exact); a
# layout's other biases follow switches in its config.
ALWAYS_BIASED = {"torch": (), "gpt2": ("bias", "attn_bias", "norm_bias"), "bloom": ("bias", "attn_bias", "norm_bias"),
                 "gptj": ("bias", "norm_bias", "head_bias"), "gpt_neox": ("bias", "norm_bias"),
                 "opt": ("norm_bias",), "llama": ()}
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "bloom": "BloomForCausalLM", "gptj": "GPTJForCausalLM",
              "gpt_neox": "GPTNeoXForCausalLM", "opt": "OPTForCausalLM", "llama": "LlamaForCausalLM"}


def head_key(fmt: str) -> str:
    """The key of a layout's output projection (untied, or a tied copy some checkpoints carry)."""
    return f"{LAYOUTS[fmt]['head']}.weight"


def embedding_key(fmt: str) -> str:
    n = LAYOUTS[fmt]
    return f"{n['P']}{n['wte']}.weight"


def _layout(c: GPTConfig, fmt: str) -> list[tuple]:
    if fmt not in LAYOUTS:
        raise ConvertError(f"unknown format {fmt!r}")
    d, H, K, D, Fw = c.embedding_dim, c.num_head, c.kv_heads, c.head_dim, c.ffn_dim
    n, P, conv1d = LAYOUTS[fmt], LAYOUTS[fmt]["P"], fmt == "gpt2"  # GPT-2's Conv1D weights are (in, out)
    always = ALWAYS_BIASED[fmt] + (("bias", "attn_bias") if fmt == "opt" and (c.bias or c.attn_bias) else ())
    has = {None: True, "bias": c.bias, "attn_bias": c.attn_bias, "norm_bias": c.bias and c.norm == "layernorm",
           "head_bias": c.head_bias}
    same = (lambda a: a, lambda a: a)
    entries = []

    def add(path, key, fns, shape, gate=None):
        if not has[gate]:
            if gate not in always:
                return  # neither the model nor the layout has it
            path = None
        entries.append((path, key, fns[0], fns[1], shape))

    def norm(path, key):
        add(f"{path}.scale", f"{key}.weight", same, (d,))
        add(f"{path}.bias", f"{key}.bias", same, (d,), "norm_bias")

    def linear(path, key, jax_shape, n_in, gate, part=""):
        """A Dense of model.py (kernel jax_shape, its first n_in dims the input) as a Linear (or Conv1D)."""
        i, o = math.prod(jax_shape[:n_in]), math.prod(jax_shape[n_in:])
        if conv1d:
            fns, shape = (lambda a: a.reshape(i, o), lambda a: a.reshape(jax_shape)), (i, o)
        else:
            fns, shape = (lambda a: a.reshape(i, o).T, lambda a: a.T.reshape(jax_shape)), (o, i)
        add(f"{path}.kernel{part}", f"{key}.weight", fns, shape)
        out = jax_shape[n_in:]
        add(f"{path}.bias{part}", f"{key}.bias", (lambda a: a.reshape(-1), lambda a: a.reshape(out)), (o,), gate)

    V, pad = c.vocab_size, c.padded_vocab_size - c.vocab_size
    # the files hold the real vocabulary's rows; model.py's padding rows (no logit depends on them) come back zero
    real_rows = (lambda a: a[:V], lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)]))
    add("wte", f"{P}{n['wte']}.weight", real_rows, (V, d))
    if c.positions == "learned":
        add("wpe", f"{P}{n['wpe']}.weight", same, (c.block_size + c.position_offset, d))
    if c.embed_norm:
        norm("embed_norm", f"{P}{n['en']}")
    for i in range(c.N):
        j, k = f"blocks.{i}", f"{P}{n['h']}.{i}"
        norm(f"{j}.ln_1", f"{k}.{n['ln1']}")
        if n["fused"] == "split":  # q, k and v as three tensors, from c_attn (or c_q and c_kv) in parts
            parts = [(f"{j}.attn.c_attn", "#0", H), (f"{j}.attn.c_attn", "#1", H), (f"{j}.attn.c_attn", "#2", H)] \
                if K == H else [(f"{j}.attn.c_q", "", H), (f"{j}.attn.c_kv", "#0", K), (f"{j}.attn.c_kv", "#1", K)]
            for (path, part, heads), name in zip(parts, ("q", "k", "v")):
                linear(path, f"{k}.{n[name]}", (d, heads, D), 1, "attn_bias", part)
        elif K != H:
            linear(f"{j}.attn.c_q", f"{k}.{n['q']}", (d, H, D), 1, "attn_bias")
            linear(f"{j}.attn.c_kv", f"{k}.{n['kv']}", (d, 2, K, D), 1, "attn_bias")
        elif n["fused"] == "3hd":
            linear(f"{j}.attn.c_attn", f"{k}.{n['qkv']}", (d, 3, H, D), 1, "attn_bias")
        else:  # "h3d": the output rows ordered (H, 3, D)
            add(f"{j}.attn.c_attn.kernel", f"{k}.{n['qkv']}.weight",
                (lambda a: a.transpose(2, 1, 3, 0).reshape(3 * d, d),
                 lambda a: a.reshape(H, 3, D, d).transpose(3, 1, 0, 2)), (3 * d, d))
            add(f"{j}.attn.c_attn.bias", f"{k}.{n['qkv']}.bias",
                (lambda a: a.transpose(1, 0, 2).reshape(3 * d), lambda a: a.reshape(H, 3, D).transpose(1, 0, 2)),
                (3 * d,), "attn_bias")
        linear(f"{j}.attn.c_proj", f"{k}.{n['proj']}", (H, D, d), 2, "attn_bias")
        if c.residual != "parallel_shared":
            norm(f"{j}.ln_2", f"{k}.{n['ln2']}")
        linear(f"{j}.mlp.c_fc", f"{k}.{n['fc']}", (d, Fw), 1, "bias")
        if c.activation == "swiglu":
            linear(f"{j}.mlp.c_gate", f"{k}.{n['gate']}", (d, Fw), 1, "bias")
        linear(f"{j}.mlp.c_proj", f"{k}.{n['fc2']}", (Fw, d), 1, "bias")
    norm("ln_f", f"{P}{n['lnf']}")
    if not c.tie_embeddings:
        add("lm_head", f"{n['head']}.weight", real_rows, (V, d))
    add("head_bias", "head_bias" if fmt == "torch" else f"{n['head']}.bias", real_rows, (V,), "head_bias")
    return entries


def _check_keys(found: dict, expected: dict, where: str) -> None:
    """Raise a ConvertError listing missing, unexpected and mis-shaped keys (name -> shape dicts)."""
    problems = key_problems(found, expected)
    if problems:
        raise ConvertError(f"{where} does not match the model: " + "; ".join(problems))


def flatten(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """A pure dict of parameters -> {'blocks.0.attn.c_attn.kernel': float32 array}."""
    flat = {}
    for k, v in params.items():
        if isinstance(v, dict):
            flat.update(flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = np.asarray(v, dtype=np.float32)
    return flat


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    """The inverse of flatten, with integer block indices as nnx.to_pure_dict gives them."""
    tree: dict = {}
    for path, v in flat.items():
        node, parts = tree, [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return tree


def _part_axis(path: str) -> int:
    return 1 if path.endswith("kernel") else 0  # a fused kernel (d, 3 or 2, heads, D); a bias (3 or 2, heads, D)


def to_torch_tensors(params: dict, c: GPTConfig, fmt: str) -> dict[str, np.ndarray]:
    """JAX parameters (a pure dict) -> {key: array} in a layout; every parameter used exactly once."""
    flat, entries = flatten(params), _layout(c, fmt)
    split = {p.split("#")[0] for p, *_ in entries if p is not None and "#" in p}
    for base in split & set(flat):  # fused weights the layout stores in parts
        whole = flat.pop(base)
        for i in range(whole.shape[_part_axis(base)]):
            flat[f"{base}#{i}"] = np.take(whole, i, axis=_part_axis(base))
    expected = {path: inv(np.zeros(shape, np.float32)).shape for path, _, _, inv, shape in entries if path is not None}
    _check_keys({p: a.shape for p, a in flat.items()}, expected, "the checkpoint's parameters")
    out = {}
    for path, key, fwd, _, shape in entries:
        out[key] = np.zeros(shape, np.float32) if path is None else np.ascontiguousarray(fwd(flat[path]))
    return out


def lora_tensors(factors: dict, c: GPTConfig, fmt: str) -> tuple[dict[str, np.ndarray], list[str], bool]:
    """A PEFT LoRA adapter of a transformers layout: (tensors, target_modules, fan_in_fan_out).

    `factors`: lora.factors, {'blocks.0.attn.c_attn': (A, B, targeted)}. Each adapted kernel goes where
    its layout puts it: the layout's own mapping of the kernel (reshapes, transposes, the split of q/k/v) is
    applied to the index of every input and output element, which gives the order of A's rows and B's
    columns in the module (in PEFT's shapes: lora_A.weight (r, in), lora_B.weight (out, r), named
    `base_model.model.MODULE.lora_{A,B}.weight`). So a fused q/k/v the layout keeps as three modules gets
    one adapter per targeted projection (A repeated, B's columns of that projection), and a fused one
    (GPT-2's c_attn, BLOOM's and NeoX's query_key_value) one adapter with B's columns reordered as the
    weight's rows: (alpha / r) B A of each module is exactly the kernel's update. A module holding only
    untargeted projections is not adapted. target_modules: the shortest module-name suffixes that match the
    adapted modules and nothing else of the model."""
    tensors, adapted, modules, conv1d = {}, [], set(), False
    for path, key, fwd, _, _ in _layout(c, fmt):
        if key.endswith(".weight"):
            modules.add(key[:-len(".weight")])
        name, _, part = (path or "").partition("#")
        if not name.endswith(".kernel") or name[:-len(".kernel")] not in factors:
            continue
        a, b, targeted = factors[name[:-len(".kernel")]]
        r, ins, outs = a.shape[-1], a.shape[:-1], b.shape[1:]
        shape = (*ins, *outs)
        index_in = np.broadcast_to(np.arange(math.prod(ins)).reshape(*ins, *(1,) * len(outs)), shape)
        index_out = np.broadcast_to(np.arange(math.prod(outs)).reshape(*(1,) * len(ins), *outs), shape)
        if part:  # one projection of a fused kernel
            index_in, index_out = (np.take(x, int(part), axis=_part_axis(name)) for x in (index_in, index_out))
        rows_in, rows_out = fwd(index_in), fwd(index_out)  # the module's weight, element by element
        if (rows_in == rows_in[:, :1]).all() and rows_in.shape[1] > 1:  # (in, out): GPT-2's Conv1D
            rows_in, rows_out, conv1d = rows_in.T, rows_out.T, True
        assert (rows_in == rows_in[:1]).all() and (rows_out == rows_out[:, :1]).all(), key  # a permutation
        order_in, order_out = rows_in[0], rows_out[:, 0]
        if not targeted.reshape(-1)[order_out].any():
            continue  # k of a fused q/k/v that the layout splits, when k is not a target
        module = key[:-len(".weight")]
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r)[order_in].T)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1)[:, order_out].T)
        adapted.append(module)
    depth = max(m.count(".") + 1 for m in adapted)
    for k in range(1, depth + 1):
        suffixes = sorted({".".join(m.split(".")[-k:]) for m in adapted})
        if {m for m in modules if any(m == s or m.endswith("." + s) for s in suffixes)} == set(adapted):
            return tensors, suffixes, conv1d
    return tensors, sorted(adapted), conv1d  # unreachable: whole names match themselves alone


VOCAB_PATHS = ("wte", "lm_head", "head_bias")  # the parameters with a row per token of the vocabulary


def from_torch_tensors(tensors: dict[str, np.ndarray], c: GPTConfig, fmt: str, where: str) -> dict:
    """{key: array} in a layout -> JAX parameters (a pure dict); every tensor used exactly once. The
    vocabulary's tensors may keep model.py's padding rows (as an export read by torch_gpt.py may)."""
    entries = _layout(c, fmt)
    vocab_keys = {key for path, key, *_ in entries if path in VOCAB_PATHS}
    tensors = {k: a[: c.vocab_size] if k in vocab_keys and a.shape[0] == c.padded_vocab_size else a
               for k, a in tensors.items()}
    _check_keys({k: tuple(v.shape) for k, v in tensors.items()}, {k: s for _, k, _, _, s in entries}, where)
    flat, parts = {}, {}
    for path, key, _, inv, _ in entries:
        a = np.asarray(tensors[key], np.float32)
        if path is None:
            if np.any(a != 0):
                raise ConvertError(f"{key} in {where} is not zero, but the model has no such bias")
            continue
        if "#" in path:
            base, i = path.split("#")
            parts.setdefault(base, {})[int(i)] = inv(a)
        else:
            flat[path] = np.ascontiguousarray(inv(a))
    for base, pieces in parts.items():  # k and v (and q) back into one fused weight
        flat[base] = np.stack([pieces[i] for i in sorted(pieces)], axis=_part_axis(base))
    return unflatten(flat)


# ----------------------------------------------------------------------------------------------
# The layout of a model

def hf_format(c: GPTConfig, adapters: bool = False) -> str:
    """The transformers layout that expresses the model exactly ('gpt2', 'bloom', 'gptj', 'gpt_neox',
    'opt' or 'llama'), or a ConvertError saying why none does: of the export --format hf, or with
    `adapters` of --format peft (a LoRA run's adapters, for its base in that layout)."""
    if c.positions == "alibi":
        fmt, family = "bloom", "an ALiBi model maps to BLOOM"
    elif c.positions == "learned":
        fmt, family = ("opt", "a model with learned positions at offset 2 maps to OPT") if c.position_offset == 2 \
            else ("gpt2", "a model with learned positions maps to GPT-2")
    elif c.rotary_interleaved:
        fmt, family = "gptj", "a model with interleaved rotary embeddings maps to GPT-J"
    elif c.norm == "rmsnorm":
        fmt, family = "llama", "a rotary model with RMSNorm maps to LLaMA"
    else:
        fmt, family = "gpt_neox", "a rotary model with LayerNorm maps to GPT-NeoX"
    gelu = c.activation == "gelu"
    why = [
        (c.position_offset not in (0, 2) and fmt in ("gpt2", "opt"), f"position_offset: {c.position_offset}"),
        (c.embed_norm != (fmt == "bloom"), f"embed_norm: {str(c.embed_norm).lower()}"),
        (fmt != "llama" and c.norm != "layernorm", f"norm: {c.norm}"),
        (fmt == "llama" and c.activation != "swiglu", f"activation: {c.activation}"),
        (fmt != "llama" and c.activation == "swiglu", "activation: swiglu"),
        (fmt == "bloom" and not gelu, f"activation: {c.activation}"),
        (fmt == "bloom" and gelu and not c.gelu_approximate, "gelu_approximate: false (BLOOM's GELU is the tanh one)"),
        (fmt == "gptj" and not gelu, f"activation: {c.activation}"),
        (fmt == "gptj" and c.residual != "parallel_shared", f"residual: {c.residual} (GPT-J's is parallel_shared)"),
        (fmt in ("gpt2", "bloom", "opt", "llama") and c.residual != "sequential", f"residual: {c.residual}"),
        (fmt == "gpt_neox" and c.residual == "parallel_shared", "residual: parallel_shared"),
        (fmt != "llama" and c.kv_heads != c.num_head, f"num_kv_head: {c.kv_heads} (fewer than the query heads)"),
        (fmt == "bloom" and c.mlp_dim not in (None, 4 * c.embedding_dim), f"mlp_dim: {c.mlp_dim}"),
        (fmt != "gptj" and c.head_bias, "head_bias: true"),
        (fmt in ("gpt2", "bloom") and not c.tie_embeddings, "tie_embeddings: false"),
        (fmt in ("gptj", "gpt_neox") and c.tie_embeddings, "tie_embeddings: true"),
        (fmt == "gptj" and c.attn_bias, "attention biases (GPT-J has none)"),
        (fmt == "gptj" and c.rotary_base != 10000, f"rotary_base: {c.rotary_base} (GPT-J's is 10000)"),
        (fmt == "llama" and c.rotary_dim != c.head_dim, f"rotary_dim: {c.rotary_dim} (LLaMA rotates whole heads)"),
        (fmt == "gpt_neox" and int(c.head_dim * (c.rotary_dim / c.head_dim)) != c.rotary_dim,
         f"rotary_dim: {c.rotary_dim}"),
        (fmt == "opt" and c.layer_norm_epsilon != 1e-5, f"layer_norm_epsilon: {c.layer_norm_epsilon} (OPT's is 1e-5)"),
    ]
    why = [msg for bad, msg in why if bad]
    if why and adapters:
        raise ConvertError(f"cannot export the adapters with --format peft: PEFT adapts a base in its transformers "
                           f"layout, and {family}, which cannot express {', '.join(why)}; export the merged model "
                           f"with --format torch instead")
    if why:
        raise ConvertError(f"cannot export to --format hf: {family}, which cannot express {', '.join(why)}; "
                           f"use --format torch")
    return fmt
