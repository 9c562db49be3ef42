"""Generation from a GPT: a KV cache filled by one prefill, then one token a step in a jitted, fixed-shape
loop (`make_generate`), and the choice of each next token (`sample_logits`: greedy, temperature, top-k,
top-p). sample.py's command line and the harness's generate_until requests run through it; so does the
check that a request's cache and logits fit the device (`check_generation_size`).
"""
from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.errors import SampleError
from model import DTYPES, GPT, GPTConfig, init_cache

GiB = 2**30
MAX_POSITIONS = 2**31  # positions are int32 on the device


# ----------------------------------------------------------------------------------------------
# Picking the next token


def sample_logits(logits: jax.Array, key: jax.Array, *, vocab_size: int, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """The next token (B,) int32 from logits (B, V_padded): greedy at temperature 0, else top-k/top-p sampling.

    Ids >= vocab_size (the embedding's padding rows) are never chosen.
    """
    logits = logits.astype(jnp.float32)
    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where(ids < vocab_size, logits, -jnp.inf)  # (B, V_padded)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if 0 < top_k < vocab_size:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # (B, 1) the k-th largest logit
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = -jnp.sort(-logits, axis=-1)  # (B, V) descending
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each
        keep = before < top_p  # the most likely token always stays
        threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)  # (B, 1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# The generation loop


def make_generate(graphdef, cfg: GPTConfig, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, eot_id: int | None = None) -> Callable:
    """A jitted fn(state, prompt (B, T0) int32, key) -> (new tokens (B, max_new_tokens) int32, steps run).

    `state` is the model's `nnx.split` state. A row that produced `eot_id` holds `eot_id` from
    there on; the loop stops early once every row has. The cache holds T0 + max_new_tokens - 1
    positions (the last token is never fed back).
    """
    if max_new_tokens < 1:
        raise SampleError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    pick = lambda logits, key: sample_logits(  # noqa: E731
        logits, key, vocab_size=cfg.vocab_size, temperature=temperature, top_k=top_k, top_p=top_p)
    fill = -1 if eot_id is None else eot_id

    def generate(state, prompt, key):
        model = nnx.merge(graphdef, state)
        B, T0 = prompt.shape
        cache = init_cache(cfg, B, T0 + max_new_tokens - 1)  # {k, v}: (N, B, L, H, D)
        logits, cache = model.decode(prompt, cache, 0)  # prefill: (B, T0, V_padded)
        token = pick(logits[:, -1], jax.random.fold_in(key, 0))  # (B,)
        out = jnp.full((B, max_new_tokens), fill, jnp.int32).at[:, 0].set(token)
        done = token == fill

        def cond(carry):
            i, _, _, _, done = carry
            return (i < max_new_tokens) & ~jnp.all(done)

        def body(carry):
            i, token, cache, out, done = carry
            logits, cache = model.decode(token[:, None], cache, T0 + i - 1)  # (B, 1, V_padded)
            token = jnp.where(done, fill, pick(logits[:, 0], jax.random.fold_in(key, i)))
            out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))
            return i + 1, token, cache, out, done | (token == fill)

        steps, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), token, cache, out, done))
        return out, steps

    return jax.jit(generate)


def generate(model: GPT, prompt, max_new_tokens: int, *, seed: int = 0, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, eot_id: int | None = None) -> np.ndarray:
    """New tokens (B, max_new_tokens) after each row of prompt (B, T0); rows padded with eot_id after it."""
    graphdef, state = nnx.split(model)
    fn = make_generate(graphdef, model.config, max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, eot_id=eot_id)
    out, _ = fn(state, jnp.asarray(prompt, jnp.int32), jax.random.key(seed))
    return np.asarray(out)


def device_memory() -> tuple[int, str]:
    """(bytes, what they are) one device can hold: its allocator's limit (a GPU's, a TPU's), or on the
    CPU, which reports none, this machine's physical memory."""
    device = jax.devices()[0]
    limit = ((device.memory_stats() if hasattr(device, "memory_stats") else None) or {}).get("bytes_limit")
    if limit:
        return int(limit), f"the {device.device_kind} device's memory"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's memory"


def generation_bytes(cfg: GPTConfig, samples: int, prompt: int, new: int) -> int:
    """The bytes make_generate's arrays take beyond the weights: the KV cache, 2 x (N, B, T0 + new - 1, K, D)
    in the compute dtype, the prefill's float32 logits (B, T0, V_padded) and the new tokens (B, new) int32."""
    itemsize = np.dtype(DTYPES[cfg.dtype]).itemsize
    cache = 2 * cfg.N * samples * (prompt + new - 1) * cfg.kv_heads * cfg.head_dim * itemsize
    return cache + samples * prompt * cfg.padded_vocab_size * 4 + samples * new * 4


def check_generation_size(cfg: GPTConfig, samples: int, prompt: int, new: int) -> None:
    """A SampleError, before anything is allocated, for a request whose positions pass int32 or whose cache
    and logits (generation_bytes) exceed what the device holds; it names the most that fits."""
    if prompt + new > MAX_POSITIONS:
        raise SampleError(f"prompt ({prompt} tokens) + --max-new-tokens ({new}) = {prompt + new} positions, past "
                          f"the 2**31 a model addresses")
    memory, what = device_memory()
    need = generation_bytes(cfg, samples, prompt, new)
    if need <= memory:
        return
    per_token = generation_bytes(cfg, samples, prompt, 2) - generation_bytes(cfg, samples, prompt, 1)
    most_new = (memory - generation_bytes(cfg, samples, prompt, 1)) // per_token + 1
    most_samples = memory // generation_bytes(cfg, 1, prompt, new)
    fits = [f"--max-new-tokens {most_new:,}" if most_new >= 1 else None,
            f"--num-samples {most_samples:,}" if most_samples >= 1 else None]
    fits = " or ".join(f for f in fits if f) or "a shorter prompt"
    raise SampleError(f"--num-samples {samples:,} x (prompt {prompt} + --max-new-tokens {new:,}) needs "
                      f"{need / GiB:,.1f} GiB for the KV cache and logits, more than the {memory / GiB:,.1f} GiB of "
                      f"{what}; at most {fits} fits")


def truncate(tokens: np.ndarray, eot_id: int | None) -> list[int]:
    """A row of new tokens up to (not including) its first end-of-text token."""
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(eot_id)] if eot_id is not None and eot_id in tokens else tokens
