"""Hand a trained model to PyTorch and Hugging Face, and bring transformers checkpoints into a run.

    python convert_torch.py --checkpoint RUN_DIR [--step N] --out DIR [--format torch|hf] [--overwrite]
    python convert_torch.py --import-hf HF_DIR --out RUN_DIR [--overwrite]

Export writes `model.safetensors`, `config.json` and the run's `tokenizer.json` (no pickles).
`--format torch` (the default) is read by the `GPT` module of this file:

    from convert_torch import GPT
    model = GPT.from_pretrained(DIR)          # torch and safetensors only; no JAX needed

`--format hf` writes the transformers layout of the model's family, for
`AutoModelForCausalLM.from_pretrained(DIR)`:

    ALiBi, LayerNorm after the embedding           BLOOM      (BloomForCausalLM)
    learned positions                              GPT-2      (GPT2LMHeadModel)
    learned positions read at offset 2             OPT        (OPTForCausalLM)
    rotary, interleaved pairs, parallel block      GPT-J      (GPTJForCausalLM)
    rotary, half-split, LayerNorm                  GPT-NeoX   (GPTNeoXForCausalLM; Pythia)
    rotary, half-split, RMSNorm, SwiGLU            LLaMA      (LlamaForCausalLM; grouped-query attention)

A model its family's layout cannot express exactly is refused with the reasons, never exported
approximately. Biases a layout always has are written as zeros when the model has none, which is exact.
Exports carry the real vocabulary: `vocab_size` is the tokenizer's and the embedding has that many
rows. model.py pads its embedding to a multiple of 128 and gives the padding rows the logit
PADDED_LOGIT, so a softmax over the real rows alone is the same distribution.

Import (`--import-hf`) turns a transformers directory (local, or at a gs:// URL: copied to a
temporary directory first) of any of those six families into a run directory whose step-0
checkpoint holds the parameters (the embedding padded with zero rows), reading the architecture
from config.json as transformers reads it and refusing, with the reasons, what model.py cannot
express (post-LayerNorm OPT, scaled rotary embeddings, ...). A field of
config.json that is not what it must be (HF_FIELDS), or a tokenizer that does not load, is one
error line naming it, before anything is written. `training.init_from=RUN_DIR` starts a
fine-tuning run from it. Every config.json we write also carries the JAX model's config under
`gpt_jax`, so JAX -> PyTorch (either format) -> JAX returns the identical config and parameters
(the embedding's padding rows, which no logit depends on, as zeros).

Every tensor is mapped exactly once in both directions; missing, unexpected and mis-shaped keys
are listed in the error. The PyTorch module reproduces model.py and follows the same switches: the
same norms and epsilon, activations, ALiBi `-slope_h * (i - j)` with model.py's slopes, rotary
embeddings, grouped-query attention, parallel residual, tied or separate output, scores scaled by
1/sqrt(D), logits over the padded vocabulary (PADDED_LOGIT on the padding).

Exporting needs numpy and safetensors only; the GPT module and reading pytorch_model.bin need torch.
This file imports nothing of the project at its top, so a copy of it alone next to an export is
all that `GPT.from_pretrained` needs (with torch, numpy and safetensors installed).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import pathlib
import shutil
import sys
import tempfile

if __name__ == "__main__":  # a Ctrl-C while torch and the rest load: one line (errors.py, beside the repository)
    try:
        import errors

        errors.stop_at_once_while_loading()
    except ImportError:
        pass

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
    """The architecture fields of model.GPTConfig (dtype, remat and attention are JAX-side only), with
    the same meanings and defaults; see model.py."""

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
    rotary_dim: int = 0
    rotary_interleaved: bool = False
    rotary_base: float = 10000.0
    position_offset: int = 0
    residual: str = "sequential"
    norm: str = "layernorm"
    activation: str = "gelu"
    mlp_dim: int | None = None
    num_kv_head: int | None = None
    attention_bias: bool | None = None
    tie_embeddings: bool = True
    head_bias: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "TorchGPTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // 128) * 128

    @property
    def head_dim(self) -> int:
        return self.embedding_dim // self.num_head

    @property
    def positions(self) -> str:
        return "alibi" if self.alibi_attn else "rotary" if self.rotary_dim else "learned"

    @property
    def kv_heads(self) -> int:
        return self.num_head if self.num_kv_head is None else self.num_kv_head

    @property
    def ffn_dim(self) -> int:
        return 4 * self.embedding_dim if self.mlp_dim is None else self.mlp_dim

    @property
    def attn_bias(self) -> bool:
        return self.bias if self.attention_bias is None else self.attention_bias


def _norm(c: TorchGPTConfig):
    if c.norm == "rmsnorm":
        return nn.RMSNorm(c.embedding_dim, eps=c.layer_norm_epsilon)
    return nn.LayerNorm(c.embedding_dim, eps=c.layer_norm_epsilon, bias=c.bias)


def rotary_angles(c: TorchGPTConfig, positions: torch.Tensor):
    """model.rotary_angles in torch: (cos, sin) float32 (T, rotary_dim/2) at positions (T,), or None."""
    if not c.rotary_dim:
        return None
    inv_freq = 1.0 / (torch.tensor(c.rotary_base, dtype=torch.float32)
                      ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float32) / c.rotary_dim))
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, rope, interleaved: bool) -> torch.Tensor:
    """model.apply_rotary in torch, for x (B, H, T, D): pairs (2i, 2i+1) or (i, i + rotary_dim/2) rotated."""
    cos, sin = rope  # (T, r)
    r = cos.shape[-1]
    rot, rest = x[..., : 2 * r], x[..., 2 * r:]
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :r], rot[..., r:])
    a, b = a * cos - b * sin, b * cos + a * sin
    rot = torch.stack([a, b], dim=-1).flatten(-2) if interleaved else torch.cat([a, b], dim=-1)
    return torch.cat([rot, rest], dim=-1)


class MLP(_Module):
    def __init__(self, c: TorchGPTConfig):
        super().__init__()
        d, f = c.embedding_dim, c.ffn_dim
        self.c_fc = nn.Linear(d, f, bias=c.bias)
        if c.activation == "swiglu":
            self.c_gate = nn.Linear(d, f, bias=c.bias)
        self.c_proj = nn.Linear(f, d, bias=c.bias)
        self.c = c

    def forward(self, x):
        h = self.c_fc(x)
        if self.c.activation == "swiglu":
            h = F.silu(self.c_gate(x)) * h
        elif self.c.activation == "relu":
            h = F.relu(h)
        else:
            h = F.gelu(h, approximate="tanh" if self.c.gelu_approximate else "none")
        return self.c_proj(h)


class Block(_Module):
    def __init__(self, c: TorchGPTConfig):
        super().__init__()
        d, H, K, D = c.embedding_dim, c.num_head, c.kv_heads, c.head_dim
        self.c, self.H, self.K, self.D = c, H, K, D
        self.ln_1 = _norm(c)
        self.attn = nn.Module()
        if K == H:
            self.attn.c_attn = nn.Linear(d, 3 * d, bias=c.attn_bias)  # output rows ordered (3, H, D)
        else:
            self.attn.c_q = nn.Linear(d, H * D, bias=c.attn_bias)  # rows (H, D)
            self.attn.c_kv = nn.Linear(d, 2 * K * D, bias=c.attn_bias)  # rows (2, K, D)
        self.attn.c_proj = nn.Linear(H * D, d, bias=c.attn_bias)  # input columns ordered (H, D)
        self.ln_2 = None if c.residual == "parallel_shared" else _norm(c)
        self.mlp = MLP(c)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, mask, rope, cache=None):
        """x (B, T, d); mask (H or 1, T, Tk) float, added to the scores; rope: (cos, sin) or None; cache: (k, v)
        of earlier positions or None."""
        B, T, d = x.shape
        H, K, D = self.H, self.K, self.D
        h = self.ln_1(x)
        if K == H:
            q, k, v = self.attn.c_attn(h).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        else:
            q = self.attn.c_q(h).view(B, T, H, D).transpose(1, 2)
            k, v = self.attn.c_kv(h).view(B, T, 2, K, D).permute(2, 0, 3, 1, 4)  # each (B, K, T, D)
        if rope is not None:
            q, k = apply_rotary(q, rope, self.c.rotary_interleaved), apply_rotary(k, rope, self.c.rotary_interleaved)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)  # (B, K, Tk, D)
        p = self.c.dropout if self.training else 0.0
        kk, vv = (k, v) if K == H else (k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1))
        y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, dropout_p=p)  # scale 1/sqrt(D)
        a = self.drop(self.attn.c_proj(y.transpose(1, 2).reshape(B, T, H * D)))
        if self.c.residual == "sequential":
            x = x + a
            return x + self.drop(self.mlp(self.ln_2(x))), (k, v)
        return x + a + self.drop(self.mlp(h if self.ln_2 is None else self.ln_2(x))), (k, v)


class GPT(_Module):
    """model.GPT in PyTorch. `forward(tokens)` -> float logits (B, T, padded_vocab_size), PADDED_LOGIT at the
    ids >= vocab_size, so softmax, cross-entropy and argmax over them are those over the real vocabulary.
    Like model.py it pads the embedding to a multiple of 128 rows; an export holds the vocab_size real ones."""

    def __init__(self, config: TorchGPTConfig | dict):
        if torch is None:
            raise ImportError("convert_torch.GPT needs PyTorch: pip install torch")
        super().__init__()
        c = self.config = config if isinstance(config, TorchGPTConfig) else TorchGPTConfig.from_dict(config)
        d, V = c.embedding_dim, c.padded_vocab_size
        self.wte = nn.Embedding(V, d)  # also the output projection when tied
        self.wpe = nn.Embedding(c.block_size + c.position_offset, d) if c.positions == "learned" else None
        self.embed_norm = _norm(c) if c.embed_norm else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.N)])
        self.ln_f = _norm(c)
        self.lm_head = None if c.tie_embeddings else nn.Linear(d, V, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(V)) if c.head_bias else None
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
        c = model.config
        for key in VOCAB_ROWS:  # the real rows; the padding rows stay zero
            t = tensors.get(key)
            if t is not None and t.shape[0] == c.vocab_size:
                tensors[key] = F.pad(t, (0, 0) * (t.dim() - 1) + (0, c.padded_vocab_size - c.vocab_size))
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
        c = self.config
        positions = torch.arange(start, start + T, device=tokens.device)
        x = self.wte(tokens)  # (B, T, d)
        if self.wpe is not None:
            if start + T > c.block_size:
                raise ValueError(f"input of {start + T} tokens is longer than block_size {c.block_size} "
                                 f"of a learned-position model")
            x = x + self.wpe(positions + c.position_offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.drop(x)
        mask, rope = self._mask(T, start + T, tokens.device), rotary_angles(c, positions)
        new = []
        for n, block in enumerate(self.blocks):
            x, kv = block(x, mask, rope, None if caches is None else caches[n])
            new.append(kv)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = self.ln_f(x) @ head.T  # (B, T, V_padded)
        if self.head_bias is not None:
            logits = logits + self.head_bias
        padding = torch.arange(logits.shape[-1], device=logits.device) >= c.vocab_size
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
# A None path is a zero tensor the layout needs but the model does not have (bias=False). A path
# ending in #i is part i of a fused weight (q, k, v of c_attn; k, v of c_kv): its index along the
# fused axis (1 of a kernel, 0 of a bias), for layouts that keep them as separate tensors.

# the keys whose rows are the vocabulary: written with the real rows only, padded back on reading
VOCAB_ROWS = ("wte.weight", "lm_head.weight", "head_bias")

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


def _layout(c: TorchGPTConfig, fmt: str) -> list[tuple]:
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


def _part_axis(path: str) -> int:
    return 1 if path.endswith("kernel") else 0  # a fused kernel (d, 3 or 2, heads, D); a bias (3 or 2, heads, D)


def to_torch_tensors(params: dict, c: TorchGPTConfig, fmt: str) -> dict[str, np.ndarray]:
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


def from_torch_tensors(tensors: dict[str, np.ndarray], c: TorchGPTConfig, fmt: str, where: str) -> dict:
    """{key: array} in a layout -> JAX parameters (a pure dict); every tensor used exactly once."""
    entries = _layout(c, fmt)
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
# Hugging Face configs

# transformers' activation names -> (model.py's activation, gelu_approximate); silu is LLaMA's gated MLP
ACTIVATION_NAMES = {"gelu_new": ("gelu", True), "gelu_pytorch_tanh": ("gelu", True), "gelu": ("gelu", False),
                    "relu": ("relu", None), "silu": ("swiglu", None)}


def hf_format(c: TorchGPTConfig) -> str:
    """The transformers layout that expresses the model exactly ('gpt2', 'bloom', 'gptj', 'gpt_neox',
    'opt' or 'llama'), or a ConvertError saying why none does."""
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
    if why:
        raise ConvertError(f"cannot export to --format hf: {family}, which cannot express {', '.join(why)}; "
                           f"use --format torch")
    return fmt


def hf_config(c: TorchGPTConfig, fmt: str, eot_id: int | None) -> dict:
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


def _exported_config(meta: dict, where: str) -> tuple[TorchGPTConfig, str]:
    """(config, layout) of a config.json written by this file: the JAX model config under `gpt_jax`,
    checked as config.yaml's model section is, and the layout its tensors are in."""
    import config as config_lib
    from model import GPTConfig

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
    return TorchGPTConfig.from_dict(dataclasses.asdict(gcfg)), layout


def config_from_hf(meta, where: str) -> tuple[TorchGPTConfig, str]:
    """(config, layout) of a transformers config.json (parsed); refuses, with the reasons, what model.py cannot
    express, and a malformed field (HF_FIELDS) with its name and value. `where` names the file in errors."""
    if not isinstance(meta, dict):
        raise ConvertError(f"{where} must hold a JSON object of the model's settings, got {_shown(meta)}")
    if "gpt_jax" in meta:  # written by this file: the exact original config
        return _exported_config(meta, where)
    get = lambda key, default=None: hf_field(meta, key, default, where)  # noqa: E731
    kind = get("model_type")
    names = {"gpt2": "GPT-2", "bloom": "BLOOM", "gptj": "GPT-J", "gpt_neox": "GPT-NeoX", "opt": "OPT",
             "llama": "LLaMA"}
    if kind not in names:
        raise ConvertError(f"{where}: model_type {kind!r} is not supported; import reads the decoder-only "
                           f"{', '.join(names.values())} layouts (model_type {', '.join(names)})")

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
        return TorchGPTConfig(vocab_size=get("vocab_size", 50257), block_size=get("n_positions", 1024),
                              embedding_dim=d, num_head=get("n_head", 12), N=get("n_layer", 12), alibi_attn=False,
                              mlp_dim=get("n_inner"), layer_norm_epsilon=get("layer_norm_epsilon", 1e-5), **act), kind
    if kind == "bloom":
        refuse_if((get("apply_residual_connection_post_layernorm", False), "post-LayerNorm residual"),
                  (not get("tie_word_embeddings", True), "untied output embedding"))
        return TorchGPTConfig(vocab_size=get("vocab_size", 250880), block_size=get("seq_length", 2048),
                              embedding_dim=get("hidden_size", 64), num_head=get("n_head", 8),
                              N=get("n_layer", 2), alibi_attn=True, bias=True, embed_norm=True,
                              gelu_approximate=True, layer_norm_epsilon=get("layer_norm_epsilon", 1e-5)), kind
    if kind == "gptj":
        act, bad_act = activation("activation_function", "gelu_new", ("gelu",))
        refuse_if(bad_act,
                  (get("rotary_dim", 64) is None, "rotary_dim null (rotary over the whole model width)"))
        return TorchGPTConfig(vocab_size=get("vocab_size", 50400), block_size=get("n_positions", 2048),
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
        return TorchGPTConfig(vocab_size=get("vocab_size", 50432), block_size=get("max_position_embeddings", 2048),
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
        return TorchGPTConfig(vocab_size=get("vocab_size", 50272), block_size=get("max_position_embeddings", 2048),
                              embedding_dim=d, num_head=H, N=get("num_hidden_layers", 12), alibi_attn=False,
                              position_offset=2, bias=bias, attention_bias=bias, mlp_dim=get("ffn_dim"),
                              tie_embeddings=get("tie_word_embeddings", True), layer_norm_epsilon=1e-5, **act), kind
    base, factor = _rope(get, where, names[kind], "rope_theta", None, 1.0)
    act, bad_act = activation("hidden_act", "silu", ("swiglu",))
    refuse_if(bad_act,
              (factor != 1.0, f"partial_rotary_factor {factor} (LLaMA rotates whole heads)"),
              (get("head_dim") not in (None, d // H), f"head_dim {get('head_dim')} (not hidden_size / heads)"))
    return TorchGPTConfig(vocab_size=get("vocab_size", 32000), block_size=get("max_position_embeddings", 2048),
                          embedding_dim=d, num_head=H, N=get("num_hidden_layers", 32), alibi_attn=False,
                          rotary_dim=d // H, rotary_base=base, norm="rmsnorm", **act,
                          num_kv_head=get("num_key_value_heads"), bias=get("mlp_bias", False),
                          attention_bias=get("attention_bias", False), mlp_dim=get("intermediate_size", 11008),
                          tie_embeddings=get("tie_word_embeddings", False),
                          layer_norm_epsilon=get("rms_norm_eps", 1e-6)), kind


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


def read_hf_tokenizer(hf_dir: pathlib.Path):
    """The tokenizer of a transformers directory, checked to load: the path of its tokenizer.json (copied as it
    is), else a byte-level BPE tokenizers.Tokenizer built from vocab.json and merges.txt, else None."""
    import shards
    from errors import DataError

    if (hf_dir / TOKENIZER_NAME).is_file():
        try:
            shards.load_tokenizer_file(hf_dir / TOKENIZER_NAME)
        except DataError as e:
            raise ConvertError(f"{e}; the tokenizers library cannot read it: fix it, or remove it and import "
                               f"without a tokenizer") from None
        return hf_dir / TOKENIZER_NAME
    vocab, merges = hf_dir / "vocab.json", hf_dir / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        return None
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:  # the library raises a bare Exception for unreadable files
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ConvertError(f"cannot build a tokenizer from {vocab} and {merges}: {reason}") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t in shards.EOT_CANDIDATES[:1] if t in tok.get_vocab()])
    return tok


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


def _is_export(directory: pathlib.Path) -> bool:
    """Whether a directory holds an export of this file: a config.json carrying `gpt_jax`."""
    try:
        meta = json.loads((directory / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "gpt_jax" in meta


_OURS = {  # what --overwrite may replace, besides an empty directory
    "export": (_is_export, f"an export of convert_torch.py (a {CONFIG_NAME} with gpt_jax)"),
    "import": (lambda directory: (directory / "config.yaml").is_file(), "a run directory (one with config.yaml)"),
}


def _check_out(out, source, overwrite: bool, kind: str = "export") -> pathlib.Path:
    """Refuse, before anything is written, an --out that must not be written (outputs.check_out: empty,
    the current or home directory or one holding them, a file), one that is the source directory, holds it,
    or lies inside it (when it exists or --overwrite would replace it: that would delete what is being
    converted), an existing one without --overwrite, and with it one that is not this kind's output
    (`kind` "export": a config.json of ours; "import": a run directory)."""
    import outputs
    import storage

    if not str(out).strip():
        raise ConvertError("--out is empty; name the directory to write")
    out = out if storage.is_url(out) else pathlib.Path(out)  # a URL: gs://bucket/dir (no local source inside)
    if source is not None and not storage.is_url(out) and (overwrite or out.exists()):
        o, s = out.resolve(), pathlib.Path(source).resolve()
        relation = "is" if o == s else "contains" if o in s.parents else "lies inside" if s in o.parents else None
        if relation:
            raise ConvertError(f"--out {out} {relation} the source directory {source}; choose an --out outside "
                               f"it (nothing was written or deleted)")
    ours, what = _OURS[kind]
    out = outputs.check_out(out, overwrite, ours=ours, what=what, hidden=True, error=ConvertError)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConvertError(f"{out} already exists; choose another --out or pass --overwrite")
    return out


def export(params: dict, gpt_config, out, fmt: str = "torch", tokenizer=None, overwrite: bool = False,
           source=None) -> str:
    """Write params (a pure dict) of a model.GPTConfig (or dict) into `out` in `fmt` ('torch' or 'hf').
    `source`: the run directory they came from, which `out` must not overlap. Returns the layout
    written: 'torch' or the transformers model_type (`hf_format`)."""
    from safetensors.numpy import save_file

    full = dataclasses.asdict(gpt_config) if dataclasses.is_dataclass(gpt_config) else dict(gpt_config)
    c = TorchGPTConfig.from_dict(full)
    layout = "torch" if fmt == "torch" else hf_format(c) if fmt == "hf" else None
    if layout is None:
        raise ConvertError(f"--format must be torch or hf, got {fmt!r}")
    import outputs
    import storage

    out = _check_out(out, source, overwrite)
    tensors = to_torch_tensors(params, c, layout)  # before touching `out`: a refusal leaves it alone
    with outputs.StagedDir(out, replace=overwrite, hidden=True, last=CONFIG_NAME) as staged:  # swapped in whole
        tmp = staged.path
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        storage.plain_mode(tmp / WEIGHTS_NAME)  # readable as the other files are, not owner-only
        tok = pathlib.Path(tokenizer) if tokenizer else None
        eot_id, eot = _eot(tok) if tok else (None, None)
        meta = {"format": "torch"} if layout == "torch" else hf_config(c, layout, eot_id)
        meta["gpt_jax"] = full
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        if tok is not None and tok.is_file():
            shutil.copyfile(tok, tmp / TOKENIZER_NAME)
            if layout != "torch":  # what AutoTokenizer needs besides tokenizer.json
                special = {f"{k}_token": eot for k in ("bos", "eos", "unk")} if eot else {}
                # the training context, for every layout: the length lm-eval's HF backend scores windows of
                # when config.json names none (BLOOM's), and eval.py's adapter's default; ALiBi and rotary
                # models still run on longer inputs
                (tmp / "tokenizer_config.json").write_text(json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": c.block_size,
                     "add_prefix_space": False, **special}, indent=2) + "\n")
        staged.commit()
    return layout


HF_READ = (CONFIG_NAME, TOKENIZER_NAME, "vocab.json", "merges.txt")  # what an import reads, with the weights


def fetch_hf_dir(url: str, scratch: pathlib.Path) -> pathlib.Path:
    """The files of a transformers directory at a URL (gs://...) that an import reads, copied into
    `scratch`: config.json, the tokenizer's files and the weights (model*.safetensors, else
    pytorch_model.bin); the rest (other weight formats, READMEs) stays where it is."""
    import fnmatch

    import storage

    fs, path = storage.filesystem(url, error=ConvertError)

    def one_line(e: Exception) -> str:
        return storage.os_problem(e) or (str(e).splitlines() or [type(e).__name__])[0][:200]

    try:
        files = {info["name"].rstrip("/").rsplit("/", 1)[-1]: info["name"] for info in fs.ls(path, detail=True)
                 if info["type"] == "file"} if fs.isdir(path) else {}
    except Exception as e:  # no access, no network
        raise ConvertError(f"cannot list {url}: {one_line(e)}") from None
    weights = sorted(n for n in files if fnmatch.fnmatch(n, "model*.safetensors")) or \
        [n for n in files if n == "pytorch_model.bin"]
    for name in [n for n in HF_READ if n in files] + weights:
        try:
            fs.get_file(files[name], str(scratch / name))
        except Exception as e:  # a full local disk, a lost connection
            raise ConvertError(f"cannot copy {url}/{name} to {scratch}: {one_line(e)}") from None
    return scratch


def import_hf(hf_dir, out, overwrite: bool = False) -> dict:
    """A transformers directory (GPT-2, BLOOM, GPT-J, GPT-NeoX, OPT, LLaMA, or our own hf export) -> a run directory
    with config.yaml, tokenizer.json (when the directory has a tokenizer) and a step-0 checkpoint of params.
    A directory at a URL (gs://...) is copied into a temporary local directory first, and named by its
    URL in what is said of it."""
    import config as config_lib
    import outputs
    import rundir
    import storage
    from model import GPTConfig

    if storage.is_url(hf_dir):
        url = str(hf_dir).rstrip("/")
        _check_out(out, None, overwrite, "import")  # before the copy
        with tempfile.TemporaryDirectory(prefix="import-hf-") as scratch:
            local = fetch_hf_dir(url, pathlib.Path(scratch))
            try:
                return import_hf(local, out, overwrite)
            except ConvertError as e:
                raise ConvertError(str(e).replace(str(local), url)) from None
    hf_dir = pathlib.Path(storage.local_path(hf_dir))
    out = _check_out(out, hf_dir, overwrite, "import")
    if not (hf_dir / CONFIG_NAME).is_file():
        raise ConvertError(f"{hf_dir} is not a transformers checkpoint directory: no {CONFIG_NAME}")
    try:
        meta = json.loads((hf_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{hf_dir / CONFIG_NAME} is not readable JSON ({e})") from None
    c, layout = config_from_hf(meta, str(hf_dir / CONFIG_NAME))
    tokenizer = read_hf_tokenizer(hf_dir)  # before anything is written: a broken one stops the import
    tensors = read_hf_tensors(hf_dir)
    wte_key, lm_key = embedding_key(layout), head_key(layout)
    if c.tie_embeddings and lm_key in tensors:  # saved by some versions; must equal the tied embedding
        lm_head = tensors.pop(lm_key)
        if wte_key in tensors and not np.array_equal(lm_head, tensors[wte_key]):
            raise ConvertError(f"{hf_dir}: {lm_key} differs from {wte_key}, but config.json ties them")
    buffers = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
    for k in [k for k in tensors if k.endswith(buffers)]:
        tensors.pop(k)  # causal masks and rotary frequencies of older checkpoints: buffers, not parameters
    for key in (wte_key, lm_key, lm_key.replace(".weight", ".bias")):
        if key in tensors and tensors[key].shape[0] == c.padded_vocab_size > c.vocab_size:
            tensors[key] = tensors[key][: c.vocab_size]  # an export that kept model.py's padding rows
    try:
        gcfg = GPTConfig(**dataclasses.asdict(c))
    except ValueError as e:
        raise ConvertError(f"{hf_dir / CONFIG_NAME} gives a model that model.py refuses: {e}") from None
    params = from_torch_tensors(tensors, c, layout, str(hf_dir))
    # the run's config: conf/config.yaml's settings, as train.py reads them, with the imported model, whose
    # own context (training.seq_len null) the file's seq_len, set for its model, must not cut
    base = config_lib.load_config(config_lib.DEFAULT_CONFIG)
    run_cfg = dataclasses.replace(base, run_dir=str(out), model_name=f"imported-{layout}", model=gcfg,
                                  training=dataclasses.replace(base.training, seq_len=None))
    with contextlib.ExitStack() as held, \
            outputs.StagedDir(out, replace=overwrite, hidden=True, last=rundir.CONFIG) as staged:
        if out.is_dir() and any(out.iterdir()):  # --overwrite of a run: not while a process writes it
            held.enter_context(rundir.Run(out).writer("convert_torch.py --import-hf --overwrite"))
        tmp = staged.path
        run = rundir.Run(tmp)
        run.save_config(run_cfg)
        if isinstance(tokenizer, pathlib.Path):  # the directory's tokenizer.json, as it is
            shutil.copyfile(tokenizer, tmp / TOKENIZER_NAME)
        elif tokenizer is not None:
            tokenizer.save(str(tmp / TOKENIZER_NAME))
        try:
            run.save_params(params, step=0)  # a failed write (a full disk) is a RunError with the reason
        except Exception as e:  # said of --out, not of the staging directory's checkpoint
            reason = storage.os_problem(e)
            if reason is None:
                raise
            raise storage.StorageError(f"cannot write {out}: {reason}") from None
        staged.commit()
    return params


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="RUN_DIR", help="export this run directory's checkpoint")
    src.add_argument("--import-hf", metavar="HF_DIR", help="import a transformers directory (GPT-2, BLOOM, GPT-J, "
                     "GPT-NeoX, OPT or LLaMA) into a run directory")
    parser.add_argument("--step", type=int, help="the checkpoint step to export (default: the last)")
    parser.add_argument("--out", required=True, help="the directory to write (an export, or a run for --import-hf)")
    parser.add_argument("--format", default="torch", choices=("torch", "hf"),
                        help="torch: this file's GPT module; hf: the transformers layout of the model's family "
                             "(default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")

    def error(message):
        raise ConvertError(f"{message} (usage: python convert_torch.py --checkpoint RUN_DIR --out DIR "
                           f"[--step N] [--format torch|hf] | --import-hf HF_DIR --out RUN_DIR)")

    parser.error = error
    args = parser.parse_args(argv)
    if args.import_hf:
        import rundir

        import_hf(args.import_hf, args.out, args.overwrite)
        imported = rundir.Run(args.out)  # a local path or a URL
        has_tokenizer = imported.is_file(TOKENIZER_NAME)
        if not has_tokenizer:
            print(f"warning: {args.import_hf} has no tokenizer ({TOKENIZER_NAME}, or vocab.json and merges.txt), so "
                  f"{args.out} has none: prepare data with the model's own (python data.py --tokenizer "
                  f"PATH/{TOKENIZER_NAME}) and copy it into {args.out} for sample.py and eval.py", file=sys.stderr)
        import shlex

        context = imported.config().model.block_size
        run, name = args.out.rstrip("/"), pathlib.PurePath(args.out.rstrip("/")).name
        data_dir = f"data/{name}"
        tokenizer = run if has_tokenizer else f"PATH/{TOKENIZER_NAME}"
        print(f"imported {args.import_hf} into run directory {args.out} (step 0), context {context} tokens (what its "
              f"config.json names, or its family's default where it names none; train on shorter windows with "
              f"training.seq_len=N). Fine-tune it (the run takes the imported model) on your text files:\n"
              f"  python data.py --input 'TEXT/*.txt' --out {shlex.quote(data_dir)} --tokenizer {shlex.quote(tokenizer)}\n"
              f"  python train.py training.init_from={shlex.quote(run)} data.dir={shlex.quote(data_dir)} "
              f"run_dir={shlex.quote(run + '-tuned')}")
        return 0
    import storage

    args.checkpoint = storage.local_path(args.checkpoint)  # file:///x: the local run directory /x
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
