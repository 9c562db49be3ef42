"""Prompt/completion data for fine-tuning: preparation (loader.py reads it).

    python data.py --format prompt_completion --input pairs.jsonl --out data/pairs \\
                   --tokenizer runs/base --seq-len 256 [--in-field in_text --out-field out_text]

Input: JSON Lines, one {"in_text": PROMPT, "out_text": COMPLETION} object a line (field names
configurable; .gz/.zst allowed). An example is the token sequence

    encode(in_text) + encode(out_text) + [end-of-text]

(each text encoded on its own, so the boundary is exact; put any separator into the texts). The
loss counts the completion tokens and the end-of-text token, never the prompt. An example longer
than seq_len + 1 tokens (the most one training row holds) loses tokens from the left of its
prompt; one whose completion and end-of-text alone do not fit is skipped. Both are counted and
printed. Records that are not objects with two string fields are skipped and counted. Pairs that could
not train are refused (`_check_examples`): none valid, a split without an example, every completion
empty.

On-disk format (shards.py): a data directory whose index has `kind: "prompt_completion"`,
`seq_len`, `loss_unigram_entropy` (of the train split's tokens in the loss: the baseline train.py's
summary compares the validation loss with), and per split `mask_shards`: parallel uint8 files
{split}_mask_NNNNN.bin, one byte per token: shards.PROMPT, COMPLETION, or END for the end-of-text
token that closes an example (counted in the loss). Examples follow each other; an END marks where
one ends. loader.py packs them into rows (or one a row) and checks the mask bytes when it opens a split.
"""
from __future__ import annotations

import os
import pathlib
from typing import Iterator

import numpy as np

from core.errors import DataError
from tokendata import corpus, shard_writer, shards
from tokendata.shards import COMPLETION, END, PROMPT

CHUNK_EXAMPLES = 4096  # examples per encode_batch call


# ---------------------------------------------------------------------------------------------
# Preparation

def _records(sources, in_field: str, out_field: str, tally: corpus.Tally) -> Iterator[tuple[str, str, str]]:
    """(name, prompt, completion) of every valid record; the tally counts and names the invalid ones."""
    for kind, location, name in sources:
        if kind != "jsonl":
            raise DataError(f"{location}: prompt/completion input must be JSON Lines (.jsonl, .ndjson)")
        for number, record, problem in corpus.json_lines(location):
            if problem is not None and problem.startswith(corpus.NOT_UTF8):
                tally.skip(f"{location}:{number}", problem, record=True)
                continue
            if not (isinstance(record, dict) and isinstance(record.get(in_field), str)
                    and isinstance(record.get(out_field), str)):
                has = f" (has: {', '.join(record) or 'no field'})" if isinstance(record, dict) else ""
                tally.skip(f"{location}:{number}", f"not a JSON object with string fields {in_field!r} and "
                                                   f"{out_field!r}{has}", record=True)
                continue
            tally.saw(f"{name}:{number}")
            yield f"{name}:{number}", record[in_field], record[out_field]
        tally.files += 1


def _examples(tok, prompts: list[str], completions: list[str], eot: int, max_tokens: int, counts: dict):
    """Encodes a chunk of pairs into (tokens, mask, example ends) arrays, truncating and skipping."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    tokens, mask, ends = [], [], []
    for p, c in zip(encode(prompts, add_special_tokens=False), encode(completions, add_special_tokens=False)):
        p, c = p.ids, c.ids
        if len(c) + 1 > max_tokens:
            counts["skipped"] += 1
            continue
        room = max_tokens - len(c) - 1  # prompt tokens that fit
        if len(p) > room:
            p = p[len(p) - room:] if room else []
            counts["truncated"] += 1
        tokens += p + c + [eot]
        mask += [PROMPT] * len(p) + [COMPLETION] * len(c) + [END]
        ends.append(len(tokens))
    return np.array(tokens, np.int64), np.array(mask, np.int64), np.array(ends, np.int64)


def _write(sources, tmp: pathlib.Path, is_val, *, tokenizer, vocab_size: int, in_field: str, out_field: str,
           seq_len: int, shard_tokens: int, progress: bool):
    """The tokenizer and the shards into tmp, records split by is_val: ({vocab_size, eot_id, dtype}, {split:
    summary}, tally)."""
    from tqdm import tqdm
    if tokenizer is not None:
        tok = shard_writer.install_tokenizer(tokenizer, tmp)
    else:
        texts = (text for name, p, c in _records(sources, in_field, out_field, corpus.Tally()) if not is_val(name)
                 for text in (p, c))
        tok = shard_writer.train_tokenizer(texts, vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
    eot = shards.eot_id_of(tok)
    vocab = max(tok.get_vocab().values()) + 1
    dtype = shards.dtype_for(vocab)
    counts = {s: {"skipped": 0, "truncated": 0} for s in ("train", "val")}
    in_loss = {s: np.zeros(vocab, np.int64) for s in ("train", "val")}  # frequencies of the tokens the loss counts
    writers = {s: (shard_writer.ShardWriter(tmp, s, dtype, shard_tokens, vocab),
                   shard_writer.ShardWriter(tmp, f"{s}_mask", "uint8", shard_tokens, 3)) for s in ("train", "val")}
    chunks = {s: ([], []) for s in ("train", "val")}

    def flush(split):
        prompts, completions = chunks[split]
        if prompts:
            tokens, mask, ends = _examples(tok, prompts, completions, eot, seq_len + 1, counts[split])
            writers[split][0].write(tokens, ends)
            writers[split][1].write(mask, ends)
            in_loss[split] += np.bincount(tokens[mask != PROMPT], minlength=vocab)
            writers[split][0].bytes += sum(len(t.encode("utf-8")) for t in prompts + completions)
        chunks[split] = ([], [])

    tally = corpus.Tally()
    bar = tqdm(desc="tokenizing", unit="example", disable=None if progress else True, leave=False)
    with bar:
        for name, prompt, completion in _records(sources, in_field, out_field, tally):
            split = "val" if is_val(name) else "train"
            chunks[split][0].append(prompt)
            chunks[split][1].append(completion)
            bar.update(1)
            if len(chunks[split][0]) >= CHUNK_EXAMPLES:
                flush(split)
        for split in chunks:
            flush(split)
    splits = {}
    for split, (tokens, mask) in writers.items():
        summary = masked_summary(tokens, mask)
        # the unigram baseline of the loss, which counts these tokens only (the completions and their end-of-text)
        summary["loss_unigram_entropy"] = shard_writer.unigram_entropy(in_loss[split])
        summary.update(truncated=counts[split]["truncated"], skipped=counts[split]["skipped"])
        splits[split] = summary
    return {"vocab_size": vocab, "vocab_size_requested": None if tokenizer is not None else vocab_size,
            "eot_id": eot, "dtype": dtype}, splits, tally


def masked_summary(tokens: shard_writer.ShardWriter, mask: shard_writer.ShardWriter) -> dict:
    """A split's summary from its token and loss-mask writers, both closed here: the tokens' summary with its
    examples, the tokens in the loss (completions and their closing tokens) and the mask shards."""
    tokens.close()
    mask.close()
    summary = tokens.summary()
    summary["examples"] = summary["documents"]
    summary["completion_tokens"] = int(mask.counts[COMPLETION] + mask.counts[END])
    summary["mask_shards"] = mask.shards
    return summary


def write_holding_out(staged: shard_writer.Staged, write, is_val, val_fraction: float, valid) -> tuple:
    """`write(is_val)` into the staged directory: (vocab fields, splits, tally, the record held out extra). Where
    no valid record (`valid(split summary)` counts them) fell below the fraction, it writes again with the
    lowest-ranked one held out too (corpus.held_out_extra); None where none was."""
    vocab_fields, splits, bad = write(is_val)
    assigned = {s: valid(splits[s]) for s in splits}
    extra = None
    if assigned["train"] + assigned["val"]:  # (none at all: the caller's error)
        extra = corpus.held_out_extra(bad, assigned["train"], assigned["val"], val_fraction)
    if extra is not None:
        staged.reset()
        vocab_fields, splits, bad = write(lambda name: name == extra or is_val(name))
    return vocab_fields, splits, bad, extra


def _check_examples(inputs: list[str], splits: dict, bad: corpus.Tally, *, seq_len: int, val_fraction: float,
                    out_field: str) -> None:
    """A DataError, naming the option that changes it, where the prepared pairs could not train: no valid
    record (the first invalid one's fields named), a split without an example (for validation, where
    --val-fraction asks for one: training reads both), or no completion token at all (the loss would
    count only each example's end-of-text)."""
    where = ", ".join(inputs)
    valid = sum(s["examples"] + s["skipped"] for s in splits.values())
    if not valid:
        first = f": {bad.skipped[0]['input']} is {bad.skipped[0]['reason']}" if bad.skipped else ""
        raise DataError(f"no prompt/completion pair in {where} ({bad.skipped_records} invalid records{first}); "
                        f"where the records hold the pairs under other names, name those fields with --in-field "
                        f"(the prompt) and --out-field (the completion)")
    fit = sum(s["examples"] for s in splits.values())
    for split in ("train", "val") if val_fraction > 0 else ("train",):
        if splits[split]["examples"] == 0:
            held = "held out for validation" if split == "val" else "left for training"
            raise DataError(
                f"no {'validation' if split == 'val' else 'training'} example: the records {held} "
                f"({splits[split]['skipped']}, by --val-fraction {val_fraction:g}) all have completions longer "
                f"than --seq-len {seq_len} and were skipped ({fit} of {valid} valid records fit); raise --seq-len"
                + (", or --val-fraction to hold out more" if split == "val" else ""))
    if sum(s["completion_tokens"] - s["examples"] for s in splits.values()) == 0:  # END tokens aside
        raise DataError(f"every completion in {where} is empty (field {out_field!r}): the loss would count only "
                        f"the end-of-text token of each example, nothing to learn; name the completion field with "
                        f"--out-field")


def prepare(inputs: list[str], out, *, seq_len: int, tokenizer: str | None = None, vocab_size: int = 8192,
            in_field: str = "in_text", out_field: str = "out_text", val_fraction: float = 0.05,
            shard_tokens: int = 2**27, overwrite: bool = False, progress: bool = True) -> dict:
    """Prepares prompt/completion JSON Lines into DIR `out` (see the module docstring); returns its index.

    Without a tokenizer, a byte-level BPE of `vocab_size` is trained on the training pairs. Records are held
    out for validation as data.py holds out documents (corpus.in_val, and corpus.held_out_extra).
    """
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else [str(i) for i in inputs]
    if not inputs:
        raise DataError("no input given")
    if seq_len < 1 or shard_tokens < 1:
        raise DataError(f"seq_len and shard tokens must be positive, got {seq_len} and {shard_tokens}")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val fraction must be in [0, 1), got {val_fraction}")
    if tokenizer is None:
        shard_writer.check_trained_vocab(vocab_size)
    sources = corpus.expand(inputs)
    shard_writer.check_out(out, overwrite, [location for _, location, _ in sources])
    is_val = lambda name: corpus.in_val(name, val_fraction)  # noqa: E731
    options = dict(tokenizer=tokenizer, vocab_size=vocab_size, in_field=in_field, out_field=out_field,
                   seq_len=seq_len, shard_tokens=shard_tokens, progress=progress)
    with shard_writer.Staged(out, overwrite) as staged:
        vocab_fields, splits, bad, extra = write_holding_out(
            staged, lambda held: _write(sources, staged.path, held, **options), is_val, val_fraction,
            lambda split: split["examples"] + split["skipped"])
        total = sum(s["tokens"] for s in splits.values())
        _check_examples(inputs, splits, bad, seq_len=seq_len, val_fraction=val_fraction, out_field=out_field)
        index = {
            "format_version": shards.FORMAT_VERSION, "kind": shards.PROMPT_COMPLETION,
            "tokenizer": "tokenizer.json", "tokenizer_sha256": shards.file_sha256(staged.path / "tokenizer.json"),
            **vocab_fields, "seq_len": seq_len,
            "in_field": in_field, "out_field": out_field,
            "tokens": total, "documents": sum(s["documents"] for s in splits.values()),
            "examples": sum(s["examples"] for s in splits.values()),
            "truncated": sum(s["truncated"] for s in splits.values()),
            "skipped": sum(s["skipped"] for s in splits.values()), "skipped_records": bad.skipped_records,
            "skipped_inputs": bad.skipped,  # the first corpus.LISTED invalid records, with the reason
            "bytes_per_token": sum(s["bytes"] for s in splits.values()) / max(total, 1),
            "unigram_entropy": splits["train"]["unigram_entropy"],  # of every token, prompts included
            "loss_unigram_entropy": splits["train"]["loss_unigram_entropy"],  # of the completions alone
            "val_extra": extra,  # the record held out because none fell below the fraction, if one was
            "inputs": inputs, "splits": splits,
        }
        staged.commit(index)
    return index
