"""DPO's precomputed reference (training.dpo.precompute_reference): the reference model's log-probabilities of
every pair, computed once at the start of a run and kept in its run directory.

RUN/reference_logps.npz holds, for each split, a float32 (pairs, 2) table: the summed log-probability of pair
j's chosen (column 0) and rejected (column 1) response under the reference (init_from's model, or LoRA's base
with its adapters off), with the split's pair count and the data's tokenizer sha256 and token count to check
it by. A resume reads it (the reference is needed no more: init_from may have moved); every epoch reuses it.
Batches then carry "ref" (B, 2, K), looked up by their pairs' ids, instead of a reference forward pass.
"""
from __future__ import annotations

import io

import jax
import numpy as np
from tqdm import tqdm

from core.errors import RunError
from tokendata import loader as loader_lib

REFERENCE_FILE = "reference_logps.npz"


class Precomputed:
    """The reference's log-probabilities of every pair of the train and val splits, by pair id."""

    def __init__(self, tables: dict[str, np.ndarray]):
        self.tables = tables

    def of(self, pairs: np.ndarray, split: str = "train") -> np.ndarray:
        """float32 (B, 2, K): the reference's log-probabilities of the pairs (B, K) ids (-1: none, 0)."""
        table = self.tables[split]
        ref = table[np.maximum(pairs, 0)].transpose(0, 2, 1)  # (B, K, 2) -> (B, 2, K)
        return np.where((pairs >= 0)[:, None, :], ref, 0.0).astype(np.float32)

    def fill(self, sample: list[dict]) -> list[dict]:
        """The validation sample's batches with their "ref" (and no pair ids)."""
        out = []
        for batch in sample:
            batch = dict(batch)
            batch["ref"] = self.of(batch.pop("pairs"), "val")
            out.append(batch)
        return out

    @classmethod
    def for_run(cls, run_dir, fns, train_loader, data, *, frozen, init_params, load_reference, place_batch, process_slice,
                batch_size: int, seq_len: int, batching: str, say, stop, is_main: bool) -> Precomputed:
        """The run's table: read from RUN/reference_logps.npz where it is there (and matches the data), else
        computed with `fns.reference_step` over both splits and saved there by process 0. The reference's
        weights: LoRA's base (`frozen`), else `init_params` (the fresh run's params before its first step), else
        `load_reference()`'s (init_from's, loaded)."""
        splits = {"train": train_loader.pairs, "val": loader_lib.Pairs(data, "val", seq_len)}
        expected = {split: len(pairs) for split, pairs in splits.items()}
        if run_dir.dir.is_file(REFERENCE_FILE):
            tables = _read(run_dir, data, expected)
            say(f"reference log-probabilities of {expected['train']:,} + {expected['val']:,} pairs read from "
                f"{run_dir.dir.show(REFERENCE_FILE)}")
            return cls(tables)
        weights = frozen[0] if frozen else init_params
        if weights is None:
            weights = load_reference()
        tables = {}
        for split, pairs in splits.items():
            bounds = loader_lib.pair_plan(pairs.chosen, pairs.rejected, np.arange(len(pairs)), seq_len + 1,
                                           batching == "packing")
            table = np.zeros((len(pairs), 2), np.float32)
            batches = loader_lib.eval_pairs(data, split, seq_len, batch_size, batching=batching, rows=(pairs, bounds))
            rows = len(bounds) - 1
            for batch in tqdm(batches, total=-(-rows // batch_size), desc=f"reference log-probabilities ({split})",
                              unit="batch", disable=None if is_main else True, leave=False):
                ids = batch["pairs"]
                logps = np.asarray(jax.device_get(fns.reference_step(weights, place_batch(
                    jax.tree.map(process_slice, batch)))))  # (B, 2, K)
                got = ids >= 0
                table[ids[got]] = logps.transpose(0, 2, 1)[got]
                stop.check()
            tables[split] = table
        if is_main:
            buffer = io.BytesIO()
            np.savez(buffer, **{f"{s}": t for s, t in tables.items()},
                     tokenizer_sha256=np.asarray(data.tokenizer_sha256), tokens=np.asarray(int(data.index["tokens"])))
            run_dir.dir.write_bytes(REFERENCE_FILE, buffer.getvalue())
        say(f"reference log-probabilities of {expected['train']:,} + {expected['val']:,} pairs computed once, kept "
            f"in {run_dir.dir.show(REFERENCE_FILE)}")
        return cls(tables)


def _read(run_dir, data, expected: dict) -> dict[str, np.ndarray]:
    where = run_dir.dir.show(REFERENCE_FILE)
    redo = "remove it to compute the reference's log-probabilities again (python train.py --resume does)"
    try:
        with np.load(io.BytesIO(run_dir.dir.read_bytes(REFERENCE_FILE))) as f:
            tables = {s: np.asarray(f[s], np.float32) for s in ("train", "val")}
            sha, tokens = str(f["tokenizer_sha256"]), int(f["tokens"])
    except Exception as e:  # a damaged or foreign file
        raise RunError(f"{where}: not a table of reference log-probabilities ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else 'unreadable'}); {redo}") from None
    if sha != data.tokenizer_sha256 or tokens != int(data.index["tokens"]):
        raise RunError(f"{where} was computed for other data than {data} (tokenizer or token count differ); {redo}")
    for split, n in expected.items():
        if tables[split].shape != (n, 2) or not np.isfinite(tables[split]).all():
            raise RunError(f"{where}: its {split} table is {tables[split].shape}, not the ({n}, 2) finite "
                           f"log-probabilities of the split's pairs; {redo}")
    return tables
