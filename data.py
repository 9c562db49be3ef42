"""Corpus preparation: documents (corpus.py) tokenized into a data directory (shards.py's format). CLI.

    python data.py                                  # the default corpus: this Python's stdlib sources
    python data.py --input 'web/*.jsonl.zst' --out data/web --vocab-size 32768 --workers 16
    python data.py --runner beam --beam-option runner=FlinkRunner ... --input ... --out ... --tokenizer tok.json
    python data.py --format prompt_completion --input pairs.jsonl --out data/pairs --tokenizer RUN_DIR --seq-len 1024
                                                    # fine-tuning pairs with a loss mask: see finetune_data.py
    python data.py --format preference --input prefs.jsonl --out data/prefs --tokenizer RUN_DIR --seq-len 512
                                                    # prompt/chosen/rejected pairs for DPO: preference_data.py
    python data.py --verify data/web                # every file's size and sha256 against index.json

What a data directory holds is shards.py's (the format, the index, verification); how batches are
read from it is loader.py's. Documents come from corpus.py (globs, directories,
hf:NAME[/CONFIG]:SPLIT; plain text, JSON Lines, Parquet; unreadable inputs skipped and counted),
which also names each document and decides by a hash of its name whether it is held out for
validation. Every document is followed by the end-of-text id; text that spells the end-of-text
token itself is encoded as that token, as the `tokenizers` library does. Without --tokenizer, a
byte-level BPE is trained on the train documents.

A directory is built in the sibling DIR.tmp-<pid> and swapped into place when complete
(shard_writer.Staged, outputs.StagedDir), so an interrupted or failed run never leaves an index naming
missing or partial shards, nor loses the directory it replaces; Ctrl-C, SIGTERM and SIGHUP stop it as
outputs.stoppable says (one line, exit status 128 + N, the staging directory removed). --out is
checked before anything is written (outputs.check_out): never the current or home directory or one
holding them, and with --overwrite only a data directory (one with index.json) or an empty one is
replaced.

`--runner beam` (data_beam.py, needs apache-beam) runs the tokenizing and shard writing as an Apache
Beam pipeline, with Beam's options given as `--beam-option KEY=VALUE`; the directory it writes is the
default runner's, byte for byte (same tokenizer, encoding, shard writer, document order).

`--verify DIR` reads every file and checks its size and sha256 against index.json, listing each
damaged one. Inputs, --out and --verify may be URLs (gs://bucket/dir): inputs are globbed and read
through fsspec, --out is built locally and uploaded with index.json last (outputs.StagedDir), --verify
streams each file; the loader reads a URL by byte ranges, each process its own rows (shards.Source).
"""
from __future__ import annotations

from core import errors  # light: nothing but the standard library

if __name__ == "__main__":
    errors.stop_at_once_while_loading()  # a Ctrl-C while JAX and the rest load: one line, no traceback

import collections
import contextlib
import os
import pathlib
import shlex
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from core import outputs, storage
from core.errors import DataError
from tokendata import corpus, finetune_data, preference_data, shard_writer, shards
from tokendata.corpus import default_corpus_files

DEFAULT_DATA_DIR = pathlib.Path(__file__).resolve().parent / "data" / "pystdlib"


# ---------------------------------------------------------------------------------------------
# Preparation

def _empty(sources: list, tally: corpus.Tally) -> str:
    skipped = tally.skipped_files + tally.skipped_records
    skipped = f", {skipped} unreadable skipped ({tally.skipped_names()})" if skipped else ""
    empty = f", {tally.empty} empty or only whitespace" if tally.empty else ""
    return f"empty corpus: no text in {len(sources)} input file(s){skipped}{empty}: {sources[0][1]}" + \
        (", ..." if len(sources) > 1 else "")



def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as taskset and container limits set it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this system
        return os.cpu_count() or 1


def _prepare(sources, out, *, description: list[str], tokenizer, vocab_size, is_val: Callable[[str], bool],
             val_fraction: float, workers, shard_tokens, text_field, overwrite, strict, progress,
             runner: str = "local", beam_options: list[str] | None = None) -> dict:
    """Prepares `sources` into `out`, documents held out by is_val (which holds out about val_fraction of
    them), plus the one of corpus.held_out_extra where is_val held out none. `out` may be a URL
    (gs://bucket/dir): the directory is built on the local disk and uploaded (shard_writer.Staged)."""
    if shard_tokens < 1:
        raise DataError(f"shard tokens must be positive, got {shard_tokens}")
    if tokenizer is None:
        shard_writer.check_trained_vocab(vocab_size)
    shard_writer.check_out(out, overwrite, [location for kind, location, _ in sources if kind != "hf"])
    if runner not in ("local", "beam"):
        raise DataError(f"unknown runner {runner!r} (choose local or beam)")
    if runner == "beam" and storage.is_url(out):  # its workers write into the directory being built
        raise DataError(f"--runner beam writes --out through a file system every worker mounts, not a URL "
                        f"({out}); prepare into such a directory and copy it, or use the local runner")
    if runner == "beam":
        try:
            from tokendata import data_beam  # apache-beam is optional: imported only for this runner
        except ImportError as e:
            raise DataError(f"--runner beam needs apache-beam ({e}); pip install apache-beam")
    if workers is not None and workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    workers = min(workers or usable_cpus(), usable_cpus())  # threads beyond the CPUs would only share them
    saved_env = {k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")}
    # bars only on a terminal, and erased when done, so an error stays the one line on stderr
    bars = dict(disable=None if progress else True, leave=False, file=sys.stderr, dynamic_ncols=True)

    def build(tmp: pathlib.Path, is_val):
        """Tokenizer and shards into tmp, documents split by is_val: ({vocab_size, eot_id, dtype}, splits, tally)."""
        tok = _obtain_tokenizer(sources, tmp, tokenizer, vocab_size, is_val, text_field, strict, workers, bars)
        vocab = max(tok.get_vocab().values()) + 1
        options = dict(eot=shards.eot_id_of(tok), vocab_size=vocab, dtype=shards.dtype_for(vocab), is_val=is_val,
                       shard_tokens=shard_tokens, text_field=text_field, strict=strict)
        if runner == "beam":
            splits, tally = data_beam.tokenize(sources, tmp, tok, options=beam_options or [], **options)
        else:
            splits, tally = _tokenize_local(sources, tmp, tok, workers=workers, bars=bars, **options)
        if sum(s["tokens"] for s in splits.values()) == 0:
            raise DataError(_empty(sources, tally))
        # vocab_size: the tokenizer's, which a BPE trained on a small corpus leaves below the one requested
        return {"vocab_size": vocab, "vocab_size_requested": None if tokenizer is not None else vocab_size,
                "eot_id": options["eot"], "dtype": options["dtype"]}, splits, tally

    try:
        # tokenizer: the tokenizers library's thread pool honours RAYON_NUM_THREADS until it first starts
        os.environ.setdefault("RAYON_NUM_THREADS", str(workers))
        with shard_writer.Staged(out, overwrite) as staged:
            vocab_fields, splits, tally = build(staged.path, is_val)
            extra = corpus.held_out_extra(tally, splits["train"]["documents"], splits["val"]["documents"],
                                          val_fraction)
            if extra is not None:  # no document fell below the fraction: again, with the lowest-ranked one held out
                staged.reset()
                vocab_fields, splits, tally = build(staged.path, lambda key: key == extra or is_val(key))
            tokens = sum(s["tokens"] for s in splits.values())
            index = {
                "format_version": shards.FORMAT_VERSION,
                "tokenizer": "tokenizer.json",
                "tokenizer_sha256": shards.file_sha256(staged.path / "tokenizer.json"),
                **vocab_fields,  # vocab_size, vocab_size_requested, eot_id, dtype
                "tokens": tokens,
                "documents": sum(s["documents"] for s in splits.values()),
                "bytes_per_token": sum(s["bytes"] for s in splits.values()) / tokens,  # end-of-text included
                "unigram_entropy": splits["train"]["unigram_entropy"],
                "skipped_files": tally.skipped_files, "skipped_records": tally.skipped_records,
                "skipped_empty": tally.empty,  # documents that were empty or only whitespace
                "skipped_inputs": tally.skipped,  # the first corpus.LISTED, with the reason
                "val_extra": extra,  # the document held out because none fell below the fraction, if one was
                "inputs": description, "splits": splits,
            }
            staged.commit(index)
        return index
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _obtain_tokenizer(sources, tmp: pathlib.Path, tokenizer, vocab_size, is_val, text_field, strict, workers,
                      bars):
    """The given tokenizer (an end-of-text token added if it lacks one), or a BPE trained on the train
    documents; either way saved as tmp/tokenizer.json. Both runners get theirs here."""
    from tqdm import tqdm
    if tokenizer is not None:
        return shard_writer.install_tokenizer(tokenizer, tmp)
    if workers == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    reader = corpus.Reader(sources, text_field, strict)
    seen = 0
    with tqdm(total=len(sources), desc="training tokenizer", unit="file", **bars) as bar:
        def train_docs() -> Iterator[str]:
            nonlocal seen
            for key, text in reader:
                seen += 1
                bar.update(reader.tally.files - bar.n)
                if not is_val(key):  # held-out text stays unseen by the tokenizer too
                    yield text
        tok = shard_writer.train_tokenizer(train_docs(), vocab_size)
    if not seen:
        raise DataError(_empty(sources, reader.tally))
    tok.save(str(tmp / "tokenizer.json"))
    return tok



def _tokenize_local(sources, tmp: pathlib.Path, tok, *, eot, vocab_size, dtype, is_val, shard_tokens, text_field,
                    strict, workers, bars) -> tuple[dict, corpus.Tally]:
    """The in-process runner: documents in input order, encoded by a thread pool, written in order.
    Returns ({split: summary}, what the reading came to)."""
    from tqdm import tqdm
    writers = {s: shard_writer.ShardWriter(tmp, s, dtype, shard_tokens, vocab_size) for s in ("train", "val")}
    # chunks of documents go to `workers` threads (encode_batch releases the GIL), each encoding
    # single-threaded; results are written in order, at most 2 * workers chunks in flight
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    reader = corpus.Reader(sources, text_field, strict)
    pending: collections.deque = collections.deque()
    done_bytes, start = 0, time.perf_counter()
    with ThreadPoolExecutor(workers) as pool, \
            tqdm(total=len(sources), desc="tokenizing", unit="file", **bars) as bar:
        def drain(limit: int) -> None:
            nonlocal done_bytes
            while len(pending) > limit:
                split, future = pending.popleft()
                ids, ends, nbytes = future.result()
                writers[split].write(ids, ends)
                writers[split].bytes += nbytes
                done_bytes += nbytes
                tokens = sum(int(w.counts.sum()) for w in writers.values())
                bar.update(reader.tally.files - bar.n)
                bar.set_postfix_str(f"{tokens / 1e6:.1f}M tokens, "
                                    f"{done_bytes / 1e6 / (time.perf_counter() - start):.1f} MB/s")

        try:
            for split, texts in shard_writer.chunks(reader, is_val):
                pending.append((split, pool.submit(shard_writer.encode_texts, tok, texts, eot, vocab_size, dtype)))
                drain(2 * workers)
            drain(0)
        except BaseException:  # stop at once: chunks not yet started are dropped
            for _, future in pending:
                future.cancel()
            raise
    for writer in writers.values():
        writer.close()
    return {s: w.summary() for s, w in writers.items()}, reader.tally



def prepare(inputs: list[str], out, *, tokenizer: str | None = None, vocab_size: int = 8192,
            val_fraction: float = 0.005, workers: int | None = None, shard_tokens: int = 2**27,
            text_field: str = "text", overwrite: bool = False, strict: bool = False,
            progress: bool = True, runner: str = "local", beam_options: list[str] | None = None) -> dict:
    """Tokenizes the files matching `inputs` (or hf:NAME[/CONFIG]:SPLIT) into DIR `out`; returns its index.

    runner "beam" runs the tokenizing and shard writing as an Apache Beam pipeline (data_beam.py) with
    the pipeline options `beam_options` (["--runner=DataflowRunner", ...]); the result is the same."""
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else [str(i) for i in inputs]
    if not inputs:
        raise DataError("no input given")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val fraction must be in [0, 1), got {val_fraction}")
    return _prepare(corpus.expand(inputs), out, description=inputs, tokenizer=tokenizer, vocab_size=vocab_size,
                    is_val=lambda key: corpus.in_val(key, val_fraction), val_fraction=val_fraction, workers=workers,
                    shard_tokens=shard_tokens, text_field=text_field, overwrite=overwrite, strict=strict,
                    progress=progress, runner=runner, beam_options=beam_options)


def prepare_default(out=DEFAULT_DATA_DIR, *, vocab_size: int = 4096, overwrite: bool = False,
                    progress: bool = True, tokenizer: str | None = None, workers: int | None = None,
                    stdlib_dir: str | os.PathLike | None = None, runner: str = "local",
                    beam_options: list[str] | None = None) -> dict:
    """Prepares the embedded default corpus: the running interpreter's stdlib sources."""
    root = pathlib.Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = default_corpus_files(root)
    if not files:
        raise DataError(f"empty corpus: no .py files under {root}")
    # documents are named relative to the stdlib; a byte-balanced set of them is held out
    held = corpus.default_held_out(root, files)
    sources = [("text", str(p), p.relative_to(root).as_posix()) for p in files]
    description = [f"Python {sys.version.split()[0]} standard library: {root}/**/*.py"]
    return _prepare(sources, out, description=description, tokenizer=tokenizer, vocab_size=vocab_size,
                    is_val=held.__contains__, val_fraction=corpus.DEFAULT_VAL_FRACTION, workers=workers,
                    shard_tokens=2**27, text_field="text",
                    overwrite=overwrite, strict=False, progress=progress, runner=runner,
                    beam_options=beam_options)



def resolve_dir(data_dir: str | None, progress: bool = True) -> str:
    """The data directory a run trains on, as its config records it: a URL as written, a local path
    resolved. None is the default corpus, prepared here on first use."""
    if data_dir is not None and storage.is_url(data_dir):
        return data_dir  # kept as written: pathlib would fold its "//"
    path = pathlib.Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    if data_dir is None and not (path / "index.json").is_file():
        print(f"preparing the default corpus in {path} (once)", flush=True)
        prepare_default(path, progress=progress)
    return str(path.resolve())


# ---------------------------------------------------------------------------------------------
# Command line

def _beam_flags(options: list[str], runner: str) -> list[str]:
    """--beam-option KEY=VALUE ... to Beam's own flags --KEY=VALUE."""
    if options and runner != "beam":
        raise DataError("--beam-option needs --runner beam")
    flags = []
    for option in options:
        key, eq, value = option.removeprefix("--").partition("=")
        if not eq or not key:
            raise DataError(f"--beam-option {option!r}: expected KEY=VALUE, e.g. runner=DataflowRunner")
        flags.append(f"--{key}={value}")
    return flags


def parse_args(argv: list[str] | None):
    parser = errors.ArgumentParser(error=DataError, description="Tokenize a corpus into memory-mapped shards "
                                                 "(no --input: this Python's stdlib sources).")
    parser.add_argument("--input", action="append", default=[], metavar="PATTERN",
                        help="glob, directory, or hf:NAME[/CONFIG]:SPLIT; repeatable")
    parser.add_argument("--out", help=f"data directory (default with no --input: {DEFAULT_DATA_DIR})")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tokenizer", help="a tokenizers tokenizer.json, or a run or data directory holding one, to use "
                                            "instead of training a BPE")
    group.add_argument("--vocab-size", type=int, help="vocabulary of the BPE trained on the inputs "
                                                      "(default 8192, 4096 for the default corpus)")
    parser.add_argument("--val-fraction", type=float, help="share of documents held out "
                                                             "(default 0.005; 0.05 for prompt_completion)")
    parser.add_argument("--workers", type=int, help="tokenizer threads, at most the CPUs this process may use "
                                                   "(default: all of them)")
    parser.add_argument("--shard-tokens", type=int, default=2**27, help="tokens per shard file")
    parser.add_argument("--text-field", default="text", help="JSON field / Parquet column holding the text")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    parser.add_argument("--strict", action="store_true", help="fail on unreadable input instead of skipping")
    parser.add_argument("--runner", choices=("local", "beam"), default="local",
                        help="local: this process (default); beam: an Apache Beam pipeline (data_beam.py)")
    parser.add_argument("--beam-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a Beam pipeline option, e.g. runner=DataflowRunner; repeatable")
    parser.add_argument("--verify", metavar="DIR", help="check every file of a prepared directory against its "
                                                        "index.json (sizes, sha256: every byte) and exit: 0 intact, "
                                                        "2 not; a resume or eval.py checks sizes and a sample of "
                                                        "each shard's bytes only")
    fine = parser.add_argument_group("prompt/completion fine-tuning data (--format prompt_completion, "
                                      "see finetune_data.py; --tokenizer may name a run directory)")
    fine.add_argument("--format", choices=("text", "prompt_completion", "preference"), default="text",
                      help="text: documents for pre-training; prompt_completion: JSON Lines pairs with a loss mask; "
                           "preference: JSON Lines prompt/chosen/rejected pairs for training.objective=dpo")
    fine.add_argument("--in-field", default="in_text", help="JSON field of the prompt")
    fine.add_argument("--out-field", default="out_text", help="JSON field of the completion")
    fine.add_argument("--seq-len", type=int, help="training context: longer examples lose prompt tokens "
                                                   "from the left (required with prompt_completion and preference)")
    fine.add_argument("--prompt-field", default="prompt", help="preference: JSON field of the prompt")
    fine.add_argument("--chosen-field", default="chosen", help="preference: JSON field of the preferred response")
    fine.add_argument("--rejected-field", default="rejected", help="preference: JSON field of the other response")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error raises (cli() prints it)."""
    args = parse_args(argv)
    start = time.perf_counter()
    if args.vocab_size is not None:  # 0 must not read as "the default"
        shard_writer.check_trained_vocab(args.vocab_size, "--vocab-size")
    if args.workers is not None and args.workers < 1:  # 0 or -3 must not read as "the default" or as 1
        raise DataError(f"--workers must be >= 1 (default: the {usable_cpus()} CPUs this process may use), "
                        f"got {args.workers}")
    if args.seq_len is not None and args.format == "text":
        raise DataError("--seq-len is for --format prompt_completion and preference (examples fitted to the training "
                        "context); "
                        "text is one stream, cut into windows of training.seq_len when training")
    if args.out is not None:  # file:///x is the local directory /x, for writers as for readers
        args.out = storage.local_path(args.out)
    if args.verify:
        args.verify = storage.local_path(args.verify)
    if args.out is not None and not args.out.strip():
        raise DataError("--out is empty; name the directory to write")
    if args.verify:
        if args.input or args.out:
            raise DataError("--verify DIR checks a prepared directory; it takes no --input or --out")
        _refuse_a_run_directory(args.verify)
        problems, summary = shards.verify(args.verify)
        for line in problems:
            print(line)
        if problems:
            raise DataError(summary)
        print(summary)
        return 0
    if args.format == "preference":
        return _prepare_preference(args, start)
    if args.format == "prompt_completion":
        if args.runner != "local":
            raise DataError("--format prompt_completion runs in this process only (no --runner beam)")
        if not args.input or not args.out or not args.seq_len:
            raise DataError("--format prompt_completion needs --input, --out and --seq-len")
        val_fraction = 0.05 if args.val_fraction is None else args.val_fraction
        index = finetune_data.prepare(args.input, args.out, seq_len=args.seq_len, tokenizer=args.tokenizer,
                                      vocab_size=8192 if args.vocab_size is None else args.vocab_size, in_field=args.in_field,
                                      out_field=args.out_field, val_fraction=val_fraction,
                                      shard_tokens=args.shard_tokens, overwrite=args.overwrite)
        train_split, val_split = index["splits"]["train"], index["splits"]["val"]
        print(f"{index['examples']:,} examples (train {train_split['examples']:,}, val {val_split['examples']:,}"
              f"{_extra(index)}), "
              f"{index['tokens']:,} tokens, {train_split['completion_tokens'] + val_split['completion_tokens']:,} "
              f"in the loss; {index['truncated']} prompts truncated from the left, {index['skipped']} examples "
              f"skipped (completion longer than --seq-len {args.seq_len}), {index['skipped_records']} invalid "
              f"records skipped{_skipped_names(index, args.out)}; vocab {index['vocab_size']}, "
              f"{time.perf_counter() - start:.1f}s -> {args.out}")
        if args.tokenizer is None:  # pairs are mostly for fine-tuning, which needs the base model's tokenizer
            print(f"note: no --tokenizer, so a new BPE tokenizer (vocab {index['vocab_size']}) was trained on these "
                  f"pairs: this data trains a model from scratch, or fine-tunes only a model trained with this "
                  f"tokenizer; to fine-tune an existing run, prepare it with --tokenizer RUN_DIR")
        _say_vocab_shortfall(index)
        return 0
    if args.val_fraction is None:
        args.val_fraction = 0.005
    if args.workers is not None and args.workers > usable_cpus():
        print(f"note: --workers {args.workers} is more than the {usable_cpus()} CPUs this process may use: "
              f"{usable_cpus()} tokenizer threads (more would only share them)")
    beam_options = _beam_flags(args.beam_option, args.runner)
    runner = dict(runner=args.runner, beam_options=beam_options)
    if args.input:
        if not args.out:
            raise DataError("--out is required with --input")
        out = args.out
        index = prepare(args.input, out, tokenizer=args.tokenizer, vocab_size=8192 if args.vocab_size is None else args.vocab_size,
                        val_fraction=args.val_fraction, workers=args.workers,
                        shard_tokens=args.shard_tokens, text_field=args.text_field,
                        overwrite=args.overwrite, strict=args.strict, **runner)
    else:
        out = args.out or DEFAULT_DATA_DIR
        index = prepare_default(out, vocab_size=4096 if args.vocab_size is None else args.vocab_size, overwrite=args.overwrite,
                                tokenizer=args.tokenizer, workers=args.workers, **runner)
    splits, skipped = index["splits"], index["skipped_files"] + index["skipped_records"]
    print(f"{index['documents']:,} documents, {index['tokens']:,} tokens "
          f"(train {splits['train']['tokens']:,}, val {splits['val']['tokens']:,}{_extra(index)}), "
          f"{index['bytes_per_token']:.2f} bytes/token, unigram entropy {index['unigram_entropy']:.3f} "
          f"nats/token, vocab {index['vocab_size']}, {index['dtype']}"
          + (f", {skipped} unreadable or invalid inputs skipped{_skipped_names(index, out)}" if skipped else "")
          + (f", {index['skipped_empty']:,} empty or whitespace-only documents skipped"
             if index["skipped_empty"] else "")
          + f", {time.perf_counter() - start:.1f}s -> {out}")
    _say_vocab_shortfall(index)
    return 0


def _prepare_preference(args, start: float) -> int:
    """data.py --format preference: the pairs prepared, and one line of what was kept and skipped."""
    if args.runner != "local":
        raise DataError("--format preference runs in this process only (no --runner beam)")
    if not args.input or not args.out or not args.seq_len:
        raise DataError("--format preference needs --input, --out, --seq-len and --tokenizer")
    if args.vocab_size is not None:
        raise DataError("--format preference takes the tuned model's tokenizer (--tokenizer), not --vocab-size")
    index = preference_data.prepare(args.input, args.out, seq_len=args.seq_len, tokenizer=args.tokenizer,
                                    prompt_field=args.prompt_field, chosen_field=args.chosen_field,
                                    rejected_field=args.rejected_field,
                                    val_fraction=0.05 if args.val_fraction is None else args.val_fraction,
                                    shard_tokens=args.shard_tokens, overwrite=args.overwrite)
    train_split, val_split = index["splits"]["train"], index["splits"]["val"]
    print(f"{index['pairs']:,} pairs (train {train_split['pairs']:,}, val {val_split['pairs']:,}{_extra(index)}), "
          f"{index['tokens']:,} tokens; {index['truncated_prompts']} prompts truncated from the left, "
          f"{index['truncated_responses']} pairs with responses truncated from the right (--seq-len {args.seq_len}); "
          f"skipped: {index['empty']} pairs with an empty response, {index['identical']} with the same response "
          f"twice, {index['skipped_records']} invalid records{_skipped_names(index, args.out)}; "
          f"{time.perf_counter() - start:.1f}s -> {args.out}")
    return 0


def _refuse_a_run_directory(directory) -> None:
    """A DataError where --verify is given a run directory (train.py's, no index.json), naming the data
    directory the run records in its data.json, which is what --verify checks."""
    if storage.RunDir(directory).is_file("index.json"):
        return
    from store import record  # (loads JAX: only for a directory that is no data directory)
    run = record.Record(storage.RunDir(directory))
    if not (run.has_config() or run.dir.is_file(record.DATA)):
        return  # neither: shards.verify says what is missing
    recorded = run.data()
    dirs = [recorded["dir"]] if recorded.get("dir") else [  # a mixture run: each source's directory
        s["dir"] for s in (recorded.get("mixture") or {}).values() if isinstance(s, dict) and s.get("dir")]
    trained = (f"this run trained on {', '.join(dirs)} (its {record.DATA}): "
               + "; ".join(f"python data.py --verify {shlex.quote(d)}" for d in dirs) if dirs
               else f"this run records no data directory (no {record.DATA})")
    raise DataError(f"{directory} is a run directory; --verify checks a prepared data directory (one with "
                    f"index.json): {trained}")


def _say_vocab_shortfall(index: dict) -> None:
    """One line when the trained BPE has fewer tokens than --vocab-size asked for."""
    requested, actual = index.get("vocab_size_requested"), index["vocab_size"]
    if requested is not None and actual < requested:
        print(f"note: vocab {actual:,} instead of the {requested:,} requested: the corpus is too small for more "
              f"BPE merges (every word in it is already one token); the data directory records {actual:,}, "
              f"which train.py sizes the model by")


def _extra(index: dict) -> str:
    """Where the validation split holds a document only because none fell below the fraction, which one."""
    if index["val_extra"] is None:
        return ""
    return f": {index['val_extra']}, held out as none fell below --val-fraction"


def _skipped_names(index: dict, out) -> str:
    """" (a.txt, b.jsonl:3, ... and 1 more; listed in DIR/index.json)" when inputs were skipped, else ""."""
    tally = corpus.Tally(skipped_files=index.get("skipped_files", 0), skipped_records=index["skipped_records"],
                         skipped=index["skipped_inputs"])
    if not tally.skipped:
        return ""
    listed = f"{out}/index.json" if storage.is_url(out) else pathlib.Path(out) / "index.json"
    return f" ({tally.skipped_names()}; listed in {listed})"


def cli(argv: list[str] | None = None) -> int:
    """main() with a user error as one `error: ...` line and exit status 2 (errors.run_cli), and Ctrl-C,
    SIGTERM and SIGHUP as outputs.stoppable handles them: a stop before the data directory is in place
    says so in one line, exit status 128 + N, with the staging directory removed and --out as it was; one
    after it is said after the summary."""
    def stoppable_main(argv):
        args = parse_args(argv)
        out = None if args.verify else args.out or (DEFAULT_DATA_DIR if not args.input else None)
        return outputs.stoppable(main, argv, out, error=DataError,
                                 restore=__name__ != "__main__")  # run as a program, the process ends with it
    return errors.run_cli(stoppable_main, argv, interrupted="interrupted; nothing was written")


if __name__ == "__main__":
    exit_status = cli()
    for stream in (sys.stdout, sys.stderr):  # all said: the process ends now (outputs.Stops)
        with contextlib.suppress(OSError, ValueError):  # a reader that has gone, a closed stream
            stream.flush()
    os._exit(exit_status)
