"""Attention for model.py: ALiBi and rotary positions, the reference attention with grouped-query
heads, the other implementations and the choice among them, cached attention for sampling, masks.

    attention(q, k, v, cfg)    q (B, T, H, D), k and v (B, T, K, D) -> (B, T, H, D), causal

ALiBi (Press, Smith & Lewis, "Train Short, Test Long", ICLR 2022) adds `-slope_h * (i - j)` to
the scaled attention score of query i and key j <= i, with one fixed slope per head and no
position embedding. The bias is built for whatever length is fed, so a model trained at context
T runs at 2T, 4T, 8T. Rotary embeddings (GPT-J, GPT-NeoX, LLaMA) turn q and k by their positions
before attention instead.

K key/value heads divide the H query heads (grouped-query attention): query head h reads key/value
head h // (H / K); K = H is plain multi-head attention.

Implementations (`model.attention` in the config, `ATTENTION_IMPLS`): the reference `xla` (below,
`_attend`: float32 scores and softmax, dropout), `dot_product` through jax.nn.dot_product_attention,
`cudnn`, cuDNN's fused flash kernel with ALiBi carried as extra head dimensions (alibi_dims.py),
`pallas`, flash_alibi.py's Triton kernel, and `splash`, JAX's splash attention for TPUs
(splash.py); `auto` is resolved per backend, dtype and length by `resolve_attention`. Generation's
cached attention (`cached_attention`) is always the reference.

Every implementation computes ALiBi within its dtype's own rounding at every length: cudnn and splash
carry it as head dimensions only where that identity is exact enough (16-bit types, up to 65,536
positions in bfloat16 and 32,768 in float16; alibi_dims.py says why), and `resolve_attention` hands
float32 and longer sequences to a kernel that adds the bias to each score (pallas on a GPU, xla elsewhere).

Packed examples and forgetful causal masking reach attention as a `Masking`: two int32 (B, T)
vectors of segment ids, O(T) memory, which the fused kernels (pallas, splash) take as they are and
only the reference expands to (B, T, T).

`cfg` below is a model.GPTConfig; only its attention fields are read (alibi_attn, attention, dtype,
dropout, head_dim, rotary_dim, rotary_base). This file imports nothing of the project but the
kernels' files (alibi_dims.py, flash_alibi.py, splash.py), each only when its path runs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# auto: the fastest measured for this backend and model (`resolve_attention`); xla: the reference
# below; dot_product: jax.nn.dot_product_attention with JAX's default implementation (XLA's, as of
# JAX 0.10); cudnn: cuDNN's fused kernel, ALiBi as extra head dimensions (NVIDIA GPU only); pallas:
# flash_alibi.py's Triton kernel, which makes the ALiBi bias inside; splash: splash attention on TPUs
# (splash.py). cudnn, pallas and splash hold O(T) memory whatever the batch.
ATTENTION_IMPLS = ("auto", "xla", "dot_product", "cudnn", "pallas", "splash")
CUDNN_MULTIPLE = 8  # cuDNN's fused kernel takes head sizes that are multiples of 8 ...
CUDNN_MAX_HEAD = {"hopper": 256, "older": 128}  # ... up to 256 on Hopper and later GPUs, else 128
PALLAS_ALIBI_MAX_HEAD = 64  # auto: ALiBi heads up to this size take pallas on a GPU (bench/RESULTS.md)
ALIBI_AS_COLUMNS = ("cudnn", "splash")  # carry ALiBi as extra head dimensions (alibi_dims.py); the rest add the bias


# ----------------------------------------------------------------------------------------------
# ALiBi


def alibi_slopes(n_head: int) -> np.ndarray:
    """Per-head ALiBi slopes, float32 (n_head,).

    For a power of two n: the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8). Otherwise the
    paper's rule: the n' = 2^floor(log2 n) slopes of the closest lower power of two, followed by
    every other slope of the sequence for 2n' (its 1st, 3rd, 5th, ...) until n slopes are taken.
    """

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(n_head)))
    slopes = geometric(closest) + geometric(2 * closest)[0::2][: n_head - closest]
    return np.asarray(slopes, dtype=np.float32)


def alibi_bias(n_head: int, q_len: int, k_len: int) -> jax.Array:
    """-slope * (i - j) for query i, key j, float32 (n_head, q_len, k_len); queries are the last q_len keys."""
    return alibi_bias_at(n_head, jnp.arange(k_len - q_len, k_len), jnp.arange(k_len))


def alibi_bias_at(n_head: int, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """-slope * (i - j) for query positions i (Tq,) and key positions j (Tk,), float32 (n_head, Tq, Tk);
    for query positions (B, Tq), each row's own (a batch of sequences each at its own position), (B, n_head,
    Tq, Tk).

    The positions may be traced, e.g. a decode step's queries at pos..pos+Tq-1 against a whole cache.
    """
    i = q_pos[..., :, None]  # ([B,] Tq, 1) absolute query positions
    j = k_pos[None, :]  # (1, Tk)
    distance = (i - j).astype(jnp.float32)[..., None, :, :]  # ([B,] 1, Tq, Tk); negative above the diagonal, masked
    return -jnp.asarray(alibi_slopes(n_head))[:, None, None] * distance  # ([B,] H, Tq, Tk)


# ----------------------------------------------------------------------------------------------
# Rotary position embeddings (Su et al., "RoFormer", 2021; GPT-J, GPT-NeoX, LLaMA)


def rotary_angles(cfg, positions: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """(cos, sin) float32 (T, rotary_dim/2) of the angles p * base^(-2i/rotary_dim) at positions p (T,), or
    (B, T, rotary_dim/2) at positions (B, T), each row's own; None without rotary embeddings. Computed once per
    forward pass and shared by every layer."""
    if not cfg.rotary_dim:
        return None
    exponents = jnp.arange(0, cfg.rotary_dim, 2, dtype=jnp.float32) / cfg.rotary_dim
    inv_freq = 1.0 / (jnp.float32(cfg.rotary_base) ** exponents)  # (rotary_dim/2,)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # ([B,] T, rotary_dim/2)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, rope: tuple[jax.Array, jax.Array], interleaved: bool) -> jax.Array:
    """Rotate the first rotary_dim dims of every head of x (B, T, H, D) by the angles of `rope` (T or B, T
    positions: `rotary_angles`), in float32.

    Dim pairs (a, b) turn into (a cos - b sin, b cos + a sin): pairs (2i, 2i+1) when interleaved
    (GPT-J), (i, i + rotary_dim/2) otherwise (GPT-NeoX, LLaMA). The other dims pass unchanged.
    """
    cos, sin = (r[..., None, :] if r.ndim == 3 else r[None, :, None, :] for r in rope)  # (1 or B, T, 1, rotary_dim/2)
    half = cos.shape[-1]
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., : 2 * half], xf[..., 2 * half:]
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    a, b = a * cos - b * sin, b * cos + a * sin
    rot = jnp.stack([a, b], axis=-1).reshape(rot.shape) if interleaved else jnp.concatenate([a, b], axis=-1)
    return jnp.concatenate([rot, rest], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# The reference attention (`xla`), with grouped-query heads


def _attend(q, k, v, q_pos, k_pos, cfg, dropout_key=None, mask=None, heads_first: bool = False) -> jax.Array:
    """The reference attention: queries q (B, Tq, H, D) at positions q_pos (Tq,) (or (B, Tq): each row's
    own), keys and values (B, Tk, K, D) at k_pos (Tk,), or (B, K, Tk, D) with `heads_first` (the KV cache's
    layout); query i sees key j iff j <= i (and, with a `Masking`, where its segment ids match), with
    -slope * (i - j) under ALiBi. Query head h reads key/value head h // (H / K)."""
    B, Tq, H, D = q.shape
    K, Tk = (k.shape[1], k.shape[2]) if heads_first else (k.shape[2], k.shape[1])
    kv = "bksd" if heads_first else "bskd"
    qg = q.reshape(B, Tq, K, H // K, D)  # the query heads in groups, one per key/value head
    scores = jnp.einsum(f"bqkgd,{kv}->bkgqs", qg, k, preferred_element_type=jnp.float32)  # (B, K, G, Tq, Tk)
    scores = scores.reshape(B, H, Tq, Tk) * (1.0 / math.sqrt(D))
    if cfg.alibi_attn:
        bias = alibi_bias_at(H, q_pos, k_pos)
        scores = scores + (bias if q_pos.ndim == 2 else bias[None])  # (1 or B, H, Tq, Tk)
    causal = k_pos[None, :] <= q_pos[..., :, None]  # ([B,] Tq, Tk)
    if q_pos.ndim == 2:
        causal = causal[:, None]  # (B, 1, Tq, Tk)
    if mask is not None:
        causal = (causal[None] & mask.dense())[:, None]  # (B, 1, Tq, Tk)
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # float32, always: a bf16 softmax destabilises training
    probs = dropout(probs, cfg.dropout, dropout_key).astype(v.dtype).reshape(B, K, H // K, Tq, Tk)
    return jnp.einsum(f"bkgqs,{kv}->bqkgd", probs, v).reshape(B, Tq, H, D)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """x with each element zeroed with probability `rate` and the rest scaled by 1 / (1 - rate); x itself
    without a key or at rate 0. The attention probabilities' dropout, and the model's on embeddings and
    residual branches."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# The implementations and the choice among them


def attention(q, k, v, cfg, dropout_key=None, mask=None, sharding=None) -> jax.Array:
    """Causal attention of q (B, T, H, D) over k, v (B, T, K, D) -> (B, T, H, D), with the ALiBi bias
    when configured. K key/value heads divide the H query heads: query head h reads key/value head
    h // (H / K) (grouped-query attention; K = H is plain multi-head attention).

    `mask`, optional: a `Masking` (packed segments, forgetful causal masking; see `attention_mask`):
    query i may see key j only where their segment ids match. `resolve_attention` says which
    implementation takes a masked call: a fused kernel on GPUs and TPUs, the reference elsewhere.

    `sharding`, optional: how q, k and v are placed on a device mesh, the NamedSharding of the
    activation axes (batch, length, heads, kv) (model.py passes what sharding.py's activation rules
    give them). The Pallas kernels (pallas, splash) read it: XLA cannot partition a Pallas call, so
    the kernel runs per device on that device's rows and heads. None: one device, or q, k and v
    whole on each.
    """
    B, T, H, D = q.shape
    impl = resolve_attention(cfg, masked=mask is not None, length=T)
    if impl == "pallas":  # O(T) memory: the bias is made inside the kernel from the slopes
        group = H // k.shape[2]  # the kernel takes as many key/value heads as query heads
        k, v = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (k, v))
        return _per_device(_pallas, q, k, v, mask, sharding, _slopes(cfg, H))
    if impl == "splash":
        check_attention_backend(dataclasses.replace(cfg, attention=impl))
        return _per_device(_splash, q, k, v, mask, sharding, _slopes(cfg, H))
    if impl == "cudnn":
        check_attention_backend(dataclasses.replace(cfg, attention=impl))
        return cudnn_attention(q, k, v, cfg)
    if impl == "dot_product":  # the bias in float32, added to float32 scores: exact in 16-bit types too
        bias = alibi_bias(H, T, T)[None] if cfg.alibi_attn else None  # (1, H, T, T)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True)
    return _attend(q, k, v, jnp.arange(T), jnp.arange(T), cfg, dropout_key, mask)


def _slopes(cfg, H: int) -> np.ndarray | None:
    return alibi_slopes(H) if cfg.alibi_attn else None


def cudnn_attention(q, k, v, cfg, implementation: str = "cudnn") -> jax.Array:
    """cuDNN's fused flash attention through jax.nn.dot_product_attention, with no bias input: ALiBi
    rides in extra head dimensions (alibi_dims.py), so neither the forward nor the backward pass holds
    a (T, T) array. The kernel takes even lengths only: one extra key after every query is hidden by
    the causal mask, and the extra query row is dropped. `implementation="xla"` runs the same
    identity through XLA's attention (how the tests check it off a GPU). In float32, and past
    alibi_dims.exact_length, the identity is not exact enough: `resolve_attention` never sends those here."""
    from layers import alibi_dims
    B, T, H, D = q.shape
    if T % 2:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (q, k, v))
    if cfg.alibi_attn:
        q, k = alibi_dims.extend(q, k, alibi_slopes(H), CUDNN_MULTIPLE, scale=1.0 / math.sqrt(D))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - D)))  # JAX's call takes v as wide as k
    y = jax.nn.dot_product_attention(q, k, v, scale=1.0 / math.sqrt(D), is_causal=True,
                                      implementation=implementation)
    return y[:, :T, :, :D]


def _pallas(q, k, v, segments, slopes):
    from layers import flash_alibi  # only when chosen: Pallas is not needed otherwise

    return flash_alibi.flash_alibi_attention(q, k, v, slopes, segments)


def _splash(q, k, v, segments, slopes):
    from layers import splash  # only when chosen

    return splash.splash_attention(q, k, v, slopes, segments)


def _per_device(kernel, q, k, v, mask, sharding, slopes) -> jax.Array:
    """kernel(q, k, v, segments, slopes) for a Pallas kernel (slopes None: no ALiBi). With a `sharding`
    of q, k and v each device runs it on its own rows and heads (shard_map): a Pallas call is opaque
    to XLA's partitioner, which would otherwise gather q, k and v whole onto every device. The slopes
    are split with the heads, the segment ids with the rows."""
    segments = None if mask is None else (mask.q_segments, mask.kv_segments)
    if sharding is None:
        return kernel(q, k, v, segments, slopes)
    if slopes is None:  # a static None, not an argument to split
        kernel = functools.partial(_without_slopes, kernel)
        slopes = np.zeros(q.shape[2], np.float32)
    P = jax.sharding.PartitionSpec
    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    if spec[1] is not None or spec[3] is not None:
        raise ValueError(f"model.attention=pallas or splash needs whole sequences and head dimensions on each "
                         f"device; the activation sharding splits (batch, length, heads, kv) as {spec}")
    qkv_spec = P(*spec)
    seg_spec = None if segments is None else (P(spec[0], None),) * 2
    run = jax.shard_map(kernel, mesh=sharding.mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, seg_spec, P(spec[2])),
                        out_specs=qkv_spec, check_vma=False)
    return run(q, k, v, segments, jnp.asarray(slopes))


def _without_slopes(kernel, q, k, v, segments, slopes):
    return kernel(q, k, v, segments, None)


def cudnn_takes(cfg, max_head: int | None = None) -> bool:
    """Whether cuDNN's fused kernel takes this model's heads: a size of at most `max_head` (default:
    this machine's GPU's, `cudnn_max_head`) and a multiple of 8, the ALiBi columns (alibi_dims.py) counted."""
    from layers import alibi_dims
    max_head = cudnn_max_head() if max_head is None else max_head
    D = alibi_dims.padded_dim(cfg.head_dim, cfg.dtype, CUDNN_MULTIPLE) if cfg.alibi_attn else cfg.head_dim
    return D <= max_head and D % CUDNN_MULTIPLE == 0


def cudnn_max_head() -> int:
    """The largest head size cuDNN's fused kernel takes on this machine's GPU: 256 from Hopper on, else
    128; Hopper's where no GPU is here (resolving for a GPU elsewhere, as the plan and tests do)."""
    if jax.default_backend() != "gpu":
        return CUDNN_MAX_HEAD["hopper"]
    capability = float(getattr(jax.devices()[0], "compute_capability", "0") or 0)
    return CUDNN_MAX_HEAD["hopper" if capability >= 9.0 else "older"]


def alibi_columns_exact(cfg, length: int | None = None) -> bool:
    """Whether ALiBi carried as head dimensions (alibi_dims.py, what cudnn and splash run) computes this
    model's attention at `length` within the kernels' own rounding: always without ALiBi; never in
    float32 (its accumulator's rounding grows with the length: already 150x the bias form's error at
    T = 2048); in the 16-bit types up to alibi_dims.exact_length (65,536 positions in bfloat16,
    32,768 in float16). None: a length within it."""
    if not cfg.alibi_attn:
        return True
    from layers import alibi_dims
    limit = alibi_dims.exact_length(cfg.dtype)
    return limit > 0 and (length is None or length <= limit)


def resolve_attention(cfg, backend: str | None = None, masked: bool = False, max_head: int | None = None,
                      length: int | None = None) -> str:
    """The implementation that runs `cfg.attention` on `backend` (default: JAX's default backend) for a
    plain batch or, with `masked`, a batch with a `Masking` (packed examples, FCM), of sequences of
    `length` (the model's call passes its own; None: a length the ALiBi columns take).

    `auto` is the fastest correct one measured there (bench/RESULTS.md, `python bench.py attention`
    and `train`): on an NVIDIA GPU in bfloat16 or float16, `cudnn` wherever cuDNN's kernel takes the
    heads (ALiBi included, by the identity of alibi_dims.py: 1.8x pallas's speed at 760m's heads of
    96), and `pallas` for ALiBi heads of 64 or fewer (cuDNN's 72 columns made it 1.2x slower than
    pallas there, and the step no faster), for heads cuDNN cannot take, and for masked batches,
    which cuDNN's kernel cannot take as JAX calls it; on a TPU, `splash`. The reference `xla`
    everywhere else: the CPU, float32 on a GPU, and attention dropout (only xla has it).

    Exact at every length: where ALiBi as head dimensions would not be exact enough
    (`alibi_columns_exact`: float32, sequences past 65,536 positions in bfloat16 or 32,768 in
    float16), ALiBi takes the bias-form kernel instead, which adds the bias to each scaled score:
    `pallas` on a GPU, `xla` elsewhere (on a TPU too, whose fused kernel has no bias input).

    A chosen implementation runs as chosen, except where it cannot take the call: `cudnn` hands
    masked batches, heads it cannot take (ALiBi's columns pushing a head of 128 past an older GPU's
    limit) and the lengths or dtype its ALiBi columns cannot carry exactly to `pallas`; `splash`
    hands the latter to `xla`; `dot_product` hands masked batches to `xla`. `max_head` stands for
    the GPU's limit (default: this machine's)."""
    exact = alibi_columns_exact(cfg, length)
    if cfg.attention != "auto":
        if cfg.attention == "cudnn" and (masked or not exact or not cudnn_takes(cfg, max_head)):
            return "pallas"
        if cfg.attention == "splash" and not exact:
            return "xla"
        if cfg.attention == "dot_product" and masked:
            return "xla"
        return cfg.attention
    backend = backend or jax.default_backend()
    if cfg.dropout > 0:
        return "xla"
    if backend == "gpu" and cfg.dtype != "float32":
        small_alibi = cfg.alibi_attn and cfg.head_dim <= PALLAS_ALIBI_MAX_HEAD
        if not masked and not small_alibi and exact and cudnn_takes(cfg, max_head):
            return "cudnn"
        return "pallas"
    if backend == "tpu" and exact:
        return "splash"
    return "xla"


NATIVE_BACKEND = {"cudnn": "gpu", "pallas": "gpu", "splash": "tpu"}  # where each kernel runs compiled


def backend_problem(impl: str, backend: str | None = None) -> str | None:
    """Why the implementation `impl` cannot run on `backend` (default: JAX's default), in words; None
    where it can (off its own backend pallas and splash run in Pallas's interpret mode: `attention_note`)."""
    backend = backend or jax.default_backend()
    if impl == "cudnn" and backend != "gpu":
        return f"model.attention=cudnn needs an NVIDIA GPU (cuDNN); this JAX runs on {backend}"
    if impl == "pallas" and backend == "tpu":
        return "model.attention=pallas is a Triton kernel for NVIDIA GPUs, not TPUs"
    if impl == "splash" and backend == "gpu":
        return "model.attention=splash is a TPU kernel, not for NVIDIA GPUs"
    return None


def check_attention_backend(cfg) -> None:
    """Raises ValueError (one line) when `cfg.attention` cannot run on the default JAX backend."""
    problem = backend_problem(cfg.attention)
    if problem:
        instead = {"cudnn": "attention=xla, dot_product or pallas", "pallas": "attention=splash or xla",
                   "splash": "attention=cudnn or pallas"}[cfg.attention]
        raise ValueError(f"{problem}: use {instead}")


def cudnn_dtype_problem() -> str:
    """The line that refuses model.attention=cudnn in float32 (model.GPTConfig's check). Without an
    NVIDIA GPU here that comes first: a 16-bit dtype alone would only lead to it."""
    problem = backend_problem("cudnn")
    need = "cudnn needs model.dtype bfloat16 or float16"
    if problem:
        return f"{problem}: use attention=xla, dot_product or pallas; on a GPU, {need} too"
    return f"model.attention={need} (cuDNN's fused kernel)"


def attention_note(cfg, length: int | None = None) -> str | None:
    """A line for the start of a run whose chosen `cfg.attention` does not run as chosen and compiled on
    this backend at sequences of `length`: cudnn or splash handing ALiBi to the bias form where its
    columns are not exact enough (float32, long sequences), or a kernel in Pallas's interpret mode
    (pallas off a GPU, splash off a TPU: exact, for tests; a `test`-size training step measured 2.7x
    slower than xla with pallas and 19x with splash on two CPU cores). None for `auto`, for an
    implementation that runs as chosen, and for one that cannot run here (check_attention_backend)."""
    backend = jax.default_backend()
    if cfg.attention == "auto" or backend_problem(cfg.attention, backend):
        return None
    impl = resolve_attention(cfg, backend, length=length)
    if cfg.attention in ALIBI_AS_COLUMNS and not alibi_columns_exact(cfg, length):
        from layers import alibi_dims
        where = ("in float32" if cfg.dtype == "float32"
                 else f"past {alibi_dims.exact_length(cfg.dtype):,} positions in {cfg.dtype}")
        return (f"note: model.attention={cfg.attention} carries ALiBi as head dimensions, which is not exact {where}: "
                f"attention runs as {impl}, which adds the bias to each score")
    if _interpreted(cfg, length):
        return (f"note: model.attention={impl} runs in Pallas's interpret mode on {backend}: exact, for testing "
                f"the kernel, and 3-20x slower than attention=xla (what auto picks here)")
    return None


def _interpreted(cfg, length: int | None = None) -> bool:
    """Whether `cfg.attention` runs a Pallas kernel in interpret mode on the default backend."""
    backend = jax.default_backend()
    impl = resolve_attention(cfg, backend, length=length)
    return impl in ("pallas", "splash") and NATIVE_BACKEND[impl] != backend and not backend_problem(impl, backend)


def attention_here(cfg, requested: str | None = None):
    """(model config, note) for a reader of a trained run (eval.py): `cfg` with the implementation
    `requested`, or by default the saved `cfg.attention` where it runs compiled on this machine and
    else `auto` (a run trained with cudnn, read on a CPU); the note says in one line what was
    chosen and why, where that is not the saved one or runs in interpret mode (None otherwise).
    Raises ValueError (one line) for a requested implementation that cannot run here."""
    if requested is not None:
        chosen = dataclasses.replace(cfg, attention=requested)  # GPTConfig's own checks too
        check_attention_backend(chosen)
        return chosen, attention_note(chosen)
    problem = backend_problem(cfg.attention)
    if problem is None and not _interpreted(cfg):
        return cfg, None
    chosen = dataclasses.replace(cfg, attention="auto")
    why = problem or f"model.attention={cfg.attention} would run in Pallas's interpret mode here"
    return chosen, (f"{why}: reading this run with attention=auto ({resolve_attention(chosen)}) instead "
                    f"(--attention chooses another)")


# ----------------------------------------------------------------------------------------------
# Cached attention, for generation


def cached_attention(q, k_cache, v_cache, pos, cfg) -> jax.Array:
    """Attention of queries q (B, T, H, D) at positions pos..pos+T-1 over caches (B, K, L, D) -> (B, T, H, D);
    pos a scalar, or (B,): each row at its own position.

    Cache slots at and beyond pos + T (still empty) are never seen. The `xla` implementation's
    float32 scores and softmax, whatever `cfg.attention` says. The cache's layout, heads before
    positions, is the one the batched products over (batch, head) read as it is: with positions
    first, XLA's CPU dot copied the whole cache into this layout every step.
    """
    T, L = q.shape[1], k_cache.shape[2]
    q_pos = jnp.asarray(pos)[..., None] + jnp.arange(T)  # (T,) or (B, T)
    y = _attend(q, k_cache.astype(q.dtype), v_cache, q_pos, jnp.arange(L), cfg, heads_first=True)
    return y.astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Attention masks beyond causal: packed segments and forgetful causal masking


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position within its segment, int32 (B, T), for segment ids (B, T) that are
    constant over each run of consecutive tokens: 0 at every token whose id differs from the one before."""
    T = segment_ids.shape[1]
    t = jnp.arange(T)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)  # (B, T)
    first = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)  # (B, T) index of the segment's first token
    return (t - first).astype(jnp.int32)


class Masking(NamedTuple):
    """Which keys each query may see beyond the causal rule, in O(T) memory: query i of row b sees key
    j <= i iff q_segments[b, i] == kv_segments[b, j]. Both int32 (B, T); a pytree, so it passes through
    jit, remat and shard_map as the arrays it holds. Packed examples give both the examples' ids;
    forgetful causal masking gives hidden keys an id no query has (HIDDEN)."""

    q_segments: jax.Array
    kv_segments: jax.Array

    def dense(self) -> jax.Array:
        """The (B, Tq, Tk) bool matrix of segment matches (the causal rule not applied): the reference's."""
        return self.q_segments[:, :, None] == self.kv_segments[:, None, :]


HIDDEN = -1  # a hidden key's segment id under forgetful causal masking; examples' ids are >= 0


def attention_mask(batch: int, length: int, *, segment_ids: jax.Array | None = None, fcm_key=None,
                   fcm_max_ratio: float = 0.0) -> Masking | None:
    """The extra attention masking for `GPT.__call__`, a `Masking` (O(T)), or None when there is none.

    segment_ids (B, T), ids >= 0: query i sees key j only within its own segment (packed examples).
    Forgetful causal masking (Liu et al. 2022, arXiv 2210.13432), when fcm_key is given and
    fcm_max_ratio > 0: each sequence draws a ratio r ~ U(0, fcm_max_ratio) and hides each key
    position with probability r from every query, its own included, as the paper's masking does.
    The first token (of the sequence and of each segment) stays visible, so no query is left
    without a key. For training only: evaluation and generation use no FCM.
    """
    if segment_ids is None and (fcm_key is None or fcm_max_ratio <= 0):
        return None
    segments = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    keys = segments
    if fcm_key is not None and fcm_max_ratio > 0:
        ratio_key, drop_key = jax.random.split(fcm_key)
        ratio = jax.random.uniform(ratio_key, (batch, 1), maxval=fcm_max_ratio)  # (B, 1) one r per sequence
        visible = jax.random.uniform(drop_key, (batch, length)) >= ratio  # (B, Tk) P(hidden) = r
        visible = visible | (segment_positions(segments) == 0)  # each segment's first token, the row's too
        keys = jnp.where(visible, segments, HIDDEN)
    return Masking(segments, keys)
