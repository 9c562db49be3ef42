"""Preference pairs for DPO: preparation (loader.PreferenceLoader reads them).

    python data.py --format preference --input pairs.jsonl --out data/prefs --tokenizer runs/base --seq-len 256 \\
                   [--prompt-field prompt --chosen-field chosen --rejected-field rejected]

Input: JSON Lines, one {"prompt": ..., "chosen": ..., "rejected": ...} object a line (TRL's standard
preference format; field names configurable; .gz/.zst allowed). The three are strings, or lists of
messages ({"role", "content"}: a conversation for the prompt, the assistant's replies for the two
responses), which are rendered with the tokenizer's run's chat template (its chat_template.jinja) or,
without one, the plain template serve.py uses (inference/chat.py), so a model tuned on conversations is
served as it was trained.

A pair is two token sequences that share the prompt,

    encode(prompt) + encode(chosen) + [end-of-text]      encode(prompt) + encode(rejected) + [end-of-text]

(each text encoded on its own, so the boundary is exact). Where one does not fit in seq_len + 1 tokens,
the prompt loses tokens from the left (down to half the room, never more than the longer response needs)
and then a response too long for what is left loses tokens from the right (its last kept token closes it;
no end-of-text). Pairs with an empty response, or with the same response twice (also after truncation:
nothing to prefer), are skipped; records that are not objects with the three fields are skipped; each
count is printed. The tokenizer must be given: the pairs tune an existing model.

On-disk format (shards.py): prompt/completion's (token shards and loss-mask shards, PROMPT on the prompt,
COMPLETION on the response, END on its last token), with `kind: "preference"` and per split `pairs`; each
pair is two examples one after the other, chosen first.
"""
from __future__ import annotations

import os
import pathlib
from typing import Iterator

import numpy as np

from core.errors import DataError
from core import chat
from tokendata import corpus, finetune_data, shard_writer, shards
from tokendata.shards import COMPLETION, END, PROMPT

CHUNK_PAIRS = 2048  # pairs per encode_batch call
FIELDS = ("prompt", "chosen", "rejected")


def _message_list(value) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value))


class Renderer:
    """A record's three fields as (prompt text, chosen text, rejected text): strings as they are, conversations
    through the chat template (the run's, or the plain one). None (with the reason) where a record is neither."""

    def __init__(self, template_source: str | None, eos_text: str):
        self.source, self.eos_text = template_source, eos_text
        self.template = None
        if template_source is not None:
            def refuse(message):
                raise ValueError(f"the chat template refused the messages: {message}")
            self.template = chat.compile_template(template_source, refuse)

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        if self.template is None:
            text = chat.plain_template(messages)
            return text if generation_prompt else text[: -len("\nAssistant:")]
        return self.template.render(messages=messages, add_generation_prompt=generation_prompt,
                                    eos_token=self.eos_text, bos_token="")

    def __call__(self, prompt, chosen, rejected) -> tuple[tuple[str, str, str] | None, str | None]:
        if all(isinstance(x, str) for x in (prompt, chosen, rejected)):
            return (prompt, chosen, rejected), None
        if not all(_message_list(x) for x in (prompt, chosen, rejected)):
            return None, "fields neither all strings nor all lists of {role, content} messages"
        try:
            head = self.render(prompt, True)
            responses = []
            for reply in (chosen, rejected):
                whole = self.render(prompt + reply, False)
                if not whole.startswith(head):
                    return None, "the chat template renders the prompt differently before a reply"
                responses.append(whole[len(head):].removesuffix(self.eos_text) if self.eos_text else whole[len(head):])
        except Exception as e:  # the template's own error
            return None, f"the chat template failed: {type(e).__name__}: {e}"
        return (head, *responses), None


def _records(sources, fields: tuple[str, str, str], renderer: Renderer,
             tally: corpus.Tally) -> Iterator[tuple[str, str, str, str]]:
    """(name, prompt, chosen, rejected) texts of every valid record; the tally counts and names the others."""
    for kind, location, name in sources:
        if kind != "jsonl":
            raise DataError(f"{location}: preference input must be JSON Lines (.jsonl, .ndjson)")
        for number, record, problem in corpus.json_lines(location):
            if problem is not None and problem.startswith(corpus.NOT_UTF8):
                tally.skip(f"{location}:{number}", problem, record=True)
                continue
            if not (isinstance(record, dict) and all(f in record for f in fields)):
                has = f" (has: {', '.join(record) or 'no field'})" if isinstance(record, dict) else ""
                tally.skip(f"{location}:{number}", f"not a JSON object with fields {', '.join(map(repr, fields))}"
                                                   f"{has}", record=True)
                continue
            texts, why = renderer(*(record[f] for f in fields))
            if texts is None:
                tally.skip(f"{location}:{number}", why, record=True)
                continue
            tally.saw(f"{name}:{number}")
            yield (f"{name}:{number}", *texts)
        tally.files += 1


def fit_pair(p: list[int], c: list[int], r: list[int], eot: int, room: int, counts: dict):
    """The pair's two sequences (tokens, mask) fitted into `room` tokens each, or None where it is skipped.

    The responses take an end-of-text token each; where the longer sequence does not fit, the prompt keeps
    its last max(room - longer response, room // 2) tokens (at most its own), then each response what room is
    left, from its start."""
    if not c or not r:
        counts["empty"] += 1
        return None
    c, r = c + [eot], r + [eot]
    longest = max(len(c), len(r))
    if len(p) + longest > room:
        keep = min(len(p), max(room - longest, room // 2))
        if keep < len(p):
            p = p[len(p) - keep:] if keep else []
            counts["truncated_prompts"] += 1
        left = room - len(p)
        if longest > left:
            counts["truncated_responses"] += 1
            c, r = c[:left], r[:left]
    if c == r:
        counts["identical"] += 1
        return None
    out = []
    for response in (c, r):
        mask = [PROMPT] * len(p) + [COMPLETION] * (len(response) - 1) + [END]
        out.append((p + response, mask))
    return out


def _write(sources, tmp: pathlib.Path, is_val, *, tokenizer, fields, renderer_of, seq_len: int, shard_tokens: int,
           progress: bool):
    """The tokenizer and the shards into tmp, records split by is_val: ({vocab_size, eot_id, dtype}, {split:
    summary}, tally)."""
    from tqdm import tqdm
    tok = shard_writer.install_tokenizer(tokenizer, tmp)  # with an end-of-text token added where it has none
    eot = shards.eot_id_of(tok)
    renderer = renderer_of(tok.id_to_token(eot))
    vocab = max(tok.get_vocab().values()) + 1
    dtype = shards.dtype_for(vocab)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    counts = {s: {"empty": 0, "identical": 0, "truncated_prompts": 0, "truncated_responses": 0, "pairs": 0}
              for s in ("train", "val")}
    writers = {s: (shard_writer.ShardWriter(tmp, s, dtype, shard_tokens, vocab),
                   shard_writer.ShardWriter(tmp, f"{s}_mask", "uint8", shard_tokens, 3)) for s in ("train", "val")}
    chunks = {s: [] for s in ("train", "val")}

    def flush(split):
        texts = chunks[split]
        if not texts:
            return
        columns = [[ids.ids for ids in encode([t[k] for t in texts], add_special_tokens=False)] for k in range(3)]
        tokens, mask, ends = [], [], []
        for p, c, r in zip(*columns):
            pair = fit_pair(p, c, r, eot, seq_len + 1, counts[split])
            if pair is None:
                continue
            counts[split]["pairs"] += 1
            for seq, m in pair:
                tokens += seq
                mask += m
                ends.append(len(tokens))
        if ends:
            tokens, mask, ends = (np.asarray(x, np.int64) for x in (tokens, mask, ends))
            writers[split][0].write(tokens, ends)
            writers[split][1].write(mask, ends)
        writers[split][0].bytes += sum(len(x.encode("utf-8")) for t in texts for x in t)
        chunks[split] = []

    tally = corpus.Tally()
    bar = tqdm(desc="tokenizing", unit="pair", disable=None if progress else True, leave=False)
    with bar:
        for name, *texts in _records(sources, fields, renderer, tally):
            split = "val" if is_val(name) else "train"
            chunks[split].append(texts)
            bar.update(1)
            if len(chunks[split]) >= CHUNK_PAIRS:
                flush(split)
        for split in chunks:
            flush(split)
    splits = {}
    for split, (tokens, mask) in writers.items():
        summary = finetune_data.masked_summary(tokens, mask)
        summary.update(counts[split])
        summary["skipped"] = counts[split]["empty"] + counts[split]["identical"]
        splits[split] = summary
    return {"vocab_size": vocab, "vocab_size_requested": None, "eot_id": eot, "dtype": dtype}, splits, tally


def _check_pairs(inputs: list[str], splits: dict, bad: corpus.Tally, *, val_fraction: float, fields) -> None:
    """A DataError where the prepared pairs could not train: no valid record (the first invalid one named), every
    pair skipped (empty or identical responses), a split without a pair."""
    where = ", ".join(inputs)
    valid = sum(s["pairs"] + s["skipped"] for s in splits.values())
    if not valid:
        first = f": {bad.skipped[0]['input']} is {bad.skipped[0]['reason']}" if bad.skipped else ""
        raise DataError(f"no preference pair in {where} ({bad.skipped_records} invalid records{first}); where the "
                        f"records hold the pairs under other names, name those fields with --prompt-field, "
                        f"--chosen-field and --rejected-field")
    empty, same = (sum(s[k] for s in splits.values()) for k in ("empty", "identical"))
    for split in ("train", "val") if val_fraction > 0 else ("train",):
        if splits[split]["pairs"] == 0:
            what = "validation" if split == "val" else "training"
            raise DataError(f"no {what} pair: of {valid} valid records, {empty} have an empty response (field "
                            f"{fields[1]!r} or {fields[2]!r}) and {same} the same response twice, which are skipped"
                            + (f", and the rest were too few to hold one out by --val-fraction {val_fraction:g}"
                               if split == "val" else ""))


def prepare(inputs: list[str], out, *, seq_len: int, tokenizer: str | None, prompt_field: str = "prompt",
            chosen_field: str = "chosen", rejected_field: str = "rejected", val_fraction: float = 0.05,
            shard_tokens: int = 2**27, overwrite: bool = False, progress: bool = True) -> dict:
    """Prepares preference JSON Lines into DIR `out` (see the module docstring); returns its index."""
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else [str(i) for i in inputs]
    if not inputs:
        raise DataError("no input given")
    if tokenizer is None:
        raise DataError("--format preference needs --tokenizer: the run (or tokenizer.json) of the model the pairs "
                        "tune, whose tokenizer they must be encoded with")
    if seq_len < 1 or shard_tokens < 1:
        raise DataError(f"seq_len and shard tokens must be positive, got {seq_len} and {shard_tokens}")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val fraction must be in [0, 1), got {val_fraction}")
    fields = (prompt_field, chosen_field, rejected_field)
    if len(set(fields)) < 3:
        raise DataError(f"--prompt-field, --chosen-field and --rejected-field must be three different fields, got "
                        f"{', '.join(fields)}")
    template = chat.template_of(tokenizer) if os.path.isdir(str(tokenizer)) else None
    renderer_of = lambda eos_text: Renderer(template, eos_text)  # noqa: E731
    sources = corpus.expand(inputs)
    shard_writer.check_out(out, overwrite, [location for _, location, _ in sources])
    is_val = lambda name: corpus.in_val(name, val_fraction)  # noqa: E731
    options = dict(tokenizer=tokenizer, fields=fields, renderer_of=renderer_of, seq_len=seq_len,
                   shard_tokens=shard_tokens, progress=progress)
    with shard_writer.Staged(out, overwrite) as staged:
        vocab_fields, splits, bad, extra = finetune_data.write_holding_out(
            staged, lambda held: _write(sources, staged.path, held, **options), is_val, val_fraction,
            lambda split: split["pairs"] + split["skipped"])
        _check_pairs(inputs, splits, bad, val_fraction=val_fraction, fields=fields)
        total = sum(s["tokens"] for s in splits.values())
        index = {
            "format_version": shards.FORMAT_VERSION, "kind": shards.PREFERENCE,
            "tokenizer": "tokenizer.json", "tokenizer_sha256": shards.file_sha256(staged.path / "tokenizer.json"),
            **vocab_fields, "seq_len": seq_len,
            "prompt_field": prompt_field, "chosen_field": chosen_field, "rejected_field": rejected_field,
            "chat_template": template is not None,
            "tokens": total, "documents": sum(s["documents"] for s in splits.values()),
            "examples": sum(s["examples"] for s in splits.values()),
            "pairs": sum(s["pairs"] for s in splits.values()),
            **{k: sum(s[k] for s in splits.values())
               for k in ("empty", "identical", "truncated_prompts", "truncated_responses", "skipped")},
            "skipped_records": bad.skipped_records,
            "skipped_inputs": bad.skipped,  # the first corpus.LISTED invalid records, with the reason
            "bytes_per_token": sum(s["bytes"] for s in splits.values()) / max(total, 1),
            "unigram_entropy": splits["train"]["unigram_entropy"],
            "val_extra": extra,
            "inputs": inputs, "splits": splits,
        }
        staged.commit(index)
    return index
