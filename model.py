"""A GPT decoder with ALiBi attention, in Flax NNX, with the switches of the other decoder families.

    tokens (B, T) -> embedding [+ learned positions] [-> LayerNorm] -> N x Block -> norm
                  -> logits (B, T, V_padded) through the transposed token embedding (tied weights)
                     or a separate lm_head [+ bias]
    Block: x + Attention(norm(x)), then x + MLP(norm(x))   (pre-norm, GPT-2 layout; or parallel, below)

Layout switches in GPTConfig cover the decoder families people bring from transformers, so their
weights import exactly (convert_torch.py). GPTConfig, with its checks, and the parameter and FLOP counts
(param_count, flops_per_token) are layers/gpt_config.py's: what a model is, apart from how it computes
here; this module re-exports them, so model.GPTConfig is the name everywhere.

    GPT-2        learned positions, LayerNorm, GELU (tanh), tied output
    BLOOM        ALiBi, LayerNorm after the embedding, GELU (tanh), tied output
    GPT-J        rotary (interleaved, part of each head), parallel residual with one norm, GELU (tanh),
                 no attention biases, separate output with a bias
    GPT-NeoX     rotary (half-split, part of each head), parallel residual with two norms, exact GELU,
                 separate output (Pythia)
    OPT          learned positions read at an offset of 2, ReLU, tied output
    LLaMA        rotary (half-split, whole head), RMSNorm, SwiGLU, grouped-query attention, no biases

Written against Flax NNX, Flax's current API. The model holds parameters only: dropout draws
from an explicit key passed to `__call__` (folded per layer and site), so the training step stays
a pure function of (params, batch, key) and no RNG state lives in the module.

ALiBi biases, rotary embeddings, the attention implementations and the masks are attention.py's;
ALiBi runs at any length, so a model trained at context T runs at 2T, 4T, 8T. With `alibi_attn:
false` (and no rotary embeddings) the model uses GPT-2's learned absolute positions instead and
refuses inputs longer than `block_size`.

Generation uses a separate path: `GPT.decode(tokens, cache, pos)` runs the same layers on new
tokens at positions pos.. against a preallocated KV cache (`init_cache`), for sample.py; the
training path `__call__` does not touch it.

Low-rank adapters (LoRA, training.lora; lora.py) sit on the chosen projections when the model is made
with `GPT(config, lora=...)`: `lora_a` and `lora_b` beside each adapted kernel (Dense), the only weights
a LoRA run trains; `adapted_kernels` says where they are, for lora.py to fold them into the kernels,
giving the base model's tree, which every other path (decode included) runs.

Every parameter carries logical axis names in its `axes` metadata and the main activations are
constrained by name (logical_axes.py); `sharding.py` maps the names to mesh axes, and the model
never sees a mesh. (The names live in our own metadata key rather than NNX's `out_sharding`, which
NNX applies eagerly and which then requires a mesh even on one CPU.)

Precision: parameters are float32; matrix products run in the compute `dtype`; attention scores,
the softmax, the logits and the loss (loss.py) are float32 whatever the compute dtype. With `fp8`, the
blocks' projections (q/k/v, attention output, MLP) run in float8 (fp8.py); the embedding, the output
projection and attention itself do not.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from layers import fp8
from layers import lora as lora_lib
from layers import remat as remat_lib
from layers.attention import (
    Masking,
    apply_rotary,
    attention,
    cached_attention,
    dropout,
    rotary_angles,
    segment_positions,
)
from layers.gpt_config import (  # noqa: F401 - model.DTYPES, model.param_count, ... as before
    DTYPES,
    VOCAB_MULTIPLE,
    GPTConfig,
    flops_per_token,
    param_count,
)
from layers.logical_axes import activation_sharding_of, logical_constraint
from layers.loss import PADDED_LOGIT, chunk_layout, chunked_cross_entropy, cross_entropy, tied_logits

# ----------------------------------------------------------------------------------------------
# Layers


def _fold(key: jax.Array | None, i: int) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, i)


class Dense(nnx.Module):
    """A weight of any shape applied by an einsum, plus an optional bias over its output dims.

    The first `n_in` kernel dimensions are contracted with the input's last dimensions.

    With `fp8`, the einsum of x and the kernel runs in float8 (fp8.einsum: e4m3 operands, e5m2 gradients);
    the adapter, the bias and everything around stay in the compute dtype.

    With `lora` (a config.LoRAConfig: rank r, alpha, dropout), its low-rank factors `lora_a` (in dims...,
    r) and `lora_b` (r, out dims...) add lora.output to it (lora.py: the factors' initialisation and
    arithmetic). A weight that fuses several projections along its first output dimension (q, k, v) takes
    `lora_slices`, a 0/1 per slice: B's unchosen slices are zero, so they get no update and no gradient.
    """

    def __init__(self, shape, axes, n_in: int, *, std: float, bias: bool, dtype, rngs: nnx.Rngs, lora=None,
                 lora_slices: tuple[float, ...] | None = None, fp8: bool = False):
        self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)
        self.bias = nnx.Param(jnp.zeros(shape[n_in:], jnp.float32), axes=axes[n_in:]) if bias else None
        self.dtype, self.n_in, self.fp8 = dtype, n_in, fp8
        self.lora_a = self.lora_b = None
        if lora is not None:  # lora.py: the factors, their place in the tree kept here (lora_a, lora_b)
            a, b = lora_lib.init_factors(shape, axes, n_in, lora.rank, rngs.params())
            self.lora_a, self.lora_b = nnx.data(a), nnx.data(b)  # (in dims..., r), (r, out dims...)
            self.lora_scale, self.lora_dropout = lora.alpha / lora.rank, lora.dropout
            self.lora_slices = None if lora_slices is None or all(lora_slices) else tuple(lora_slices)

    def __call__(self, spec: str, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """einsum(spec, x, kernel) [+ the adapter] [+ bias]; `dropout_key` drops the adapter's input (if it has one)."""
        if self.fp8:  # quantized from the weight's own dtype: no compute-dtype copy of it
            y = fp8.einsum(spec, x, self.kernel[...], self.dtype)
        else:
            y = jnp.einsum(spec, x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.lora_a is not None:
            y = y + lora_lib.output(spec, x, self.lora_a[...], self.lora_b[...], n_in=self.n_in, scale=self.lora_scale,
                                    rate=self.lora_dropout, chosen=self.lora_slices, key=dropout_key, dtype=self.dtype)
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


def _norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm | nnx.RMSNorm:
    # Flax computes the mean and variance in float32 even when `dtype` is bfloat16.
    if cfg.norm == "rmsnorm":
        return nnx.RMSNorm(cfg.embedding_dim, epsilon=cfg.layer_norm_epsilon, dtype=DTYPES[cfg.dtype],
                           param_dtype=jnp.float32, scale_metadata={"axes": ("embed",)}, rngs=rngs)
    return nnx.LayerNorm(
        cfg.embedding_dim,
        epsilon=cfg.layer_norm_epsilon,
        use_bias=cfg.bias,
        dtype=DTYPES[cfg.dtype],
        param_dtype=jnp.float32,
        scale_metadata={"axes": ("embed",)},
        bias_metadata={"axes": ("embed",)},
        rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, lora=None, rngs: nnx.Rngs):
        d, H, K, D, dtype = cfg.embedding_dim, cfg.num_head, cfg.kv_heads, cfg.head_dim, DTYPES[cfg.dtype]
        dense = functools.partial(Dense, bias=cfg.attn_bias, dtype=dtype, rngs=rngs, fp8=cfg.fp8)
        if K == H:  # q, k and v in one weight: (d, 3, H, D)
            self.c_attn = dense((d, 3, H, D), ("embed", None, "heads", "kv"), 1, std=0.02,
                                lora=lora_lib.adapted(lora, "q", "k", "v"),
                                lora_slices=lora_lib.slices(lora, "q", "k", "v"))
            self.c_q = self.c_kv = None
        else:  # grouped-query attention: q (d, H, D), and k and v (d, 2, K, D) with their own axis name
            self.c_attn = None
            self.c_q = dense((d, H, D), ("embed", "heads", "kv"), 1, std=0.02, lora=lora_lib.adapted(lora, "q"))
            self.c_kv = dense((d, 2, K, D), ("embed", None, "kv_heads", "kv"), 1, std=0.02,
                              lora=lora_lib.adapted(lora, "k", "v"), lora_slices=lora_lib.slices(lora, "k", "v"))
        # residual projection, scaled down by depth as in GPT-2: (H, D, d)
        self.c_proj = dense((H, D, d), ("heads", "kv", "embed"), 2, std=0.02 / math.sqrt(2 * cfg.N),
                            lora=lora_lib.adapted(lora, "o"))
        self.cfg = cfg

    def qkv(self, x: jax.Array, rope=None, lora_key=None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The query (B, T, H, D), key and value (B, T, K, D) projections of x (B, T, d) in the compute dtype;
        q and k rotated by `rope` (`rotary_angles` at these tokens' positions) when given. `lora_key`: the
        adapters' dropout."""
        if self.c_attn is not None:
            qkv = self.c_attn("btd,dshc->btshc", x, _fold(lora_key, 0))  # (B, T, 3, H, D)
            qkv = logical_constraint(qkv, ("batch", "length", None, "heads", "kv"))
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each (B, T, H, D)
        else:
            q = self.c_q("btd,dhc->bthc", x, _fold(lora_key, 0))
            q = logical_constraint(q, ("batch", "length", "heads", "kv"))  # (B, T, H, D)
            kv = self.c_kv("btd,dshc->btshc", x, _fold(lora_key, 1))  # (B, T, 2, K, D)
            kv = logical_constraint(kv, ("batch", "length", None, "kv_heads", "kv"))
            k, v = kv[:, :, 0], kv[:, :, 1]
        if rope is not None:
            q, k = (apply_rotary(a, rope, self.cfg.rotary_interleaved) for a in (q, k))
        return q, k, v

    def out(self, y: jax.Array, lora_key=None) -> jax.Array:
        """The output projection of the attended values y (B, T, H, D) -> (B, T, d)."""
        y = logical_constraint(y, ("batch", "length", "heads", "kv"))
        return self.c_proj("bthc,hcd->btd", y, lora_key)  # (B, T, d)

    def __call__(self, x: jax.Array, rope=None, dropout_key=None, mask=None, lora_key=None) -> jax.Array:
        with jax.named_scope("qkv"):
            q, k, v = self.qkv(x, rope, lora_key)
        with jax.named_scope("attention"):
            sharding = activation_sharding_of(("batch", "length", "heads", "kv"))  # the Pallas kernel's, per device
            y = attention(q, k, v, self.cfg, dropout_key, mask, sharding)
        with jax.named_scope("out"):
            return self.out(y, _fold(lora_key, 2))  # (B, T, d)

    def decode(self, x: jax.Array, rope, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array):
        """Attention of x (B, T, d) at positions pos..pos+T-1 over a cache (B, K, L, D) of earlier keys; pos a
        scalar, or (B,): each row at its own position.

        Writes this input's keys and values into the caches at pos and returns (y (B, T, d), k_cache, v_cache).
        """
        q, k, v = self.qkv(x, rope)
        if pos.ndim == 0:  # one block of positions for every row: (B, K, T, D) into the cache's layout
            k, v = (jnp.swapaxes(a, 1, 2).astype(k_cache.dtype) for a in (k, v))
            k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, 0, pos, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, 0, pos, 0))
        else:  # row b's T tokens at pos[b]..: a scatter, in place, of (B, T, K, D) at [b, :, pos[b] + t]
            rows, at = jnp.arange(x.shape[0])[:, None], pos[:, None] + jnp.arange(x.shape[1])  # (B, 1), (B, T)
            k_cache = k_cache.at[rows, :, at].set(k.astype(k_cache.dtype), indices_are_sorted=True,
                                                  unique_indices=True, mode="promise_in_bounds")
            v_cache = v_cache.at[rows, :, at].set(v.astype(v_cache.dtype), indices_are_sorted=True,
                                                  unique_indices=True, mode="promise_in_bounds")
        y = cached_attention(q, k_cache, v_cache, pos, self.cfg)  # (B, T, H, D)
        return self.out(y), k_cache, v_cache


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, lora=None, rngs: nnx.Rngs):
        d, f = cfg.embedding_dim, cfg.ffn_dim
        dense = functools.partial(Dense, n_in=1, bias=cfg.bias, dtype=DTYPES[cfg.dtype], rngs=rngs,
                                  lora=lora_lib.adapted(lora, "mlp"), fp8=cfg.fp8)
        self.c_fc = dense((d, f), ("embed", "mlp"), std=0.02)  # SwiGLU's "up" projection
        self.c_gate = dense((d, f), ("embed", "mlp"), std=0.02) if cfg.activation == "swiglu" else None
        self.c_proj = dense((f, d), ("mlp", "embed"), std=0.02 / math.sqrt(2 * cfg.N))
        self.activation, self.approximate = cfg.activation, cfg.gelu_approximate

    def __call__(self, x: jax.Array, lora_key=None) -> jax.Array:
        with jax.named_scope("fc"):
            h = self.c_fc("btd,df->btf", x, _fold(lora_key, 0))  # (B, T, F)
            gate = self.c_gate("btd,df->btf", x, _fold(lora_key, 1)) if self.activation == "swiglu" else None
        with jax.named_scope("activation"):
            if self.activation == "swiglu":
                h = jax.nn.silu(gate) * h
            elif self.activation == "relu":
                h = jax.nn.relu(h)
            else:
                h = jax.nn.gelu(h, approximate=self.approximate)
            h = logical_constraint(h, ("batch", "length", "mlp"))
        with jax.named_scope("proj"):
            return self.c_proj("btf,fd->btd", h, _fold(lora_key, 2))  # (B, T, d)


class Block(nnx.Module):
    """x + Attention(norm_1(x)), then x + MLP(norm_2(x)) (sequential, GPT-2); or, with a parallel
    residual, x + Attention(norm_1(x)) + MLP(norm_2(x)) (GPT-NeoX), or MLP(norm_1(x)) (GPT-J: one norm)."""

    def __init__(self, cfg: GPTConfig, *, lora=None, rngs: nnx.Rngs):
        self.ln_1 = _norm(cfg, rngs)
        self.attn = Attention(cfg, lora=lora, rngs=rngs)
        self.ln_2 = None if cfg.residual == "parallel_shared" else _norm(cfg, rngs)
        self.mlp = MLP(cfg, lora=lora, rngs=rngs)
        self.dropout, self.sequential = cfg.dropout, cfg.residual == "sequential"
        self.lora_dropout = lora is not None and lora.dropout > 0  # the adapters draw keys of their own

    def _residual(self, x: jax.Array, h: jax.Array, a: jax.Array, dropout_key, lora_key=None) -> jax.Array:
        """The block's output from its input x, x's first norm h and the attention output a."""
        a = dropout(a, self.dropout, _fold(dropout_key, 1))
        if self.sequential:  # the MLP reads the stream after attention
            x = x + a
            with jax.named_scope("ln_2"):
                h = self.ln_2(x)
        elif self.ln_2 is not None:  # parallel: from the block's input
            with jax.named_scope("ln_2"):
                h = self.ln_2(x)
        with jax.named_scope("mlp"):
            m = self.mlp(h, lora_key)
        m = dropout(m, self.dropout, _fold(dropout_key, 2))
        return x + m if self.sequential else x + a + m

    def __call__(self, x: jax.Array, rope=None, dropout_key=None, mask=None) -> jax.Array:
        with jax.named_scope("ln_1"):
            h = self.ln_1(x)
        lora_key = _fold(dropout_key, 3) if self.lora_dropout else None
        with jax.named_scope("attn"):
            a = self.attn(h, rope, _fold(dropout_key, 0), mask, _fold(lora_key, 0))
        x = self._residual(x, h, a, dropout_key, _fold(lora_key, 1))
        return logical_constraint(x, ("batch", "length", "embed"))

    def decode(self, x: jax.Array, rope, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array):
        """The block at positions pos..pos+T-1 with a KV cache (no dropout): (x, k_cache, v_cache)."""
        h = self.ln_1(x)
        y, k_cache, v_cache = self.attn.decode(h, rope, k_cache, v_cache, pos)
        return self._residual(x, h, y, None), k_cache, v_cache


class GPT(nnx.Module):
    """The model of `config`; with `lora` (a config.LoRAConfig) its chosen projections carry low-rank adapters
    (Dense), the leaves `lora_a` and `lora_b` beside their kernels (`split_lora`, `merge_lora`)."""

    def __init__(self, config: GPTConfig, *, lora=None, rngs: nnx.Rngs):
        cfg = self.config = config
        d = cfg.embedding_dim
        init = lambda shape: 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)  # noqa: E731
        self.wte = nnx.Param(init((cfg.padded_vocab_size, d)), axes=("vocab", "embed"))
        learned = cfg.positions == "learned"
        self.wpe = nnx.Param(init((cfg.block_size + cfg.position_offset, d)), axes=(None, "embed")) if learned else None
        self.embed_norm = _norm(cfg, rngs) if cfg.embed_norm else None
        self.blocks = nnx.List([Block(cfg, lora=lora, rngs=rngs) for _ in range(cfg.N)])
        self.ln_f = _norm(cfg, rngs)
        untied = not cfg.tie_embeddings
        self.lm_head = nnx.Param(init((cfg.padded_vocab_size, d)), axes=("vocab", "embed")) if untied else None
        self.head_bias = nnx.Param(jnp.zeros(cfg.padded_vocab_size, jnp.float32), axes=("vocab",)) \
            if cfg.head_bias else None
        self._block_forward = remat_lib.forward(cfg.remat)  # the blocks called as they are, or rematerialised

    def __call__(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None, mask: Masking | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits, float32 (B, T, padded_vocab_size), for int tokens (B, T); the padding rows (ids >=
        vocab_size) are PADDED_LOGIT, so a softmax over them is one over the real vocabulary. Dropout
        iff a key is given.

        mask, optional: an `attention.Masking` on top of the causal rule (`attention.attention_mask`: packed
        examples, forgetful causal masking), two (B, T) vectors of segment ids.
        segment_ids (B, T) int, optional, for packed examples: learned positions restart at 0 at
        each segment's first token (ALiBi and rotary embeddings need nothing: within a segment they
        see only distances).
        """
        return self.head(self.hidden(tokens, dropout_key=dropout_key, mask=mask, segment_ids=segment_ids))

    def hidden(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None, mask: Masking | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
        """The final hidden states, after the final norm, in the compute dtype: (B, T, d) for int tokens
        (B, T); `head` turns them into `__call__`'s logits. Arguments as `__call__`'s."""
        cfg = self.config
        T = tokens.shape[1]
        with jax.named_scope("embed"):  # named scopes: what a profile's operations belong to (bench.py --profile)
            x = self._embed(tokens, 0, T, segment_ids)
            x = dropout(x, cfg.dropout, _fold(dropout_key, cfg.N))
            x = logical_constraint(x, ("batch", "length", "embed"))
            rope = rotary_angles(cfg, jnp.arange(T))
        for i, block in enumerate(self.blocks):
            with jax.named_scope("block"):
                if mask is None:
                    x = self._block_forward(block, x, rope, _fold(dropout_key, i))
                else:
                    x = self._block_forward(block, x, rope, _fold(dropout_key, i), mask)
        with jax.named_scope("ln_f"):
            return logical_constraint(self.ln_f(x), ("batch", "length", "embed"))  # (B, T, d)

    def _embed(self, tokens: jax.Array, pos, length: int, segment_ids=None) -> jax.Array:
        """Embeddings of tokens (B, T) at positions pos..pos+T-1 (pos a scalar, or (B,): each row's own), in the
        compute dtype: (B, T, d).

        `length` is how far the sequence reaches; a learned-position model refuses more than block_size.
        With segment_ids (B, T), learned positions count from each segment's start instead.
        """
        cfg = self.config
        x = jnp.take(self.wte[...], tokens, axis=0)  # (B, T, d)
        if self.wpe is not None:
            if length > cfg.max_length:
                raise ValueError(
                    f"a sequence of {length} tokens is longer than block_size {cfg.block_size} of a learned-position "
                    f"model; only ALiBi and rotary models run beyond their training context"
                )
            offset = cfg.position_offset
            if jnp.ndim(pos) == 1:  # each row at its own position pos[b] (B,): (B, T, d)
                x = x + jnp.take(self.wpe[...], pos[:, None] + jnp.arange(tokens.shape[1]) + offset, axis=0)
            elif segment_ids is None:  # (T, d) over the batch
                x = x + jax.lax.dynamic_slice_in_dim(self.wpe[...], pos + offset, tokens.shape[1])
            else:
                x = x + jnp.take(self.wpe[...], segment_positions(segment_ids) + offset, axis=0)  # (B, T, d)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x.astype(DTYPES[cfg.dtype])

    def head(self, h: jax.Array) -> jax.Array:
        """The output projection of final hidden states h (B, T, d) (`hidden`'s): float32 (B, T, V_padded),
        with PADDED_LOGIT on the padding rows (ids >= vocab_size)."""
        cfg = self.config
        weight, bias = self.head_weights()
        logits = tied_logits(h, weight, DTYPES[cfg.dtype])  # (B, T, V_padded)
        if bias is not None:
            logits = logits + bias
        if cfg.padded_vocab_size > cfg.vocab_size:  # the padding rows never take probability
            logits = jnp.where(jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size, logits, PADDED_LOGIT)
        return logical_constraint(logits, ("batch", "length", "vocab"))  # (B, T, V_padded)

    def head_weights(self) -> tuple[jax.Array, jax.Array | None]:
        """(weight (V_padded, d), bias (V_padded,) or None) of the output projection: the token embedding
        (tied) or lm_head, and GPT-J's logit bias."""
        weight = self.wte if self.lm_head is None else self.lm_head
        return weight[...], None if self.head_bias is None else self.head_bias[...]

    def loss(self, tokens: jax.Array, targets: jax.Array, weights: jax.Array | None = None, *, chunk: int = 0,
             dropout_key: jax.Array | None = None, mask: Masking | None = None,
             segment_ids: jax.Array | None = None):
        """(mean loss, counted tokens) of `cross_entropy(self(tokens, ...), targets, weights)`.

        With chunk > 0 and more than `chunk` tokens (B * T), the loss and its gradient are computed
        about `chunk` tokens at a time (`chunked_cross_entropy`), so the float32 (B, T, V_padded)
        logits never exist whole; otherwise through the whole logits. The other arguments are `__call__`'s.
        """
        cfg = self.config
        h = self.hidden(tokens, dropout_key=dropout_key, mask=mask, segment_ids=segment_ids)  # (B, T, d)
        with jax.named_scope("loss"):
            if chunk_layout(h.shape[0], h.shape[1], chunk) is None:
                return cross_entropy(self.head(h), targets, weights)
            weight, bias = self.head_weights()
            return chunked_cross_entropy(h, weight, bias, targets, weights, vocab_size=cfg.vocab_size, chunk=chunk,
                                         dtype=DTYPES[cfg.dtype])

    def token_logps(self, tokens: jax.Array, targets: jax.Array, *, dropout_key: jax.Array | None = None,
                    mask: Masking | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
        """float32 (B, T): the log-probability of each target under the logits of `__call__` (the padded
        vocabulary's logits are PADDED_LOGIT, so the softmax is the real vocabulary's), through the whole logits."""
        logits = self(tokens, dropout_key=dropout_key, mask=mask, segment_ids=segment_ids).astype(jnp.float32)
        with jax.named_scope("loss"):
            return -optax.softmax_cross_entropy_with_integer_labels(logits, targets)

    def decode(self, tokens: jax.Array, cache: dict, pos) -> tuple[jax.Array, dict]:
        """Logits for tokens (B, T) at positions pos..pos+T-1, given a KV cache of the pos tokens before; pos a
        scalar, or (B,) int: row b's tokens at pos[b]..pos[b]+T-1, each row on its own (serve.py's slots).

        `cache` is `init_cache(...)` or a previous decode's: {"k", "v"}: N arrays (B, K, L, D), one a layer. Returns
        (float32 logits (B, T, V_padded), the cache with these tokens' keys and values at pos..pos+T-1).
        The caller keeps pos + T <= L (nothing is checked on traced positions). Prefill a prompt with
        one call at pos 0, then feed one token per call: the logits equal `__call__`'s on the whole
        sequence at those positions. No dropout.
        """
        pos = jnp.asarray(pos, jnp.int32)
        x = self._embed(tokens, pos, cache["k"][0].shape[2])  # the cache's length bounds the positions
        rope = rotary_angles(self.config, pos[..., None] + jnp.arange(tokens.shape[1]))  # (T,) or (B, T) positions
        ks, vs = [], []
        for block, k, v in zip(self.blocks, cache["k"], cache["v"]):  # each layer's own arrays, updated in place
            x, k, v = block.decode(x, rope, k, v, pos)
            ks.append(k)
            vs.append(v)
        return self.head(self.ln_f(x)), {"k": tuple(ks), "v": tuple(vs)}


# ----------------------------------------------------------------------------------------------
# Low-rank adapters: the parameter tree of a GPT with `lora` is the base model's, plus `lora_a` and
# `lora_b` beside each adapted kernel, e.g. blocks/0/attn/c_attn/{kernel, bias, lora_a, lora_b}

def adapted_kernels(config: GPTConfig, lora) -> dict:
    """Where GPT(config, lora) has adapters: {path of the adapted Dense (a tuple of keys): (alpha / r, its
    chosen slices or None)}, what lora.merge and lora.factors fold in or export."""
    model = nnx.eval_shape(lambda: GPT(config, lora=lora, rngs=nnx.Rngs(params=0)))
    return {path: (module.lora_scale, module.lora_slices) for path, module in nnx.iter_modules(model)
            if isinstance(module, Dense) and module.lora_a is not None}


def init_cache(config: GPTConfig, batch: int, max_len: int) -> dict:
    """An empty KV cache for `GPT.decode`: {"k", "v"}: a tuple of N zero arrays (batch, K, max_len, D), one a
    layer, in the compute dtype, K the key/value heads (num_kv_head). One array a layer, not one (N, ...) array:
    each step writes its keys into each layer's own buffer in place, where slicing a layer out of one stacked
    array and setting it back copied the whole cache several times a token (4.4x slower at 6,000 positions).
    Heads before positions: the layout attention's batched products over (batch, head) read without a copy
    (attention.cached_attention)."""
    shape = (batch, config.kv_heads, max_len, config.head_dim)
    dtype = DTYPES[config.dtype]
    return {name: tuple(jnp.zeros(shape, dtype) for _ in range(config.N)) for name in ("k", "v")}
