"""What this machine lets the process use of its memory: the smallest of its physical memory, the
process's address-space limit (`ulimit -v`: RLIMIT_AS, less what the process has mapped already) and its
cgroup's memory limit (a container's, a SLURM job's: memory.max, less what the group uses already).
The CPU backend reports no memory limit of its own, so a check of what fits on a CPU reads it here.
Imports nothing of the project."""
from __future__ import annotations

import os
import pathlib
import resource

CGROUP = pathlib.Path("/sys/fs/cgroup")  # cgroup v2's unified hierarchy (v1's memory controller beneath it)


def _read_int(path: pathlib.Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # ("max": no limit)


def _cgroup_room() -> int | None:
    """Bytes the process's cgroup may still take (its limit less its use), None without a limit."""
    try:
        line = next(part for part in pathlib.Path("/proc/self/cgroup").read_text().splitlines()
                    if part.startswith("0::"))
        group = CGROUP / line[3:].lstrip("/")
    except (OSError, StopIteration):
        group = CGROUP
    for where in (group, CGROUP):  # v2: this process's group, or the root a container sees as its own
        limit = _read_int(where / "memory.max")
        if limit is not None:
            used = _read_int(where / "memory.current") or 0
            return max(limit - used, 0)
    limit = _read_int(CGROUP / "memory" / "memory.limit_in_bytes")  # v1
    if limit is not None and limit < 1 << 60:  # (v1 says "no limit" as a huge number)
        used = _read_int(CGROUP / "memory" / "memory.usage_in_bytes") or 0
        return max(limit - used, 0)
    return None


def _address_space_room() -> int | None:
    """Bytes of address space the process may still map under `ulimit -v`, None without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        mapped = int(pathlib.Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        mapped = 0
    return max(soft - mapped, 0)


def memory() -> tuple[int, str]:
    """(bytes, what they are): the most memory this process can use on this machine, and which limit that is."""
    options = [(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's memory")]
    room = _address_space_room()
    if room is not None:
        options.append((room, "the address space this process may still map (ulimit -v)"))
    room = _cgroup_room()
    if room is not None:
        options.append((room, "the memory its cgroup may still use (a container's or a job's limit)"))
    return min(options)
