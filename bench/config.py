"""A benchmark run's settings, as parsed from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.processes import Placement
from bench.systems import System


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def files(self) -> Path:
        """Logs, the prompt set and the raw JSONL of every run, beside the result."""
        return self.output.parent / f"{self.output.stem}_files"

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
            "seed": self.seed,
            "bandwidth_kbps": self.bandwidth_kbps,
            "quick": self.quick,
        }
