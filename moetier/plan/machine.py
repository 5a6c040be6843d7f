"""What this machine offers: the card's free memory, the host's available memory (the least of
MemAvailable and the cgroup's room) and the locked-memory limit, each with where it was read.

Reference 004: the tighter node is the real budget, so the host figure is the least of every limit
that applies, never the largest.
"""

from __future__ import annotations

import resource
from pathlib import Path

from moetier.errors import MoetierError
from moetier.plan.units import GiB, parse_size

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")


def gpu_memory(device_index: int | None = None) -> tuple[int, int]:
    """(free, total) bytes of the card, from cudaMemGetInfo. Creates the CUDA context (its memory is
    then already in use, so a plan on this budget does not count it again)."""
    import torch

    if not torch.cuda.is_available():
        raise MoetierError("no CUDA device is visible, so the card's memory cannot be read: give "
                           "--gpu-memory (e.g. --gpu-memory 139GiB) or plan for --device cpu")
    free, total = torch.cuda.mem_get_info(device_index if device_index is not None else torch.cuda.current_device())
    return int(free), int(total)


def meminfo(path: Path = PROC / "meminfo") -> dict[str, int]:
    """/proc/meminfo in bytes (its kB are KiB)."""
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def cgroup_room(root: Path = CGROUP) -> int | None:
    """Bytes this cgroup may still take (memory.max - memory.current, v2; limit - usage, v1); None
    without a limit."""
    for limit_f, usage_f in (("memory.max", "memory.current"),
                             ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_f).read_text().strip()
            usage = int((root / usage_f).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes a huge number for "no limit"
            return None
        return max(0, int(limit) - usage)
    return None


CAP_IPC_LOCK = 14


def can_lock_any(status: Path = PROC / "self" / "status") -> bool:
    """CAP_IPC_LOCK in the effective capabilities: the locked-memory limit does not apply."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK (soft) in bytes; None when unlimited or not enforced (CAP_IPC_LOCK)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or can_lock_any():
        return None
    return int(soft)


def host_available(meminfo_path: Path = PROC / "meminfo", cgroup: Path = CGROUP) -> tuple[int, str]:
    """(bytes, where from): the least of MemAvailable and the cgroup's room."""
    info = meminfo(meminfo_path)
    if "MemAvailable" not in info:
        raise MoetierError(f"{meminfo_path} has no MemAvailable; give --host-memory (e.g. --host-memory 100GiB)")
    avail, source = info["MemAvailable"], "MemAvailable"
    room = cgroup_room(cgroup)
    if room is not None and room < avail:
        avail, source = room, "cgroup memory.max - memory.current"
    return avail, source


def gpu_budget(text: str | None, device: str) -> tuple[int | None, str, bool]:
    """The device budget: --gpu-memory (a size, or a share of the card) or the card's free memory.
    -> (bytes or None for cpu, where from, whether the CUDA context still has to be counted)."""
    if device == "cpu":
        if text is not None:  # not used on the CPU, but nonsense is still refused (a share is checked as one)
            parse_size(text, "--gpu-memory", total=GiB, what="the card's total memory")
        return None, "cpu: no device memory", False
    if text is not None and not str(text).strip().endswith("%"):
        return parse_size(text, "--gpu-memory"), "--gpu-memory", True
    free, total = gpu_memory()
    if text is None:
        return free, "cudaMemGetInfo free", False
    return parse_size(text, "--gpu-memory", total, "the card's total memory"), f"--gpu-memory {text} of the card", True


def host_budget(text: str | None) -> tuple[int, str]:
    if text is not None and not str(text).strip().endswith("%"):
        return parse_size(text, "--host-memory"), "--host-memory"
    avail, source = host_available()
    if text is None:
        return avail, source
    total = meminfo().get("MemTotal")
    return parse_size(text, "--host-memory", total, "MemTotal"), f"--host-memory {text} of MemTotal"
