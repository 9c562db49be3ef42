"""Generation from a GPT: a KV cache filled by one prefill, then one token a step in a jitted, fixed-shape
loop (`make_generate`), and the choice of each next token (`sample_logits`: greedy, temperature, top-k,
top-p). sample.py's command line and the harness's generate_until requests run through it; so does the
check that a request's cache and logits fit the device (`check_generation_size`).
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import machine, seeds
from core.errors import SampleError
from model import DTYPES, GPT, GPTConfig, init_cache, param_count

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
        keep = (before < top_p) | (jnp.arange(ordered.shape[-1]) == 0)  # the most likely token always stays
        threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)  # (B, 1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# The generation loop


class Generation:
    """KV-cache generation of `max_new_tokens` tokens after a prompt, for one model and one set of
    sampling settings (make_generate builds it), in two ways with the same results token for token:

    - `gen(state, prompt, key) -> (new tokens (B, max_new_tokens) int32, steps run)`: one jitted call,
      the prefill and the whole loop (the harness's generate_until);
    - `gen.chunks(state, prompt, key)`: the prefill, then the same loop run a chunk of steps at a
      time, each call resuming from the last (the cache carried, donated, never copied), sized to take
      about `CHUNK_SECONDS`; it yields a `Carry` after the prefill and after each chunk, so that the
      caller (sample.py) can show progress and stop between chunks with what was generated so far.

    `state` is the model's `nnx.split` state. Token i (0-based) is drawn with the key folded with i,
    so how the steps are cut into calls changes nothing. A row that produced `eot_id` holds `eot_id`
    from there on; the loop stops early once every row has. The cache holds T0 + max_new_tokens - 1
    positions (the last token is never fed back).
    """

    def __init__(self, graphdef, cfg: GPTConfig, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, eot_id: int | None = None):
        if max_new_tokens < 1:
            raise SampleError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens
        pick = lambda logits, key: sample_logits(  # noqa: E731
            logits, key, vocab_size=cfg.vocab_size, temperature=temperature, top_k=top_k, top_p=top_p)
        fill = -1 if eot_id is None else eot_id

        def start(state, prompt, key) -> dict:
            """The prefill and the first new token: the loop's carry at step 1."""
            model = nnx.merge(graphdef, state)
            B, T0 = prompt.shape
            cache = init_cache(cfg, B, T0 + max_new_tokens - 1)  # {k, v}: N x (B, K, L, D)
            logits, cache = model.decode(prompt, cache, 0)  # prefill: (B, T0, V_padded)
            token = pick(logits[:, -1], jax.random.fold_in(key, 0))  # (B,)
            out = jnp.full((B, max_new_tokens), fill, jnp.int32).at[:, 0].set(token)
            return {"i": jnp.int32(1), "token": token, "cache": cache, "out": out, "done": token == fill, "key": key}

        def resume(state, carry: dict, until) -> dict:
            """The loop from the carry's step up to step `until` (traced: one compilation for every chunk),
            max_new_tokens, or until every row is done."""
            model = nnx.merge(graphdef, state)
            T0 = carry["cache"]["k"][0].shape[2] - max_new_tokens + 1
            until = jnp.minimum(until, max_new_tokens)

            def cond(c):
                return (c["i"] < until) & ~jnp.all(c["done"])

            def body(c):
                i = c["i"]
                logits, cache = model.decode(c["token"][:, None], c["cache"], T0 + i - 1)  # (B, 1, V_padded)
                token = jnp.where(c["done"], fill, pick(logits[:, 0], jax.random.fold_in(c["key"], i)))
                out = jax.lax.dynamic_update_slice(c["out"], token[:, None], (0, i))
                return {"i": i + 1, "token": token, "cache": cache, "out": out, "done": c["done"] | (token == fill),
                        "key": c["key"]}

            return jax.lax.while_loop(cond, body, carry)

        def whole(state, prompt, key):
            carry = resume(state, start(state, prompt, key), max_new_tokens)
            return carry["out"], carry["i"]

        self.whole = jax.jit(whole)
        self.start = jax.jit(start)
        self.resume = jax.jit(resume, donate_argnums=1)  # the cache is updated in place, chunk after chunk

    def __call__(self, state, prompt, key) -> tuple[jax.Array, jax.Array]:
        return self.whole(state, prompt, key)

    def compile(self, state, prompt, key) -> "Generation":
        """The prefill and the chunked loop compiled now for these arguments' shapes (sample.py times it),
        for `chunks` to call."""
        carry = jax.eval_shape(self.start, state, prompt, key)
        self.start = self.start.lower(state, prompt, key).compile()
        self.resume = self.resume.lower(state, carry, jnp.int32(0)).compile()
        return self

    def chunks(self, state, prompt, key, *, first: int = 1, seconds: float | None = None) -> Iterator["Carry"]:
        """The generation a chunk of steps at a time: a Carry after the prefill, then after each chunk,
        until max_new_tokens or every row has ended. The first chunk is `first` steps; each next one as
        many as the last ran in `seconds` (default CHUNK_SECONDS). A Carry stays readable for as long as
        the caller keeps this generator waiting (the next chunk consumes its arrays)."""
        seconds = CHUNK_SECONDS if seconds is None else seconds
        carry = self.start(state, prompt, key)
        steps, ended = int(carry["i"]), bool(np.asarray(carry["done"]).all())
        size = first
        while True:
            yield Carry(carry, steps, ended or steps >= self.max_new_tokens)
            if ended or steps >= self.max_new_tokens:
                return
            began = time.perf_counter()
            carry = self.resume(state, carry, jnp.int32(min(steps + size, self.max_new_tokens)))
            ran, (steps, ended) = steps, (int(carry["i"]), bool(np.asarray(carry["done"]).all()))  # waits for it
            took = time.perf_counter() - began
            ran = steps - ran
            size = max(1, min(self.max_new_tokens, round(ran * seconds / took) if took > 0 else 2 * size, 4 * size))


CHUNK_SECONDS = 0.25  # how long one chunk of Generation.chunks runs: the longest a Ctrl-C waits for the loop


class Carry:
    """The state of a generation between two chunks: `steps` new tokens per row so far (the first
    included), whether it has `ended`, and `tokens()`: those tokens (B, steps) int32 on the host,
    rows that ended padded with their end-of-text token."""

    def __init__(self, carry: dict, steps: int, ended: bool):
        self.carry, self.steps, self.ended = carry, steps, ended

    def tokens(self) -> np.ndarray:
        return np.asarray(self.carry["out"])[:, :self.steps]


def make_generate(graphdef, cfg: GPTConfig, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, eot_id: int | None = None) -> Generation:
    """The Generation of max_new_tokens tokens with these settings: called as fn(state, prompt (B, T0) int32,
    key) -> (new tokens (B, max_new_tokens) int32, steps run), one jitted call, or a chunk at a time
    (`Generation.chunks`)."""
    return Generation(graphdef, cfg, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      eot_id=eot_id)


def generate(model: GPT, prompt, max_new_tokens: int, *, seed: int = 0, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, eot_id: int | None = None) -> np.ndarray:
    """New tokens (B, max_new_tokens) after each row of prompt (B, T0); rows padded with eot_id after it."""
    graphdef, state = nnx.split(model)
    fn = make_generate(graphdef, model.config, max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, eot_id=eot_id)
    out, _ = fn(state, jnp.asarray(prompt, jnp.int32), seeds.key_of(seed))
    return np.asarray(out)


def device_memory() -> tuple[int, str]:
    """(bytes, what they are) one device can hold: its allocator's limit (a GPU's, a TPU's), or on the
    CPU, which reports none, what this process may use of the machine's memory (core/machine.py: the
    physical memory, or less under `ulimit -v` or a cgroup's limit)."""
    device = jax.devices()[0]
    limit = ((device.memory_stats() if hasattr(device, "memory_stats") else None) or {}).get("bytes_limit")
    if limit:
        return int(limit), f"the {device.device_kind} device's memory"
    return machine.memory()


SCORE_COPIES = 3  # float32 (B, H, T0, L) arrays the prefill's attention holds at once: scores, exponentials, softmax
CACHE_COPIES = 2  # caches the loop holds at once: the one carried (updated in place) and the body's working arrays


def generation_bytes(cfg: GPTConfig, samples: int, prompt: int, new: int) -> int:
    """The most bytes a Generation's arrays take at once beyond the weights, for B = samples rows of a
    prompt of T0 tokens and `new` new tokens, L = T0 + new - 1 cached positions, in the compute dtype's
    itemsize s: the larger of its two phases, each with the new tokens (B, new) int32.

    The prefill, one call over the whole prompt:
    - the KV cache it fills: 2 x (N, B, K, L, D) x s;
    - its attention, one layer at a time: SCORE_COPIES x (B, H, T0, L) float32 (the reference attention's
      scores, their exponentials and probabilities);
    - its other activations: (B, T0) x (3 d + (H + 2K) D + 2 F) x s (the residual stream and its norm,
      the attention's projections and output, the MLP's hidden layer and activation);
    - its float32 logits (B, T0, V_padded).
    The loop, one token a step: CACHE_COPIES x the KV cache (the cache it carries, written in place, and
    its body's working arrays: a layer's keys laid out for the products, a dtype's conversions).

    The copies are what XLA's memory analysis of the compiled prefill and loop reports on a CPU (the loop
    takes 1.15 to 2.05 caches there, with the model's depth and dtype; test_sample holds the sum above
    what it reports).
    """
    s = np.dtype(DTYPES[cfg.dtype]).itemsize
    B, T0, L = samples, prompt, prompt + new - 1
    H, K, D, d, F = cfg.num_head, cfg.kv_heads, cfg.head_dim, cfg.embedding_dim, cfg.ffn_dim
    cache = 2 * cfg.N * B * L * K * D * s
    attention = SCORE_COPIES * B * H * T0 * L * 4
    activations = B * T0 * (3 * d + (H + 2 * K) * D + 2 * F) * s
    logits = B * T0 * cfg.padded_vocab_size * 4
    return max(cache + attention + activations + logits, CACHE_COPIES * cache) + B * new * 4


def weight_bytes(cfg: GPTConfig) -> int:
    """The bytes of the model's float32 parameters (param_count), which share the device with a generation."""
    return param_count(cfg) * 4


def check_generation_size(cfg: GPTConfig, samples: int, prompt: int, new: int) -> None:
    """A SampleError, before anything is allocated, for a request whose positions pass int32, or whose
    generation (generation_bytes: the cache, the prefill of the prompt, the tokens) exceeds what the device
    holds beside the weights; it names the most new tokens, samples and prompt tokens that fit (each with the
    other two as asked)."""
    if prompt + new > MAX_POSITIONS:
        raise SampleError(f"prompt ({prompt} tokens) + --max-new-tokens ({new}) = {prompt + new} positions, past "
                          f"the 2**31 a model addresses")
    memory, what = device_memory()
    weights = weight_bytes(cfg)
    room = memory - weights
    need = generation_bytes(cfg, samples, prompt, new)
    if need <= room:
        return
    fits = [("--max-new-tokens {:,}", largest(lambda n: generation_bytes(cfg, samples, prompt, n) <= room, new)),
            ("--num-samples {:,}", largest(lambda b: generation_bytes(cfg, b, prompt, new) <= room, samples)),
            ("a prompt of {:,} tokens", largest(lambda t: generation_bytes(cfg, samples, t, new) <= room, prompt))]
    fits = " or ".join(text.format(most) for text, most in fits if most >= 1) or "no request on this model"
    raise SampleError(f"--num-samples {samples:,} x (prompt {prompt:,} + --max-new-tokens {new:,}) needs "
                      f"{need / GiB:,.1f} GiB for the KV cache and the prompt's prefill, more than the "
                      f"{max(room, 0) / GiB:,.1f} GiB of {what} beside the weights ({weights / GiB:,.1f} GiB); "
                      f"at most {fits} fits")


def largest(fits: Callable[[int], bool], below: int) -> int:
    """The largest n in 1..below - 1 for which fits(n) holds (fits true up to some n, false after), else 0."""
    low, high = 0, below  # fits(low) (or low is 0), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def truncate(tokens: np.ndarray, eot_id: int | None) -> list[int]:
    """A row of new tokens up to (not including) its first end-of-text token."""
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(eot_id)] if eot_id is not None and eot_id in tokens else tokens
