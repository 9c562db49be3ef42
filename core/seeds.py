"""JAX keys from the 64-bit seeds this project's configs and command lines take.

    key_of(seed)   jax.random.key(seed) for a seed JAX takes as it is (-2**31 <= seed < 2**32), and for any
                   other 64-bit seed the key of its low 32 bits folded with its high 32 bits

With 64-bit integers off (JAX's default), jax.random.key keeps a Python int's low 32 bits alone, so seeds that
differ only above them (7 and 2**32 + 7) would give one key: the same initial weights, dropout and samples
under two seeds. The seeds JAX takes whole keep the key they always had, so runs and samples made with them
are unchanged.
"""
from __future__ import annotations

MASK32 = 2**32 - 1


def key_of(seed: int):
    """The jax.random key of a 64-bit `seed` (see the module docstring)."""
    import jax

    if -2**31 <= seed < 2**32:
        return jax.random.key(seed)
    return jax.random.fold_in(jax.random.key(seed & MASK32), (seed >> 32) & MASK32)
