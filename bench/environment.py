"""Where and with what a benchmark ran: the machine, the versions, the git commit."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from shared.hardware import MATMUL_FLAGS, matmul_flags, proc_field


def _cpu_model() -> str:
    return proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown"


def _memory_gib() -> float | None:
    total = proc_field("/proc/meminfo", "MemTotal:")
    return round(int(total.split()[0]) / 2**20, 1) if total else None


def machine() -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": _cpu_model(),
        "cores": cores,
        "memory_gib": _memory_gib(),
        "cpu_flags": " ".join(matmul_flags()) or "none of " + " ".join(MATMUL_FLAGS),
        "platform": platform.platform(),
        "hostname": platform.node(),
    }


def measurement_parser(name: str, doc: str | None, prompt_tokens: int) -> argparse.ArgumentParser:
    """The flags of an in-process measurement `python -m bench.NAME` on a target model: the
    model, its dtype, the prompt length, torch threads, the output folder; it adds its own."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench.{name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="target model folder (HF format)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = usable cores)")
    parser.add_argument("--out", type=Path, required=True)
    return parser


def load_measured_model(args: argparse.Namespace) -> Any:
    """The target model of a `measurement_parser` run, on the CPU with --threads torch threads
    (0: the cores this process may use)."""
    import torch  # here, not at the top: the load tester and the fleet run import this module without a model

    from shared import lm

    torch.set_num_threads(args.threads or lm.configure_cpu(torch.device("cpu"), 0))
    return lm.load_model(args.model, args.dtype, "cpu")


def provenance(command: str) -> dict[str, Any]:
    """Where, with what and when a measurement ran, and the command that runs it again."""
    return {"machine": machine(), "versions": versions(), "date": time.strftime("%Y-%m-%d"), "command": command}


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


def write_result(out: Path, name: str, result: dict[str, Any], report: str) -> None:
    """A benchmark's JSON result (OUT/NAME.json) and its readable report (OUT/report.md), and
    the report on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "report.md").write_text(report)
    print(report)  # noqa: T201
