"""The PyTorch model of an export: model.py's GPT in torch, alone in this file.

Written by `python convert_torch.py --checkpoint RUN_DIR --out DIR` (the default `--format torch`):
`DIR/model.safetensors` and `DIR/config.json`, read here by

    from torch_gpt import GPT     # torch_gpt.py copied beside, or interop/ on sys.path
    model = GPT.from_pretrained(DIR)          # torch, numpy and safetensors; no JAX
    logits = model(tokens)                    # (B, T, padded vocabulary), float32; padding ids PADDED_LOGIT
    out = model.generate(tokens, 50, temperature=0.8, top_k=40)  # KV cache; temperature 0 = greedy

The module reproduces model.py and follows the same switches: the same norms and epsilon,
activations, ALiBi `-slope_h * (i - j)` with model.py's slopes, rotary embeddings, grouped-query
attention, parallel residual, tied or separate output, scores scaled by 1/sqrt(D), logits over the
padded vocabulary (PADDED_LOGIT on the padding). An export carries the real vocabulary's rows
(`vocab_size` of them); `from_pretrained` pads them back with zero rows.

This file imports nothing of the project, so it alone, copied next to an export, is all that
`GPT.from_pretrained` needs. TorchGPTConfig is the one copy of model.GPTConfig's architecture
fields it needs for that (test_families.py checks that the two agree).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # the converter, which imports this file, exports without torch
    torch = F = nn = None

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
PADDED_LOGIT = -1e9  # the logit of the embedding's padding rows, as loss.PADDED_LOGIT
VOCAB_MULTIPLE = 128  # the embedding's rows are padded to a multiple of this, as model.VOCAB_MULTIPLE
# the keys whose rows are the vocabulary: written with the real rows only, padded back on reading
VOCAB_ROWS = ("wte.weight", "lm_head.weight", "head_bias")


class LoadError(ValueError):
    """A directory that is not a --format torch export, or whose tensors do not match its config; str(e) is one line."""


EXPORT = "python convert_torch.py --checkpoint RUN_DIR --format torch --out DIR"  # what writes what this file loads


def read_export_config(directory: pathlib.Path) -> dict:
    """The config.json of a --format torch export in `directory`; a LoadError in one line saying what the
    directory is instead (none, a run directory, a --format hf export, another model) and what loads it or
    what export this file needs."""
    if not directory.is_dir():
        raise LoadError(f"{directory}: no such directory; give the --out of {EXPORT}")
    if not (directory / CONFIG_NAME).is_file():
        if (directory / "config.yaml").is_file() and (directory / "checkpoints").is_dir():
            command = EXPORT.replace("RUN_DIR", str(directory))
            raise LoadError(f"{directory} is a run directory, not an export: export it first ({command}), then load DIR")
        raise LoadError(f"{directory} has no {CONFIG_NAME}: it holds no export; this file loads what {EXPORT} writes")
    try:
        meta = json.loads((directory / CONFIG_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{directory / CONFIG_NAME} cannot be read ({e}); export the run again ({EXPORT})") from None
    if not isinstance(meta, dict) or "gpt_jax" not in meta:
        raise LoadError(f"{directory} is no export of this toolkit (its {CONFIG_NAME} has no gpt_jax): a transformers "
                        f"model loads with transformers.AutoModelForCausalLM.from_pretrained; this file loads what "
                        f"{EXPORT} writes")
    if meta.get("format") != "torch":
        raise LoadError(f"{directory} is a --format hf export (transformers' {meta.get('model_type')} layout): load it "
                        f"with transformers.AutoModelForCausalLM.from_pretrained, or export the run for this file "
                        f"with {EXPORT}")
    return meta


def key_problems(found: dict, expected: dict) -> list[str]:
    """The missing, unexpected and mis-shaped keys of `found` against `expected` (name -> shape dicts),
    one 'missing: a, b' item per kind that has any; [] when they match."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = sorted(f"{k} {tuple(found[k])} != expected {tuple(expected[k])}"
                    for k in set(found) & set(expected) if tuple(found[k]) != tuple(expected[k]))
    return [f"{name}: {', '.join(keys)}" for name, keys in
            (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes)) if keys]


_Module = nn.Module if nn is not None else object  # without torch the classes exist, and refuse to build


def alibi_slopes(n_head: int) -> torch.Tensor:
    """attention.alibi_slopes, in torch: 2^(-8(i+1)/n) for the nearest lower power of two n, then every
    other slope of the sequence for 2n until n_head are taken. float32 (n_head,)."""
    closest = 2 ** int(math.floor(math.log2(n_head)))
    geometric = lambda n: [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]  # noqa: E731
    return torch.tensor(geometric(closest) + geometric(2 * closest)[0::2][: n_head - closest], dtype=torch.float32)


@dataclasses.dataclass(frozen=True)
class TorchGPTConfig:
    """The architecture fields of model.GPTConfig (dtype, remat, attention and fp8 are JAX-side only), with
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
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

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
    """attention.rotary_angles in torch: (cos, sin) float32 (T, rotary_dim/2) at positions (T,), or None."""
    if not c.rotary_dim:
        return None
    inv_freq = 1.0 / (torch.tensor(c.rotary_base, dtype=torch.float32)
                      ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float32) / c.rotary_dim))
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, rope, interleaved: bool) -> torch.Tensor:
    """attention.apply_rotary in torch, for x (B, H, T, D): pairs (2i, 2i+1) or (i, i + rotary_dim/2) rotated."""
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
            raise ImportError("torch_gpt.GPT needs PyTorch: pip install torch")
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
        meta = read_export_config(directory)
        model = cls(meta["gpt_jax"])
        tensors = load_file(str(directory / WEIGHTS_NAME), device=str(map_location))
        c = model.config
        for key in VOCAB_ROWS:  # the real rows; the padding rows stay zero
            t = tensors.get(key)
            if t is not None and t.shape[0] == c.vocab_size:
                tensors[key] = F.pad(t, (0, 0) * (t.dim() - 1) + (0, c.padded_vocab_size - c.vocab_size))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        problems = key_problems({k: tuple(v.shape) for k, v in tensors.items()}, expected)
        if problems:
            raise LoadError(f"{directory / WEIGHTS_NAME} does not match the model: " + "; ".join(problems))
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

