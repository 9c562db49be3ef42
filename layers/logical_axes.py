"""Logical axis names: the one interface between the model code and sharding.py.

model.py names every parameter dimension in its `axes` metadata (`vocab`, `embed`, `heads`,
`kv_heads`, `kv`, `mlp`, or None for a replicated dimension) and constrains its main activations
by name (`batch`, `length`, and the same names). sharding.py maps names to mesh axes, in one
table; the model code never sees a mesh.

    param_axes(state)                        the names of every parameter, a pytree like `state`
    with activation_sharding(to_sharding):   installed by step.py from sharding.activation_rules(mesh)
        logical_constraint(x, axes)          x placed as `to_sharding(axes)` says; x itself outside
        activation_sharding_of(axes)         that sharding itself (or None), for code that places its
                                             own work, e.g. a Pallas kernel run per device

Without an installed function (a single device, plain data parallelism) every constraint is a no-op.
This file imports nothing of the project.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
from flax import nnx

_activation_sharding: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(names_to_sharding: Callable):
    """Within this context, traced model code constrains activations with `names_to_sharding(axes)`."""
    token = _activation_sharding.set(names_to_sharding)
    try:
        yield
    finally:
        _activation_sharding.reset(token)


def activation_sharding_of(axes: tuple[str | None, ...]):
    """The sharding that activations with logical axis names `axes` get in this context; None outside one."""
    to_sharding = _activation_sharding.get()
    return None if to_sharding is None else to_sharding(axes)


def logical_constraint(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """x constrained to the sharding of its logical axis names `axes` (one per dimension); x outside a context."""
    sharding = activation_sharding_of(axes)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def param_axes(state):
    """The logical axis names of every parameter, as a pytree shaped like `state`."""
    return jax.tree.map(
        lambda v: v.get_metadata("axes"), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
