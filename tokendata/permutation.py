"""The windows' order: a keyed Feistel network on [0, 2^bits) made a bijection on [0, n) by cycle
walking, one permutation per (seed, epoch). It maps index by index in O(1) memory, vectorised over a
batch, so the batch at any step costs the same and a resume replays the batches exactly (loader.py).

    permute(indices, n, seed, epoch) -> the windows at those positions of epoch's order

Runs depend on it staying what it is: a change here changes every run's data order, and the resumes of
runs trained before (test_formats.py's fixtures) would no longer continue them exactly.
"""
from __future__ import annotations

import functools

import numpy as np

FEISTEL_ROUNDS = 6
_MASK64 = 2**64 - 1
_MIX1, _MIX2, _GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


def _u64(value: int) -> np.ndarray:
    """A 0-d uint64 array: numpy applies it to a small array about twice as fast as a np.uint64 scalar,
    which matters here, where a batch of 32 windows costs a few hundred tiny array operations."""
    return np.array(value & _MASK64, np.uint64)


_SHIFT30, _SHIFT27, _SHIFT31, _MUL1, _MUL2 = _u64(30), _u64(27), _u64(31), _u64(_MIX1), _u64(_MIX2)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast 64-bit hash (uint64 arithmetic wraps)."""
    x = (x ^ (x >> _SHIFT30)) * _MUL1
    x = (x ^ (x >> _SHIFT27)) * _MUL2
    return x ^ (x >> _SHIFT31)


def _mix64_int(x: int) -> int:
    """_mix64 on one Python int."""
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=256)
def _round_keys(seed: int, epoch: int) -> tuple[np.ndarray, ...]:
    """The Feistel round keys of the permutation chosen by (seed, epoch), computed once per epoch."""
    key = _mix64_int(_mix64_int(seed & _MASK64) ^ epoch)
    return tuple(_u64(_mix64_int((key + (r + 1) * _GOLDEN) & _MASK64)) for r in range(FEISTEL_ROUNDS))


def permute(indices: np.ndarray, n: int, seed: int, epoch) -> np.ndarray:
    """Position -> window under the permutation of [0, n) chosen by (seed, epoch); epoch may vary per element."""
    x = np.asarray(indices, np.uint64).copy()
    epoch = np.broadcast_to(np.asarray(epoch, np.uint64), x.shape)
    bits = max(1, (n - 1).bit_length())
    lo_bits = bits // 2
    shift, lo_mask, hi_mask = _u64(lo_bits), _u64((1 << lo_bits) - 1), _u64((1 << (bits - lo_bits)) - 1)
    limit = _u64(n)

    def rounds(v: np.ndarray, keys: tuple[np.ndarray, ...]) -> np.ndarray:
        hi, lo = v >> shift, v & lo_mask
        for r, round_key in enumerate(keys):  # each round xors one half with a keyed hash of the other: invertible
            if r % 2 == 0:
                hi = hi ^ (_mix64(lo ^ round_key) & hi_mask)
            else:
                lo = lo ^ (_mix64(hi ^ round_key) & lo_mask)
        return (hi << shift) | lo

    # a batch spans one epoch, or two at an epoch's end: one epoch's keys are scalars, several epochs' keys
    # arrays of each element's epoch's keys (the same arithmetic, element by element, in one pass)
    first = int(epoch.flat[0]) if x.size else 0
    if (epoch == first).all():
        keys = _round_keys(int(seed), first)
    else:
        epochs, which = np.unique(epoch, return_inverse=True)
        table = np.asarray([[int(k) for k in _round_keys(int(seed), int(e))] for e in epochs], np.uint64)
        keys = tuple(table[:, r][which.ravel()].reshape(x.shape) for r in range(FEISTEL_ROUNDS))
    x = rounds(x, keys)
    outside = x >= limit
    while outside.any():  # 2^bits < 2n, so on average fewer than two walks
        x[outside] = rounds(x[outside], tuple(k if k.ndim == 0 else k[outside] for k in keys))
        outside = x >= limit
    return x.astype(np.int64)
