"""Several prepared data directories mixed by weight: one loader whose batch at step s is a pure function
of (seed, s, the sources and the stages of their weights), so that a resume needs nothing but the step.

    mix = Mixture({"web": web_loader, "code": code_loader}, [(0, [0.8, 0.2]), (5000, [0.5, 0.5])],
                  batch_size, seed=seed)
    mix.get_batch(step)      # this process's rows of the global batch at `step`

The global samples g = step * batch_size + row are taken in blocks of BLOCK sequences. A stage (the weights
in force from its first step on) gives every one of its blocks the same count per source: the
largest-remainder rounding of BLOCK x weight / sum of the weights (`apportion`). Inside block b of a stage,
slot p belongs to the source whose range holds q = permute(p, BLOCK, key, b) (permutation.py, keyed by the
seed and the stage's first step): q in [0, c_0) to the first source, the next c_1 to the second, and so on,
so a block is a keyed shuffle of exact counts. The sequence a slot takes from source s is s's own i-th,
where i = (s's sequences in the stages before) + b c_s + (s's slots before p in the block): closed form
in the counts, so no iterator state is saved. Source s's i-th sequence is its loader's global sample i (a
text source's window permute(i % n, n, seed_s, i // n): its own keyed order, epoch after epoch).

A stage that begins inside a block ends the block before it short, its first slots taken as they would
have been: what came before a change of weights does not depend on it, and no source's sequence is
skipped or taken twice.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from core.errors import DataError
from tokendata.loader import Loader, TextLoader, open_loader
from tokendata.permutation import permute

BLOCK = 1024  # sequences a block's exact counts are rounded for: shares within 1/1024 of the weights
GROUP_BLOCKS = 8  # blocks whose slots (and text windows) are computed together, in one pass


def apportion(weights: list[float], k: int) -> list[int]:
    """Counts summing to k, proportional to `weights` (normalised): each source's quota k w / sum(w) rounded
    down, then one more for the largest remainders (a tie to the earlier source)."""
    total = math.fsum(weights)
    quotas = [w * k / total for w in weights]
    counts = [math.floor(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:k - sum(counts)]:
        counts[i] += 1
    return counts


def source_seed(seed: int, name: str) -> int:
    """The seed of source `name`'s own order of its sequences: the run's seed and the name, not its place
    among the sources (adding another source leaves this one's order as it was)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


class Schedule:
    """Which source, and which of its sequences, every global sample is (see the module docstring).

    `stages`: [(first step, weights)], the first at step 0, steps increasing, one weight per source."""

    def __init__(self, stages: list[tuple[int, list[float]]], batch_size: int, *, seed: int = 0,
                 block: int = BLOCK):
        self.block, self.sources = block, len(stages[0][1])
        self.starts = np.asarray([step * batch_size for step, _ in stages], np.int64)  # global samples
        self.counts = [np.asarray(apportion(w, block), np.int64) for _, w in stages]
        self.slots = [np.concatenate([[0], np.cumsum(c)]) for c in self.counts]  # source s: [slots[s], slots[s+1])
        self.keys = [source_seed(seed, f"blocks from step {step}") for step, _ in stages]
        self.cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.base = [np.zeros(self.sources, np.int64)]  # each source's sequences before each stage
        for t in range(len(stages) - 1):
            full, used = divmod(int(self.starts[t + 1] - self.starts[t]), block)
            taken = self.base[t] + full * self.counts[t]
            if used:  # the stage's last block, cut short by the next stage: the sequences of its first slots
                taken = taken + np.bincount(self.assigned(t, full)[0][:used], minlength=self.sources)
            self.base.append(taken)

    def assigned(self, t: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, place among that source's slots so far) of every slot p of block b of stage t: slot p
        takes the source whose range holds permute(p); a source's sequences are taken in slot order. The
        GROUP_BLOCKS blocks of b's group are computed together (one permutation pass) and kept."""
        first = b - b % GROUP_BLOCKS
        if (t, first) not in self.cache:
            k, size = GROUP_BLOCKS, self.block
            epochs = np.repeat(np.arange(first, first + k, dtype=np.uint64), size)
            q = permute(np.tile(np.arange(size), k), size, self.keys[t], epochs).astype(np.int64)
            src = (np.searchsorted(self.slots[t], q, side="right") - 1).reshape(k, size)
            place = np.empty((k, size), np.int64)
            for s, count in enumerate(self.counts[t].tolist()):  # each source's slots, in slot order
                if count:
                    mine = src == s
                    place[mine] = (np.cumsum(mine, axis=1) - 1)[mine]
            while len(self.cache) >= 2:  # a batch spans a group or two: keep the last two
                self.cache.pop(next(iter(self.cache)))
            self.cache[t, first] = (src, place)
        src, place = self.cache[t, first]
        return src[b - first], place[b - first]

    def blocks(self, g: np.ndarray) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """The blocks the global samples `g` (int64) fall in: [(stage t, block b, where in g, their slots)]."""
        stage = np.searchsorted(self.starts, g, side="right") - 1
        off = g - self.starts[stage]
        block, slot = off // self.block, off % self.block
        if stage[0] == stage[-1] and block[0] == block[-1]:  # the common case: one block
            return [(int(stage[0]), int(block[0]), slice(None), slot)]
        out = []
        for t, b in sorted(set(zip(stage.tolist(), block.tolist()))):
            at = (stage == t) & (block == b)
            out.append((t, b, at, slot[at]))
        return out

    def block_rows(self, t: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's sequence index) of every slot of block b of stage t."""
        block_src, place = self.assigned(t, b)
        return block_src, self.base[t][block_src] + b * self.counts[t][block_src] + place

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's sequence index) of each global sample in `g` (int64)."""
        g = np.asarray(g, np.int64)
        src, index = np.empty_like(g), np.empty_like(g)
        for t, b, at, slot in self.blocks(g):
            block_src, block_index = self.block_rows(t, b)
            src[at], index[at] = block_src[slot], block_index[slot]
        return src, index

    def taken(self, n: int) -> np.ndarray:
        """How many sequences each source gave to the global samples [0, n)."""
        if n <= 0:
            return np.zeros(self.sources, np.int64)
        t = int(np.searchsorted(self.starts, n - 1, side="right") - 1)
        full, used = divmod(int(n - self.starts[t]), self.block)
        taken = self.base[t] + full * self.counts[t]
        if used:
            taken = taken + np.bincount(self.assigned(t, full)[0][:used], minlength=self.sources)
        return taken


class Mixture(Loader):
    """Batches of several sources (each a Loader of the same kind and shape) mixed by the stages of their
    weights: the rows of this process at `step` are global samples step * batch_size + rows, each read
    from its source (`Schedule.locate`), the rows of one source read together."""

    def __init__(self, loaders: dict[str, Loader], stages: list[tuple[int, list[float]]], batch_size: int, *,
                 seed: int, process_index: int = 0, process_count: int = 1, block: int = BLOCK):
        first = next(iter(loaders.values()))
        super().__init__(first.seq_len, batch_size, seed=seed, process_index=process_index,
                         process_count=process_count)
        self.names, self.loaders = list(loaders), list(loaders.values())
        self.schedule = Schedule(stages, batch_size, seed=seed, block=block)
        self.prefetch = max(loader.prefetch for loader in self.loaders)
        # text sources: the windows of a whole block of samples computed at once (a permutation pass per
        # source, not one per source and batch) and kept while batches take their rows from it: a batch
        # then costs about what a one-source batch does, or less
        self.text = all(type(loader) is TextLoader for loader in self.loaders)
        if self.text:
            self.windows = np.asarray([loader.num_windows for loader in self.loaders], np.int64)
            self.seeds = [loader.seed for loader in self.loaders]
            self._windows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def get_batch(self, step: int):
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.text:
            return self._text_rows(step * self.batch_size + self.rows)
        src, index = self.schedule.locate(step * self.batch_size + self.rows)
        parts = {s: self.loaders[s].rows_at(index[src == s]) for s in np.unique(src).tolist()}
        first = next(iter(parts.values()))
        if isinstance(first, dict):  # prompt/completion rows: each array of the batch, rows in order
            out = {k: np.empty((len(src), *v.shape[1:]), v.dtype) for k, v in first.items()}
            for s, part in parts.items():
                for k, v in part.items():
                    out[k][src == s] = v
            return out
        out = np.empty((len(src), *first.shape[1:]), first.dtype)
        for s, part in parts.items():
            out[src == s] = part
        return out

    def _text_rows(self, g: np.ndarray) -> np.ndarray:
        """Text sources' rows of the global samples `g`: each sample's source and window as TextLoader.rows_at
        gives it, the windows of a whole block computed at once and kept (_block_windows)."""
        g = np.asarray(g, np.int64)
        src, windows = np.empty_like(g), np.empty_like(g)
        for t, b, at, slot in self.schedule.blocks(g):
            block_src, block_windows = self._block_windows(t, b)
            src[at], windows[at] = block_src[slot], block_windows[slot]
        T = self.seq_len
        out = np.empty((len(g), T + 1), np.int32)
        starts = windows * T
        groups = [(s, at) for s in range(len(self.loaders)) if len(at := np.flatnonzero(src == s))]
        for s, at in groups:  # each source's rows read together
            out[at] = self.loaders[s].stream.gather(starts[at], T + 1)
        # every source has one vocabulary (one tokenizer): one max for all, then each source's rows to name it
        if not self.loaders[0].stream.in_vocabulary(out):
            for s, at in groups:
                picked = windows[at]
                self.loaders[s].stream.check(out[at], lambda: ((w * T, T + 1) for w in picked.tolist()))
        return out

    def _block_windows(self, t: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of every slot of block b of stage t: its source's sequence index i is window
        permute(i % n, n, seed, i // n) of that source (n windows, its own seed). The GROUP_BLOCKS blocks of
        b's group are computed together, a pass per source for all of them (a pass's cost is mostly its cycle
        walking's last few rounds, the same for 300 indices as for 2,400), and kept."""
        first = b - b % GROUP_BLOCKS
        if (t, first) not in self._windows:
            rows = [self.schedule.block_rows(t, c) for c in range(first, first + GROUP_BLOCKS)]
            src, index = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
            windows = np.empty_like(index)
            for s, n in enumerate(self.windows.tolist()):
                at = src == s
                if at.any():
                    windows[at] = permute(index[at] % n, n, self.seeds[s], index[at] // n)
            while len(self._windows) >= 2:  # a batch spans a group or two: keep the last two
                self._windows.pop(next(iter(self._windows)))
            self._windows[t, first] = (src, windows)
        src, windows = self._windows[t, first]
        return src[b - first], windows[b - first]

    def taken(self, steps: int) -> dict[str, int]:
        """{source: sequences it gave to the first `steps` steps}."""
        return dict(zip(self.names, self.schedule.taken(steps * self.batch_size).tolist()))

    def epochs(self, steps: int) -> dict[str, float]:
        """{source: epochs of it the first `steps` steps went through}."""
        taken = self.taken(steps)
        return {name: taken[name] / loader.epoch_rows for name, loader in zip(self.names, self.loaders)}


def check_sources(opened: dict) -> None:
    """Sources a run can mix: one tokenizer (by content) and one kind, or a DataError naming the first
    that differs. `opened`: {name: shards.DataDir}."""
    (first_name, first), *rest = opened.items()
    for name, data in rest:
        if data.tokenizer_sha256 != first.tokenizer_sha256:
            raise DataError(f"data.mixture: source {name!r} ({data}) was tokenized with another tokenizer than "
                            f"{first_name!r} ({first}); prepare every source with one tokenizer "
                            f"(python data.py --tokenizer {first} ...)")
        if data.kind != first.kind:
            raise DataError(f"data.mixture: source {name!r} ({data}) is {data.kind} data and {first_name!r} "
                            f"({first}) is {first.kind}: a run mixes sources of one kind")


def open_mixture(sources: dict, stages: list[tuple[int, list[float]]], seq_len: int, batch_size: int, *,
                 seed: int, process_index: int = 0, process_count: int = 1, batching: str = "packing") -> Mixture:
    """The Mixture of `sources` ({name: shards.DataDir}, checked by check_sources) with `stages`: each
    source's train split through its own loader, in its own keyed order (source_seed)."""
    loaders = {}
    for name, data in sources.items():
        try:
            loaders[name] = open_loader(data, "train", seq_len, batch_size, seed=source_seed(seed, name),
                                        batching=batching)
        except DataError as e:
            raise DataError(f"data.mixture.{name}: {e}") from None
    return Mixture(loaders, stages, batch_size, seed=seed, process_index=process_index,
                   process_count=process_count)


def shares(names: list[str], schedule: Schedule, stages: list[tuple[int, list[float]]]) -> list[dict]:
    """[{step, shares: {name: its share of every block}}] of each stage: the counts per block over the
    block, the weights as rounded (what a run records and says, and the plan shows)."""
    return [{"step": step, "shares": {n: int(c) / schedule.block for n, c in zip(names, counts)}}
            for (step, _), counts in zip(stages, schedule.counts)]


def share_lines(names: list[str], schedule: Schedule, stages: list[tuple[int, list[float]]]) -> list[str]:
    """Each stage's shares, a line each, as start-up and the plan say them."""
    return [f"data mixture from step {stage['step']}: " + ", ".join(f"{n} {v:.1%}" for n, v in stage["shares"].items())
            for stage in shares(names, schedule, stages)]


def describe(mix: Mixture, stages: list[tuple[int, list[float]]], steps: int) -> list[str]:
    """What a run's start-up says of its mixture: each stage's shares, and each source's epochs over
    `steps` steps (a source repeated is said so)."""
    lines = share_lines(mix.names, mix.schedule, stages)
    epochs = mix.epochs(steps)
    lines.append(f"over {steps} steps: " + ", ".join(
        f"{n} {e:.2f} epochs" + (" (repeated)" if e > 1 else "") for n, e in epochs.items()))
    return lines
