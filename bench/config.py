"""What `python -m bench` is asked (BenchFlags: its flags, also SPECDEC_BENCH_* environment variables)
and the run's settings resolved from them (BenchSettings)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.processes import Placement
from bench.systems import DEFAULT_SYSTEMS, System

QUICK_MAX_NEW_TOKENS = 12


class BenchFlags(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_BENCH_")

    output: Path = Field(description="result JSON; logs and raw JSONL go to OUTPUT_files/")
    report: Path | None = Field(None, description="folder for report.md and the PNG plots")
    quick: bool = Field(False, description="smoke run on tiny random models (fp32, few tokens)")
    systems: str = Field(
        ",".join(DEFAULT_SYSTEMS), description="comma-separated; NAME@0 runs a wire system at RTT 0 only (NAME@0/50: at those)"
    )
    variant: list[str] = Field(
        default_factory=list,
        description="NAME=FLAGS: an extra edge-agent system, e.g. 'k8=--k 8' or 'cost@0=--k-policy cost' "
        "(NAME@0: at RTT 0 only; repeatable)",
    )
    prompts: Path | None = Field(None, description="JSONL of prompts (edge-agent's format); default: Spec-Bench")
    per_task: int | None = Field(
        None,
        description="prompts per task: the shortest of each, round-robin over its labels "
        "(default 3 for Spec-Bench, all prompts of a --prompts file)",
    )
    rtt_ms: str | None = Field(None, description="comma-separated added RTTs for wire systems (default 0,50; --quick: 0)")
    bandwidth_kbps: float = Field(0.0, description="link cap for wire systems in kbit/s (0 = none)")
    max_new_tokens: int | None = Field(None, description=f"per prompt (default 64; --quick: {QUICK_MAX_NEW_TOKENS})")
    dtype: str | None = Field(
        None,
        description="auto | bfloat16 | float32 | float16 (default auto: bf16 on CUDA and on CPUs with "
        "avx512_bf16/amx_bf16, else fp32; --quick: float32)",
    )
    k: int | None = Field(None, description="draft tokens per round for edge-agent systems (default: edge-agent's)")
    temperature: float = Field(0.0, description="0 = greedy (then outputs are compared to target-only)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling at temperature > 0 (1 = off)")
    seed: int = Field(0, description="seeds every system's sampling")
    pin: bool = Field(False, description="two-machine mode only (= --placement pinned)")
    placement: Literal["unpinned", "pinned", "both"] | None = Field(
        None, description="pinned: verifier on core 0, edge on core 1, one thread each (taskset); default unpinned"
    )
    engine: Literal["transformers", "llama.cpp", "vllm"] = Field(
        "transformers",
        description="the verifier's engine; llama.cpp serves the target folder's GGUF (the packaged target keeps one); "
        "vllm runs the verifier under --verifier-python",
    )
    verifier_python: Path | None = Field(
        None,
        description="the interpreter cloud-verifier runs under (default: this one)",
    )
    draft_model: Path | None = Field(None, description="draft model folder (default: the packaged Qwen 0.5B)")
    target_model: Path | None = Field(None, description="target model folder (default: the packaged Qwen 1.5B)")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "what to run": ("systems", "variant", "quick", "draft_model", "target_model", "dtype", "engine", "verifier_python"),
        "prompts and sampling": ("prompts", "per_task", "max_new_tokens", "k", "temperature", "top_p", "seed"),
        "links and placement": ("rtt_ms", "bandwidth_kbps", "pin", "placement"),
        "results": ("output", "report"),
    }


def files_beside(output: Path) -> Path:
    """Logs, the prompt set and the raw JSONL of every run, beside the result OUTPUT."""
    return output.parent / f"{output.stem}_files"


@dataclass(frozen=True)
class BenchSettings:
    systems: list[System]
    rtts_ms: list[float]
    placements: list[Placement]
    output: Path
    report: Path | None
    draft_model: Path
    target_model: Path
    prompts: Path | None  # None: Spec-Bench (or the tiny set with --quick)
    per_task: int | None  # Spec-Bench or any labelled file: prompts per task
    max_new_tokens: int
    dtype: str  # what both sides load the models in (an "auto" request is resolved before the run)
    dtype_reason: str
    k: int | None  # None: edge-agent's default
    temperature: float
    seed: int
    bandwidth_kbps: float  # 0 = unlimited
    quick: bool
    top_p: float = 1.0
    engine: str = "transformers"  # the verifier's (cloud-verifier --engine)
    verifier_python: str = sys.executable  # the interpreter cloud-verifier runs under

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def files(self) -> Path:
        return files_beside(self.output)

    def as_json(self) -> dict[str, Any]:
        return {
            "systems": [
                {
                    "name": s.name,
                    "kind": s.kind.value,
                    "edge_flags": list(s.edge_flags),
                    "only_rtts_ms": list(s.only_rtts_ms) if s.only_rtts_ms is not None else None,
                }
                for s in self.systems
            ],
            "rtt_ms": self.rtts_ms,
            "placements": [p.name for p in self.placements],
            "draft_model": str(self.draft_model),
            "target_model": str(self.target_model),
            "prompts": str(self.prompts) if self.prompts else None,
            "per_task": self.per_task,
            "max_new_tokens": self.max_new_tokens,
            "dtype": self.dtype,
            "dtype_reason": self.dtype_reason,
            "k": self.k,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "bandwidth_kbps": self.bandwidth_kbps,
            "quick": self.quick,
            "engine": self.engine,
            "verifier_python": self.verifier_python,
        }
