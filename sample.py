"""Text generation from a run directory, with a KV cache in a jitted, fixed-shape loop.

    python sample.py --checkpoint RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
                     [--top-k K] [--top-p P] [--seed S] [--num-samples M] [--step STEP]

The run directory gives everything: the model (`config.yaml`), the weights (the last checkpoint,
or `--step`) and `tokenizer.json`. The prompt is encoded once and repeated M times into one
batch; one `jax.jit` call prefills the cache with the whole prompt (`GPT.decode` at position 0),
then a `lax.while_loop` feeds one token per step until N new tokens or until every sample has
produced the end-of-text token. A sample ends at its end-of-text token. The loop runs a chunk of
steps per call (decoding.Generation.chunks, about a quarter of a second each, the cache carried
from one to the next; the tokens are those of one long loop): between two chunks a terminal shows
the progress of a generation longer than a few seconds (tokens, tokens/s; nothing in a log), and a
Ctrl-C stops it, prints the samples as far as they got and ends with one line saying where, status 130.

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

User errors (a missing run directory or checkpoint, an empty prompt, a prompt that is not UTF-8, a
bad number, a too-long learned-position request, a cache and a prompt's prefill larger than the
device's memory, which the error sizes down) end in one `error: ...` line on stderr and exit status
2, before the model loads. A Ctrl-C while it starts ends it at once with one line and status 130; a
reader of its output that has gone (`| head -c 600`) ends it quietly with status 141.
"""
from __future__ import annotations

import os

from core import errors  # light: nothing but the standard library

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
    p.add_argument("--base", metavar="BASE_DIR", help="a LoRA run's base model (a run directory) where it is now, if it moved since the run trained (default: where the run's lora_base.json records it)")
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
    if not -2**63 <= args.seed < 2**63:  # core/seeds.py's key_of takes a 64-bit integer
        raise errors.SampleError(f"--seed must be a 64-bit integer (between -2**63 and 2**63 - 1), got {args.seed}")
    if args.prompt == "":
        raise errors.SampleError("--prompt is empty; give some text to continue")
    if not args.prompt.isascii():
        check_utf8(args.prompt)
    return args


def check_utf8(prompt: str) -> None:
    """A SampleError naming the first byte of a --prompt that is not UTF-8 text: bytes the command line
    could not decode reach Python as lone surrogates (surrogateescape), which no tokenizer takes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(prompt)  # the bytes as given
        try:
            raw.decode("utf-8")
            where = ""
        except UnicodeDecodeError as e:
            where = f" (byte 0x{raw[e.start]:02x} at byte {e.start})"
        raise errors.SampleError(f"--prompt is not UTF-8 text{where}: give it in UTF-8 (iconv converts from "
                                 "other encodings)") from None


if __name__ == "__main__":
    errors.parse_before_loading(parse_args)  # --help and argument mistakes: at once, before JAX loads

import contextlib
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from core import seeds
from core.errors import Interrupted, SampleError
from inference.decoding import check_generation_size, make_generate, truncate
from store import rundir
from tokendata import shards

# ----------------------------------------------------------------------------------------------
# Command line


def main(argv=None) -> int:
    args = parse_args(argv)
    run_dir = args.checkpoint
    run = rundir.existing(run_dir, args.base)
    cfg = run.record.config().model
    tokenizer = run.record.tokenizer()
    finetuned = run.record.is_finetuned()
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
    model, step = run.weights.load_model(args.step)

    graphdef, state = nnx.split(model)
    prompt = jnp.asarray(np.tile(np.asarray(prompt_ids, np.int32), (args.num_samples, 1)))  # (M, T0)
    key = seeds.key_of(args.seed)
    generation = make_generate(graphdef, cfg, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                               top_p=args.top_p, eot_id=eot_id)
    t0 = time.perf_counter()
    generation.compile(state, prompt, key)
    t1 = time.perf_counter()
    with noting_stops() as interrupted, tqdm(total=args.num_samples * args.max_new_tokens, unit="token",
                                              desc="generating", delay=PROGRESS_AFTER, leave=False,
                                              disable=None) as bar:  # None: on a terminal only
        for done in generation.chunks(state, prompt, key):
            bar.update(args.num_samples * done.steps - bar.n if not bar.disable else 0)
            if interrupted:
                break
    out, steps = done.tokens(), done.steps  # waits for the device
    t2 = time.perf_counter()

    for i, row in enumerate(out):
        text = tokenizer.decode(([] if finetuned else prompt_ids) + truncate(row, eot_id))
        print(f"---------- sample {i + 1}/{args.num_samples} ----------")
        print(text)
    if interrupted and not done.ended:  # (a Ctrl-C during the last chunk came too late to stop anything)
        sys.stdout.flush()  # the samples, then the line that says where they stop
        how = "interrupted" if interrupted[0] == signal.SIGINT else f"stopped by {signal.Signals(interrupted[0]).name}"
        raise Interrupted(f"{how} after {steps:,} of --max-new-tokens {args.max_new_tokens:,} new tokens a "
                          "sample: the samples above are what was generated", interrupted[0])
    sys.stdout.flush()  # the samples out (or a reader that has gone found) before the line about them
    new = args.num_samples * steps
    print(f"{run_dir} step {step}: {args.num_samples} x ({len(prompt_ids)} prompt + {steps} new tokens) in "
          f"{t2 - t1:.3f} s, {new / max(t2 - t1, 1e-9):.1f} new tokens/s (compile {t1 - t0:.1f} s)", file=sys.stderr)
    return 0


PROGRESS_AFTER = 3.0  # seconds of generating before a terminal shows its progress (tokens, tokens/s)


@contextlib.contextmanager
def noting_stops():
    """While the samples are generated: a Ctrl-C (SIGINT), SIGTERM or SIGHUP (a closed terminal) is noted in
    the list this yields, for the loop to stop after its chunk (Generation.chunks: within CHUNK_SECONDS) and
    print what it has; a second one is handled as the first would have been before (run_cli's: the process
    ends at once)."""
    noted: list[int] = []

    def note(signum, frame):
        if not noted:
            if signum == signal.SIGHUP:  # the samples still to print must not fail on a terminal that is gone
                errors.detach_from_terminal()
            noted.append(signum)
        elif callable(previous[signum]):
            previous[signum](signum, frame)  # the command's own: run_cli's
        else:
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, note) for s in errors.STOP_SIGNALS}
    try:
        yield noted
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr and exit status 2."""
    return errors.run_cli(main, argv, at_once=True)  # nothing to undo: a Ctrl-C ends it where it stands


if __name__ == "__main__":
    sys.exit(cli())
