"""What the machine offers the model runtimes: the CPU's matmul instructions, the cores this
process may use, and the dtype that is fast there (`--dtype auto`, `--threads 0`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

# The instructions that decide how a bf16 matmul scales with its rows on a CPU: without
# avx512_bf16 / amx_bf16 bf16 is converted in software, slower than fp32 (a 100-token prefill
# of the 1.5B: 28.6 s bf16 against 4.7 s fp32 on an AVX2-only EPYC core); with them a block of
# k rows costs about one row. Machines of the same name differ here, so results name them.
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def proc_field(path: str, key: str) -> str | None:
    """The value after `key:` on the first line of a /proc file that starts with key; None
    where the file or the line is missing (not Linux)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    return set((proc_field("/proc/cpuinfo", "flags") or "").split())


def matmul_flags(flags: set[str] | None = None) -> list[str]:
    present = cpu_flags() if flags is None else flags
    return [flag for flag in MATMUL_FLAGS if flag in present]


def _cgroup_cpu_limit(root: Path) -> float | None:
    """CPUs the cgroup quota allows (v2 cpu.max, else v1 cfs quota/period); None: no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 else None
    except (OSError, ValueError):
        return None


def runs_on_every_core() -> bool:
    """Whether this process may run on every core of the machine (its affinity is not pinned)."""
    if not hasattr(os, "sched_getaffinity"):
        return True
    return len(os.sched_getaffinity(0)) >= (os.cpu_count() or 1)


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on (affinity), capped by a container's CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = _cgroup_cpu_limit(cgroup_root)
    return max(1, min(cores, math.ceil(limit))) if limit else cores


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # "bfloat16" | "float32" | what the user asked for
    reason: str


def choose_dtype(asked: str, device_type: str, flags: set[str] | None = None) -> DtypeChoice:
    """`asked` unless it is "auto": then bf16 on CUDA and on CPUs with native bf16 matmuls,
    fp32 on other CPUs."""
    if asked != "auto":
        return DtypeChoice(asked, "set by --dtype")
    if device_type == "cuda":
        return DtypeChoice("bfloat16", "auto: CUDA")
    present = cpu_flags() if flags is None else flags
    native = [flag for flag in BF16_FLAGS if flag in present]
    if native:
        return DtypeChoice("bfloat16", f"auto: the CPU has {native[0]} (native bf16 matmuls)")
    return DtypeChoice("float32", "auto: the CPU has no avx512_bf16/amx_bf16, so bf16 would run slower than fp32")
