"""Prompt/completion data for fine-tuning: preparation and a packing (or padding) loader.

    python data.py --format prompt_completion --input pairs.jsonl --out data/pairs \\
                   --tokenizer runs/base --seq-len 256 [--in-field in_text --out-field out_text]

Input: JSON Lines, one {"in_text": PROMPT, "out_text": COMPLETION} object a line (field names
configurable; .gz/.zst allowed). An example is the token sequence

    encode(in_text) + encode(out_text) + [end-of-text]

(each text encoded on its own, so the boundary is exact; put any separator into the texts). The
loss counts the completion tokens and the end-of-text token, never the prompt. An example longer
than seq_len + 1 tokens (the most one training row holds) loses tokens from the left of its
prompt; one whose completion and end-of-text alone do not fit is skipped. Both are counted and
printed. Records that are not objects with two string fields are skipped and counted.

On-disk format: a data.py directory (format_version 1: tokenizer.json, {split}_NNNNN.bin token
shards, index.json written last, the directory swapped into place when complete) whose index has
`kind: "prompt_completion"`, `seq_len`, and per split `mask_shards`: parallel uint8 files
{split}_mask_NNNNN.bin, one byte per token: 0 prompt, 1 completion, 2 the end-of-text token that
closes an example (counted in the loss). Examples follow each other; a 2 marks where one ends.
Opening a split checks its mask bytes (a value other than 0, 1, 2 names the shard and position);
every batch's token ids are checked against the vocabulary, as data.Loader's are.

Batches (`Loader`, a pure function of the step like data.Loader): every epoch takes the examples
in the order of a keyed permutation (data.permute, seed and epoch), then either packs consecutive
whole examples into rows of seq_len + 1 tokens (`packing`, the default: few padding tokens) or
puts one example per row (`padding`). A row's unused tail is end-of-text padding with weight 0.
A batch is {"tokens": int32 (B, T+1), "weights": float32 (B, T), "segments": int32 (B, T)}:
inputs tokens[:, :-1], targets tokens[:, 1:]; weights[t] = 1 iff target t+1 is a completion or
closing token of the same example as input t; segments number the examples of a row 1, 2, ...
(0 = padding), and the model's attention never crosses segments.
"""
from __future__ import annotations

import collections
import io
import json
import os
import pathlib
import shutil
from typing import Iterator

import numpy as np

import corpus
import data
from corpus import DataError

KIND = "prompt_completion"
PROMPT, COMPLETION, END = 0, 1, 2  # mask byte values
BATCHING = ("packing", "padding")
CHUNK_EXAMPLES = 4096  # examples per encode_batch call


# ---------------------------------------------------------------------------------------------
# Preparation

def _tokenizer_path(tokenizer) -> pathlib.Path:
    """--tokenizer: a tokenizer.json, or a run or data directory holding one."""
    path = pathlib.Path(tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer {tokenizer} not found (give a tokenizer.json or a run/data directory with one)")
    return path


def _records(sources, in_field: str, out_field: str, tally: corpus.Tally) -> Iterator[tuple[str, str, str]]:
    """(name, prompt, completion) of every valid record; the tally counts and names the invalid ones."""
    for kind, location, name in sources:
        if kind != "jsonl":
            raise DataError(f"{location}: prompt/completion input must be JSON Lines (.jsonl, .ndjson)")
        with io.TextIOWrapper(corpus.open_binary(location), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if not (isinstance(record, dict) and isinstance(record.get(in_field), str)
                        and isinstance(record.get(out_field), str)):
                    tally.skip(f"{location}:{number}", f"not a JSON object with string fields {in_field!r} and "
                                                       f"{out_field!r}", record=True)
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
        tok = data.load_tokenizer_file(_tokenizer_path(tokenizer))
        if data.eot_id_of(tok) is None:
            tok.add_special_tokens([data.EOT_TOKEN])
    else:
        if vocab_size < 258:
            raise DataError(f"vocab size must be at least 258 for a byte-level BPE, got {vocab_size}")
        texts = (text for name, p, c in _records(sources, in_field, out_field, corpus.Tally()) if not is_val(name)
                 for text in (p, c))
        tok = data.train_tokenizer(texts, vocab_size)
    tok.save(str(tmp / "tokenizer.json"))
    eot = data.eot_id_of(tok)
    vocab = max(tok.get_vocab().values()) + 1
    dtype = data.dtype_for(vocab)
    counts = {s: {"skipped": 0, "truncated": 0} for s in ("train", "val")}
    writers = {s: (data.ShardWriter(tmp, s, dtype, shard_tokens, vocab),
                   data.ShardWriter(tmp, f"{s}_mask", "uint8", shard_tokens, 3)) for s in ("train", "val")}
    chunks = {s: ([], []) for s in ("train", "val")}

    def flush(split):
        prompts, completions = chunks[split]
        if prompts:
            tokens, mask, ends = _examples(tok, prompts, completions, eot, seq_len + 1, counts[split])
            writers[split][0].write(tokens, ends)
            writers[split][1].write(mask, ends)
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
        tokens.close()
        mask.close()
        summary = tokens.summary()
        summary["examples"] = summary["documents"]
        summary["completion_tokens"] = int(mask.counts[COMPLETION] + mask.counts[END])
        summary["mask_shards"] = mask.shards
        summary.update(truncated=counts[split]["truncated"], skipped=counts[split]["skipped"])
        splits[split] = summary
    return {"vocab_size": vocab, "eot_id": eot, "dtype": dtype}, splits, tally


def prepare(inputs: list[str], out, *, seq_len: int, tokenizer: str | None = None, vocab_size: int = 8192,
            in_field: str = "in_text", out_field: str = "out_text", val_fraction: float = 0.05,
            shard_tokens: int = 2**27, overwrite: bool = False, progress: bool = True) -> dict:
    """Prepares prompt/completion JSON Lines into DIR `out` (see the module docstring); returns its index.

    Without a tokenizer, a byte-level BPE of `vocab_size` is trained on the training pairs. Records are held
    out for validation as data.py holds out documents (corpus.in_val, and corpus.held_out_extra).
    """
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else [str(i) for i in inputs]
    out = pathlib.Path(out)
    if not inputs:
        raise DataError("no input given")
    if seq_len < 1 or shard_tokens < 1:
        raise DataError(f"seq_len and shard tokens must be positive, got {seq_len} and {shard_tokens}")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val fraction must be in [0, 1), got {val_fraction}")
    if out.exists() and not overwrite:
        raise DataError(f"{out} exists; pass --overwrite to replace it")
    sources = corpus.expand(inputs)
    for _, location, _ in sources:  # --overwrite must never delete an input
        if out.resolve() in pathlib.Path(location).resolve().parents:
            raise DataError(f"input {location} lies inside the output directory {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    data.clean_leftovers(out)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    is_val = lambda name: corpus.in_val(name, val_fraction)  # noqa: E731
    options = dict(tokenizer=tokenizer, vocab_size=vocab_size, in_field=in_field, out_field=out_field,
                   seq_len=seq_len, shard_tokens=shard_tokens, progress=progress)
    try:
        vocab_fields, splits, bad = _write(sources, tmp, is_val, **options)
        assigned = {s: splits[s]["examples"] + splits[s]["skipped"] for s in splits}  # valid records
        extra = None
        if assigned["train"] + assigned["val"]:  # (none at all: the error below)
            extra = corpus.held_out_extra(bad, assigned["train"], assigned["val"], val_fraction)
        if extra is not None:  # no record fell below the fraction: again, with the lowest-ranked one held out
            shutil.rmtree(tmp)
            tmp.mkdir()
            vocab_fields, splits, bad = _write(sources, tmp, lambda name: name == extra or is_val(name), **options)
        total = sum(s["tokens"] for s in splits.values())
        if splits["train"]["examples"] == 0:
            raise DataError(f"no training example in {', '.join(inputs)} ({bad.skipped_records} invalid records, "
                            f"{splits['train']['skipped']} too long for seq_len {seq_len})")
        index = {
            "format_version": data.FORMAT_VERSION, "kind": KIND,
            "tokenizer": "tokenizer.json", "tokenizer_sha256": data.file_sha256(tmp / "tokenizer.json"),
            **vocab_fields, "seq_len": seq_len,
            "in_field": in_field, "out_field": out_field,
            "tokens": total, "documents": sum(s["documents"] for s in splits.values()),
            "examples": sum(s["examples"] for s in splits.values()),
            "truncated": sum(s["truncated"] for s in splits.values()),
            "skipped": sum(s["skipped"] for s in splits.values()), "skipped_records": bad.skipped_records,
            "skipped_inputs": bad.skipped,  # the first corpus.LISTED invalid records, with the reason
            "bytes_per_token": sum(s["bytes"] for s in splits.values()) / max(total, 1),
            "unigram_entropy": splits["train"]["unigram_entropy"],
            "val_extra": extra,  # the record held out because none fell below the fraction, if one was
            "inputs": inputs, "splits": splits,
        }
        (tmp / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        data.swap_into_place(tmp, out)
        return index
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------
# Reading

def is_prompt_completion(index: dict) -> bool:
    return index.get("kind") == KIND


class Examples:
    """One split's examples: the token stream, its mask stream, and where each example starts."""

    def __init__(self, data_dir, split: str):
        self.stream = data.Stream(data_dir, split)  # validates the index and the token shards
        self.index = index = self.stream.index
        if not is_prompt_completion(index):
            raise DataError(f"{data_dir} is not prompt/completion data (prepare it with --format prompt_completion)")
        directory, masks = self.stream.directory, []  # a URL: its verified local copy, sizes checked
        for shard in index["splits"][split]["mask_shards"]:
            file, n = directory / shard["file"], int(shard["tokens"])
            if n:
                masks.append(np.asarray(np.memmap(file, np.uint8, "r", shape=(n,))))
                if int(masks[-1].max()) > END:  # a corrupt byte: weights and example bounds would be wrong
                    at = int(np.flatnonzero(masks[-1] > END)[0])
                    raise DataError(f"{file}: byte {at} is {int(masks[-1][at])}, not a loss-mask value "
                                    f"({PROMPT}, {COMPLETION} or {END}): the shard is corrupt")
        self.mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
        if len(self.mask) != self.stream.tokens:
            raise DataError(f"{data_dir}: split {split!r} has {len(self.mask)} mask bytes for "
                            f"{self.stream.tokens} tokens; re-run data.py")
        ends = np.flatnonzero(self.mask == END) + 1  # (n,) one past each example's last token
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self.lengths = (ends - self.starts).astype(np.int64)
        self.eot = int(index["eot_id"])

    def __len__(self) -> int:
        return len(self.starts)

    def fill(self, examples, tokens: np.ndarray, weights: np.ndarray, segments: np.ndarray) -> None:
        """Writes examples (ids) one after another into one row: tokens (T+1,), weights (T,), segments (T,)."""
        T = len(weights)
        mask = np.zeros(T + 1, np.uint8)
        seg = np.zeros(T + 1, np.int32)
        tokens[:] = self.eot
        pos = 0
        for k, e in enumerate(examples, 1):
            start, n = int(self.starts[e]), int(self.lengths[e])
            self.stream.read(start, tokens[pos:pos + n])
            mask[pos:pos + n] = self.mask[start:start + n]
            seg[pos:pos + n] = k
            pos += n
        segments[:] = seg[:-1]
        weights[:] = (mask[1:] > 0) & (seg[1:] == seg[:-1]) & (seg[1:] > 0)

    def batch(self, rows: list, seq_len: int) -> dict:
        """A batch of len(rows) rows, row i holding the examples rows[i] (ids), its token ids checked against
        the vocabulary (one max; a corrupt shard is a DataError naming it)."""
        batch = empty_batch(len(rows), seq_len)
        for i, examples in enumerate(rows):
            self.fill(examples, batch["tokens"][i], batch["weights"][i], batch["segments"][i])
        self.stream.check(batch["tokens"], lambda: ((int(self.starts[e]), int(self.lengths[e]))
                                                    for examples in rows for e in examples))
        return batch


def _plan(lengths: np.ndarray, order: np.ndarray, row_tokens: int, packing: bool) -> np.ndarray:
    """Row boundaries (R + 1,) into `order`: row r holds examples order[b[r]:b[r + 1]]."""
    if not packing:
        return np.arange(len(order) + 1, dtype=np.int64)
    bounds, used = [0], 0
    for i, n in enumerate(lengths[order].tolist()):
        if used + n > row_tokens:
            bounds.append(i)
            used = 0
        used += n
    bounds.append(len(order))
    return np.asarray(bounds, np.int64)


class Loader(data.Loader):
    """Batches of prompt/completion rows; the batch at a step is a pure function of (seed, step, shape, process).

    Epoch e's rows are the examples in the order permute(., seed, e), packed (or one a row); global
    row g = step * batch_size + row is row g - (rows of epochs before) of the epoch it falls in.
    `iterate` (with prefetching) comes from data.Loader.
    """

    def __init__(self, data_dir, split: str, seq_len: int, batch_size: int, *, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, batching: str = "packing"):
        if seq_len < 1 or batch_size < 1:
            raise DataError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if batching not in BATCHING:
            raise DataError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise DataError(f"process index {process_index} is outside process count {process_count}")
        if batch_size % process_count:
            raise DataError(f"global batch size {batch_size} does not divide by {process_count} processes")
        self.examples = _checked(data_dir, split, seq_len)
        self.index = self.examples.index
        self.seq_len, self.batch_size, self.seed, self.packing = seq_len, batch_size, seed, batching == "packing"
        self.local_batch_size = batch_size // process_count
        self.rows = np.arange(process_index * self.local_batch_size,
                              (process_index + 1) * self.local_batch_size, dtype=np.int64)
        self._epoch_rows: list[int] = []  # rows of each epoch planned so far
        self._plans: collections.OrderedDict[int, tuple] = collections.OrderedDict()  # epoch -> (order, bounds)

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        if e not in self._plans:
            n = len(self.examples)
            order = data.permute(np.arange(n), n, self.seed, e)
            self._plans[e] = (order, _plan(self.examples.lengths, order, self.seq_len + 1, self.packing))
            while len(self._plans) > 3:  # keep the most recently used few
                self._plans.popitem(last=False)
        self._plans.move_to_end(e)
        return self._plans[e]

    def _locate(self, g: int) -> tuple[int, int]:
        """(epoch, row within it) of global row g."""
        e, before = 0, 0
        while True:
            if e == len(self._epoch_rows):
                self._epoch_rows.append(len(self._epoch(e)[1]) - 1)
            if g < before + self._epoch_rows[e]:
                return e, g - before
            before += self._epoch_rows[e]
            e += 1

    def get_batch(self, step: int) -> dict:
        """This process's rows of the global batch at `step`: {tokens (b, T+1), weights (b, T), segments (b, T)}."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rows = []  # each row's examples
        for g in (step * self.batch_size + self.rows).tolist():
            e, r = self._locate(g)
            order, bounds = self._epoch(e)
            rows.append(order[bounds[r]:bounds[r + 1]])
        return self.examples.batch(rows, self.seq_len)


def _checked(data_dir, split: str, seq_len: int) -> Examples:
    examples = Examples(data_dir, split)
    if len(examples) == 0:
        hint = "; prepare with a larger --val-fraction" if split == "val" else ""
        raise DataError(f"{data_dir}: split {split!r} has no examples{hint}")
    longest = int(examples.lengths.max())
    if longest > seq_len + 1:
        raise DataError(f"{data_dir}: an example of {longest} tokens does not fit training.seq_len {seq_len} "
                        f"(prepared for seq_len {examples.index.get('seq_len')}); re-prepare with --seq-len {seq_len}")
    return examples


def empty_batch(rows: int, seq_len: int) -> dict:
    """All-zero batch arrays: tokens (rows, T+1), weights (rows, T), segments (rows, T)."""
    return {"tokens": np.zeros((rows, seq_len + 1), np.int32), "weights": np.zeros((rows, seq_len), np.float32),
            "segments": np.zeros((rows, seq_len), np.int32)}


def eval_batches(data_dir, split: str, seq_len: int, batch_size: int, *, batching: str = "packing",
                 max_rows: int | None = None) -> Iterator[dict]:
    """The split's examples once, in order, in rows as the Loader builds them, batch_size rows a batch."""
    examples = _checked(data_dir, split, seq_len)
    bounds = _plan(examples.lengths, np.arange(len(examples)), seq_len + 1, batching == "packing")
    n = len(bounds) - 1 if max_rows is None else min(len(bounds) - 1, max_rows)
    for first in range(0, n, batch_size):
        yield examples.batch([range(bounds[r], bounds[r + 1]) for r in range(first, min(first + batch_size, n))],
                             seq_len)
