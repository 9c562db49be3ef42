"""Batched generation for serve.py: many requests decoded together on one KV cache of fixed slots.

The cache holds `slots` rows of `context` positions (model.init_cache). A request (a `Sequence`: one
completion of one prompt) waits in a queue until a slot is free; its prompt is then prefilled into that
slot's row (padded on the right to a length bucket, 8, 16, 32, ... up to the context: the padding's keys lie
beyond the prompt, where the slot's own tokens overwrite them before any query sees them). The prompts
admitted together are prefilled a bucket at a time, as many in one call as the widest step holds (padded to
a width with rows that write no slot); requests that arrive during a prefill are admitted before the next
decode step, so a burst of requests starts decoding together. The prefill also draws each one's first
token. From then on every decode step advances every active slot by one token, each at its own position (one
call of the model's decode over the slots, a position a row), drawing each slot's next token with that
slot's own settings (temperature, top-p, its own key folded with the token's index). A step runs only the
first `width` slots (1, 4, 16, ...: the smallest that holds every active one; slots are given lowest
first), so a lone request pays for one row, not sixteen.

The steps run a chunk at a time on the device (a while_loop of up to CHUNK_MAX steps, sized to take about
CHUNK_SECONDS), and between two chunks the engine's thread hands the new tokens to their requests, frees
the slots of requests that ended (their end-of-text token, their max_tokens, a stop string found by the
caller, a client gone: `cancel`), and prefills the requests that arrived. A request's tokens do not depend
on what else is in the batch: each row's computation reads only its own slot.

Logprobs: each new token's log-probability under the model (log-softmax of its logits over the real
vocabulary, before temperature), and for requests that ask, the TOP_MAX most likely alternatives; the
prefill gives the same for every prompt token (echo), from the same call that draws the first token.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import seeds
from inference.decoding import SCORE_COPIES, device_memory, weight_bytes
from model import DTYPES, GPTConfig, init_cache

CHUNK_SECONDS = 0.02  # how long a chunk of decode steps runs: the longest a new request waits to join
CHUNK_MAX = 64  # the most steps in one chunk
TOP_MAX = 20  # the most alternatives a token's logprobs list
MIN_BUCKET = 8  # the shortest padded prompt; buckets double up to the context


def cache_bytes(cfg: GPTConfig, slots: int, context: int) -> int:
    """The KV cache's bytes: keys and values, (slots, K, context, D) a layer, in the compute dtype."""
    return 2 * cfg.N * slots * context * cfg.kv_heads * cfg.head_dim * np.dtype(DTYPES[cfg.dtype]).itemsize


def prefill_bytes(cfg: GPTConfig, bucket: int, context: int) -> int:
    """The most bytes a prefill of `bucket` tokens takes beside the cache: its attention over the slot's context,
    one layer at a time (decoding.SCORE_COPIES float32 (H, bucket, context) arrays), its other activations, its
    float32 logits and their log-softmax (bucket, V_padded)."""
    s = np.dtype(DTYPES[cfg.dtype]).itemsize
    H, K, D, d, F = cfg.num_head, cfg.kv_heads, cfg.head_dim, cfg.embedding_dim, cfg.ffn_dim
    attention = SCORE_COPIES * H * bucket * context * 4
    activations = bucket * (3 * d + (H + 2 * K) * D + 2 * F) * s
    return attention + activations + 2 * bucket * cfg.padded_vocab_size * 4


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion being generated: the prompt's token ids, how many new tokens at most, its sampling
    settings and key, and whether it wants top alternatives (`top`: 0 = none) and the prompt's logprobs
    (`echo`). `deliver(event)` is called from the engine's thread with each event, in order:
    ("prompt", logprobs (T0,) float32 with NaN first, top ids (T0, top), top logprobs) when echo,
    ("tokens", ids, logprobs, top ids (n, top), top logprobs (n, top)) for each run of new tokens (never the
    end-of-text token; the logprobs NaN unless `logprobs` or `top`), ("end", "stop" | "length") after its
    end-of-text token or max_tokens, or ("error", message) when the engine stops under it. A cancelled one gets
    nothing more."""
    prompt: list[int]
    max_tokens: int
    deliver: Callable[[tuple], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    top: int = 0
    echo: bool = False
    logprobs: bool = True  # whether it wants its new tokens' logprobs (a step computes them only if a slot does)
    cancelled: bool = False


class Engine:
    """The slots, the compiled programs and the thread that runs them (`start`, `stop`).

    `submit(seq)` queues a Sequence (False when `max_queue` are already waiting); `cancel(seq)` ends one
    at the next chunk (its slot freed, no more events). `active()`/`waiting()` count them."""

    def __init__(self, model, cfg: GPTConfig, *, slots: int, context: int, eot_id: int | None,
                 max_queue: int = 256, widths: tuple[int, ...] | None = None):
        self.cfg, self.slots, self.context, self.eot = cfg, slots, context, -1 if eot_id is None else eot_id
        self.max_queue = max_queue
        self.graphdef, self.state = nnx.split(model)
        self.widths = widths or tuple(sorted({min(w, slots) for w in (1, 4, 16, 64, 256, 1024) if w < slots} | {slots}))
        self.cache = init_cache(cfg, slots, context)
        self.seqs: list[Sequence | None] = [None] * slots
        # each slot's state between chunks, on the host: the token to feed, its position, tokens generated,
        # the most it may generate, whether it ended, its temperature, top-p and key
        self.token = np.zeros(slots, np.int32)
        self.pos = np.zeros(slots, np.int32)
        self.count = np.zeros(slots, np.int32)
        self.limit = np.zeros(slots, np.int32)
        self.done = np.ones(slots, bool)
        self.temp = np.zeros(slots, np.float32)
        self.top_p = np.ones(slots, np.float32)
        self.keys = np.zeros((slots,) + jax.random.key_data(jax.random.key(0)).shape, np.uint32)
        self.queue: collections.deque[Sequence] = collections.deque()
        self.lock = threading.Condition()
        self.running = False
        self.thread: threading.Thread | None = None
        self.failure: str | None = None
        self.step_seconds = 1e-3  # one decode step's time, measured as chunks run
        self.room = device_memory()[0] - weight_bytes(cfg) - cache_bytes(cfg, slots, context)  # for a prefill
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("tops", "echo"), donate_argnums=1)
        self._chunk = jax.jit(self._chunk_fn, static_argnames=("width", "tops", "logprobs"), donate_argnums=1)

    # -- the device programs ---------------------------------------------------------------------

    def _pick(self, logits, keys, counts, temp, top_p, logprobs: bool = True):
        """The next token of each row (W,) int32 from float32 logits (W, V_padded), each row with its own
        temperature (0: greedy), top-p and key (folded with `counts`, the index of the token drawn), and the
        rows' log-softmax over the real vocabulary (W, V_padded; None unless `logprobs`). The sampling's work
        (the draws, the sort for top-p) runs only when some row needs it."""
        ids = jnp.arange(logits.shape[-1])
        logits = jnp.where(ids < self.cfg.vocab_size, logits, -jnp.inf)
        logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True) if logprobs else None
        # argmax's token (the first of the largest logits) from two plain reductions: XLA's CPU argmax, one
        # reduction over (value, index) pairs, took as long as the output head's product at 16 slots
        best = jnp.max(logits, axis=-1, keepdims=True)
        greedy = jnp.min(jnp.where(logits == best, ids, logits.shape[-1] - 1), axis=-1).astype(jnp.int32)

        def nucleus(scaled):
            ordered = -jnp.sort(-scaled, axis=-1)
            probs = jax.nn.softmax(ordered, axis=-1)
            first = jnp.arange(ordered.shape[-1]) == 0  # the most likely token always stays (a top-p that the
            keep = ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) | first  # device flushes to 0 too)
            threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
            return jnp.where((top_p[:, None] < 1) & (scaled < threshold), -jnp.inf, scaled)

        def sampled():
            scaled = logits / jnp.where(temp > 0, temp, 1.0)[:, None]
            scaled = jax.lax.cond(jnp.any((temp > 0) & (top_p < 1)), nucleus, lambda x: x, scaled)
            keys_i = jax.vmap(jax.random.fold_in)(keys, counts)
            drawn = jax.vmap(jax.random.categorical)(keys_i, scaled).astype(jnp.int32)
            return jnp.where(temp > 0, drawn, greedy)

        return jax.lax.cond(jnp.any(temp > 0), sampled, lambda: greedy), logp

    def _prefill_fn(self, state, cache, slots, tokens, lengths, temp, top_p, key_data, *, tops: bool, echo: bool):
        """Prompts (W, bucket) into their slots' rows of the cache, row i's first lengths[i] tokens real (a row
        whose slot is `self.slots`, past the last, is padding: it reads slot 0's rows and is written nowhere),
        and each prompt's first new token. Returns (cache, tokens (W,), their logprobs (W,), top ids and logprobs
        (W, TOP_MAX), the prompts' logprobs (W, bucket), their top ids and logprobs (W, bucket, TOP_MAX)); the tops
        of size 1 when not `tops` (the prompts' of size 0), the prompts' logprobs of width 1 when not `echo`."""
        model = nnx.merge(self.graphdef, state)
        W = tokens.shape[0]
        rows = {name: tuple(jnp.take(c, slots, axis=0, mode="clip") for c in cache[name]) for name in cache}
        logits, rows = model.decode(tokens, rows, 0)  # (W, bucket, V_padded)
        cache = {name: tuple(c.at[slots].set(r, mode="drop") for c, r in zip(cache[name], rows[name]))
                 for name in cache}
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # (W, V_padded)
        token, logp = self._pick(last, jax.random.wrap_key_data(key_data), jnp.zeros(W, jnp.int32), temp, top_p)
        chosen = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logp, TOP_MAX) if tops else (jnp.zeros((W, 1)), jnp.zeros((W, 1), jnp.int32))
        if not echo:
            return cache, token, chosen, top_ids, top_lp, jnp.zeros((W, 1)), jnp.zeros((W, 1, 1), jnp.int32), \
                jnp.zeros((W, 1, 1))
        real = jnp.arange(logits.shape[-1]) < self.cfg.vocab_size
        prompt_logp = jax.nn.log_softmax(jnp.where(real, logits, -jnp.inf))  # (W, bucket, V_padded)
        following = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # position t predicts token t + 1
        picked = jnp.take_along_axis(prompt_logp, following[..., None], axis=-1)[..., 0]
        picked = jnp.concatenate([jnp.full((W, 1), jnp.nan), picked[:, :-1]], axis=1)  # the first token has none
        if tops:
            prompt_top_lp, prompt_top_ids = jax.lax.top_k(prompt_logp, TOP_MAX)
            prompt_top_lp = jnp.concatenate([prompt_top_lp[:, -1:] * jnp.nan, prompt_top_lp[:, :-1]], axis=1)
            prompt_top_ids = jnp.concatenate([prompt_top_ids[:, -1:], prompt_top_ids[:, :-1]], axis=1)
        else:  # no alternatives: (W, bucket, 0), so that a prompt's (T0, top) slice of them is (T0, 0)
            none = (W, tokens.shape[1], 0)
            prompt_top_lp, prompt_top_ids = jnp.zeros(none), jnp.zeros(none, jnp.int32)
        return cache, token, chosen, top_ids, top_lp, picked, prompt_top_ids, prompt_top_lp

    def _chunk_fn(self, state, cache, token, pos, count, limit, done, temp, top_p, key_data, steps, *, width: int,
                  tops: bool, logprobs: bool = True):
        """Up to `steps` decode steps of the first `width` slots (each slot at its own position), stopping early
        when every one has ended. Returns (cache, new tokens (CHUNK_MAX, width), their logprobs (NaN unless
        `logprobs` or `tops`), top ids and logprobs (CHUNK_MAX, width, TOP_MAX or 1), steps run, and the slots'
        token, pos, count, done after)."""
        model = nnx.merge(self.graphdef, state)
        rows = {name: tuple(c[:width] for c in cache[name]) for name in cache}
        keys = jax.random.wrap_key_data(key_data)
        k = TOP_MAX if tops else 1

        def pick(logits, count):
            token, logp = self._pick(logits, keys, count, temp, top_p, logprobs or tops)
            chosen = (jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0] if logp is not None
                      else jnp.full(token.shape, jnp.nan))
            if tops:
                top_lp, top_ids = jax.lax.top_k(logp, k)
            else:
                top_lp, top_ids = jnp.zeros((width, 1)), jnp.zeros((width, 1), jnp.int32)
            return token, chosen, top_ids, top_lp

        def cond(c):
            return (c["i"] < steps) & ~jnp.all(c["done"])

        def body(c):
            # every slot's token at its own position (model.decode with a position a row), reading its own rows
            logits, rows = model.decode(c["token"][:, None], c["rows"], c["pos"])
            new, lp, top_ids, top_lp = pick(logits[:, 0], c["count"])
            live = ~c["done"]
            new = jnp.where(live, new, c["token"])
            count = c["count"] + live
            i = c["i"]
            return {"i": i + 1, "rows": rows,
                    "token": new, "pos": c["pos"] + live, "count": count,
                    "done": c["done"] | (live & ((new == self.eot) | (count >= limit))),
                    "out": c["out"].at[i].set(new), "lp": c["lp"].at[i].set(lp),
                    "top_ids": c["top_ids"].at[i].set(top_ids), "top_lp": c["top_lp"].at[i].set(top_lp)}

        carry = {"i": jnp.int32(0), "rows": rows, "token": token, "pos": pos, "count": count, "done": done,
                 "out": jnp.zeros((CHUNK_MAX, width), jnp.int32), "lp": jnp.zeros((CHUNK_MAX, width)),
                 "top_ids": jnp.zeros((CHUNK_MAX, width, k), jnp.int32), "top_lp": jnp.zeros((CHUNK_MAX, width, k))}
        carry = jax.lax.while_loop(cond, body, carry)
        cache = {name: tuple(c.at[:width].set(r) for c, r in zip(cache[name], carry["rows"][name])) for name in cache}
        return (cache, carry["out"], carry["lp"], carry["top_ids"], carry["top_lp"], carry["i"],
                carry["token"], carry["pos"], carry["count"], carry["done"])

    def prefill_fits(self, length: int) -> bool:
        """Whether a prompt of `length` tokens can be prefilled beside the weights and the cache."""
        return prefill_bytes(self.cfg, self.bucket(length), self.context) <= self.room

    def width_for(self, rows: int) -> int:
        """The narrowest step width (a prefill's or a decode step's) that holds `rows` rows."""
        return next(w for w in self.widths if w >= rows)

    def bucket(self, length: int) -> int:
        """The padded length a prompt of `length` tokens is prefilled at."""
        b = MIN_BUCKET
        while b < length:
            b *= 2
        return min(b, self.context)

    def warm_up(self, tops: bool = False) -> float:
        """Compile now, before any request: the prefill of the shortest bucket for as many prompts at once as each
        width holds, and the chunk of every width, with and without the new tokens' logprobs (with the top
        alternatives too when `tops`). Returns the seconds taken."""
        began = time.perf_counter()
        for with_tops, logprobs in [(False, False), (False, True)] + [(True, True)] * tops:
            for width in self.widths if not with_tops and not logprobs else self.widths[:1]:
                self.admit([(Sequence([0], 1, lambda event: None, temperature=0.0, top=TOP_MAX if with_tops else 0),
                              slot) for slot in range(width)])
            for width in self.widths:  # every slot ended: each compiles, none runs a step
                w = slice(0, width)
                self.cache, *_ = self._chunk(self.state, self.cache, self.token[w], self.pos[w], self.count[w],
                                             self.limit[w], self.done[w], self.temp[w], self.top_p[w], self.keys[w],
                                             np.int32(1), width=width, tops=with_tops, logprobs=logprobs)
        jax.block_until_ready(self.cache)
        return time.perf_counter() - began

    # -- the host's side ---------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> bool:
        with self.lock:
            if len(self.queue) >= self.max_queue or not self.running:
                return False
            self.queue.append(seq)
            self.lock.notify()
        return True

    def cancel(self, seq: Sequence) -> None:
        with self.lock:
            seq.cancelled = True
            if seq in self.queue:  # a waiting one gives up its place at once
                self.queue.remove(seq)
            self.lock.notify()

    def active(self) -> int:
        return sum(s is not None for s in self.seqs)

    def waiting(self) -> int:
        return len(self.queue)

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="generation", daemon=True)
        self.thread.start()

    def stop(self, message: str) -> None:
        """End the thread after its chunk; every request still queued or active gets ("error", message)."""
        with self.lock:
            self.running = False
            self.lock.notify()
        if self.thread is not None:
            self.thread.join()
        for seq in list(self.queue) + [s for s in self.seqs if s is not None]:
            if not seq.cancelled:
                seq.deliver(("error", message))
        self.queue.clear()
        self.seqs = [None] * self.slots

    def _loop(self) -> None:
        try:
            while True:
                with self.lock:
                    while self.running and not self.queue and all(s is None for s in self.seqs):
                        self.lock.wait()
                    if not self.running:
                        return
                    for slot, seq in enumerate(self.seqs):
                        if seq is not None and seq.cancelled:
                            self._free(slot)
                    admitted = []
                    while self.queue and None in self.seqs:
                        seq = self.queue.popleft()
                        if not seq.cancelled:
                            slot = self.seqs.index(None)
                            self.seqs[slot] = seq
                            admitted.append((seq, slot))
                if admitted:
                    self.admit(admitted)
                    with self.lock:  # those that arrived during the prefill join before the next chunk
                        if self.queue and None in self.seqs:
                            continue
                if any(s is not None for s in self.seqs):
                    self._run_chunk()
        except Exception as e:  # a bug or the device failing: every request is told, the server says it
            self.failure = f"generation failed: {type(e).__name__}: {e}"
            with self.lock:
                self.running = False
            for seq in list(self.queue) + [s for s in self.seqs if s is not None]:
                seq.deliver(("error", self.failure))
            self.queue.clear()
            self.seqs = [None] * self.slots
            raise

    def _free(self, slot: int) -> None:
        self.seqs[slot] = None
        self.done[slot], self.token[slot], self.pos[slot], self.count[slot] = True, 0, 0, 0

    def admit(self, admitted: list[tuple[Sequence, int]]) -> None:
        """Prefill the prompts of the sequences given their slots, those of one bucket together (as many at once as
        the widest step holds and the device's memory allows), and deliver each one's first token (and its
        prompt's logprobs)."""
        by_bucket: dict[int, list[tuple[Sequence, int]]] = {}
        for seq, slot in admitted:
            by_bucket.setdefault(self.bucket(len(seq.prompt)), []).append((seq, slot))
        for bucket, group in by_bucket.items():
            most = max(1, min(self.widths[-1], self.room // max(1, prefill_bytes(self.cfg, bucket, self.context))))
            for start in range(0, len(group), most):
                self._prefill_group(group[start:start + most], bucket)

    def _prefill_group(self, group: list[tuple[Sequence, int]], bucket: int) -> None:
        width = self.width_for(len(group))
        tokens = np.zeros((width, bucket), np.int32)
        lengths = np.ones(width, np.int32)
        slots = np.full(width, self.slots, np.int32)  # the rows past the group's: padding, written nowhere
        temp, top_p = np.zeros(width, np.float32), np.ones(width, np.float32)
        key_data = np.zeros((width,) + self.keys.shape[1:], np.uint32)
        for i, (seq, slot) in enumerate(group):
            tokens[i, :len(seq.prompt)] = seq.prompt
            lengths[i], slots[i], temp[i], top_p[i] = len(seq.prompt), slot, seq.temperature, seq.top_p
            key_data[i] = np.asarray(jax.random.key_data(seeds.key_of(seq.seed)))
        tops, echo = any(seq.top for seq, _ in group), any(seq.echo for seq, _ in group)
        self.cache, token, lp, top_ids, top_lp, prompt_lp, prompt_top_ids, prompt_top_lp = self._prefill(
            self.state, self.cache, slots, tokens, lengths, temp, top_p, key_data, tops=tops, echo=echo)
        token, lp, top_ids, top_lp = np.asarray(token), np.asarray(lp), np.asarray(top_ids), np.asarray(top_lp)
        if echo:
            prompt_lp, prompt_top_ids, prompt_top_lp = (np.asarray(prompt_lp), np.asarray(prompt_top_ids),
                                                        np.asarray(prompt_top_lp))
        for i, (seq, slot) in enumerate(group):
            T0 = len(seq.prompt)
            if seq.echo:
                seq.deliver(("prompt", prompt_lp[i, :T0], prompt_top_ids[i, :T0, :seq.top],
                             prompt_top_lp[i, :T0, :seq.top]))
            if seq.max_tokens == 0:  # echo alone: the prompt's logprobs, nothing generated
                seq.deliver(("end", "length"))
                self._free(slot)
                continue
            first = int(token[i])
            if first != self.eot:
                seq.deliver(("tokens", [first], [float(lp[i])], top_ids[i][None, :seq.top], top_lp[i][None, :seq.top]))
            if first == self.eot or seq.max_tokens <= 1:
                seq.deliver(("end", "stop" if first == self.eot else "length"))
                self._free(slot)
                continue
            self.token[slot], self.pos[slot], self.count[slot], self.limit[slot] = first, T0, 1, seq.max_tokens
            self.done[slot], self.temp[slot], self.top_p[slot] = False, seq.temperature, seq.top_p
            self.keys[slot] = key_data[i]

    def _run_chunk(self) -> None:
        """One chunk of decode steps over the slots in use; each active request gets its new tokens."""
        used = [i for i, s in enumerate(self.seqs) if s is not None]
        if not used:
            return
        width = self.width_for(used[-1] + 1)
        tops = any(s is not None and s.top for s in self.seqs[:width])
        logprobs = any(s is not None and s.logprobs for s in self.seqs[:width])
        steps = int(min(CHUNK_MAX, max(1, CHUNK_SECONDS / self.step_seconds)))
        w = slice(0, width)
        began = time.perf_counter()
        (self.cache, out, lp, top_ids, top_lp, ran, token, pos, count, done) = self._chunk(
            self.state, self.cache, self.token[w], self.pos[w], self.count[w], self.limit[w], self.done[w],
            self.temp[w], self.top_p[w], self.keys[w], np.int32(steps), width=width, tops=tops, logprobs=logprobs)
        ran = int(ran)  # waits for the chunk
        if ran:
            self.step_seconds = 0.7 * self.step_seconds + 0.3 * (time.perf_counter() - began) / ran
        out, lp, top_ids, top_lp = np.asarray(out), np.asarray(lp), np.asarray(top_ids), np.asarray(top_lp)
        before = self.count[w].copy()
        self.token[w], self.pos[w], self.count[w], self.done[w] = (np.asarray(token), np.asarray(pos), np.asarray(count),
                                                                   np.asarray(done))
        with self.lock:
            for slot in range(width):
                seq = self.seqs[slot]
                if seq is None:
                    continue
                if seq.cancelled:
                    self._free(slot)
                    continue
                new = int(self.count[slot] - before[slot])
                ended_by_eot = self.done[slot] and int(self.token[slot]) == self.eot
                new -= int(bool(ended_by_eot and new))  # the end-of-text token itself is no text
                if new:
                    seq.deliver(("tokens", [int(t) for t in out[:new, slot]], [float(x) for x in lp[:new, slot]],
                                 top_ids[:new, slot, :seq.top], top_lp[:new, slot, :seq.top]))
                if self.done[slot]:
                    seq.deliver(("end", "stop" if int(self.token[slot]) == self.eot else "length"))
                    self._free(slot)
