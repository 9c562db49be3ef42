"""transformers' config.json both ways: `hf_config` writes the config.json of the layout hf_layouts.hf_format
names for a model.GPTConfig, and `config_from_hf` reads one as transformers does, every field it reads
checked against HF_FIELDS (what each must be: one line naming a malformed field and its value), refusing
with the reasons what model.py cannot express (post-LayerNorm OPT, scaled rotary embeddings, ...). A
config.json an export wrote carries the JAX model's own config under `gpt_jax`, which is read instead.
"""
from __future__ import annotations

import json
import math

from core.errors import ConvertError
from interop.hf_layouts import HF_CLASSES
from model import GPTConfig
from training import config as config_lib

# transformers' activation names -> (model.py's activation, gelu_approximate); silu is LLaMA's gated MLP
ACTIVATION_NAMES = {"gelu_new": ("gelu", True), "gelu_pytorch_tanh": ("gelu", True), "gelu": ("gelu", False),
                    "relu": ("relu", None), "silu": ("swiglu", None)}


def hf_config(c: GPTConfig, fmt: str, eot_id: int | None) -> dict:
    """The config.json of layout `fmt` (hf_layouts.hf_format's) for the model, with `eot_id` as its
    beginning and end of text."""
    common = {"architectures": [HF_CLASSES[fmt]], "model_type": fmt, "vocab_size": c.vocab_size,
              "tie_word_embeddings": c.tie_embeddings, "bos_token_id": eot_id, "eos_token_id": eot_id,
              "use_cache": True, "dtype": "float32", "initializer_range": 0.02}
    act = {"gelu": "gelu_new" if c.gelu_approximate else "gelu", "relu": "relu", "swiglu": "silu"}[c.activation]
    rope = {"rope_type": "default", "rope_theta": c.rotary_base}
    if fmt == "gpt2":
        return {**common, "n_positions": c.block_size, "n_embd": c.embedding_dim, "n_layer": c.N, "n_head": c.num_head,
                "n_inner": c.mlp_dim, "activation_function": act, "layer_norm_epsilon": c.layer_norm_epsilon,
                "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    if fmt == "bloom":
        return {**common, "hidden_size": c.embedding_dim, "n_layer": c.N, "n_head": c.num_head,
                "layer_norm_epsilon": c.layer_norm_epsilon, "hidden_dropout": c.dropout,
                "attention_dropout": c.dropout, "apply_residual_connection_post_layernorm": False,
                "pretraining_tp": 1, "slow_but_exact": False, "seq_length": c.block_size}
    if fmt == "gptj":
        return {**common, "n_positions": c.block_size, "n_embd": c.embedding_dim, "n_layer": c.N, "n_head": c.num_head,
                "rotary_dim": c.rotary_dim, "n_inner": c.mlp_dim, "activation_function": act,
                "layer_norm_epsilon": c.layer_norm_epsilon, "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
                "attn_pdrop": c.dropout}
    if fmt == "gpt_neox":
        factor = c.rotary_dim / c.head_dim
        return {**common, "hidden_size": c.embedding_dim, "num_hidden_layers": c.N, "num_attention_heads": c.num_head,
                "intermediate_size": c.ffn_dim, "hidden_act": act, "max_position_embeddings": c.block_size,
                "layer_norm_eps": c.layer_norm_epsilon, "use_parallel_residual": c.residual == "parallel",
                "attention_bias": c.attn_bias, "rope_parameters": {**rope, "partial_rotary_factor": factor},
                "rotary_pct": factor, "rotary_emb_base": c.rotary_base,  # the same, for older transformers
                "hidden_dropout": c.dropout, "attention_dropout": c.dropout}
    if fmt == "opt":
        return {**common, "hidden_size": c.embedding_dim, "num_hidden_layers": c.N, "num_attention_heads": c.num_head,
                "ffn_dim": c.ffn_dim, "max_position_embeddings": c.block_size, "activation_function": act,
                "do_layer_norm_before": True, "_remove_final_layer_norm": False,
                "word_embed_proj_dim": c.embedding_dim, "enable_bias": c.bias or c.attn_bias,
                "layer_norm_elementwise_affine": True, "pad_token_id": eot_id, "dropout": c.dropout,
                "attention_dropout": c.dropout, "layerdrop": 0.0}
    return {**common, "hidden_size": c.embedding_dim, "num_hidden_layers": c.N, "num_attention_heads": c.num_head,
            "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "intermediate_size": c.ffn_dim,
            "hidden_act": act, "max_position_embeddings": c.block_size, "rms_norm_eps": c.layer_norm_epsilon,
            "rope_parameters": rope, "rope_theta": c.rotary_base, "attention_bias": c.attn_bias, "mlp_bias": c.bias,
            "attention_dropout": c.dropout, "pretraining_tp": 1}


# Every config.json field the import reads, and what it must be: one check, so a malformed field is one
# line naming it and its value. Null only where transformers gives null a meaning (a default size).
_INT = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731  (JSON true is no size)
_NUMBER = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
HF_KINDS = {  # kind -> (what the error says the field must be, the check)
    "size": ("a positive integer", lambda v: _INT(v) and v > 0),
    "size or null": ("a positive integer or null", lambda v: v is None or _INT(v) and v > 0),
    "positive": ("a positive number", lambda v: _NUMBER(v) and v > 0),
    "fraction": ("a number in (0, 1]", lambda v: _NUMBER(v) and 0 < v <= 1),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "string": ("a string", lambda v: isinstance(v, str)),
    "object or null": ("an object or null", lambda v: v is None or isinstance(v, dict)),
}
HF_FIELDS = {
    **dict.fromkeys(("model_type", "activation_function", "hidden_act", "rope_type", "type"), "string"),
    **dict.fromkeys(("vocab_size", "n_positions", "max_position_embeddings", "seq_length", "n_embd", "hidden_size",
                     "n_layer", "num_hidden_layers", "n_head", "num_attention_heads", "intermediate_size", "ffn_dim"),
                    "size"),
    **dict.fromkeys(("n_inner", "num_key_value_heads", "head_dim", "rotary_dim", "word_embed_proj_dim"), "size or null"),
    **dict.fromkeys(("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps", "rope_theta", "rotary_emb_base"),
                    "positive"),
    **dict.fromkeys(("partial_rotary_factor", "rotary_pct"), "fraction"),
    **dict.fromkeys(("tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                     "add_cross_attention", "apply_residual_connection_post_layernorm", "use_parallel_residual",
                     "attention_bias", "mlp_bias", "enable_bias", "do_layer_norm_before", "_remove_final_layer_norm",
                     "layer_norm_elementwise_affine"), "bool"),
    **dict.fromkeys(("rope_parameters", "rope_scaling"), "object or null"),
}


def _shown(value) -> str:
    """A config.json value as JSON spells it (null, true, "768"), cut short."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def hf_field(meta: dict, key: str, default, where: str, within: str = ""):
    """meta[key] (`default` where it is absent) if it is what HF_FIELDS says, else a ConvertError naming the
    field (inside `within`, e.g. 'rope_parameters.') and its value."""
    if key not in meta:
        return default
    what, ok = HF_KINDS[HF_FIELDS[key]]
    if not ok(meta[key]):
        raise ConvertError(f"{where}: {within}{key} must be {what}, got {_shown(meta[key])}")
    return meta[key]


def _rope(get, where: str, family: str, theta_key: str, factor_key: str | None, default_factor: float
          ) -> tuple[float, float]:
    """(base, fraction of the head rotated) as transformers reads them; plain rotary embeddings only.

    As in transformers, a `rope_scaling` (the older key) that is set replaces `rope_parameters` whole;
    then the base and fraction come from it, else from the family's own top-level keys. Any rope_type
    but the default, in either key, is refused: model.py cannot express scaled rotary embeddings."""
    found = {key: get(key) or {} for key in ("rope_scaling", "rope_parameters")}
    for key, params in found.items():
        kind = hf_field(params, "rope_type", hf_field(params, "type", "default", where, f"{key}."), where, f"{key}.")
        if kind != "default":
            raise ConvertError(f"{where}: this {family} cannot be expressed by model.py: {key} with rope_type "
                               f"{kind!r} (scaled rotary embeddings; model.py has the plain ones only)")
    key = "rope_scaling" if found["rope_scaling"] else "rope_parameters"
    base = hf_field(found[key], "rope_theta", get(theta_key, 10000.0), where, f"{key}.")
    factor = hf_field(found[key], "partial_rotary_factor", get(factor_key, default_factor) if factor_key
                      else default_factor, where, f"{key}.")
    return float(base), float(factor)


def _exported_config(meta: dict, where: str) -> tuple[GPTConfig, str]:
    """(config, layout) of a config.json written by an export: the JAX model config under `gpt_jax`,
    checked as config.yaml's model section is, and the layout its tensors are in. The config keeps the
    architecture and dropout, as one read from transformers' fields does; how the model is computed
    (dtype, remat, attention) is left to the importing run (the defaults)."""
    layout = "torch" if meta.get("format") == "torch" else hf_field(meta, "model_type", None, where)
    if layout not in HF_CLASSES and layout != "torch":
        raise ConvertError(f"{where}: an export's config.json (it has gpt_jax) with model_type {layout!r}, not one "
                           f"of the layouts exports write ({', '.join(HF_CLASSES)}), nor format \"torch\"")
    block = meta["gpt_jax"]
    if not isinstance(block, dict):
        raise ConvertError(f"{where}: gpt_jax (the exported JAX model config) must be an object, got {_shown(block)}")
    missing = [name for name in GPTConfig.REQUIRED_FIELDS if name not in block]
    if missing:
        raise ConvertError(f"{where}: gpt_jax (the exported JAX model config) lacks {', '.join(missing)}")
    try:
        _, gcfg = config_lib.resolve_model({k: v for k, v in block.items() if k != "name"}, {})
    except config_lib.ConfigError as e:
        raise ConvertError(f"{where}: gpt_jax (the exported JAX model config) is not a valid model config: {e}"
                           ) from None
    return GPTConfig(**{name: getattr(gcfg, name) for name in (*GPTConfig.PARAMETER_FIELDS, "dropout")}), layout


def config_from_hf(meta, where: str) -> tuple[GPTConfig, str]:
    """(config, layout) of a transformers config.json (parsed); refuses, with the reasons, what model.py cannot
    express, and a malformed field (HF_FIELDS) with its name and value. `where` names the file in errors."""
    if not isinstance(meta, dict):
        raise ConvertError(f"{where} must hold a JSON object of the model's settings, got {_shown(meta)}")
    if "gpt_jax" in meta:  # written by an export: the exact original config
        return _exported_config(meta, where)
    get = lambda key, default=None: hf_field(meta, key, default, where)  # noqa: E731
    kind = get("model_type")
    names = {"gpt2": "GPT-2", "bloom": "BLOOM", "gptj": "GPT-J", "gpt_neox": "GPT-NeoX", "opt": "OPT",
             "llama": "LLaMA"}
    if kind not in names:
        raise ConvertError(f"{where}: model_type {kind!r} is not supported; import reads the decoder-only "
                           f"{', '.join(names.values())} layouts (model_type {', '.join(names)})")

    def model_config(**fields) -> GPTConfig:
        try:
            return GPTConfig(**fields)
        except ValueError as e:
            raise ConvertError(f"{where} gives a model that model.py refuses: {e}") from None

    def refuse_if(*checks):
        why = [msg for bad, msg in checks if bad]
        if why:
            raise ConvertError(f"{where}: this {names[kind]} cannot be expressed by model.py: {', '.join(why)}")

    def activation(key, default, allowed):
        """(the MLP switches for config.json's activation name, the check refusing it unless its kind is allowed)"""
        name = get(key, default)
        kind, approximate = ACTIVATION_NAMES.get(name, (None, None))
        known = [n for n, (k, _) in ACTIVATION_NAMES.items() if k in allowed]
        switches = {"activation": kind or "gelu", **({} if approximate is None else {"gelu_approximate": approximate})}
        return switches, (kind not in allowed, f"{key} {name!r} (only {', '.join(known)})")

    if kind == "gpt2":
        d, (act, bad_act) = get("n_embd", 768), activation("activation_function", "gelu_new", ("gelu", "relu"))
        refuse_if(bad_act,
                  (not get("scale_attn_weights", True), "scale_attn_weights false"),
                  (get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx true"),
                  (get("add_cross_attention", False), "cross-attention"),
                  (not get("tie_word_embeddings", True), "untied output embedding"))
        return model_config(vocab_size=get("vocab_size", 50257), block_size=get("n_positions", 1024),
                            embedding_dim=d, num_head=get("n_head", 12), N=get("n_layer", 12), alibi_attn=False,
                            mlp_dim=get("n_inner"), layer_norm_epsilon=get("layer_norm_epsilon", 1e-5), **act), kind
    if kind == "bloom":
        refuse_if((get("apply_residual_connection_post_layernorm", False), "post-LayerNorm residual"),
                  (not get("tie_word_embeddings", True), "untied output embedding"))
        return model_config(vocab_size=get("vocab_size", 250880), block_size=get("seq_length", 2048),
                            embedding_dim=get("hidden_size", 64), num_head=get("n_head", 8),
                            N=get("n_layer", 2), alibi_attn=True, bias=True, embed_norm=True,
                            gelu_approximate=True, layer_norm_epsilon=get("layer_norm_epsilon", 1e-5)), kind
    if kind == "gptj":
        act, bad_act = activation("activation_function", "gelu_new", ("gelu",))
        refuse_if(bad_act,
                  (get("rotary_dim", 64) is None, "rotary_dim null (rotary over the whole model width)"))
        return model_config(vocab_size=get("vocab_size", 50400), block_size=get("n_positions", 2048),
                            embedding_dim=get("n_embd", 4096), num_head=get("n_head", 16), N=get("n_layer", 28),
                            alibi_attn=False, rotary_dim=get("rotary_dim", 64), rotary_interleaved=True,
                            residual="parallel_shared", attention_bias=False, mlp_dim=get("n_inner"),
                            tie_embeddings=get("tie_word_embeddings", False), head_bias=True,
                            layer_norm_epsilon=get("layer_norm_epsilon", 1e-5), **act), kind
    d, H = get("hidden_size", 768), get("num_attention_heads", 12)
    if kind == "gpt_neox":
        act, bad_act = activation("hidden_act", "gelu", ("gelu", "relu"))
        base, factor = _rope(get, where, names[kind], "rotary_emb_base", "rotary_pct", 0.25)
        rotary_dim = int(d // H * factor)
        refuse_if(bad_act,
                  (rotary_dim < 2 or rotary_dim % 2, f"{rotary_dim} rotary dims per head (an even number from 2)"),
                  (get("head_dim") not in (None, d // H), f"head_dim {get('head_dim')} (not hidden_size / heads)"))
        return model_config(vocab_size=get("vocab_size", 50432), block_size=get("max_position_embeddings", 2048),
                            embedding_dim=d, num_head=H, N=get("num_hidden_layers", 12), alibi_attn=False,
                            rotary_dim=rotary_dim, rotary_base=base,
                            residual="parallel" if get("use_parallel_residual", True) else "sequential",
                            attention_bias=get("attention_bias", True), mlp_dim=get("intermediate_size"),
                            tie_embeddings=get("tie_word_embeddings", False),
                            layer_norm_epsilon=get("layer_norm_eps", 1e-5), **act), kind
    if kind == "opt":
        act, bad_act = activation("activation_function", "relu", ("gelu", "relu"))
        refuse_if(bad_act,
                  (not get("do_layer_norm_before", True), "post-LayerNorm blocks (do_layer_norm_before false)"),
                  (get("_remove_final_layer_norm", False), "no final LayerNorm"),
                  (get("word_embed_proj_dim") not in (None, d), "an embedding projection (word_embed_proj_dim)"),
                  (not get("layer_norm_elementwise_affine", True), "LayerNorms without scales"))
        bias = get("enable_bias", True)
        return model_config(vocab_size=get("vocab_size", 50272), block_size=get("max_position_embeddings", 2048),
                            embedding_dim=d, num_head=H, N=get("num_hidden_layers", 12), alibi_attn=False,
                            position_offset=2, bias=bias, attention_bias=bias, mlp_dim=get("ffn_dim"),
                            tie_embeddings=get("tie_word_embeddings", True), layer_norm_epsilon=1e-5, **act), kind
    base, factor = _rope(get, where, names[kind], "rope_theta", None, 1.0)
    act, bad_act = activation("hidden_act", "silu", ("swiglu",))
    refuse_if(bad_act,
              (factor != 1.0, f"partial_rotary_factor {factor} (LLaMA rotates whole heads)"),
              (get("head_dim") not in (None, d // H), f"head_dim {get('head_dim')} (not hidden_size / heads)"))
    return model_config(vocab_size=get("vocab_size", 32000), block_size=get("max_position_embeddings", 2048),
                        embedding_dim=d, num_head=H, N=get("num_hidden_layers", 32), alibi_attn=False,
                        rotary_dim=d // H, rotary_base=base, norm="rmsnorm", **act,
                        num_kv_head=get("num_key_value_heads"), bias=get("mlp_bias", False),
                        attention_bias=get("attention_bias", False), mlp_dim=get("intermediate_size", 11008),
                        tie_embeddings=get("tie_word_embeddings", False),
                        layer_norm_epsilon=get("rms_norm_eps", 1e-6)), kind

