"""LoRA (Hu et al. 2021, arXiv 2106.09685): low-rank adapters on a model's projections, apart from the GPT.

    init_factors      A (in dims..., r), uniform as PEFT's, and B (r, out dims...), zeros: a new adapter
                      changes nothing
    output            (alpha / r) * (dropout(x) A) B, a kernel's einsum split at the rank; B's slices of
                      the projections a fused weight (q, k, v) holds but the run does not adapt are zero
    adapted, slices   which Dense of a block gets adapters, and which of its fused slices
    split, join       a parameter tree into (base, adapters) and back: a LoRA run trains and saves the
                      adapters alone, beside a frozen base
    merge, factors    the base's parameters with each adapter folded in (kernel + (alpha / r) A B), and
                      each adapter's factors for an export (convert_torch.py --format peft)

model.py's Dense holds a kernel's factors as its own `lora_a` and `lora_b` (their place in the parameter
tree, which checkpoints and exports name) and applies them through `output`; `model.adapted_kernels`
says where they sit. A fused q/k/v weight (k/v with grouped heads) has one A shared by its adapted
projections, each with its own slice of B (PEFT trains an A per projection; the export copies the
shared A to each). Imports attention.py's dropout only of the project.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from layers.attention import dropout

LEAVES = ("lora_a", "lora_b")  # an adapted kernel's factors, beside it in the parameter tree


def adapted(lora, *targets: str):
    """`lora` (a config.LoRAConfig) if it targets any of `targets` (q, k, v, o, mlp), else None."""
    return lora if lora is not None and set(targets) & set(lora.targets) else None


def slices(lora, *targets: str) -> tuple[float, ...] | None:
    """For a weight fusing `targets` along its first output dimension: 1 where the run adapts it, 0 where not."""
    return None if lora is None else tuple(float(t in lora.targets) for t in targets)


def init_factors(shape, axes, n_in: int, rank: int, key: jax.Array) -> tuple[nnx.Param, nnx.Param]:
    """(A, B) for a kernel of `shape` whose first `n_in` dims are its inputs, with logical `axes`: A takes the
    input axis names and B the output ones (sharding.py places them as their kernel), the rank none."""
    bound = 1.0 / math.sqrt(math.prod(shape[:n_in]))  # PEFT: kaiming_uniform_(a=sqrt(5)) of an (r, fan_in) weight
    a = jax.random.uniform(key, (*shape[:n_in], rank), jnp.float32, -bound, bound)
    b = jnp.zeros((rank, *shape[n_in:]), jnp.float32)
    return nnx.Param(a, axes=(*axes[:n_in], None)), nnx.Param(b, axes=(None, *axes[n_in:]))


def masked(b: jax.Array, chosen: tuple[float, ...] | None) -> jax.Array:
    """B (r, out dims...) with the slices of its first output dim that are not `chosen` zeroed."""
    if chosen is None:
        return b
    return b * jnp.asarray(chosen, b.dtype).reshape((1, -1) + (1,) * (b.ndim - 2))


def output(spec: str, x: jax.Array, a: jax.Array, b: jax.Array, *, n_in: int, scale: float, rate: float,
           chosen: tuple[float, ...] | None, key, dtype) -> jax.Array:
    """scale * einsum(einsum(dropout(x), A), B) for a kernel applied as einsum(spec, x, kernel), in `dtype`:
    the einsum split at the rank (the (B, T, r) product in between), dropout at `rate` with `key`."""
    ins, out = spec.split("->")
    x_dims, k_dims = ins.split(",")
    r = next(c for c in "rzyxwvu" if c not in spec)  # a letter for the rank dimension
    kept = "".join(c for c in x_dims if c not in k_dims[:n_in])  # x's batch dims, e.g. "bt"
    x = dropout(x.astype(dtype), rate, key)
    h = jnp.einsum(f"{x_dims},{k_dims[:n_in]}{r}->{kept}{r}", x, a.astype(dtype))
    y = jnp.einsum(f"{kept}{r},{r}{k_dims[n_in:]}->{out}", h, masked(b, chosen).astype(dtype))
    return (scale * y).astype(dtype)


def split(params: dict) -> tuple[dict, dict]:
    """(base, adapters) of a pure dict of parameters: the adapters are the `lora_a` and `lora_b` leaves, with
    their nesting; the base is everything else (the base model's own tree)."""
    base, adapters = {}, {}
    for k, v in params.items():
        if isinstance(v, dict):
            b, a = split(v)
            if b:
                base[k] = b
            if a:
                adapters[k] = a
        elif k in LEAVES:
            adapters[k] = v
        else:
            base[k] = v
    return base, adapters


def join(base: dict, adapters: dict) -> dict:
    """The union of split's two trees: the parameters of the model with adapters."""
    out = dict(base)
    for k, v in adapters.items():
        out[k] = join(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def _node(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def merge(params: dict, kernels: dict) -> dict:
    """The base's parameters (no adapter leaves) computing what the adapted model with `params` (base and
    adapters) computes: each adapted kernel replaced by kernel + scale * A @ B, in float32. `kernels`:
    model.adapted_kernels, {path: (scale, chosen slices)}."""
    merged, _ = split(params)
    for path, (scale, chosen) in kernels.items():
        node = _node(params, path)
        update = jnp.tensordot(jnp.asarray(node["lora_a"], jnp.float32),
                               masked(jnp.asarray(node["lora_b"], jnp.float32), chosen), axes=1)
        _node(merged, path)["kernel"] = jnp.asarray(node["kernel"], jnp.float32) + scale * update
    return merged


def factors(adapters: dict, kernels: dict) -> dict:
    """{'blocks.0.attn.c_attn': (A, B, targeted)} for every adapted kernel (`kernels`: model.adapted_kernels),
    from `adapters` (split's tree, numpy): A (in dims..., r) and B (r, out dims...) as float32 numpy arrays,
    B's slices of untargeted projections zero, and `targeted` (out dims...) True where the adapter may change
    the output. The update of the kernel is (alpha / r) * A @ B. What an export of the adapters maps."""
    import numpy as np

    out = {}
    for path, (_, chosen) in kernels.items():
        node = _node(adapters, path)
        a, b = np.asarray(node["lora_a"], np.float32), np.asarray(node["lora_b"], np.float32)
        targeted = np.ones(b.shape[1:], bool)
        if chosen is not None:
            targeted = targeted & np.asarray(chosen, bool).reshape((-1,) + (1,) * (b.ndim - 2))
        out[".".join(map(str, path))] = (a, b * targeted, targeted)
    return out
