"""Device mesh, the one logical-axis rules table, ZeRO stages 0-3, batch placement.

    devices ──make_mesh──> Mesh (data, fsdp, tensor)
    logical_axes.param_axes (names per weight dim) ──RULES for the ZeRO stage──> PartitionSpec per weight
    state {params, opt_state, step, rng} ──state_shardings──> NamedSharding per leaf (jit in/out shardings)
    this process's loader rows ──place_batch──> one global jax.Array split over (data, fsdp)

Mesh axes. `data` and `fsdp` are both data-parallel: the batch is split over their product, and
ZeRO shards state over that same product. They differ only in where they sit in the mesh:
`fsdp` is the inner of the two, so `jax.make_mesh` puts it on nearer devices, which is where the
per-layer parameter gathers of stage 3 belong (e.g. `data` across hosts or slices, `fsdp` within
one). `tensor` splits attention heads and the MLP's hidden units Megatron-style (and the
vocabulary), combined with any ZeRO stage.

ZeRO stages (Rajbhandari et al. 2019) change the table, never the model:
    0  everything replicated over (data, fsdp): plain data parallelism
    1  optimizer state (AdamW mu, nu) sharded over (data, fsdp)
    2  also the gradients: constrained to the optimizer state's sharding as soon as they are
       computed, so the data-parallel reduction is a reduce-scatter, not an all-reduce
    3  also the parameters (FSDP): XLA gathers each weight where a layer uses it

The table is ordered (EasyLM style): for each weight, rules are tried in order; a rule gives a
dimension with that logical name its mesh axes unless the dimension is taken, the mesh axes are
already used by another dimension of the same weight, or the dimension does not divide by their
size. Rules whose mesh axes have size 1 are skipped (sharding over one device is replication).
A ZeRO rule that cannot apply for divisibility falls through to the next rule, and `describe`
names every such weight: ZeRO then shards that weight along another dimension or leaves it
replicated, never silently. A dimension with a logical name no rule covers is an error.
Tensor-parallel divisibility (every dimension TENSOR_RULES splits) is checked up front by `check_model`.

The logical axis names are logical_axes.py's (the model's weights and activations carry them); of the
project only errors.py is imported. Starting several processes as one run is multihost.py's.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core.errors import ShardingError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch is split over both data-parallel axes
ZERO_AXES = ("data", "fsdp")  # ZeRO shards state over the same devices
ZERO_STAGES = (0, 1, 2, 3)  # 0 replicated | 1 optimizer state | 2 + gradients | 3 + parameters sharded
# The logical axis names model.py puts on weights, and the config that sets each one's size (for messages)
AXIS_SOURCES = {"vocab": "the padded vocabulary", "embed": "model.embedding_dim", "heads": "model.num_head",
                "kv_heads": "model.num_kv_head", "kv": "the head size (model.embedding_dim / model.num_head)",
                "mlp": "the MLP width (model.mlp_dim or 4 x embedding_dim)"}
LOGICAL_AXES = tuple(AXIS_SOURCES)

# The rules table: (logical axis name, mesh axes or None). Tensor parallelism comes first, then
# (only for the parts of the state the ZeRO stage shards) the ZeRO rules, largest dimensions
# first, then an explicit "replicated" for every known name.
TENSOR_RULES = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))
ZERO_RULES = (("embed", ZERO_AXES), ("mlp", ZERO_AXES), ("vocab", ZERO_AXES), ("kv", ZERO_AXES),
              ("heads", ZERO_AXES), ("kv_heads", ZERO_AXES))
REPLICATED_RULES = tuple((name, None) for name in LOGICAL_AXES)

# Activations (logical_axes.logical_constraint names): batch over the data-parallel axes, the
# tensor-parallel dimensions over `tensor`, everything else replicated.
ACTIVATION_RULES = {"batch": BATCH_AXES, "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
                    "vocab": "tensor", "length": None, "embed": None, "kv": None}


# ----------------------------------------------------------------------------------------------
# Mesh


def check_sizes(data: int, fsdp: int, tensor: int) -> None:
    """The mesh sizes a config gives: positive, at most one of them -1 (the devices the others leave)."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    if any(v < 1 and v != -1 for v in sizes.values()) or list(sizes.values()).count(-1) > 1:
        raise ShardingError(f"sharding.data, sharding.fsdp and sharding.tensor must be positive, at most one of them "
                            f"-1 (the rest of the devices); got {', '.join(f'{k}={v}' for k, v in sizes.items())}")


def check_zero_stage(zero_stage: int) -> None:
    if zero_stage not in ZERO_STAGES:
        raise ShardingError(f"sharding.zero_stage must be 0, 1, 2 or 3, got {zero_stage}")


def mesh_sizes(data: int, fsdp: int, tensor: int, n: int) -> dict[str, int]:
    """{data, fsdp, tensor} sizes for n devices, one of the configured sizes possibly -1 for the rest."""
    check_sizes(data, fsdp, tensor)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    desc = " x ".join(f"{k}={v}" for k, v in sizes.items())
    free = [k for k, v in sizes.items() if v == -1]
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if n % fixed:
            raise ShardingError(f"sharding mesh {desc}: {fixed} does not divide the {n} devices")
        sizes[free[0]] = n // fixed
    elif fixed != n:
        raise ShardingError(f"sharding mesh {desc} needs {fixed} devices, but there are {n}; "
                            f"set one size to -1 to use the rest")
    return sizes


AXIS_TYPES = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # shardings come from jit and constraints


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh over all devices (of every process); one size may be -1 for the rest."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(data, fsdp, tensor, len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=AXIS_TYPES, devices=devices)


def abstract_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *, n: int) -> jax.sharding.AbstractMesh:
    """The mesh make_mesh would build over n devices, without devices: its shardings give shapes and
    bytes per device (a planning tool's), never placements."""
    sizes = mesh_sizes(data, fsdp, tensor, n)
    return jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=AXIS_TYPES)


def axis_size(mesh, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(mesh.shape[a] for a in axes)


def _mesh_entry(mesh, axes):
    """The PartitionSpec entry for mesh axes, leaving out axes of size 1; None if nothing is left."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def check_model(mesh, sizes: dict[str, int]) -> None:
    """Every dimension the rules table splits for tensor parallelism (TENSOR_RULES: query and key/value
    heads, MLP width, padded vocabulary) must divide evenly. `sizes`: the model's size along each
    logical axis (model.GPTConfig.axis_sizes)."""
    for name, axes in TENSOR_RULES:
        n = axis_size(mesh, axes)
        if sizes[name] % n:
            raise ShardingError(f"{AXIS_SOURCES[name]} ({sizes[name]}) is not divisible by the {axes} axis "
                                f"(sharding.{axes}={n})")


def check_batch(mesh, batch_size: int, micro_batches: int) -> None:
    """Every micro-batch must split evenly over the data-parallel devices."""
    dp = axis_size(mesh, BATCH_AXES)
    micro = batch_size // micro_batches
    if micro % dp:
        raise ShardingError(
            f"a micro-batch of {micro} sequences (training.batch_size={batch_size} / training.micro_batches="
            f"{micro_batches}) does not divide over the {dp} data-parallel devices (data x fsdp)")


# ----------------------------------------------------------------------------------------------
# The rules table and parameter specs


def rules_for(zero_stage: int) -> dict[str, tuple]:
    """The ordered rules for each part of the state at a ZeRO stage: {'params', 'grads', 'opt_state'}."""
    check_zero_stage(zero_stage)
    zero = {"params": zero_stage >= 3, "grads": zero_stage >= 2, "opt_state": zero_stage >= 1}
    return {part: TENSOR_RULES + (ZERO_RULES if z else ()) + REPLICATED_RULES for part, z in zero.items()}


def spec_for(path: str, shape, names, rules, mesh, fallbacks: list | None = None) -> P:
    """The PartitionSpec the ordered `rules` give a weight of `shape` with logical axis `names`."""
    if names is None or len(names) != len(shape):
        raise ShardingError(f"parameter {path} {tuple(shape)} has no logical axis names for each dimension "
                            f"(got {names!r}); every parameter needs them in its `axes` metadata")
    spec = [None] * len(shape)
    done = [n is None for n in names]  # an unnamed dimension is replicated
    used: set[str] = set()
    for name, axes in rules:
        for i, n in enumerate(names):
            if done[i] or n != name:
                continue
            if axes is None:
                done[i] = True
                continue
            entry = _mesh_entry(mesh, axes)
            if entry is None:  # mesh axes of size 1: nothing to shard over
                continue
            entry_axes = {entry} if isinstance(entry, str) else set(entry)
            if entry_axes & used:
                continue
            if shape[i] % axis_size(mesh, entry):
                if fallbacks is not None:
                    fallbacks.append(f"{path} dim {i} ({n}={shape[i]}) over {entry}")
                continue
            spec[i], done[i] = entry, True
            used |= entry_axes
    missing = [n for n, d in zip(names, done) if not d]
    if missing:
        raise ShardingError(f"no sharding rule covers logical axis {missing[0]!r} of parameter {path}; "
                            f"known axes: {', '.join(LOGICAL_AXES)}")
    return P(*spec)


def param_specs(params, axes, rules, mesh, fallbacks: list | None = None):
    """A PartitionSpec for each leaf of `params` (arrays or ShapeDtypeStructs) from its logical `axes`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p, names: spec_for(jax.tree_util.keystr(path), p.shape, names, rules, mesh, fallbacks),
        params, axes,
    )


def _like_params(tree, params, param_value, other):
    """For every leaf of an optimizer state `tree`: param_value(path) where the leaf is a parameter's
    moment, i.e. its path ends with a parameter's path and it has that parameter's shape (AdamW's mu and nu
    hold every parameter; Muon's momentum, in optax.partition's masked trees, the matrices alone), other()
    elsewhere (counts, coefficients)."""
    shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}

    def leaf(path, x):
        for i in range(len(path)):
            name = jax.tree_util.keystr(tuple(path[i:]))
            if shapes.get(name) == getattr(x, "shape", None):
                return param_value(name)
        return other()

    return jax.tree_util.tree_map_with_path(leaf, tree)


def state_shardings(abstract_state, axes, mesh, zero_stage: int):
    """NamedShardings for the train state {params, opt_state, step, rng}, and those of its gradients.

    Returns (state_shardings, grad_shardings, fallbacks): optimizer-state subtrees shaped like the
    params get the opt_state rules, other optimizer leaves (counts) and step and rng are replicated.
    """
    rules = rules_for(zero_stage)
    fallbacks: list[str] = []
    params = abstract_state["params"]
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    specs = {part: param_specs(params, axes, rules[part], mesh, fallbacks if part != "grads" else None)
             for part in rules}
    replicated = NamedSharding(mesh, P())
    opt_specs = {jax.tree_util.keystr(p): spec for p, spec in jax.tree_util.tree_flatten_with_path(
        specs["opt_state"], is_leaf=lambda x: isinstance(x, P))[0]}
    shardings = {
        "params": jax.tree.map(named, specs["params"]),
        "opt_state": _like_params(abstract_state["opt_state"], params, lambda name: named(opt_specs[name]),
                                  lambda: replicated),
        **{k: jax.tree.map(lambda _: replicated, v) for k, v in abstract_state.items()
           if k not in ("params", "opt_state")},
    }
    return shardings, jax.tree.map(named, specs["grads"]), sorted(set(fallbacks))


def with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs carrying `shardings`: the target of a jitted init or a checkpoint restore."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)


def activation_rules(mesh):
    """For logical_axes.activation_sharding: a tuple of activation axis names -> NamedSharding."""

    def to_sharding(names):
        unknown = [n for n in names if n is not None and n not in ACTIVATION_RULES]
        if unknown:
            raise ShardingError(f"no sharding rule for activation axis {unknown[0]!r}")
        return NamedSharding(mesh, P(*(_mesh_entry(mesh, ACTIVATION_RULES[n]) if n else None for n in names)))

    return to_sharding


# ----------------------------------------------------------------------------------------------
# Batches


def batch_sharding(mesh) -> NamedSharding:
    """Rows of a batch over the data-parallel axes; tokens within a row stay together."""
    return NamedSharding(mesh, P(_mesh_entry(mesh, BATCH_AXES)))


def process_rows(mesh, global_batch: int) -> tuple[int, int]:
    """(index, count): this process holds rows [index * B/count, (index + 1) * B/count) of a global batch B.

    What the loader needs as process_index/process_count. Processes whose devices hold the same
    rows (e.g. when the tensor axis spans processes) share an index and load the same rows.
    """
    blocks = {}
    for device, idx in batch_sharding(mesh).devices_indices_map((global_batch,)).items():
        lo, hi, _ = idx[0].indices(global_batch)
        blocks.setdefault(device.process_index, []).append((lo, hi))
    spans = {}
    for proc, ranges in blocks.items():
        ranges.sort()
        if any(a[1] != b[0] and a != b for a, b in zip(ranges, ranges[1:])):
            raise ShardingError(f"process {proc}'s devices hold non-contiguous batch rows {ranges}")
        spans[proc] = (ranges[0][0], ranges[-1][1])
    distinct = sorted(set(spans.values()))
    size = distinct[0][1] - distinct[0][0]
    if any(hi - lo != size for lo, hi in distinct) or size * len(distinct) != global_batch:
        raise ShardingError(f"the batch rows do not split evenly over processes: {spans}")
    lo, _ = spans[jax.process_index()]
    return lo // size, len(distinct)


def place_batch(local_rows: np.ndarray, mesh, global_batch: int) -> jax.Array:
    """The global batch (global_batch, ...) as one array split over (data, fsdp), from this process's
    rows (the block process_rows names)."""
    global_shape = (global_batch, *local_rows.shape[1:])
    return jax.make_array_from_process_local_data(batch_sharding(mesh), local_rows, global_shape)


# ----------------------------------------------------------------------------------------------
# How much is sharded


def sharded_bytes(tree, shardings, mesh):
    """(total bytes, bytes per device, bytes in leaves that are sharded at all) of a tree of arrays or
    ShapeDtypeStructs placed by `shardings` on `mesh` (a Mesh or an AbstractMesh)."""
    total = per_device = sharded = 0
    for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        nbytes = math.prod(a.shape) * np.dtype(a.dtype).itemsize
        split = math.prod(axis_size(mesh, e) for e in s.spec if e is not None)
        total, per_device = total + nbytes, per_device + nbytes / split
        sharded += nbytes if split > 1 else 0
    return total, per_device, sharded


def describe(abstract_state, shardings, mesh, zero_stage: int, fallbacks=()) -> str:
    """A few lines: the mesh, and for params and optimizer state the share sharded and the bytes per device."""
    sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in MESH_AXES)
    lines = [f"sharding: mesh {sizes} ({mesh.size} devices, {jax.process_count()} process(es)), "
             f"ZeRO stage {zero_stage}"]
    for part in ("params", "opt_state"):
        total, per_device, sharded = sharded_bytes(abstract_state[part], shardings[part], mesh)
        lines.append(f"  {part}: {sharded / max(total, 1):.1%} of {total / 2**20:.2f} MiB sharded; "
                     f"{per_device / 2**20:.2f} MiB per device ({per_device / max(total, 1):.1%})")
    if fallbacks:
        lines.append(f"  not divisible, so sharded along another dimension or replicated: {'; '.join(fallbacks)}")
    return "\n".join(lines)
