"""The step-deterministic loaders: batches of a prepared data directory (shards.py) as a pure
function of the step. Each takes the directory opened once (`shards.open_data`), and reads its shards
through it.

    loader = open_loader(shards.open_data(DIR), "train", seq_len, batch_size, seed=..., process_index=p, process_count=P)
    batches = loader.iterate(start_step)      # get_batch(start_step), get_batch(start_step + 1), ... prefetched

Text data (`TextLoader`): training window i covers stream[i*T : i*T + T + 1] (inputs and targets
overlap by one token, so every token after the first is a target exactly once per epoch); windows
cross document and shard boundaries, as in GPT-2 style pre-training. Global sample
g = step * batch_size + row is window permute(g % n, seed, g // n) of the n windows: a keyed
Feistel permutation per epoch (permutation.py), computed index by index, so the batch at any step costs the same
and resuming at step s replays the batches exactly. A batch is int32 tokens (B, T+1).

Prompt/completion data (`PromptCompletionLoader`, from finetune_data.py): every epoch takes the
examples in the order of the same keyed permutation, then packs consecutive whole examples into
rows of T + 1 tokens (`packing`, the default: few padding tokens) or puts one example per row
(`padding`). A row's unused tail is end-of-text padding with weight 0. A batch is {"tokens": int32
(B, T+1), "weights": float32 (B, T), "segments": int32 (B, T)}: weights[t] = 1 iff target t+1 is a
completion or closing token of the same example as input t; segments number the examples of a row
1, 2, ... (0 = padding), and the model's attention never crosses segments.

Process p of P computes only rows [p*B/P, (p+1)*B/P) of each global batch. Every batch is checked
against the vocabulary (one max per batch), so a flipped byte in a shard is named by file, position
and id instead of indexing the embedding out of range. `validation_sample` is the fixed sample
train.py evaluates on, spread over the whole split and padded to whole batches so evaluation
compiles once.
"""
from __future__ import annotations

import bisect
import collections
import queue
import threading
from typing import Callable, Iterable, Iterator

import numpy as np

from core.errors import DataError
from tokendata import shards
from tokendata.permutation import permute
from tokendata.shards import BATCHING

REMOTE_GROUP = 8  # text batches read from a URL in one request, twice that read ahead: the requests'
# latency is hidden behind the steps, and paid once per 8 batches, not once per batch


# ---------------------------------------------------------------------------------------------
# Text data

class Stream:
    """One split's shards as a single logical token stream: memory-mapped from a local directory, read
    by byte ranges from a URL (a batch's rows in one concurrent request; shards.Source).

    `check` tests a batch read from it against the vocabulary: a flipped byte in a shard gives an id
    that would index the embedding out of range, so it is caught here and named, not met as a NaN loss."""

    def __init__(self, data: shards.DataDir, split: str, masks: bool = False):
        """`masks`: the split's loss-mask shards (prompt/completion data, one uint8 a token) instead."""
        self.index, splits = data.index, data.splits
        if split not in splits:
            raise DataError(f"{data}: no split {split!r} (has: {', '.join(splits)})")
        self.split, self.vocab_size = split, data.vocab_size
        self.source = data.source
        self.dtype = np.dtype(np.uint8 if masks else data.dtype).newbyteorder("<")
        self.directory, self.itemsize = self.source.location, self.dtype.itemsize
        self.names, self.shards, self.starts = [], [], [0]  # shards: local memory maps, none for a URL
        for shard in splits[split]["mask_shards" if masks else "shards"]:
            if int(shard["tokens"]):
                self.names.append(shard["file"])
                self.starts.append(self.starts[-1] + int(shard["tokens"]))
                if not self.source.remote:
                    # a plain array over the memory map: indexing it skips np.memmap's per-result wrapping
                    self.shards.append(np.asarray(self.source.memmap(shard["file"], self.dtype, int(shard["tokens"]))))
        self.files = [self.source.show(name) for name in self.names]
        self.tokens = self.starts[-1]

    def windows(self, seq_len: int, what: str) -> int:
        n = (self.tokens - 1) // seq_len if self.tokens else 0
        if n < 1:
            hint = ("; train with a shorter training.seq_len, or prepare the data with more documents or a larger "
                    "--val-fraction" if self.split == "val" else "; train with a shorter training.seq_len")
            raise DataError(f"{what}: a window of {seq_len + 1} tokens is longer than the split "
                            f"({self.tokens} tokens){hint}")
        return n

    def read_spans(self, spans: list[tuple[int, int]], out: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """stream[start : start + n] of each (start, n), across shard boundaries, into `out` (arrays of
        those lengths; by default new ones in the shards' dtype); from a URL all of them in one request."""
        pieces = []  # (span, shard, first, end, offset in the span's array)
        for k, (start, n) in enumerate(spans):
            i = bisect.bisect_right(self.starts, start) - 1
            pos, done = start - self.starts[i], 0
            while done < n:
                take = min(n - done, self.starts[i + 1] - self.starts[i] - pos)
                pieces.append((k, i, pos, pos + take, done))
                done += take
                i, pos = i + 1, 0
        out = [np.empty(n, self.dtype) for _, n in spans] if out is None else out
        if self.source.remote:
            raw = self.source.read_ranges([(self.names[i], a * self.itemsize, b * self.itemsize)
                                           for _, i, a, b, _ in pieces])
            for (k, _, a, b, at), data in zip(pieces, raw):
                out[k][at:at + b - a] = np.frombuffer(data, self.dtype)
        else:
            for k, i, a, b, at in pieces:
                out[k][at:at + b - a] = self.shards[i][a:b]
        return out

    def read_rows(self, starts, n: int) -> np.ndarray:
        """int32 (len(starts), n): row i = stream[starts[i] : starts[i] + n]."""
        return self.gather(starts, n).astype(np.int32, copy=False)

    def gather(self, starts, n: int) -> np.ndarray:
        """(len(starts), n) in the shards' dtype: row i = stream[starts[i] : starts[i] + n]. Locally the rows
        that lie in one shard are read in one gather from its memory map; a row across a shard's end, and every
        row from a URL, through read_spans."""
        starts = np.asarray(starts, np.int64)
        offsets = np.arange(n)
        if len(self.shards) == 1 and not self.source.remote:  # a start past the shard's end: an IndexError
            return self.shards[0][starts[:, None] + offsets]
        rows = np.empty((len(starts), n), self.dtype)
        if self.source.remote:
            self.read_spans([(start, n) for start in starts.tolist()], list(rows))  # each row written in place
            return rows
        edges = np.asarray(self.starts, np.int64)
        shard = np.searchsorted(edges, starts, side="right") - 1
        pos = starts - edges[shard]
        inside = pos + n <= edges[shard + 1] - edges[shard]
        for i in np.unique(shard[inside]).tolist():
            at = np.flatnonzero(inside & (shard == i))
            rows[at] = self.shards[i][pos[at, None] + offsets]
        across = np.flatnonzero(~inside).tolist()
        self.read_spans([(int(starts[k]), n) for k in across], [rows[k] for k in across])
        return rows

    def in_vocabulary(self, tokens: np.ndarray) -> bool:
        """Whether every id in `tokens` (int32, read from a stream of this vocabulary and dtype) is in it."""
        return not tokens.size or tokens.max() < self.vocab_size and (self.itemsize < 4 or tokens.min() >= 0)

    def check(self, tokens: np.ndarray, spans: Callable[[], Iterable[tuple[int, int]]]) -> None:
        """Raises DataError if an id in `tokens` (int32, read from this stream) is outside the vocabulary.

        One max over the batch (and for uint32 shards one min: an id past 2^31 is a negative int32); only
        then are the stream spans (start, length) the batch was read from searched, to name the shard
        file, the token's position in it and the id."""
        if self.in_vocabulary(tokens):
            return
        for start, n in spans():
            span = self.read_spans([(start, n)])[0]  # the shards' own dtype: no id wraps
            bad = np.flatnonzero(span >= self.vocab_size)
            if len(bad):
                at = start + int(bad[0])  # in the stream, then in its shard
                i = bisect.bisect_right(self.starts, at) - 1
                offset = at - self.starts[i]
                raise DataError(f"{self.files[i]}: token {offset} (at byte {offset * span.dtype.itemsize}) is id "
                                f"{int(span[bad[0]])}, outside the vocabulary of {self.vocab_size}: the shard is "
                                f"corrupt; `python data.py --verify {self.directory}` checks every file")
        raise DataError(f"{self.directory} split {self.split!r}: a batch holds token ids outside the vocabulary "
                        f"of {self.vocab_size} (from {int(tokens.min())} to {int(tokens.max())})")


class Loader:
    """What both loaders share: this process's rows of each global batch, and iteration with prefetching.

    A subclass's get_batch(step) is a pure function of (seed, step, shape, process)."""

    def __init__(self, seq_len: int, batch_size: int, *, seed: int, process_index: int, process_count: int):
        if seq_len < 1 or batch_size < 1:
            raise DataError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise DataError(f"process index {process_index} is outside process count {process_count}")
        if batch_size % process_count:
            raise DataError(f"global batch size {batch_size} does not divide by {process_count} processes")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.local_batch_size = batch_size // process_count
        self.rows = np.arange(process_index * self.local_batch_size,
                              (process_index + 1) * self.local_batch_size, dtype=np.int64)

    def get_batch(self, step: int):
        raise NotImplementedError

    def get_batches(self, steps: list[int]) -> list:
        """[get_batch(s) for s in steps]; a loader reading a URL reads them all in one request."""
        return [self.get_batch(s) for s in steps]

    prefetch = 2  # batches made ahead by iterate()
    group = 1  # batches made at once by the prefetching thread (REMOTE_GROUP for data at a URL)

    def iterate(self, start_step: int = 0, prefetch: int | None = None) -> Iterator:
        """get_batch(start_step), get_batch(start_step + 1), ...; prefetch > 0 fills a queue from a thread."""
        prefetch = self.prefetch if prefetch is None else prefetch
        return self._prefetched(start_step, prefetch) if prefetch > 0 else self._plain(start_step)

    def _plain(self, step: int) -> Iterator:
        while True:
            yield self.get_batch(step)
            step += 1

    def _prefetched(self, step: int, depth: int) -> Iterator:
        batches: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def produce(step: int) -> None:
            while not stop.is_set():
                try:
                    items: list = self.get_batches(list(range(step, step + self.group)))
                except BaseException as e:  # handed to the consumer, which re-raises it
                    items = [e]
                for item in items:
                    while not stop.is_set():  # a timed put, so a stopped consumer never leaves it blocked
                        try:
                            batches.put(item, timeout=0.05)
                            break
                        except queue.Full:
                            pass
                    if isinstance(item, BaseException):
                        return
                step += self.group

        thread = threading.Thread(target=produce, args=(step,), name="data-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = batches.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:  # generator closed or collected: stop the producer and wait for it
            stop.set()
            thread.join()


def open_loader(data: shards.DataDir, split: str, seq_len: int, batch_size: int, *, seed: int = 0, process_index: int = 0,
                process_count: int = 1, batching: str = "packing") -> Loader:
    """The loader for the directory's kind: a TextLoader, or a PromptCompletionLoader (with `batching`)."""
    rows = dict(seed=seed, process_index=process_index, process_count=process_count)
    if data.is_preference:
        return PreferenceLoader(data, split, seq_len, batch_size, batching=batching, **rows)
    if data.is_prompt_completion:
        return PromptCompletionLoader(data, split, seq_len, batch_size, batching=batching, **rows)
    if batching != "packing" and process_index == 0:  # said, not refused: a run saved with it still resumes
        print(f"note: data.batching={batching} applies to prompt/completion data only; {data} is text, read "
              f"as windows of one token stream (no examples to pad)", flush=True)
    return TextLoader(data, split, seq_len, batch_size, **rows)


class TextLoader(Loader):
    """Batches of training windows, int32 (local_batch_size, seq_len + 1).

    Global sample g = step * batch_size + row falls in epoch g // num_windows, where it is window
    permute(g % num_windows, seed, epoch). Process p computes only rows [p*B/P, (p+1)*B/P).
    """

    def __init__(self, data: shards.DataDir, split: str, seq_len: int, batch_size: int, *, seed: int = 0,
                 process_index: int = 0, process_count: int = 1):
        super().__init__(seq_len, batch_size, seed=seed, process_index=process_index, process_count=process_count)
        self.stream = Stream(data, split)
        self.index = self.stream.index
        if self.stream.source.remote:
            self.group, self.prefetch = REMOTE_GROUP, 2 * REMOTE_GROUP
        self.num_windows = self.stream.windows(seq_len, f"{data} split {split!r}")

    def get_batch(self, step: int) -> np.ndarray:
        """int32 [local_batch_size, seq_len + 1]: this process's rows of the global batch at `step`."""
        return self.get_batches([step])[0]

    def get_batches(self, steps: list[int]) -> list[np.ndarray]:
        """get_batch of each step, their rows read together (from a URL in one request)."""
        if min(steps) < 0:
            raise ValueError(f"step must be >= 0, got {min(steps)}")
        g = (np.asarray(steps, np.int64)[:, None] * self.batch_size + self.rows).ravel()
        return list(self.rows_at(g).reshape(len(steps), self.local_batch_size, self.seq_len + 1))

    @property
    def epoch_rows(self) -> int:
        """Global samples in an epoch: every window once."""
        return self.num_windows

    def rows_at(self, g: np.ndarray) -> np.ndarray:
        """int32 (len(g), seq_len + 1): global samples g (int64), read together (from a URL in one request)."""
        windows = permute(g % self.num_windows, self.num_windows, self.seed, g // self.num_windows)
        rows = self.stream.read_rows(windows * self.seq_len, self.seq_len + 1)
        self.stream.check(rows, lambda: ((window * self.seq_len, self.seq_len + 1) for window in windows.tolist()))
        return rows


def spread(n: int, m: int | None) -> np.ndarray:
    """Indices of m of n items spread evenly from the first to near the last (all n when m is None or
    not smaller): a sample of a split that stands for the whole of it, not for its beginning."""
    return np.arange(n) if m is None or m >= n else (np.arange(m, dtype=np.int64) * n) // m


def split_windows(data: shards.DataDir, split: str, seq_len: int) -> int:
    """How many non-overlapping windows of seq_len (+1) tokens the split holds."""
    return Stream(data, split).windows(seq_len, f"{data} split {split!r}")


def eval_windows(data: shards.DataDir, split: str, seq_len: int, batch_size: int, *,
                 max_windows: int | None = None) -> Iterator[np.ndarray]:
    """The non-overlapping windows stream[i*T : i*T + T + 1] of the split, each once, in order, in
    batches: every one, or max_windows of them spread evenly over the split (`spread`)."""
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
    stream = Stream(data, split)
    picked = spread(stream.windows(seq_len, f"{data} split {split!r}"), max_windows)
    for first in range(0, len(picked), batch_size):
        windows = picked[first:first + batch_size]
        batch = stream.read_rows(windows * seq_len, seq_len + 1)
        stream.check(batch, lambda: [(int(w) * seq_len, seq_len + 1) for w in windows])  # each row's window
        yield batch


# ---------------------------------------------------------------------------------------------
# Prompt/completion data

class Examples:
    """One split's examples: the token stream, its mask stream, and where each example starts."""

    def __init__(self, data: shards.DataDir, split: str):
        self.stream = Stream(data, split)  # maps (or names, at a URL) the token shards
        self.index = data.index
        if not data.has_masks:
            raise DataError(f"{data} is not prompt/completion data (prepare it with --format prompt_completion)")
        # the loss masks, one byte a token, are read like the tokens; at start every shard of them is
        # read once, a shard at a time (from a URL too, kept nowhere), for the examples' bounds: the
        # packing plan needs every example's length
        self.masks, ends = Stream(data, split, masks=True), []
        if self.masks.tokens != self.stream.tokens:
            raise DataError(f"{data}: split {split!r} has {self.masks.tokens} mask bytes for "
                            f"{self.stream.tokens} tokens; re-run data.py")
        source = self.masks.source
        for i, name in enumerate(self.masks.names):
            n = self.masks.starts[i + 1] - self.masks.starts[i]
            mask = np.frombuffer(source.read_bytes(name), np.uint8) if source.remote else self.masks.shards[i]
            if len(mask) != n:
                raise DataError(f"{source.show(name)}: {len(mask)} loss-mask bytes, index.json records {n}")
            if int(mask.max()) > shards.END:  # a corrupt byte: weights and example bounds would be wrong
                at = int(np.flatnonzero(mask > shards.END)[0])
                raise DataError(f"{source.show(name)}: byte {at} is {int(mask[at])}, not a loss-mask value "
                                f"({shards.PROMPT}, {shards.COMPLETION} or {shards.END}): the shard is corrupt")
            ends.append(np.flatnonzero(mask == shards.END) + 1 + self.masks.starts[i])
        ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)  # one past each example's last token
        if self.stream.tokens and (not len(ends) or ends[-1] != self.stream.tokens):  # e.g. every byte PROMPT
            raise DataError(f"{self.masks.files[-1]}: the split's last loss-mask byte is not {shards.END} (the "
                            f"end of an example): {len(ends)} examples end in {self.stream.tokens} tokens, and the "
                            f"rest belongs to none; the loss masks are damaged, prepare the directory again")
        self.starts = np.concatenate([[0], ends])[:len(ends)].astype(np.int64)  # none for no example
        self.lengths = (ends - self.starts).astype(np.int64)
        self.eot = data.eot_id

    def __len__(self) -> int:
        return len(self.starts)

    def fill(self, examples, read: Iterator[np.ndarray], masks: Iterator[np.ndarray], tokens: np.ndarray,
             weights: np.ndarray, segments: np.ndarray) -> None:
        """Writes examples (ids), their tokens and loss masks the next arrays of `read` and `masks`, one
        after another into one row: tokens (T+1,), weights (T,), segments (T,)."""
        T = len(weights)
        mask = np.zeros(T + 1, np.uint8)
        seg = np.zeros(T + 1, np.int32)
        tokens[:] = self.eot
        pos = 0
        for k, e in enumerate(examples, 1):
            n = int(self.lengths[e])
            tokens[pos:pos + n] = next(read)
            mask[pos:pos + n] = next(masks)
            seg[pos:pos + n] = k
            pos += n
        segments[:] = seg[:-1]
        weights[:] = (mask[1:] > 0) & (seg[1:] == seg[:-1]) & (seg[1:] > 0)

    def batch(self, rows: list, seq_len: int) -> dict:
        """A batch of len(rows) rows, row i holding the examples rows[i] (ids), its token ids checked against
        the vocabulary (one max; a corrupt shard is a DataError naming it)."""
        batch = empty_batch(len(rows), seq_len)
        spans = [(int(self.starts[e]), int(self.lengths[e])) for examples in rows for e in examples]
        read, masks = iter(self.stream.read_spans(spans)), iter(self.masks.read_spans(spans))  # a request each
        for i, examples in enumerate(rows):
            self.fill(examples, read, masks, batch["tokens"][i], batch["weights"][i], batch["segments"][i])
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


class PromptCompletionLoader(Loader):
    """Batches of prompt/completion rows: {tokens (b, T+1), weights (b, T), segments (b, T)}.

    Epoch e's rows are the examples in the order permute(., seed, e), packed (or one a row); global
    row g = step * batch_size + row is row g - (rows of epochs before) of the epoch it falls in.
    """

    def __init__(self, data: shards.DataDir, split: str, seq_len: int, batch_size: int, *, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, batching: str = "packing"):
        super().__init__(seq_len, batch_size, seed=seed, process_index=process_index, process_count=process_count)
        if batching not in BATCHING:
            raise DataError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
        self.examples = _checked(data, split, seq_len)
        self.index = self.examples.index
        if self.examples.stream.source.remote:
            self.prefetch = 2 * REMOTE_GROUP
        self.packing = batching == "packing"
        self._epoch_rows: list[int] = []  # rows of each epoch planned so far
        self._plans: collections.OrderedDict[int, tuple] = collections.OrderedDict()  # epoch -> (order, bounds)

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        if e not in self._plans:
            n = len(self.examples)
            order = permute(np.arange(n), n, self.seed, e)
            self._plans[e] = (order, _plan(self.examples.lengths, order, self.seq_len + 1, self.packing))
            while len(self._plans) > 3:  # keep the most recently used few
                self._plans.popitem(last=False)
        self._plans.move_to_end(e)
        return self._plans[e]

    def _locate(self, g: int) -> tuple[int, int]:
        """(epoch, row within it) of global row g."""
        e, before = 0, 0
        while True:
            self._locate_rows(e)
            if g < before + self._epoch_rows[e]:
                return e, g - before
            before += self._epoch_rows[e]
            e += 1

    def get_batch(self, step: int) -> dict:
        """This process's rows of the global batch at `step`: {tokens (b, T+1), weights (b, T), segments (b, T)}."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.rows_at(step * self.batch_size + self.rows)

    @property
    def epoch_rows(self) -> int:
        """Global rows in the first epoch (the others hold as many examples, packed into about as many rows)."""
        return self._locate_rows(0)

    def _locate_rows(self, e: int) -> int:
        while len(self._epoch_rows) <= e:
            self._epoch_rows.append(len(self._epoch(len(self._epoch_rows))[1]) - 1)
        return self._epoch_rows[e]

    def rows_at(self, g: np.ndarray) -> dict:
        """Global rows g (int64) of the split: {tokens (len(g), T+1), weights (len(g), T), segments (len(g), T)}."""
        rows = []  # each row's examples
        for gi in np.asarray(g).tolist():
            e, r = self._locate(gi)
            order, bounds = self._epoch(e)
            rows.append(order[bounds[r]:bounds[r + 1]])
        return self.examples.batch(rows, self.seq_len)


def _checked(data: shards.DataDir, split: str, seq_len: int) -> Examples:
    examples = Examples(data, split)
    if len(examples) == 0:
        hint = "; prepare with a larger --val-fraction" if split == "val" else ""
        raise DataError(f"{data}: split {split!r} has no examples{hint}")
    longest = int(examples.lengths.max())
    if longest > seq_len + 1:
        raise DataError(f"{data}: an example of {longest} tokens does not fit training.seq_len {seq_len} (by default "
                        f"the model's context; the data was prepared with --seq-len {examples.index.get('seq_len')}): "
                        f"prepare it again with --seq-len {seq_len} (prompts then lose tokens from the left, and "
                        f"examples whose completion does not fit are skipped), or train with training.seq_len="
                        f"{longest - 1} where the model takes that context")
    return examples


def empty_batch(rows: int, seq_len: int) -> dict:
    """All-zero batch arrays: tokens (rows, T+1), weights (rows, T), segments (rows, T)."""
    return {"tokens": np.zeros((rows, seq_len + 1), np.int32), "weights": np.zeros((rows, seq_len), np.float32),
            "segments": np.zeros((rows, seq_len), np.int32)}


def eval_examples(data: shards.DataDir, split: str, seq_len: int, batch_size: int, *, batching: str = "packing",
                 max_rows: int | None = None, rows: tuple | None = None) -> Iterator[dict]:
    """The split's examples once, in order, in rows as the Loader builds them, batch_size rows a batch:
    every row, or max_rows of them spread evenly over the split (`spread`). `rows`: example_rows's
    answer for these arguments, where the caller has it already."""
    examples, bounds = rows if rows is not None else example_rows(data, split, seq_len, batching)
    picked = spread(len(bounds) - 1, max_rows).tolist()
    for first in range(0, len(picked), batch_size):
        yield examples.batch([range(bounds[r], bounds[r + 1]) for r in picked[first:first + batch_size]], seq_len)


def example_rows(data: shards.DataDir, split: str, seq_len: int, batching: str = "packing") -> tuple[Examples, np.ndarray]:
    """(the split's Examples, the bounds of the rows they fill as the Loader builds them): row r holds
    examples bounds[r] to bounds[r + 1]."""
    examples = _checked(data, split, seq_len)
    return examples, _plan(examples.lengths, np.arange(len(examples)), seq_len + 1, batching == "packing")


def validation_sample(data: shards.DataDir, seq_len: int, batch_size: int, max_rows: int, batching: str = "packing"):
    """The fixed sample train.py evaluates on: max_rows windows (text) or rows of examples
    (prompt/completion) spread evenly over the val split, or all of them when it holds no more, as
    (batches, rows, tokens counted, the split's rows). Every batch is whole (batch_size rows; the rows
    that pad the last one weigh 0), so evaluation compiles once; each is
    {tokens (B, T+1), weights (B, T)[, segments (B, T)]}."""
    batches = []
    if data.is_preference:  # rows of pairs; the counts are of sequences' tokens in the loss, both sides
        rows = pair_rows(data, "val", seq_len, batching)
        batches = list(eval_pairs(data, "val", seq_len, batch_size, batching=batching, max_rows=max_rows, rows=rows))
        used = sum(int((b["pairs"] >= 0).any(axis=1).sum()) for b in batches)
        return batches, used, int(sum(b["weights"].sum() for b in batches)), len(rows[1]) - 1
    if data.is_prompt_completion:
        rows = example_rows(data, "val", seq_len, batching)  # every mask shard read once, for both
        of = len(rows[1]) - 1
        for batch in eval_examples(data, "val", seq_len, batch_size, batching=batching, max_rows=max_rows,
                                   rows=rows):
            padded = empty_batch(batch_size, seq_len)  # zero weights on the rows that pad the batch
            for k, v in batch.items():
                padded[k][: len(v)] = v
            batches.append(padded)
    else:
        of = split_windows(data, "val", seq_len)
        for tokens in eval_windows(data, "val", seq_len, batch_size, max_windows=max_rows):
            padded = {"tokens": np.zeros((batch_size, seq_len + 1), np.int32),
                      "weights": np.zeros((batch_size, seq_len), np.float32)}
            padded["tokens"][: len(tokens)] = tokens
            padded["weights"][: len(tokens)] = 1.0
            batches.append(padded)
    rows = sum(int((batch["weights"].sum(axis=1) > 0).sum()) for batch in batches)
    tokens = int(sum(batch["weights"].sum() for batch in batches))
    return batches, rows, tokens, of


# ---------------------------------------------------------------------------------------------
# Preference pairs (preference_data.py): examples 2j and 2j + 1 are pair j's chosen and rejected sequences

def pair_slots(seq_len: int) -> int:
    """The most pairs a row of seq_len + 1 tokens holds: each sequence has at least two tokens (a response token
    and its end-of-text, or two response tokens)."""
    return (seq_len + 1) // 2


def empty_pair_batch(rows: int, seq_len: int) -> dict:
    """All-zero pair batch arrays: tokens (rows, 2, T+1), weights and segments (rows, 2, T), pairs (rows, K) -1."""
    return {"tokens": np.zeros((rows, 2, seq_len + 1), np.int32),
            "weights": np.zeros((rows, 2, seq_len), np.float32),
            "segments": np.zeros((rows, 2, seq_len), np.int32),
            "pairs": np.full((rows, pair_slots(seq_len)), -1, np.int64)}


def pair_plan(chosen: np.ndarray, rejected: np.ndarray, order: np.ndarray, row_tokens: int,
               packing: bool) -> np.ndarray:
    """Row boundaries (R + 1,) into `order` (pair ids): row r holds pairs order[b[r]:b[r + 1]], their chosen
    sequences in one row of row_tokens and their rejected ones in another, each within it."""
    if not packing:
        return np.arange(len(order) + 1, dtype=np.int64)
    bounds, used_c, used_r = [0], 0, 0
    for i, (c, r) in enumerate(zip(chosen[order].tolist(), rejected[order].tolist())):
        if used_c + c > row_tokens or used_r + r > row_tokens:
            bounds.append(i)
            used_c = used_r = 0
        used_c, used_r = used_c + c, used_r + r
    bounds.append(len(order))
    return np.asarray(bounds, np.int64)


def _require_preference(data: shards.DataDir) -> None:
    if not data.is_preference:
        raise DataError(f"{data} is not preference data (prepare it with data.py --format preference); "
                        f"training.objective=dpo trains on prompt/chosen/rejected pairs")


class Pairs:
    """One split's preference pairs over its Examples: pair j is examples 2j (chosen) and 2j + 1 (rejected)."""

    def __init__(self, data: shards.DataDir, split: str, seq_len: int, examples: Examples | None = None):
        """`examples`: the split's Examples, where the caller has read them already (_checked's)."""
        _require_preference(data)
        self.examples = examples if examples is not None else _checked(data, split, seq_len)
        if len(self.examples) % 2:
            raise DataError(f"{data}: split {split!r} holds {len(self.examples)} sequences, not whole pairs; the "
                            f"loss masks are damaged, prepare the directory again")
        self.chosen, self.rejected = self.examples.lengths[0::2], self.examples.lengths[1::2]

    def __len__(self) -> int:
        return len(self.chosen)

    def batch(self, rows: list, seq_len: int) -> dict:
        """A batch of len(rows) rows, row i holding the pairs rows[i] (ids): [:, 0] their chosen sequences, [:, 1]
        their rejected ones, segment k of both sides pair rows[i][k - 1] (`pairs`)."""
        batch = empty_pair_batch(len(rows), seq_len)
        ex = self.examples
        spans = [(int(ex.starts[e]), int(ex.lengths[e])) for pairs in rows for side in (0, 1)
                 for e in (2 * np.asarray(pairs, np.int64) + side).tolist()]
        read, masks = iter(ex.stream.read_spans(spans)), iter(ex.masks.read_spans(spans))
        for i, pairs in enumerate(rows):
            pairs = np.asarray(pairs, np.int64)
            for side in (0, 1):
                ex.fill(2 * pairs + side, read, masks, batch["tokens"][i, side], batch["weights"][i, side],
                        batch["segments"][i, side])
            batch["pairs"][i, :len(pairs)] = pairs
        ex.stream.check(batch["tokens"].reshape(-1, seq_len + 1), lambda: iter(spans))
        return batch


class PreferenceLoader(PromptCompletionLoader):
    """Batches of preference pairs: {tokens (b, 2, T+1), weights (b, 2, T), segments (b, 2, T), pairs (b, K)}.

    Epoch e takes the pairs in the order permute(., seed, e), packed (whole pairs, the chosen sequences in one
    row and the rejected ones in its twin, `packing`) or one pair a row (`padding`); `pairs` holds each row's
    pair ids by segment (-1: none), for a precomputed reference's log-probabilities."""

    def __init__(self, data: shards.DataDir, split: str, seq_len: int, batch_size: int, *, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, batching: str = "packing"):
        _require_preference(data)  # before the examples are read
        super().__init__(data, split, seq_len, batch_size, seed=seed, process_index=process_index,
                         process_count=process_count, batching=batching)
        self.pairs = Pairs(data, split, seq_len, self.examples)

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        if e not in self._plans:
            n = len(self.pairs)
            order = permute(np.arange(n), n, self.seed, e)
            self._plans[e] = (order, pair_plan(self.pairs.chosen, self.pairs.rejected, order, self.seq_len + 1,
                                                self.packing))
            while len(self._plans) > 3:
                self._plans.popitem(last=False)
        self._plans.move_to_end(e)
        return self._plans[e]

    def rows_at(self, g: np.ndarray) -> dict:
        rows = []
        for gi in np.asarray(g).tolist():
            e, r = self._locate(gi)
            order, bounds = self._epoch(e)
            rows.append(order[bounds[r]:bounds[r + 1]])
        return self.pairs.batch(rows, self.seq_len)


def pair_rows(data: shards.DataDir, split: str, seq_len: int, batching: str = "packing") -> tuple[Pairs, np.ndarray]:
    """(the split's Pairs, the bounds of the rows they fill in their own order, as the loader packs them)."""
    pairs = Pairs(data, split, seq_len)
    return pairs, pair_plan(pairs.chosen, pairs.rejected, np.arange(len(pairs)), seq_len + 1, batching == "packing")


def eval_pairs(data: shards.DataDir, split: str, seq_len: int, batch_size: int, *, batching: str = "packing",
               max_rows: int | None = None, rows: tuple | None = None) -> Iterator[dict]:
    """The split's pairs once, in order, batch_size rows a batch (the last one padded with empty rows): every
    row, or max_rows of them spread evenly over the split."""
    pairs, bounds = rows if rows is not None else pair_rows(data, split, seq_len, batching)
    picked = spread(len(bounds) - 1, max_rows).tolist()
    for first in range(0, len(picked), batch_size):
        batch = pairs.batch([range(bounds[r], bounds[r + 1]) for r in picked[first:first + batch_size]], seq_len)
        padded = empty_pair_batch(batch_size, seq_len)
        for k, v in batch.items():
            padded[k][: len(v)] = v
        yield padded
