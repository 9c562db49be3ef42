"""Text generation from a run directory, with a KV cache in one jitted, fixed-shape loop.

    python sample.py --checkpoint RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
                     [--top-k K] [--top-p P] [--seed S] [--num-samples M] [--step STEP]

The run directory gives everything: the model (`config.yaml`), the weights (the last checkpoint,
or `--step`) and `tokenizer.json`. The prompt is encoded once and repeated M times into one
batch; one `jax.jit` call prefills the cache with the whole prompt (`GPT.decode` at position 0),
then a `lax.while_loop` feeds one token per step until N new tokens or until every sample has
produced the end-of-text token. A sample ends at its end-of-text token.

Sampling: logits over the padded vocabulary rows (ids >= vocab_size) are -inf; temperature 0 is
greedy (argmax), otherwise the logits are divided by T, cut to the K largest (`--top-k`, 0 = off)
and then to the smallest set of tokens whose probability reaches P (`--top-p`, nucleus; 1 = off),
and a token is drawn with `jax.random` from a key folded with the step. The same seed gives the
same samples. An ALiBi model generates beyond its training context; a learned-position model
refuses a prompt plus new tokens longer than its `block_size`.

A run fine-tuned on prompt/completion data (its data.json says `kind: prompt_completion`) is
used the way it was trained: `--prompt` is the in_text, encoded on its own exactly as
finetune_data.py encodes it, and the completion (the out_text, up to the end-of-text token) is
printed alone.

User errors (a missing run directory or checkpoint, an empty prompt, a bad number, a too-long
learned-position request, a cache and logits larger than the device's memory, which the error sizes
down) end in one `error: ...` line on stderr and exit status 2, before the model loads.
"""
from __future__ import annotations

import errors  # light: nothing but the standard library

if __name__ == "__main__":
    errors.stop_at_once_while_loading()  # a Ctrl-C while JAX and the rest load: one line, no traceback


def parse_args(argv):
    p = errors.ArgumentParser(error=errors.SampleError, description="Generate text from a trained run.")
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR", help="run directory (config, checkpoints, tokenizer)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100,
                   help="tokens to generate per sample (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens; 0 = all (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set with probability P; 1 = all "
                                                                 "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, a 64-bit integer (default: %(default)s)")
    p.add_argument("--num-samples", type=int, default=1, help="samples, generated in one batch (default: %(default)s)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step; default the last")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        raise errors.SampleError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise errors.SampleError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise errors.SampleError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise errors.SampleError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.num_samples < 1:
        raise errors.SampleError(f"--num-samples must be >= 1, got {args.num_samples}")
    if not -2**63 <= args.seed < 2**63:  # jax.random.key takes a 64-bit integer
        raise errors.SampleError(f"--seed must be a 64-bit integer (between -2**63 and 2**63 - 1), got {args.seed}")
    if args.prompt == "":
        raise errors.SampleError("--prompt is empty; give some text to continue")
    return args


if __name__ == "__main__":
    errors.parse_before_loading(parse_args)  # --help and argument mistakes: at once, before JAX loads

import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rundir
import shards
from errors import SampleError
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


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv=None) -> int:
    args = parse_args(argv)
    run_dir = args.checkpoint
    run = rundir.existing(run_dir)
    cfg = run.config().model
    tokenizer = run.tokenizer()
    finetuned = run.is_finetuned()
    prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    if not prompt_ids:
        raise SampleError(f"--prompt {args.prompt!r} encodes to no tokens")
    if max(prompt_ids) >= cfg.vocab_size:
        raise SampleError(f"the tokenizer gives id {max(prompt_ids)}, beyond the model's vocab_size {cfg.vocab_size}")
    total = len(prompt_ids) + args.max_new_tokens
    if cfg.max_length is not None and total > cfg.max_length:
        raise SampleError(
            f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens ({args.max_new_tokens}) = {total} exceeds "
            f"block_size {cfg.block_size} of this learned-position model")
    check_generation_size(cfg, args.num_samples, len(prompt_ids), args.max_new_tokens)
    eot_id = shards.eot_id_of(tokenizer)
    model, step = run.load_model(args.step)

    graphdef, state = nnx.split(model)
    prompt = jnp.asarray(np.tile(np.asarray(prompt_ids, np.int32), (args.num_samples, 1)))  # (M, T0)
    key = jax.random.key(args.seed)
    fn = make_generate(graphdef, cfg, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, eot_id=eot_id)
    t0 = time.perf_counter()
    compiled = fn.lower(state, prompt, key).compile()
    t1 = time.perf_counter()
    out, steps = compiled(state, prompt, key)
    out, steps = np.asarray(out), int(steps)  # waits for the device
    t2 = time.perf_counter()

    for i, row in enumerate(out):
        text = tokenizer.decode(([] if finetuned else prompt_ids) + truncate(row, eot_id))
        print(f"---------- sample {i + 1}/{args.num_samples} ----------")
        print(text)
    new = args.num_samples * steps
    print(f"{run_dir} step {step}: {args.num_samples} x ({len(prompt_ids)} prompt + {steps} new tokens) in "
          f"{t2 - t1:.3f} s, {new / max(t2 - t1, 1e-9):.1f} new tokens/s (compile {t1 - t0:.1f} s)", file=sys.stderr)
    return 0


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr and exit status 2."""
    return errors.run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
