"""The accelerators this project knows: each chip's dense bfloat16 peak (for MFU in the training log,
bench.py and the plan), and for `train.py --plan` the memory of each JAX device and what a TPU slice's
name (v4-32, v5e-16) means in devices and hosts.

    peak_flops(device_kind) -> FLOP/s of one JAX device, or None (the CPU)
    target("v4-32") -> Target(label, memory, count, backend, peak_flops, processes)
"""
from __future__ import annotations

import dataclasses
import re

from core.errors import PlanError

GiB = 2**30

# Peak dense bf16 FLOP/s per chip, for MFU; matched against jax.devices()[0].device_kind (per device: peak_flops).
# Devices not listed (the CPU) show no MFU.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe part is lower (756e12)
    "A100": 312e12,
    "L4": 121e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v6 lite": 918e12,  # Trillium
    "TPU v4": 275e12,
    "TPU v3": 123e12,
    "TPU v2": 45e12,
}


# JAX devices per chip where a chip's TensorCores are devices of their own (TPU v2, v3); a v4 or
# v5p chip's two cores are one device (megacore), and the other chips have one core
DEVICES_PER_CHIP = {"TPU v2": 2, "TPU v3": 2}


def peak_flops(device_kind: str) -> float | None:
    """Dense bfloat16 peak FLOP/s of one JAX device of this kind (a TPU v2 or v3 core is half a chip), or
    None for a kind not in PEAK_FLOPS. MFU divides by this times the device count."""
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return flops / DEVICES_PER_CHIP.get(name, 1)
    return None


# ----------------------------------------------------------------------------------------------
# Devices a run is planned for (train.py --plan): memory per JAX device, how slice names count devices


@dataclasses.dataclass(frozen=True)
class Kind:
    label: str
    memory: float  # bytes of HBM per JAX device
    peak_key: str | None  # PEAK_FLOPS's key: the chip's dense bfloat16 peak
    backend: str  # "gpu" or "tpu": what attention.resolve_attention picks for
    per_chip: int = 1  # JAX devices per chip (TPU v2, v3: two TensorCores, each its own device)
    slice_names: str = ""  # what the number in a slice name (v3-32) counts: "cores" or "chips"
    one_host: int = 4  # chips a single-host slice has at most; larger slices have 4 chips per host


# TPU v2/v3/v4/v5p slice names count TensorCores (2 per chip); v4 and v5p show a chip's two cores as one
# JAX device (megacore), v2 and v3 as two. v5e and v6e slice names count chips (one core each).
KINDS = {
    "h100": Kind("H100 80 GiB", 80 * GiB, "H100", "gpu"),
    "h200": Kind("H200 141 GB", 141e9, "H200", "gpu"),
    "a100-40": Kind("A100 40 GiB", 40 * GiB, "A100", "gpu"),
    "a100-80": Kind("A100 80 GiB", 80 * GiB, "A100", "gpu"),
    "v2": Kind("TPU v2 (8 GiB per core)", 8 * GiB, "TPU v2", "tpu", per_chip=2, slice_names="cores"),
    "v3": Kind("TPU v3 (16 GiB per core)", 16 * GiB, "TPU v3", "tpu", per_chip=2, slice_names="cores"),
    "v4": Kind("TPU v4 (32 GiB per chip)", 32 * GiB, "TPU v4", "tpu", slice_names="cores"),
    "v5e": Kind("TPU v5e (16 GiB per chip)", 16 * GiB, "TPU v5e", "tpu", slice_names="chips", one_host=8),
    "v5p": Kind("TPU v5p (95 GiB per chip)", 95 * GiB, "TPU v5p", "tpu", slice_names="cores"),
    "v6e": Kind("TPU v6e (32 GiB per chip)", 32 * GiB, "TPU v6 lite", "tpu", slice_names="chips", one_host=8),
}
ALIASES = {"h100-80": "h100", "a100": "a100-80", "v5litepod": "v5e", "v5lite": "v5e"}
CORES_PER_CHIP = 2  # TPU v2, v3, v4, v5p: the cores a slice name counts
CHIPS_PER_HOST = 4  # a multi-host TPU slice's hosts (workers), each one process of the run


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a run is planned for: `count` JAX devices of `memory` bytes each."""

    label: str
    memory: float
    count: int
    backend: str
    peak_flops: float | None  # per JAX device; None: unknown (a memory size)
    processes: int | None = None  # a TPU slice's hosts, one process each; None: not known from the name


def here() -> Target:
    """The devices this process trains on: every JAX device, each with its allocator's limit (a GPU's, a
    TPU's) or, on the CPU, which reports none, its share of this machine's physical memory."""
    import os

    import jax

    device = jax.local_devices()[0]  # one of this process's: another's answers no memory_stats
    limit = ((device.memory_stats() if hasattr(device, "memory_stats") else None) or {}).get("bytes_limit")
    memory = limit or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / jax.local_device_count()
    label = "CPU device(s) of this machine" if device.platform == "cpu" else device.device_kind
    return Target(label, float(memory), jax.device_count(), device.platform, peak_flops(device.device_kind))


def target(name: str = "H100", devices: int | None = None) -> Target:
    """A Target from a device name (H100, H200, A100-40, A100-80, v3, v4-32, v5e-16, v5p-128, ...) or a
    memory size of one GPU (24GiB, 80GB), and a device count (a TPU slice name gives its own)."""
    text = name.strip().lower().replace(" ", "").replace("_", "-")
    text = re.sub(r"^(nvidia-|tpu-?)", "", text)
    size = re.fullmatch(r"(\d+(?:\.\d+)?)(gib|gb)", text)
    if size:
        memory = float(size[1]) * (GiB if size[2] == "gib" else 1e9)
        if memory < 1:  # every share of it is a division by it
            raise PlanError(f"--device {name.strip()}: a GPU's memory must be more than 0, e.g. 24GiB")
        return Target(f"a GPU with {name.strip()}", memory, _count(devices, None, name), "gpu", None)
    m = (re.fullmatch(r"(h100|h200|a100)(?:-?(\d+)(?:gb|gib)?)?", text)
         or re.fullmatch(r"(v2|v3|v4|v5e|v5p|v5litepod|v5lite|v6e)(?:-(\d+))?", text))
    if not m:
        raise PlanError(f"unknown device {name!r}; known: H100, H200, A100-40, A100-80, v2, v3, v4, v5e, v5p, v6e "
                        f"(TPU slices as v3-32, v4-32, v5e-16), or a GPU's memory such as 24GiB")
    base, number = m[1], m[2]
    if base in ("h100", "h200", "a100"):
        key = f"{base}-{number}" if number else base
        key = ALIASES.get(key, key)
        if key not in KINDS:
            raise PlanError(f"unknown device {name!r}: {base.upper()} comes as "
                            f"{', '.join(k.upper() for k in KINDS if k.startswith(base))}")
        kind, count, processes = KINDS[key], _count(devices, None, name), None
    else:
        kind = KINDS[ALIASES.get(base, base)]
        in_slice = processes = None
        if number:
            n = int(number)
            if n < 1:
                smallest = CORES_PER_CHIP if kind.slice_names == "cores" else 1
                raise PlanError(f"TPU slice {name}: no {kind.slice_names} in it; the smallest is {base}-{smallest}")
            chips = n // CORES_PER_CHIP if kind.slice_names == "cores" else n
            if kind.slice_names == "cores" and n % CORES_PER_CHIP:
                raise PlanError(f"TPU slice {name}: {base} slices are named by TensorCores, an even number")
            in_slice = chips * kind.per_chip
            processes = 1 if chips <= kind.one_host else -(-chips // CHIPS_PER_HOST)
        count = _count(devices, in_slice, name)
    peak = peak_flops(kind.peak_key) if kind.peak_key else None  # per JAX device, as training counts it
    return Target(kind.label, kind.memory, count, kind.backend, peak, processes)


def _count(devices: int | None, in_slice: int | None, name: str) -> int:
    if devices is not None and devices < 1:
        raise PlanError(f"--devices must be a positive number of devices, got {devices}")
    if in_slice is not None and devices is not None and devices != in_slice:
        raise PlanError(f"{name} has {in_slice} JAX devices, not --devices {devices}")
    return in_slice or devices or 1
