"""What a GPT is, apart from how it computes (model.py): its config, `GPTConfig` (the fields, the layout
switches of the decoder families, every check of their values and combinations, the sizes they imply),
and its counts: the exact parameters (`param_count`) and the training FLOPs per token (`flops_per_token`,
for MFU and the plan).

model.py re-exports every name here (model.GPTConfig, model.param_count, ...), the names the rest of the
project uses. The checks name the attention implementations, rematerialisation policies and FP8's compute
dtypes of this folder; imports nothing of the project outside it.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from layers import fp8
from layers import remat as remat_lib
from layers.attention import ATTENTION_IMPLS, cudnn_dtype_problem

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
VOCAB_MULTIPLE = 128  # pad the vocabulary so the embedding and logits matmuls tile well


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257  # tokenizer vocabulary; the embedding is padded to a multiple of 128
    block_size: int = 1024  # training context; the limit for learned positions only
    embedding_dim: int = 768  # d, the residual stream width
    num_head: int = 12  # attention heads; head size = embedding_dim / num_head
    N: int = 12  # number of blocks
    dropout: float = 0.0  # on embeddings, attention probabilities and residual branches
    alibi_attn: bool = True  # ALiBi biases (True) or GPT-2 learned absolute positions (False)
    bias: bool = True  # biases in linear layers and LayerNorms
    embed_norm: bool = False  # LayerNorm right after the embedding (BLOOM's layout)
    gelu_approximate: bool = True  # tanh approximation of GELU (GPT-2, BLOOM) or exact erf
    layer_norm_epsilon: float = 1e-5
    # The switches of the other decoder families (GPT-J, GPT-NeoX/Pythia, OPT, LLaMA); the defaults are the
    # GPT-2/BLOOM layout above, so a config that does not name them means what it always meant.
    rotary_dim: int = 0  # rotary embedding on the first rotary_dim dims of every head (needs alibi_attn false); 0: none
    rotary_interleaved: bool = False  # rotate dims (2i, 2i+1) (GPT-J) rather than (i, i + rotary_dim/2) (NeoX, LLaMA)
    rotary_base: float = 10000.0  # the rotary wavelengths: base^(-2i/rotary_dim)
    position_offset: int = 0  # learned positions: position p reads row p + offset of the table (OPT: 2)
    # sequential | parallel (NeoX: attention and MLP from the same input) | parallel_shared (GPT-J: one norm for both)
    residual: str = "sequential"
    norm: str = "layernorm"  # layernorm | rmsnorm (LLaMA: no mean, no bias)
    activation: str = "gelu"  # MLP: gelu (gelu_approximate: tanh or erf) | relu (OPT) | swiglu (LLaMA: silu(gate) * up)
    mlp_dim: int | None = None  # the MLP width; None: 4 * embedding_dim
    num_kv_head: int | None = None  # key/value heads, dividing num_head (grouped-query attention); None: num_head
    attention_bias: bool | None = None  # biases of the q, k, v and output projections; None: as `bias`
    tie_embeddings: bool = True  # output projection = the token embedding, transposed; false: a separate lm_head
    head_bias: bool = False  # a bias on the output logits (GPT-J's lm_head)
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16
    remat: str = "none"  # rematerialisation per block: none | full | save_matmuls
    attention: str = "auto"  # auto (fastest for the backend) | xla (reference) | dot_product | cudnn (GPU) | pallas
    fp8: bool = False  # the blocks' projections in float8 (fp8.py): FP8 GEMMs on an H100/H200, FP8's numerics elsewhere

    # (class attributes, not fields) what a mapping `model: {...}` without a named size must set
    REQUIRED_FIELDS = ("vocab_size", "block_size", "embedding_dim", "num_head", "N")
    # the fields that change the parameters or the function they compute: what training.init_from, an
    # import and an export must agree on; the rest say how it is computed (dropout, dtype, remat, attention, fp8)
    PARAMETER_FIELDS = ("vocab_size", "block_size", "embedding_dim", "num_head", "N", "alibi_attn", "bias",
                        "embed_norm", "gelu_approximate", "layer_norm_epsilon", "rotary_dim", "rotary_interleaved",
                        "rotary_base", "position_offset", "residual", "norm", "activation", "mlp_dim", "num_kv_head",
                        "attention_bias", "tie_embeddings", "head_bias")
    RESIDUALS = ("sequential", "parallel", "parallel_shared")
    NORMS = ("layernorm", "rmsnorm")
    ACTIVATIONS = ("gelu", "relu", "swiglu")

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "embedding_dim", "num_head", "N"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("vocab_size", "block_size", "embedding_dim", "num_head", "N", "mlp_dim", "num_kv_head"):
            if (getattr(self, name) or 0) >= 2**31:  # an array dimension: XLA's shapes are 32-bit
                raise ValueError(f"model.{name} must be below 2**31, got {getattr(self, name)}")
        # one spelling per model: a value equal to its default's meaning is stored as the default (null),
        # so configs, init_from and imports compare equal whenever the models are the same
        for name, same in (("mlp_dim", 4 * self.embedding_dim), ("num_kv_head", self.num_head),
                           ("attention_bias", self.bias)):
            if getattr(self, name) == same:
                object.__setattr__(self, name, None)
        if self.embedding_dim % self.num_head:
            raise ValueError(
                f"model.embedding_dim ({self.embedding_dim}) must be divisible by model.num_head ({self.num_head})"
            )
        for name, allowed in (("residual", self.RESIDUALS), ("norm", self.NORMS), ("activation", self.ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("mlp_dim", "num_kv_head"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be a positive integer or null, got {getattr(self, name)}")
        if self.num_head % self.kv_heads:
            raise ValueError(f"model.num_kv_head ({self.kv_heads}) must divide model.num_head ({self.num_head})")
        if self.rotary_dim:
            if self.alibi_attn:
                raise ValueError("model.rotary_dim > 0 needs model.alibi_attn: false (one position scheme: ALiBi "
                                 "biases or rotary embeddings)")
            if self.rotary_dim < 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
                raise ValueError(f"model.rotary_dim must be even and in 0..head size ({self.head_dim}), "
                                 f"got {self.rotary_dim}")
        if not self.rotary_base > 0:
            raise ValueError(f"model.rotary_base must be positive, got {self.rotary_base}")
        if self.position_offset < 0 or (self.position_offset and self.positions != "learned"):
            raise ValueError(f"model.position_offset ({self.position_offset}) must be >= 0, and 0 unless the model "
                             f"has learned positions (alibi_attn: false, rotary_dim: 0)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.remat not in remat_lib.REMAT_POLICIES:
            raise ValueError(f"model.remat must be one of {', '.join(remat_lib.REMAT_POLICIES)}, "
                             f"got {self.remat!r}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_IMPLS)}, got {self.attention!r}")
        if self.fp8 and self.dtype not in fp8.COMPUTE_DTYPES:
            raise ValueError(f"model.fp8 needs model.dtype {' or '.join(fp8.COMPUTE_DTYPES)}, got {self.dtype!r} "
                             f"(float16 cannot hold the scale of an FP8 gradient)")
        if self.attention == "cudnn" and self.dtype == "float32":
            raise ValueError(cudnn_dtype_problem())  # without a GPU here, that first
        if self.attention not in ("auto", "xla") and self.dropout > 0:
            raise ValueError(
                f"model.attention={self.attention} cannot drop attention probabilities; use attention=xla or dropout=0"
            )

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def head_dim(self) -> int:
        return self.embedding_dim // self.num_head

    @property
    def positions(self) -> str:
        """How the model knows where a token is: 'alibi', 'rotary' or 'learned'."""
        return "alibi" if self.alibi_attn else "rotary" if self.rotary_dim else "learned"

    @property
    def kv_heads(self) -> int:
        return self.num_head if self.num_kv_head is None else self.num_kv_head

    @property
    def ffn_dim(self) -> int:
        return 4 * self.embedding_dim if self.mlp_dim is None else self.mlp_dim

    @property
    def axis_sizes(self) -> dict[str, int]:
        """The size of each logical axis the parameters name (logical_axes.py), for sharding.check_model."""
        return {"vocab": self.padded_vocab_size, "embed": self.embedding_dim, "heads": self.num_head,
                "kv_heads": self.kv_heads, "kv": self.head_dim, "mlp": self.ffn_dim}

    @property
    def attn_bias(self) -> bool:
        return self.bias if self.attention_bias is None else self.attention_bias

    @property
    def max_length(self) -> int | None:
        """The longest sequence the model takes: block_size with learned positions; None (no limit) with
        ALiBi and rotary embeddings, which are defined at every distance and position."""
        return self.block_size if self.positions == "learned" else None


# ----------------------------------------------------------------------------------------------
# Parameter and FLOP counts


def param_count(cfg: GPTConfig) -> int:
    """Exact number of parameters, the padded embedding rows included.

    Per block, with width d, H query and K key/value heads of size D, MLP width F: attention
    d * (H + 2K) * D + H * D * d weights (+ (H + 2K) * D + d biases with attention biases); MLP
    2 d F weights, 3 d F with SwiGLU's gate (+ F (2F with the gate) + d biases with `bias`); each
    norm d scales (+ d biases for a LayerNorm with `bias`). GPT-2's layout gives the familiar
    12 d^2 + 13 d per block.
    """
    d, H, K, D, F = cfg.embedding_dim, cfg.num_head, cfg.kv_heads, cfg.head_dim, cfg.ffn_dim
    gated = cfg.activation == "swiglu"
    norm = d + (d if cfg.bias and cfg.norm == "layernorm" else 0)
    attention = d * (H + 2 * K) * D + H * D * d + ((H + 2 * K) * D + d if cfg.attn_bias else 0)
    mlp = (3 if gated else 2) * d * F + ((2 if gated else 1) * F + d if cfg.bias else 0)
    per_block = attention + mlp + norm * (1 if cfg.residual == "parallel_shared" else 2)
    V = cfg.padded_vocab_size
    embeddings = V * d * (1 if cfg.tie_embeddings else 2) + (V if cfg.head_bias else 0)
    if cfg.positions == "learned":
        embeddings += (cfg.block_size + cfg.position_offset) * d
    return embeddings + cfg.N * per_block + norm * (2 if cfg.embed_norm else 1)


def flops_per_token(cfg: GPTConfig, seq_len: int, adapters: int | None = None) -> float:
    """Training FLOPs per token, forward and backward: 6 N + 6 L d T.

    6 N for the parameter matmuls (2 forward, 4 backward per weight; N = param_count, as llm.c
    counts it) plus the attention scores and their weighted sum, 12 L d T, halved for the causal
    mask. Used for MFU in the training log and the benchmark. With `adapters` (a LoRA run's count of
    adapter parameters): 4 N + 6 L d T + 6 x adapters, the frozen base's weights getting no gradients
    (2 forward, 2 for the inputs' gradients).
    """
    weights = 6.0 * param_count(cfg) if adapters is None else 4.0 * param_count(cfg) + 6.0 * adapters
    return weights + 6.0 * cfg.N * cfg.embedding_dim * seq_len
