"""Corpus preparation as an Apache Beam pipeline, for corpora beyond one machine.

    python data.py --runner beam --input 'pile/*.jsonl.zst' --out /mnt/shared/pile --tokenizer tok.json \
        --beam-option runner=DataflowRunner --beam-option project=P --beam-option region=R ...

data.py does everything before and after the pipeline in the launching process, exactly as for its
default runner: the checks, the staging directory DIR.tmp-<pid>, the tokenizer (the given one, or a
byte-level BPE trained on the train documents by the same function, which reads every train document
on the launching machine: for a corpus that needs a cluster, pass --tokenizer), the index, and the
swap into place (shard_writer.Staged). The pipeline in between does the heavy part:

    sources (input order) ─Reshuffle─▶ tokenize one source ─▶ DIR.tmp-<pid>/pieces/<source>.<split>.{bin,ends}
        │ all pieces' token counts (one small list)
        ▼ plan: shard j of a split = stream[j*S : (j+1)*S], S = --shard-tokens, as (piece, start, stop) ranges
    ─Reshuffle─▶ write shard j with shard_writer.ShardWriter ─▶ DIR.tmp-<pid>/<split>_<j>.bin
        │ shard entries, token frequencies summed per split
        ▼ DIR.tmp-<pid>/beam_manifest.json, written once every shard is complete

What is guaranteed: the same tokenizer, documents (corpus.Reader on each source), split decision
(the same is_val), encoding (shard_writer.encode_texts) and shard writer as the default runner, and a split's
stream ordered by input order (sources as corpus.expand lists them, records in file order). So each
split's token stream, its shard files (same boundaries, every --shard-tokens tokens) and every index
field are the same as the default runner's, byte for byte; only the Beam runner's work is spread over
workers, one input file per task (a single huge file is one task).

Workers read the inputs and write into DIR.tmp-<pid>, so --out and the inputs must be on a file
system that the launcher and every worker see at the same paths (NFS, Filestore, a FUSE mount), and
the workers must be able to import this file and the folders it imports (tokendata/, core/; e.g. a worker
image holding the checkout). Files are written under temporary names and renamed when complete, so a retried task
never leaves half a file; the launcher writes the index only after checking every shard's size.
An input error (a corrupt file with --strict, a missing text field) is carried to the launcher as
data and reported as the one error line; the directory is then removed.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import shutil
import uuid

import numpy as np

from core.errors import DataError
from tokendata import corpus, shard_writer

_root = logging.getLogger()
_level = _root.level
_root.setLevel(logging.ERROR)  # apache_beam's import warns about optional GCP client libraries
try:
    import apache_beam as beam
finally:
    _root.setLevel(_level)

PIECES = "pieces"  # one source's tokens of one split, before they are cut into shards
MANIFEST = "beam_manifest.json"


def _piece(tmp: pathlib.Path, number: int, split: str, suffix: str) -> pathlib.Path:
    return tmp / PIECES / f"{number:08d}.{split}.{suffix}"


def _replace_into(part: pathlib.Path, final: pathlib.Path) -> None:
    os.replace(part, final)  # atomic on one file system: a reader sees the old file or the whole new one


# ---------------------------------------------------------------------------------------------
# Step 1: one source to token pieces, one per split

def _tokenize_source(item: tuple[int, tuple], tmp: pathlib.Path, tok, eot: int, vocab_size: int, dtype: str,
                     is_val, text_field: str, strict: bool) -> dict:
    """Encodes source `number`'s documents in order, as the default runner does, into piece files:
    .bin the tokens (the shards' dtype), .ends the int64 end offset of each document in the piece."""
    number, source = item
    reader = corpus.Reader([source], text_field, strict)
    tag = uuid.uuid4().hex  # this attempt's temporary names: a retry or a duplicate attempt has its own
    files, counts = {}, {s: {"tokens": 0, "documents": 0, "bytes": 0} for s in ("train", "val")}
    little = np.dtype(dtype).newbyteorder("<")

    def flush(split: str, texts: list[str]) -> None:
        ids, ends, nbytes = shard_writer.encode_texts(tok, texts, eot, vocab_size, dtype)
        if split not in files:
            files[split] = [open(_piece(tmp, number, split, f"{s}.{tag}"), "wb") for s in ("bin", "ends")]
        files[split][0].write(ids.astype(little).tobytes())
        files[split][1].write((ends + counts[split]["tokens"]).astype("<i8").tobytes())
        counts[split]["tokens"] += len(ids)
        counts[split]["documents"] += len(ends)
        counts[split]["bytes"] += nbytes

    error = None
    try:
        for split, texts in shard_writer.chunks(reader, is_val):
            flush(split, texts)
    except DataError as e:  # the user's to fix: carried to the launcher, which reports it
        error = str(e)
    finally:
        for pair in files.values():
            for f in pair:
                f.close()
    for split in files:
        for suffix in ("bin", "ends"):
            if error is None:
                _replace_into(_piece(tmp, number, split, f"{suffix}.{tag}"), _piece(tmp, number, split, suffix))
            else:
                _piece(tmp, number, split, f"{suffix}.{tag}").unlink(missing_ok=True)
    return {"source": number, "error": error, "pieces": counts, "tally": dataclasses.asdict(reader.tally)}


class _TokenizeSource(beam.DoFn):
    def __init__(self, tokenizer_json: str, **kwargs):
        self.tokenizer_json, self.kwargs = tokenizer_json, kwargs

    def setup(self):
        from tokenizers import Tokenizer
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers parallelise across sources
        self.tok = Tokenizer.from_str(self.tokenizer_json)

    def process(self, item):
        yield _tokenize_source(item, tok=self.tok, **self.kwargs)


# ---------------------------------------------------------------------------------------------
# Step 2: the shard plan, from every piece's token count

def plan_shards(results: list[dict], shard_tokens: int):
    """(split, j, [(source, start, stop), ...]): shard j of a split is stream[j*S : (j+1)*S], the split's
    pieces concatenated in source order; nothing if any source failed."""
    results = sorted(results, key=lambda r: r["source"])
    if any(r["error"] for r in results):
        return
    for split in ("train", "val"):
        pieces = [(r["source"], r["pieces"][split]["tokens"]) for r in results if r["pieces"][split]["tokens"]]
        j, ranges, room = 0, [], shard_tokens
        for source, tokens in pieces:
            start = 0
            while start < tokens:
                take = min(room, tokens - start)
                ranges.append((source, start, start + take))
                start, room = start + take, room - take
                if room == 0:
                    yield split, j, ranges
                    j, ranges, room = j + 1, [], shard_tokens
        if ranges:
            yield split, j, ranges


# ---------------------------------------------------------------------------------------------
# Step 3: one shard, written by the default runner's shard writer

def write_shard(task, tmp: pathlib.Path, dtype: str, shard_tokens: int, vocab_size: int):
    """Copies a shard's piece ranges through shard_writer.ShardWriter; returns (split, j, shard entry, frequencies)."""
    split, j, ranges = task
    little = np.dtype(dtype).newbyteorder("<")
    part = tmp / f"{split}_{j:05d}.{uuid.uuid4().hex}"  # written apart, then renamed into place
    part.mkdir()
    writer = shard_writer.ShardWriter(part, split, dtype, shard_tokens, vocab_size, first_shard=j)
    for source, start, stop in ranges:
        tokens = np.fromfile(_piece(tmp, source, split, "bin"), little, count=stop - start,
                             offset=start * little.itemsize)
        ends = np.fromfile(_piece(tmp, source, split, "ends"), "<i8")
        ends = ends[(ends > start) & (ends <= stop)] - start  # documents ending in this range
        writer.write(tokens, ends)
    writer.close()
    (shard,) = writer.shards
    _replace_into(part / shard["file"], tmp / shard["file"])
    part.rmdir()
    return split, j, shard, writer.counts


class _WriteShard(beam.DoFn):
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def process(self, task):
        yield write_shard(task, **self.kwargs)


def _sum_counts(arrays) -> np.ndarray:
    return functools.reduce(np.add, arrays)


# ---------------------------------------------------------------------------------------------
# Step 4: the manifest, once every shard is written

def _write_manifest(results: list[dict], entries: list, counts: dict, tmp: pathlib.Path) -> None:
    manifest = {"sources": sorted(results, key=lambda r: r["source"]),
                "shards": {s: [entry for _, _, entry in sorted(x for x in entries if x[0] == s)]
                           for s in ("train", "val")},
                "counts": {s: np.asarray(c).tolist() for s, c in counts.items()}}
    part = tmp / f"{MANIFEST}.{uuid.uuid4().hex}"
    part.write_text(json.dumps(manifest))
    _replace_into(part, tmp / MANIFEST)


def build(pipeline, sources, tmp: pathlib.Path, tok, *, eot, vocab_size, dtype, is_val, shard_tokens,
          text_field, strict) -> None:
    """The pipeline's steps on `pipeline`; its only result is tmp/beam_manifest.json and the files it names."""
    results = (pipeline
               | "Sources" >> beam.Create(list(enumerate(sources)))
               | "SpreadSources" >> beam.Reshuffle()
               | "Tokenize" >> beam.ParDo(_TokenizeSource(tok.to_str(), tmp=tmp, eot=eot, vocab_size=vocab_size,
                                                          dtype=dtype, is_val=is_val, text_field=text_field,
                                                          strict=strict))
               | "AllSources" >> beam.combiners.ToList())
    written = (results
               | "Plan" >> beam.FlatMap(plan_shards, shard_tokens)
               | "SpreadShards" >> beam.Reshuffle()
               | "WriteShards" >> beam.ParDo(_WriteShard(tmp=tmp, dtype=dtype, shard_tokens=shard_tokens,
                                                         vocab_size=vocab_size)))
    entries = written | "Entries" >> beam.Map(lambda w: w[:3]) | "AllShards" >> beam.combiners.ToList()
    counts = written | "Frequencies" >> beam.Map(lambda w: (w[0], w[3])) | "PerSplit" >> beam.CombinePerKey(_sum_counts)
    _ = results | "Manifest" >> beam.Map(_write_manifest, entries=beam.pvalue.AsSingleton(entries),
                                         counts=beam.pvalue.AsDict(counts), tmp=tmp)


# ---------------------------------------------------------------------------------------------
# The launcher's side: run, then read the manifest back into the default runner's split summaries

def tokenize(sources, tmp: pathlib.Path, tok, *, eot, vocab_size, dtype, is_val, shard_tokens, text_field,
             strict, options: list[str]) -> tuple[dict, corpus.Tally]:
    """Runs the pipeline with Beam's own flags `options`; returns ({split: summary}, what the reading came to:
    the sources' tallies added in input order, as the default runner's one reader keeps it)."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.runner import PipelineState
    (tmp / PIECES).mkdir()
    try:
        pipeline = beam.Pipeline(options=PipelineOptions(options))
        build(pipeline, sources, tmp.resolve(), tok, eot=eot, vocab_size=vocab_size, dtype=dtype, is_val=is_val,
              shard_tokens=shard_tokens, text_field=text_field, strict=strict)
        state = pipeline.run().wait_until_finish()
    except Exception as e:  # the runner's own errors: a bad option, a failed job, a worker's exception
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        raise DataError(f"beam pipeline failed: {type(e).__name__}: {first[:300]}")
    if state is not None and state != PipelineState.DONE:
        raise DataError(f"beam pipeline ended in state {state}")
    manifest_path = tmp / MANIFEST
    if not manifest_path.is_file():
        raise DataError(f"beam pipeline finished without writing {manifest_path}; are {tmp.parent} "
                        f"and the inputs on a file system the workers share?")
    manifest = json.loads(manifest_path.read_text())
    errors = [r["error"] for r in manifest["sources"] if r["error"]]
    if errors:
        raise DataError(errors[0])  # the first failing input in input order
    if len(manifest["sources"]) != len(sources):
        raise DataError(f"beam pipeline read {len(manifest['sources'])} of {len(sources)} inputs")
    splits, itemsize = {}, np.dtype(dtype).itemsize
    for split in ("train", "val"):
        files = manifest["shards"][split]
        pieces = [r["pieces"][split] for r in manifest["sources"]]
        for j, shard in enumerate(files):  # the index may name only complete shards
            size = (tmp / shard["file"]).stat().st_size if (tmp / shard["file"]).is_file() else None
            if shard["file"] != f"{split}_{j:05d}.bin" or size != shard["tokens"] * itemsize:
                raise DataError(f"beam pipeline left shard {shard['file']} incomplete ({size} bytes)")
        counts = np.asarray(manifest["counts"].get(split, np.zeros(vocab_size, np.int64)), np.int64)
        splits[split] = shard_writer.split_summary(files, counts, sum(p["bytes"] for p in pieces))
        if (splits[split]["tokens"], splits[split]["documents"]) != \
                (sum(p["tokens"] for p in pieces), sum(p["documents"] for p in pieces)):
            raise DataError(f"beam pipeline: the {split} shards do not hold every tokenized document")
    shutil.rmtree(tmp / PIECES)
    manifest_path.unlink()
    tally = corpus.Tally()
    for result in manifest["sources"]:
        tally.add(corpus.Tally(**result["tally"]))
    return splits, tally
