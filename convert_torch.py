"""Hand a trained model to PyTorch and Hugging Face, and bring GPT-2 weights into a run.

    python convert_torch.py --checkpoint RUN_DIR [--step N] --out DIR [--format torch|hf] [--overwrite]
    python convert_torch.py --import-hf HF_DIR --out RUN_DIR [--overwrite]

Export writes `model.safetensors`, `config.json` and the run's `tokenizer.json` (no pickles).
`--format torch` (the default) is read by the `GPT` module of this file:

    from convert_torch import GPT
    model = GPT.from_pretrained(DIR)          # torch and safetensors only; no JAX needed

`--format hf` writes transformers' own layouts, for `AutoModelForCausalLM.from_pretrained(DIR)`:
GPT-2 for a learned-position model, BLOOM (an ALiBi GPT with a LayerNorm after the embedding) for
an ALiBi model with `embed_norm`. A model a layout cannot express exactly is refused, never
exported approximately. A model without biases is written with zero biases, which is exact.
Exports carry the real vocabulary: `vocab_size` is the tokenizer's and the embedding has that many
rows. model.py pads its embedding to a multiple of 128 and gives the padding rows the logit
PADDED_LOGIT, so a softmax over the real rows alone is the same distribution.

Import (`--import-hf`) turns a local transformers GPT-2 (or BLOOM) directory into a run directory
whose step-0 checkpoint holds the parameters (the embedding padded with zero rows);
`training.init_from=RUN_DIR` starts a fine-tuning run from it. Every config.json we write also
carries the JAX model's config under `gpt_jax`, so JAX -> PyTorch -> JAX returns the identical
config and parameters (the embedding's padding rows, which no logit depends on, as zeros).

Every tensor is mapped exactly once in both directions; missing, unexpected and mis-shaped keys
are listed in the error. The PyTorch module reproduces model.py: the same LayerNorm epsilon, the
same GELU (tanh or erf), ALiBi `-slope_h * (i - j)` with model.py's slopes, scores scaled by
1/sqrt(D), tied output embedding, logits over the padded vocabulary (PADDED_LOGIT on the padding).

Exporting needs numpy and safetensors only; the GPT module and reading pytorch_model.bin need torch.
This file imports nothing of the project at its top, so a copy of it alone next to an export is
all that `GPT.from_pretrained` needs (with torch, numpy and safetensors installed).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # the converter's exports need no torch; GPT and pytorch_model.bin do
    torch = F = nn = None

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
PADDED_LOGIT = -1e9  # the logit of the embedding's padding rows, as model.PADDED_LOGIT


try:  # in the repository, the project's user-error base class; alone beside an export, not needed
    from errors import UserError
except ImportError:
    UserError = Exception


class ConvertError(UserError):
    """A user-caused problem (paths, steps, unsupported layouts, key mismatches); str(e) is one line."""


# ----------------------------------------------------------------------------------------------
# The PyTorch model: self-contained (torch only), the architecture of model.py

_Module = nn.Module if nn is not None else object  # without torch the classes exist, and refuse to build


def alibi_slopes(n_head: int) -> torch.Tensor:
    """model.alibi_slopes, in torch: 2^(-8(i+1)/n) for the nearest lower power of two n, then every
    other slope of the sequence for 2n until n_head are taken. float32 (n_head,)."""
    closest = 2 ** int(math.floor(math.log2(n_head)))
    geometric = lambda n: [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]  # noqa: E731
    return torch.tensor(geometric(closest) + geometric(2 * closest)[0::2][: n_head - closest], dtype=torch.float32)


@dataclasses.dataclass(frozen=True)
class TorchGPTConfig:
    """The architecture fields of model.GPTConfig (dtype, remat and attention are JAX-side only)."""

    vocab_size: int
    block_size: int
    embedding_dim: int
    num_head: int
    N: int
    dropout: float = 0.0
    alibi_attn: bool = True
    bias: bool = True
    embed_norm: bool = False
    gelu_approximate: bool = True
    layer_norm_epsilon: float = 1e-5

    @classmethod
    def from_dict(cls, d: dict) -> "TorchGPTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // 128) * 128


class Block(_Module):
    def __init__(self, c: TorchGPTConfig):
        super().__init__()
        d = c.embedding_dim
        self.c, self.H, self.D = c, c.num_head, d // c.num_head
        self.ln_1 = nn.LayerNorm(d, eps=c.layer_norm_epsilon, bias=c.bias)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(d, 3 * d, bias=c.bias)  # output rows ordered (3, H, D)
        self.attn.c_proj = nn.Linear(d, d, bias=c.bias)  # input columns ordered (H, D)
        self.ln_2 = nn.LayerNorm(d, eps=c.layer_norm_epsilon, bias=c.bias)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, 4 * d, bias=c.bias)
        self.mlp.c_proj = nn.Linear(4 * d, d, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, mask, cache=None):
        """x (B, T, d); mask (H or 1, T, Tk) float, added to the scores; cache: (k, v) of earlier positions or None."""
        B, T, d = x.shape
        qkv = self.attn.c_attn(self.ln_1(x)).view(B, T, 3, self.H, self.D).permute(2, 0, 3, 1, 4)  # (3, B, H, T, D)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)  # (B, H, Tk, D)
        p = self.c.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # scale 1/sqrt(D)
        y = y.transpose(1, 2).reshape(B, T, d)  # (B, T, H*D)
        x = x + self.drop(self.attn.c_proj(y))
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh" if self.c.gelu_approximate else "none")
        return x + self.drop(self.mlp.c_proj(h)), (k, v)


class GPT(_Module):
    """model.GPT in PyTorch. `forward(tokens)` -> float logits (B, T, padded_vocab_size), PADDED_LOGIT at the
    ids >= vocab_size, so softmax, cross-entropy and argmax over them are those over the real vocabulary.
    Like model.py it pads the embedding to a multiple of 128 rows; an export holds the vocab_size real ones."""

    def __init__(self, config: TorchGPTConfig | dict):
        if torch is None:
            raise ImportError("convert_torch.GPT needs PyTorch: pip install torch")
        super().__init__()
        c = self.config = config if isinstance(config, TorchGPTConfig) else TorchGPTConfig.from_dict(config)
        d = c.embedding_dim
        self.wte = nn.Embedding(c.padded_vocab_size, d)  # also the output projection (tied)
        self.wpe = None if c.alibi_attn else nn.Embedding(c.block_size, d)
        self.embed_norm = nn.LayerNorm(d, eps=c.layer_norm_epsilon, bias=c.bias) if c.embed_norm else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.N)])
        self.ln_f = nn.LayerNorm(d, eps=c.layer_norm_epsilon, bias=c.bias)
        self.register_buffer("slopes", alibi_slopes(c.num_head), persistent=False)

    @classmethod
    def from_pretrained(cls, directory, map_location="cpu") -> "GPT":
        """A model from a directory written by `python convert_torch.py --checkpoint RUN --out DIR`."""
        from safetensors.torch import load_file

        directory = pathlib.Path(directory)
        meta = json.loads((directory / CONFIG_NAME).read_text())
        if meta.get("format") != "torch" or "gpt_jax" not in meta:
            raise ConvertError(f"{directory} is not a --format torch export; load an --format hf export with "
                               f"transformers.AutoModelForCausalLM.from_pretrained")
        model = cls(meta["gpt_jax"])
        tensors = load_file(str(directory / WEIGHTS_NAME), device=str(map_location))
        c, wte = model.config, tensors.get("wte.weight")
        if wte is not None and wte.shape[0] == c.vocab_size:  # the real rows; the padding rows stay zero
            tensors["wte.weight"] = F.pad(wte, (0, 0, 0, c.padded_vocab_size - c.vocab_size))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        _check_keys({k: tuple(v.shape) for k, v in tensors.items()}, expected, str(directory / WEIGHTS_NAME))
        model.load_state_dict(tensors, strict=True)
        return model.eval()

    def _mask(self, q_len: int, k_len: int, device) -> torch.Tensor:
        """(H or 1, q_len, k_len) float: ALiBi -slope*(i-j) and -inf above the diagonal; queries are the last q_len."""
        i = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # absolute query positions
        j = torch.arange(k_len, device=device)[None, :]
        mask = torch.zeros(q_len, k_len, device=device).masked_fill(j > i, float("-inf"))[None]  # (1, Tq, Tk)
        if self.config.alibi_attn:
            mask = mask - self.slopes.to(device)[:, None, None] * (i - j).float()  # (H, Tq, Tk)
        return mask

    def forward(self, tokens: torch.Tensor, caches=None, start: int = 0):
        """Logits (B, T, padded_vocab) for tokens (B, T) at positions start..start+T-1; with `caches`
        (a list, one (k, v) or None per block) returns (logits, new caches)."""
        B, T = tokens.shape
        x = self.wte(tokens)  # (B, T, d)
        if self.wpe is not None:
            if start + T > self.config.block_size:
                raise ValueError(f"input of {start + T} tokens is longer than block_size {self.config.block_size} "
                                 f"of a learned-position model")
            x = x + self.wpe(torch.arange(start, start + T, device=tokens.device))
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.drop(x)
        mask = self._mask(T, start + T, tokens.device)
        new = []
        for n, block in enumerate(self.blocks):
            x, kv = block(x, mask, None if caches is None else caches[n])
            new.append(kv)
        logits = self.ln_f(x) @ self.wte.weight.T  # (B, T, V_padded), tied
        padding = torch.arange(logits.shape[-1], device=logits.device) >= self.config.vocab_size
        logits = logits.masked_fill(padding, PADDED_LOGIT)  # the padding rows never take probability
        return logits if caches is None else (logits, new)

    def generate(self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue tokens (B, T) by max_new_tokens with a KV cache: the prompt once, then one token
        per step. temperature 0 is greedy; otherwise sample (top_k optional). Padded vocabulary rows
        are never chosen. Returns (B, T + max_new_tokens)."""
        with torch.no_grad():
            logits, caches = self(tokens, caches=[None] * len(self.blocks), start=0)  # the prompt, once
            out = tokens
            for n in range(max_new_tokens):
                last = logits[:, -1, : self.config.vocab_size].float()  # (B, V): never a padding row
                if temperature == 0.0:
                    nxt = last.argmax(dim=-1, keepdim=True)
                else:
                    last = last / temperature
                    if top_k is not None:
                        kth = torch.topk(last, min(top_k, last.shape[-1])).values[:, -1:]
                        last = last.masked_fill(last < kth, float("-inf"))
                    nxt = torch.multinomial(torch.softmax(last, dim=-1), 1, generator=generator)
                out = torch.cat([out, nxt], dim=1)  # (B, T + n + 1)
                if n + 1 < max_new_tokens:  # one new position through the cache
                    logits, caches = self(nxt, caches=caches, start=out.shape[1] - 1)
            return out


# ----------------------------------------------------------------------------------------------
# Layouts: each entry maps one JAX parameter (a dotted path into the pure dict) to one tensor.
# (jax_path or None, key, to_torch(array) -> array, from_torch(array) -> array, torch shape).
# A None path is a zero tensor the layout needs but the model does not have (bias=False).


def _layout(c: TorchGPTConfig, fmt: str) -> list[tuple]:
    d, H, D, F4 = c.embedding_dim, c.num_head, c.embedding_dim // c.num_head, 4 * c.embedding_dim
    same = (lambda a: a, lambda a: a)
    tr = (lambda a: a.T, lambda a: a.T)
    entries = []

    def add(path, key, fns, shape, is_bias=False):
        if is_bias and not c.bias:
            if fmt == "torch":
                return  # the torch module has no biases either
            path = None
        entries.append((path, key, fns[0], fns[1], shape))

    def norm(path, key):
        add(f"{path}.scale", f"{key}.weight", same, (d,))
        add(f"{path}.bias", f"{key}.bias", same, (d,), True)

    qkv_flat = (lambda a: a.reshape(3 * d), lambda a: a.reshape(3, H, D))
    if fmt == "torch":
        P, names = "", dict(wte="wte", wpe="wpe", en="embed_norm", h="blocks", ln1="ln_1", ln2="ln_2",
                            qkv="attn.c_attn", proj="attn.c_proj", fc="mlp.c_fc", fc2="mlp.c_proj", lnf="ln_f")
        qkv_w = (lambda a: a.reshape(d, 3 * d).T, lambda a: a.T.reshape(d, 3, H, D))  # (3HD, d)
        qkv_b, proj_w = qkv_flat, (lambda a: a.reshape(d, d).T, lambda a: a.T.reshape(H, D, d))
        fc_w, shapes = tr, dict(qkv=(3 * d, d), fc=(F4, d), fc2=(d, F4))
    elif fmt == "gpt2":
        P, names = "transformer.", dict(wte="wte", wpe="wpe", h="h", ln1="ln_1", ln2="ln_2", qkv="attn.c_attn",
                                        proj="attn.c_proj", fc="mlp.c_fc", fc2="mlp.c_proj", lnf="ln_f")
        # Conv1D weights are (in, out); c_attn's output columns are [q | k | v], each (H, D)
        qkv_w = (lambda a: a.reshape(d, 3 * d), lambda a: a.reshape(d, 3, H, D))
        qkv_b, proj_w = qkv_flat, (lambda a: a.reshape(d, d), lambda a: a.reshape(H, D, d))
        fc_w, shapes = same, dict(qkv=(d, 3 * d), fc=(d, F4), fc2=(F4, d))
    elif fmt == "bloom":
        P, names = "transformer.", dict(wte="word_embeddings", en="word_embeddings_layernorm", h="h",
                                        ln1="input_layernorm", ln2="post_attention_layernorm",
                                        qkv="self_attention.query_key_value", proj="self_attention.dense",
                                        fc="mlp.dense_h_to_4h", fc2="mlp.dense_4h_to_h", lnf="ln_f")
        # nn.Linear weights are (out, in); query_key_value's output rows are ordered (H, 3, D)
        qkv_w = (lambda a: a.transpose(2, 1, 3, 0).reshape(3 * d, d),
                 lambda a: a.reshape(H, 3, D, d).transpose(3, 1, 0, 2))
        qkv_b = (lambda a: a.transpose(1, 0, 2).reshape(3 * d), lambda a: a.reshape(H, 3, D).transpose(1, 0, 2))
        proj_w = (lambda a: a.reshape(d, d).T, lambda a: a.T.reshape(H, D, d))
        fc_w, shapes = tr, dict(qkv=(3 * d, d), fc=(F4, d), fc2=(d, F4))
    else:
        raise ConvertError(f"unknown format {fmt!r}")

    V, pad = c.vocab_size, c.padded_vocab_size - c.vocab_size
    # the files hold the real vocabulary's rows; model.py's padding rows (no logit depends on them) come back zero
    real_rows = (lambda a: a[:V], lambda a: np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)]))
    add("wte", f"{P}{names['wte']}.weight", real_rows, (V, d))
    if not c.alibi_attn:
        add("wpe", f"{P}{names['wpe']}.weight", same, (c.block_size, d))
    if c.embed_norm:
        norm("embed_norm", f"{P}{names['en']}")
    for i in range(c.N):
        j, k = f"blocks.{i}", f"{P}{names['h']}.{i}"
        norm(f"{j}.ln_1", f"{k}.{names['ln1']}")
        add(f"{j}.attn.c_attn.kernel", f"{k}.{names['qkv']}.weight", qkv_w, shapes["qkv"])
        add(f"{j}.attn.c_attn.bias", f"{k}.{names['qkv']}.bias", qkv_b, (3 * d,), True)
        add(f"{j}.attn.c_proj.kernel", f"{k}.{names['proj']}.weight", proj_w, (d, d))
        add(f"{j}.attn.c_proj.bias", f"{k}.{names['proj']}.bias", same, (d,), True)
        norm(f"{j}.ln_2", f"{k}.{names['ln2']}")
        add(f"{j}.mlp.c_fc.kernel", f"{k}.{names['fc']}.weight", fc_w, shapes["fc"])
        add(f"{j}.mlp.c_fc.bias", f"{k}.{names['fc']}.bias", same, (F4,), True)
        add(f"{j}.mlp.c_proj.kernel", f"{k}.{names['fc2']}.weight", fc_w, shapes["fc2"])
        add(f"{j}.mlp.c_proj.bias", f"{k}.{names['fc2']}.bias", same, (d,), True)
    norm("ln_f", f"{P}{names['lnf']}")
    return entries


def _check_keys(found: dict, expected: dict, where: str) -> None:
    """Raise a ConvertError listing missing, unexpected and mis-shaped keys (name -> shape dicts)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = sorted(f"{k} {tuple(found[k])} != expected {tuple(expected[k])}"
                    for k in set(found) & set(expected) if tuple(found[k]) != tuple(expected[k]))
    problems = [f"{name}: {', '.join(keys)}" for name, keys in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes)) if keys]
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


def to_torch_tensors(params: dict, c: TorchGPTConfig, fmt: str) -> dict[str, np.ndarray]:
    """JAX parameters (a pure dict) -> {key: array} in a layout; every parameter used exactly once."""
    flat, entries = flatten(params), _layout(c, fmt)
    expected = {path: inv(np.zeros(shape, np.float32)).shape for path, _, _, inv, shape in entries if path is not None}
    _check_keys({p: a.shape for p, a in flat.items()}, expected, "the checkpoint's parameters")
    out = {}
    for path, key, fwd, _, shape in entries:
        out[key] = np.zeros(shape, np.float32) if path is None else np.ascontiguousarray(fwd(flat[path]))
    return out


def from_torch_tensors(tensors: dict[str, np.ndarray], c: TorchGPTConfig, fmt: str, where: str) -> dict:
    """{key: array} in a layout -> JAX parameters (a pure dict); every tensor used exactly once."""
    entries = _layout(c, fmt)
    _check_keys({k: tuple(v.shape) for k, v in tensors.items()}, {k: s for _, k, _, _, s in entries}, where)
    flat = {}
    for path, key, _, inv, _ in entries:
        a = np.asarray(tensors[key], np.float32)
        if path is None:
            if np.any(a != 0):
                raise ConvertError(f"{key} in {where} is not zero, but the model has no biases (bias: false)")
            continue
        flat[path] = np.ascontiguousarray(inv(a))
    return unflatten(flat)


# ----------------------------------------------------------------------------------------------
# Hugging Face configs


def hf_format(c: TorchGPTConfig) -> str:
    """'gpt2' or 'bloom', or a ConvertError saying why neither layout expresses the model exactly."""
    if not c.alibi_attn:
        if c.embed_norm:
            raise ConvertError("cannot export to --format hf: GPT-2 (the layout for learned positions) has no "
                               "LayerNorm after the embedding (embed_norm: true); use --format torch")
        return "gpt2"
    if not c.embed_norm:
        raise ConvertError("cannot export to --format hf: an ALiBi model maps to BLOOM, which always has a "
                           "LayerNorm after the embedding, and this model has embed_norm: false; use --format torch")
    if not c.gelu_approximate:
        raise ConvertError("cannot export to --format hf: BLOOM's GELU is the tanh approximation and this model "
                           "uses the exact erf GELU (gelu_approximate: false); use --format torch")
    return "bloom"


def hf_config(c: TorchGPTConfig, fmt: str, eot_id: int | None) -> dict:
    common = {"vocab_size": c.vocab_size, "layer_norm_epsilon": c.layer_norm_epsilon,
              "tie_word_embeddings": True, "bos_token_id": eot_id, "eos_token_id": eot_id, "use_cache": True,
              "dtype": "float32", "initializer_range": 0.02}
    if fmt == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common, "n_positions": c.block_size,
                "n_embd": c.embedding_dim, "n_layer": c.N, "n_head": c.num_head, "n_inner": None,
                "activation_function": "gelu_new" if c.gelu_approximate else "gelu",
                "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    return {"architectures": ["BloomForCausalLM"], "model_type": "bloom", **common, "hidden_size": c.embedding_dim,
            "n_layer": c.N, "n_head": c.num_head, "hidden_dropout": c.dropout, "attention_dropout": c.dropout,
            "apply_residual_connection_post_layernorm": False, "pretraining_tp": 1, "slow_but_exact": False,
            "seq_length": c.block_size}


def config_from_hf(meta: dict, where: str) -> tuple[TorchGPTConfig, str]:
    """(config, layout) of a transformers GPT-2 or BLOOM config.json; refuses what model.py cannot express."""
    kind = meta.get("model_type")
    if "gpt_jax" in meta:  # written by this file: the exact original config
        return TorchGPTConfig.from_dict(meta["gpt_jax"]), kind
    get = lambda key, default=None: meta.get(key, default)  # noqa: E731
    if kind == "gpt2":
        act = get("activation_function", "gelu_new")
        approx = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}.get(act)
        d = get("n_embd", 768)
        why = [msg for bad, msg in (
            (approx is None, f"activation_function {act!r} (only gelu_new, gelu_pytorch_tanh, gelu)"),
            (get("n_inner") not in (None, 4 * d), f"n_inner {get('n_inner')} (only 4 * n_embd)"),
            (not get("scale_attn_weights", True), "scale_attn_weights false"),
            (get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx true"),
            (get("add_cross_attention", False), "cross-attention"),
            (not get("tie_word_embeddings", True), "untied output embedding")) if bad]
        if why:
            raise ConvertError(f"{where}: this GPT-2 cannot be expressed by model.py: {', '.join(why)}")
        return TorchGPTConfig(vocab_size=get("vocab_size", 50257), block_size=get("n_positions", 1024),
                              embedding_dim=d, num_head=get("n_head", 12), N=get("n_layer", 12),
                              alibi_attn=False, bias=True, embed_norm=False, gelu_approximate=approx,
                              layer_norm_epsilon=get("layer_norm_epsilon", 1e-5)), "gpt2"
    if kind == "bloom":
        if get("apply_residual_connection_post_layernorm", False) or not get("tie_word_embeddings", True):
            raise ConvertError(f"{where}: this BLOOM cannot be expressed by model.py (post-LayerNorm residual "
                               f"or untied output embedding)")
        return TorchGPTConfig(vocab_size=get("vocab_size", 250880), block_size=get("seq_length", 2048),
                              embedding_dim=get("hidden_size", 64), num_head=get("n_head", 8),
                              N=get("n_layer", 2), alibi_attn=True, bias=True, embed_norm=True,
                              gelu_approximate=True, layer_norm_epsilon=get("layer_norm_epsilon", 1e-5)), "bloom"
    raise ConvertError(f"{where}: model_type {kind!r} is not supported; import reads GPT-2 (and BLOOM) checkpoints")


def read_hf_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """The tensors of a transformers checkpoint: model.safetensors (or its shards); pytorch_model.bin
    only through torch.load(weights_only=True), which refuses anything but tensors."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    files = sorted(directory.glob("model*.safetensors"))
    if files:
        tensors = {}
        for f in files:
            try:
                tensors.update(load_file(str(f)))
            except (SafetensorError, OSError) as e:
                raise ConvertError(f"cannot read {f} as safetensors ({e}); copy or save it again") from None
        return tensors
    binary = directory / "pytorch_model.bin"
    if not binary.is_file():
        raise ConvertError(f"no model.safetensors (or pytorch_model.bin) in {directory}")
    if torch is None:
        raise ConvertError(f"reading {binary} needs PyTorch (pip install torch), or convert it to model.safetensors")
    try:
        state = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # a refused pickle, a damaged archive, a cut-short file: each its own exception type
        raise ConvertError(f"{binary} cannot be read by torch.load(weights_only=True), which loads tensors and "
                           f"never code ({_torch_load_reason(e)}): a damaged file, or more than tensors in it; save "
                           f"it as model.safetensors where it was made (save_pretrained does)") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConvertError(f"{binary} holds no plain state dict of tensors; save it as model.safetensors")
    return {k: v.float().numpy() for k, v in state.items()}


def _torch_load_reason(e: Exception) -> str:
    """The informative part of torch.load's error: the refused global or opcode, else its first sentence."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    return first.split(". ")[0][:200]


# ----------------------------------------------------------------------------------------------
# Run directories (JAX and orbax are imported only here, so `from convert_torch import GPT` needs torch only)


def read_run(run_dir, step: int | None = None):
    """(Config, params pure dict of numpy arrays, step) of a run directory's checkpoint (the last by default)."""
    import rundir  # brings in JAX: only the converter needs it, not `GPT.from_pretrained`

    run = rundir.existing(run_dir)
    cfg = run.config()
    params, step = run.load_params(step)
    return cfg, params, step


def _eot(tokenizer_path: pathlib.Path) -> tuple[int | None, str | None]:
    """(id, text) of a tokenizer.json's end-of-text token, (None, None) without one."""
    import shards

    if not tokenizer_path.is_file():
        return None, None
    tok = shards.load_tokenizer_file(tokenizer_path)
    eot_id = shards.eot_id_of(tok)
    return (None, None) if eot_id is None else (eot_id, tok.id_to_token(eot_id))


def _check_out(out, source, overwrite: bool) -> None:
    """Refuse an --out that is the source directory, holds it, or lies inside it, when it exists or
    --overwrite would replace it: replacing it would delete what is being converted."""
    out = pathlib.Path(out)
    if source is None or not (overwrite or out.exists()):
        return
    o, s = out.resolve(), pathlib.Path(source).resolve()
    relation = "is" if o == s else "contains" if o in s.parents else "lies inside" if s in o.parents else None
    if relation:
        raise ConvertError(f"--out {out} {relation} the source directory {source}; choose an --out outside it "
                           f"(nothing was written or deleted)")


def _prepare_out(out: pathlib.Path, overwrite: bool) -> pathlib.Path:
    """A fresh temporary directory beside `out`, moved into place by _finish_out."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConvertError(f"{out} already exists; choose another --out or pass --overwrite")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _finish_out(tmp: pathlib.Path, out: pathlib.Path) -> None:
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    tmp.replace(out)


def export(params: dict, gpt_config, out, fmt: str = "torch", tokenizer=None, overwrite: bool = False,
           source=None) -> str:
    """Write params (a pure dict) of a model.GPTConfig (or dict) into `out` in `fmt` ('torch' or 'hf').
    `source`: the run directory they came from, which `out` must not overlap. Returns the layout
    written: 'torch', 'gpt2' or 'bloom'."""
    from safetensors.numpy import save_file

    full = dataclasses.asdict(gpt_config) if dataclasses.is_dataclass(gpt_config) else dict(gpt_config)
    c = TorchGPTConfig.from_dict(full)
    layout = "torch" if fmt == "torch" else hf_format(c) if fmt == "hf" else None
    if layout is None:
        raise ConvertError(f"--format must be torch or hf, got {fmt!r}")
    _check_out(out, source, overwrite)
    tensors = to_torch_tensors(params, c, layout)  # before touching `out`: a refusal leaves it alone
    out = pathlib.Path(out)
    tmp = _prepare_out(out, overwrite)
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        tok = pathlib.Path(tokenizer) if tokenizer else None
        eot_id, eot = _eot(tok) if tok else (None, None)
        meta = {"format": "torch"} if layout == "torch" else hf_config(c, layout, eot_id)
        meta["gpt_jax"] = full
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        if tok is not None and tok.is_file():
            shutil.copyfile(tok, tmp / TOKENIZER_NAME)
            if layout != "torch":  # what AutoTokenizer needs besides tokenizer.json
                special = {f"{k}_token": eot for k in ("bos", "eos", "unk")} if eot else {}
                # a learned-position model stops at block_size; ALiBi has no limit (transformers' default)
                limit = {} if c.alibi_attn else {"model_max_length": c.block_size}
                (tmp / "tokenizer_config.json").write_text(json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", **limit, "add_prefix_space": False, **special},
                    indent=2) + "\n")
        _finish_out(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return layout


def import_hf(hf_dir, out, overwrite: bool = False) -> dict:
    """A transformers GPT-2 (or BLOOM, or our own hf export) directory -> a run directory with
    config.yaml, tokenizer.json (when the directory has a tokenizer) and a step-0 checkpoint of params."""
    import config as config_lib
    import rundir
    import shards
    from model import GPTConfig

    hf_dir, out = pathlib.Path(hf_dir), pathlib.Path(out)
    _check_out(out, hf_dir, overwrite)
    if not (hf_dir / CONFIG_NAME).is_file():
        raise ConvertError(f"{hf_dir} is not a transformers checkpoint directory: no {CONFIG_NAME}")
    meta = json.loads((hf_dir / CONFIG_NAME).read_text())
    c, layout = config_from_hf(meta, str(hf_dir))
    tensors = read_hf_tensors(hf_dir)
    wte_key = "transformer.wte.weight" if layout == "gpt2" else "transformer.word_embeddings.weight"
    lm_head = tensors.pop("lm_head.weight", None)  # saved by some versions; must equal the tied embedding
    if lm_head is not None and wte_key in tensors and not np.array_equal(lm_head, tensors[wte_key]):
        raise ConvertError(f"{hf_dir}: lm_head.weight differs from {wte_key}; model.py ties them")
    for k in [k for k in tensors if k.endswith((".attn.bias", ".attn.masked_bias"))]:
        tensors.pop(k)  # causal-mask buffers of older GPT-2 checkpoints, not parameters
    if wte_key in tensors and tensors[wte_key].shape[0] == c.padded_vocab_size > c.vocab_size:
        tensors[wte_key] = tensors[wte_key][: c.vocab_size]  # an export that kept model.py's padding rows
    params = from_torch_tensors(tensors, c, layout, str(hf_dir))
    gcfg = GPTConfig(**dataclasses.asdict(c))
    tmp = _prepare_out(out, overwrite)
    try:
        run = rundir.Run(tmp)
        run.save_config(config_lib.Config(run_dir=str(out), model_name=f"imported-{layout}", model=gcfg))
        if (hf_dir / TOKENIZER_NAME).is_file():
            shutil.copyfile(hf_dir / TOKENIZER_NAME, tmp / TOKENIZER_NAME)
        elif (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers

            tok = Tokenizer(models.BPE.from_file(str(hf_dir / "vocab.json"), str(hf_dir / "merges.txt")))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            tok.add_special_tokens([t for t in shards.EOT_CANDIDATES[:1] if t in tok.get_vocab()])
            tok.save(str(tmp / TOKENIZER_NAME))
        run.save_params(params, step=0)
        _finish_out(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return params


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="RUN_DIR", help="export this run directory's checkpoint")
    src.add_argument("--import-hf", metavar="HF_DIR", help="import a transformers GPT-2 directory into a run directory")
    parser.add_argument("--step", type=int, help="the checkpoint step to export (default: the last)")
    parser.add_argument("--out", required=True, help="the directory to write (an export, or a run for --import-hf)")
    parser.add_argument("--format", default="torch", choices=("torch", "hf"),
                        help="torch: this file's GPT module; hf: transformers GPT-2 / BLOOM (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")

    def error(message):
        raise ConvertError(f"{message} (usage: python convert_torch.py --checkpoint RUN_DIR --out DIR "
                           f"[--step N] [--format torch|hf] | --import-hf HF_DIR --out RUN_DIR)")

    parser.error = error
    args = parser.parse_args(argv)
    if args.import_hf:
        import_hf(args.import_hf, args.out, args.overwrite)
        if not (pathlib.Path(args.out) / TOKENIZER_NAME).is_file():
            print(f"warning: {args.import_hf} has no tokenizer ({TOKENIZER_NAME}, or vocab.json and merges.txt), so "
                  f"{args.out} has none: prepare data with the model's own (python data.py --tokenizer "
                  f"PATH/{TOKENIZER_NAME}) and copy it into {args.out} for sample.py and eval.py", file=sys.stderr)
        print(f"imported {args.import_hf} into run directory {args.out} (step 0); fine-tune with "
              f"python train.py training.init_from={args.out} data.dir=...")
        return 0
    import storage

    source = None if storage.is_url(args.checkpoint) else args.checkpoint
    _check_out(args.out, source, args.overwrite)  # before reading the checkpoint
    cfg, params, step = read_run(args.checkpoint, args.step)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = pathlib.Path(args.checkpoint) / TOKENIZER_NAME
        if storage.is_url(args.checkpoint):  # a run in an object store: its tokenizer through a local copy
            run = storage.RunDir(args.checkpoint)
            tokenizer = pathlib.Path(scratch) / TOKENIZER_NAME
            if run.is_file(TOKENIZER_NAME):
                tokenizer.write_bytes(run.read_bytes(TOKENIZER_NAME))
        layout = export(params, cfg.model, args.out, args.format, tokenizer, args.overwrite, source)
    how = {"torch": "from convert_torch import GPT; GPT.from_pretrained(DIR)"}.get(
        layout, f"transformers.AutoModelForCausalLM.from_pretrained(DIR) ({layout} layout)")
    print(f"wrote step {step} of {args.checkpoint} to {args.out}; load with {how}")
    return 0


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr and exit status 2."""
    try:
        import errors
    except ImportError:  # this file alone, beside an export: --help works, a conversion needs the repository
        return main(argv)
    return errors.run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
