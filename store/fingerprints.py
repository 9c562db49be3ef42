"""Whether a checkpoint reads back as it was saved, and in which format it was written.

    fingerprints(state)          a 64-bit fingerprint of every array, computed where the arrays are
    metadata(state, tokens)      what a checkpoint is saved with (orbax's custom metadata): its format
                                 (formats.py), the tokens trained up to it, the arrays' fingerprints and
                                 one of that metadata itself
    checkpoint_format(custom)    the format a checkpoint was written in, from that metadata: recorded from
                                 format 3 on, told by what it holds before (fingerprints: 2; nothing: 1)
    fingerprint_problem          what differs between a restored state and its saved fingerprints, in
                                 words (None: it reads as saved); format 1 has none to check
    tokens_problem               a format 2 checkpoint's tokens trained (no fingerprint of them in that
                                 format) other than the count its run's record fixes
    step_problem, tree_mismatch  a checkpoint under another step's name; one of another model

checkpoints.py saves, restores and loads through these; knows nothing of runs or storage.
"""
from __future__ import annotations

import functools
import typing

import numpy as np

from store import formats

FINGERPRINTS = "fingerprints"  # the key of a checkpoint's custom metadata that holds them
TOKENS = "tokens"  # ... and the one of the tokens trained up to it (context and batch may change on resume)
ROW = "row"  # ... and the step's row of metrics.jsonl, which a resume puts back where the log lost it
METADATA = "#metadata"  # the fingerprint, among the arrays', of the rest of the metadata (format, tokens)


def named_leaves(tree) -> list[tuple[str, typing.Any]]:
    """(path/of/the/leaf, leaf) of a state tree; block indices read the same as ints or as orbax's strings."""
    import jax

    name = lambda k: getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))  # noqa: E731  (dict, list, attr)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [("/".join(str(name(k)) for k in path), leaf) for path, leaf in flat]


def fingerprints(tree) -> dict[str, str]:
    """A 64-bit fingerprint of every array of a state, as 16 hex digits by leaf name.

    For an array whose elements, read as unsigned integers of their width (widened to uint32; an
    8-byte element as two), are u_i at row-major position i, it is the pair of uint32 sums (mod 2**32)
        sum_i u_i * (2*i*0x9E3779B1 + 1)      and      sum_i rotl(u_i, 13) * (2*i*0x85EBCA77 + 0x27D4EB2F)
    Every multiplier is odd, so any one flipped bit changes both sums; the weights depend on the
    position, so moved elements change them too. It is computed where the arrays are (a sharded
    state on its devices, by every process alike), one read of the state, and never gathers an
    array onto one host."""
    import jax

    names, leaves = zip(*named_leaves(tree)) if jax.tree.leaves(tree) else ((), ())
    sums = jax.device_get(_fingerprint_fn()(list(leaves)))
    return {n: f"{int(a):08x}{int(b):08x}" for n, (a, b) in zip(names, sums)}


@functools.cache
def _fingerprint_fn():
    import jax
    import jax.numpy as jnp
    import numpy as np

    def one(x):
        x = jnp.asarray(x)
        if x.dtype == jnp.bool_:
            u = x.astype(jnp.uint32)
        else:
            width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
            u = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)  # 8 bytes: a last axis of 2
        i = jnp.zeros(u.shape, jnp.uint32)  # the row-major position, without reshaping a sharded array
        for axis, size in enumerate(u.shape):
            i = i * np.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, u.shape, axis)
        a = jnp.sum(u * (i * np.uint32(2 * 0x9E3779B1 % 2**32) + np.uint32(1)), dtype=jnp.uint32)
        r = (u << np.uint32(13)) | (u >> np.uint32(19))
        b = jnp.sum(r * (i * np.uint32(2 * 0x85EBCA77 % 2**32) + np.uint32(0x27D4EB2F)), dtype=jnp.uint32)
        return jnp.stack([a, b])

    return jax.jit(lambda leaves: [one(x) for x in leaves])


def metadata(state, tokens: int | None, row: dict | None = None) -> dict:
    """The custom metadata a checkpoint of `state` is saved with: this code's format, the tokens trained up
    to it, the step's metrics row (`row`), and the fingerprints of every array and of that metadata itself
    (METADATA)."""
    custom = {**formats.record(), **({TOKENS: int(tokens)} if tokens is not None else {}),
              **({ROW: row} if row is not None else {})}
    return {**custom, FINGERPRINTS: {**fingerprints(state), METADATA: metadata_fingerprint(custom)}}


def metadata_fingerprint(custom: dict) -> str:
    """16 hex digits of the sha256 of a checkpoint's metadata other than its fingerprints."""
    import hashlib
    import json

    rest = {k: v for k, v in custom.items() if k != FINGERPRINTS}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_format(custom: dict) -> int:
    """The format a checkpoint was written in (formats.py), from its metadata: as recorded there, or for one
    from before formats were recorded, by what the metadata holds: fingerprints (format 2) or nothing of
    this project's at all (format 1). A ValueError saying why when it is neither: damaged metadata."""
    number = custom.get("format")
    if number is not None:  # recorded from format 3 on: any smaller number is damage, not age
        if not isinstance(number, int) or isinstance(number, bool) or number < formats.FIRST_RECORDED:
            raise ValueError(f"its format in _CHECKPOINT_METADATA ({number!r}) is none this project has recorded "
                             f"(an integer from {formats.FIRST_RECORDED} on): the file was altered or damaged")
        return number
    if FINGERPRINTS in custom or METADATA in custom:
        return 2
    if not custom:
        return 1
    raise ValueError("its array fingerprints (in _CHECKPOINT_METADATA) are missing or unreadable, so what was "
                     "read cannot be checked against what was saved")


def unverified(step: int, directory) -> str:
    """The one line said of a format 1 checkpoint when it is read."""
    return (f"checkpoint {step} in {directory} was written before checkpoints carried fingerprints (format 1, "
            f"before {formats.SINCE[2]}): read as it is, without checking it against what was saved; the "
            f"checkpoints saved from now on are checked")


def fingerprint_problem(custom: dict, number: int, state) -> str | None:
    """Which arrays of a restored checkpoint of format `number`, with the metadata `custom`, differ from the
    fingerprints saved with it; None only when every array has its fingerprint and all agree, and the
    metadata's own fingerprint (from format 3 on) agrees too. From format 2 on every checkpoint carries
    them, so missing or unreadable ones are a problem: the check fails closed, never open. A checkpoint of
    format 1 has none to check (None)."""
    if number == 1:
        return None
    if problem := metadata_problem(custom, number):
        return problem
    saved = custom[FINGERPRINTS]
    now = fingerprints(state)
    unchecked = sorted(now.keys() - saved.keys())
    if unchecked:
        return (f"array {unchecked[0]}" + (f" and {len(unchecked) - 1} more" if len(unchecked) > 1 else "") +
                " has no fingerprint in _CHECKPOINT_METADATA, so it cannot be checked against what was saved")
    bad = sorted(name for name in now if saved[name] != now[name])
    if not bad:
        return None
    return (f"array {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") +
            " read back other than saved (its fingerprint differs): the files were altered or damaged")


def metadata_problem(custom: dict, number: int) -> str | None:
    """What fingerprint_problem finds without the arrays: array fingerprints that are missing or unreadable,
    and (from format 3 on) metadata that differs from its own fingerprint; None for format 1."""
    if number == 1:
        return None
    saved = custom.get(FINGERPRINTS)
    if not isinstance(saved, dict) or not all(isinstance(v, str) for v in saved.values()):
        return ("its array fingerprints (in _CHECKPOINT_METADATA) are missing or unreadable, so what was read "
                "cannot be checked against what was saved")
    if (number >= 3 or METADATA in saved) and saved.get(METADATA) != metadata_fingerprint(custom):
        return ("its metadata (_CHECKPOINT_METADATA: format, tokens trained) reads back other than saved (its "
                "fingerprint differs): the file was altered or damaged")
    return None


def tokens_problem(custom: dict, number: int, step: int, tokens_per_step: int | None) -> str | None:
    """Why the tokens trained that a checkpoint of format 2 at `step` records cannot be its count, when its
    run's record fixes the tokens of every step so far (`tokens_per_step`; None: it does not, as after a
    resume that changed the batch or the context). Format 2 has no fingerprint of its metadata, so its count
    is checked against step x tokens_per_step instead; format 3's is fingerprinted (fingerprint_problem), and
    format 1 records none. None when it agrees, or records no count (the caller counts)."""
    if number != 2 or tokens_per_step is None or TOKENS not in custom:
        return None
    tokens, expected = custom[TOKENS], step * tokens_per_step
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens == expected:
        return None
    return (f"its tokens trained ({tokens!r} in _CHECKPOINT_METADATA) are not the {step} x {tokens_per_step} = "
            f"{expected} that the run's config and log fix (a format 2 checkpoint has no fingerprint of its "
            f"metadata): the file was altered or damaged")


def step_problem(state, step: int) -> str | None:
    """A checkpoint whose directory names another step than the state it holds (renamed or copied
    under another number): not to be trusted as that step. None when they agree (or the state holds no
    step, as an import's parameters alone)."""
    held = state.get("step") if isinstance(state, dict) else None
    if held is None:
        return None
    held = int(np.asarray(held))
    if held == step:
        return None
    return f"it holds the state of step {held}, not {step}: its directory was renamed or copied under another step"


def tree_mismatch(saved, abstract_state) -> str | None:
    """How a checkpoint's tree (its metadata) and this run's state differ: keys on one side only and
    arrays of another shape, the first few of each; None when they agree."""
    def shapes(tree) -> dict[str, tuple | None]:
        return {name: getattr(leaf, "shape", None) for name, leaf in named_leaves(tree)}

    def show(names) -> str:  # the parameters first: they say what differs in the model
        first = sorted(names, key=lambda n: (not n.startswith("params/"), n))[:4]
        return ", ".join(first) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    there, here = shapes(saved), shapes(abstract_state)
    resized = [f"{k} {tuple(there[k])} there, {tuple(here[k])} here" for k in sorted(
        there.keys() & here.keys(), key=lambda n: (not n.startswith("params/"), n))
        if None not in (there[k], here[k]) and tuple(there[k]) != tuple(here[k])]
    parts = ([f"only in the checkpoint: {show(there.keys() - here.keys())}"] if there.keys() - here.keys() else []) + \
            ([f"only in this run: {show(here.keys() - there.keys())}"] if here.keys() - there.keys() else []) + \
            ([f"other shapes: {', '.join(resized[:3])}" + (f" and {len(resized) - 3} more" if len(resized) > 3 else "")]
             if resized else [])
    return "; ".join(parts) or None
