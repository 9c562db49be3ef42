"""Rematerialisation of a model's blocks (model.remat): jax.checkpoint's policies, and a block whose
backward pass is pinned in place, so that the memory remat drops stays dropped (`pinned`).

    forward(remat)   the function model.GPT calls a block through: `plain`, or `pinned` under the policy

A block is any Flax NNX module called as block(x, rope, dropout_key, mask); this file knows nothing else
of the model.
"""
from __future__ import annotations

import functools

import jax
from flax import nnx

REMAT_POLICIES = {
    "none": None,  # keep every activation: fastest, most memory
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only block inputs, recompute the rest
    # keep the outputs of weight matmuls, recompute attention scores and elementwise ops
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def forward(remat: str):
    """How a block is called under model.remat (a name of REMAT_POLICIES)."""
    return plain if remat == "none" else functools.partial(pinned, REMAT_POLICIES[remat])


def plain(block, x: jax.Array, rope, dropout_key, mask=None):
    """block(x, ...) as it is: model.remat none."""
    return block(x, rope, dropout_key, mask)


def pinned(policy, block, x: jax.Array, rope, dropout_key, mask=None):
    """block(x, ...) under jax.checkpoint(policy), with its backward pass pinned in place.

    Remat saves memory only if the compiler recomputes a block when the backward pass reaches it and
    finishes the block's gradients before moving on; a scheduler is free to do otherwise (XLA's CPU
    scheduler, left free, recomputes blocks ahead and defers their bias and norm gradients'
    reductions, keeping most of what remat drops). Two optimization barriers leave it no choice: what
    the recomputation starts from (the block's input and what the policy saved) waits for the
    cotangent of the block's output, and the cotangent of its input leaves together with all of the
    block's gradients. The weights stay out of the first barrier, so a sharded block's weights can
    still be gathered ahead. Values and gradients are jax.checkpoint's; forward-mode autodiff
    (jax.jvp) of a rematerialised model is not supported.

    The GPU compiler keeps barriers until it has scheduled; the CPU compiler drops them before,
    unless told otherwise as test_plan.py does. The second barrier also holds the earlier block's
    backward pass until this block's gradients are reduced over the data-parallel devices: the cost
    of that in communication is still to be measured on a multi-device GPU or TPU.
    """
    graphdef, state = nnx.split(block)
    layout = {}  # set by the forward pass for the backward: the residuals' tree, and which are activations

    def forward(state, x, rope, dropout_key, mask):
        return nnx.merge(graphdef, state)(x, rope, dropout_key, mask)

    pinned = jax.custom_vjp(forward)

    def pinned_forward(state, *args):
        y, backward = jax.vjp(jax.checkpoint(forward, policy=policy), state, *args)
        residuals, layout["tree"] = jax.tree.flatten(backward)
        ids = {id(leaf) for leaf in jax.tree.leaves(state)}
        layout["activations"] = [i for i, r in enumerate(residuals) if id(r) not in ids]
        return y, residuals

    def pinned_backward(residuals, dy):
        residuals, at = list(residuals), layout["activations"]
        pinned_residuals, dy = jax.lax.optimization_barrier(([residuals[i] for i in at], dy))
        for i, r in zip(at, pinned_residuals):
            residuals[i] = r
        return jax.lax.optimization_barrier(jax.tree.unflatten(layout["tree"], residuals)(dy))

    pinned.defvjp(pinned_forward, pinned_backward)
    return pinned(state, x, rope, dropout_key, mask)
