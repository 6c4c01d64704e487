"""Where and with what a benchmark ran: the machine, the versions, the git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any


def _proc_field(path: str, key: str) -> str | None:
    """The value after `key:` on the first line of a /proc file that starts with key; None
    where the file or the line is missing (not Linux)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown"


# The instructions that decide how a bf16 matmul scales with its rows on a CPU: without
# avx512_bf16 / amx_bf16 a bf16 row costs the same alone or shared, with them a block of k
# rows costs about one row (machines of the same name differ here, so results name them).
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def _matmul_flags() -> list[str]:
    present = set((_proc_field("/proc/cpuinfo", "flags") or "").split())
    return [flag for flag in MATMUL_FLAGS if flag in present]


def _memory_gib() -> float | None:
    total = _proc_field("/proc/meminfo", "MemTotal:")
    return round(int(total.split()[0]) / 2**20, 1) if total else None


def machine() -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": _cpu_model(), "cores": cores, "memory_gib": _memory_gib(),
            "cpu_flags": " ".join(_matmul_flags()) or "none of " + " ".join(MATMUL_FLAGS),
            "platform": platform.platform(), "hostname": platform.node()}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "grpcio", "specedge"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def git_state(repo: Path) -> dict[str, Any]:
    """Commit and whether the working tree had changes (then the commit alone does not
    reproduce the run)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}
