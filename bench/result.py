"""The result document: every run's raw per-request records, its summary, per-task
breakdown, identity with target-only and ratios to the references of the same run; checked
against bench/result.schema.json."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from bench.config import BenchSettings
from bench.environment import git_state, machine, versions
from bench.runner import Run
from bench.summarize import identical_count, ratio, summarize
from bench.systems import CLOUD_ONLY, HF_ASSISTED, TARGET_ONLY
from bench.tasks import OTHER_TASK, TASKS
from shared.errors import SpecDecError

SCHEMA_VERSION = 1


class ResultInvalid(SpecDecError):
    """The result document does not match its schema (a bug in the bench)."""


def schema() -> dict[str, Any]:
    return dict(json.loads((resources.files("bench") / "result.schema.json").read_text()))


def validate(document: dict[str, Any]) -> None:
    """Check against the shipped schema; jsonschema is a dev dependency, so a plain install
    skips the check rather than failing a finished run."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validate(document, schema())
    except jsonschema.ValidationError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "(top)"
        raise ResultInvalid(f"result does not match its schema at {where}: {err.message}") from None


def _mib(kib: int | None) -> float | None:
    return round(kib / 1024, 1) if kib is not None else None


def _find(runs: Sequence[Run], name: str, placement: str, rtt: float | None = None) -> Run | None:
    for run in runs:
        if run.system.name == name and run.placement.name == placement and (rtt is None or run.rtt_ms == rtt):
            return run
    return None


NO_WIRE_FIELDS = ("cloud_call_ratio", "bytes_up_per_token", "bytes_down_per_token", "verify_bytes_up_per_drafted_token")


def _summary(run: Run, records: Sequence[dict[str, Any]], rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """summarize(), with the wire fields of systems that have no wire left empty, and
    cloud_only's stream counted as one cloud step per token (it has no rounds)."""
    summary = summarize(records, rounds)
    if not run.system.crosses_wire:
        summary |= dict.fromkeys(NO_WIRE_FIELDS)
    elif run.system.name == CLOUD_ONLY:
        summary["cloud_call_ratio"] = 1.0 if summary["output_tokens"] else None
    return summary


def _run_document(run: Run, runs: Sequence[Run], greedy: bool) -> dict[str, Any]:
    summary = _summary(run, run.records, run.rounds)
    reference = _find(runs, TARGET_ONLY, run.placement.name)
    identical = None
    if greedy and reference is not None and run is not reference:
        identical = identical_count(run.records, {r["id"]: r["token_ids"] for r in reference.records})
    ratios: dict[str, float | None] = {}
    rate = summary["tokens_per_s"] or 0.0
    references: list[tuple[str, str, float | None]] = [
        ("vs_target_only", TARGET_ONLY, None),
        ("vs_hf_assisted", HF_ASSISTED, None),
    ]
    if run.rtt_ms is not None:  # cloud_only is compared on the same link only
        references.append(("vs_cloud_only", CLOUD_ONLY, run.rtt_ms))
    for key, name, rtt in references:
        other = _find(runs, name, run.placement.name, rtt)
        if other is not None and other is not run:
            ratios[key] = ratio(rate, summarize(other.records)["tokens_per_s"] or 0.0)
    per_task = {}
    for task in (*TASKS, OTHER_TASK):
        records = [r for r in run.records if r["task"] == task]
        if records:
            ids = {r["id"] for r in records}
            per_task[task] = _summary(run, records, [r for r in run.rounds if r.get("id") in ids])
    return {
        "system": run.system.name,
        "kind": run.system.kind.value,
        "edge_flags": list(run.system.edge_flags),
        "placement": run.placement.name,
        "rtt_ms": run.rtt_ms,
        "process": {
            "peak_rss_mib": _mib(run.peak_rss_kib),
            "verifier_peak_rss_mib": _mib(run.verifier_peak_rss_kib),
            "wall_s": run.wall_s,
        },
        "summary": summary,
        "identical_to_target_only": identical,
        "ratios": ratios,
        "per_task": per_task,
        "requests": run.records,
    }


def build(
    settings: BenchSettings,
    runs: Sequence[Run],
    prompt_ids: list[str],
    runner_meta: dict[str, Any],
    kv_bytes_per_token: int | None,
    repo: Path,
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "machine": machine(),
        "versions": versions(),
        "git": git_state(repo),
        "models": {
            "draft": str(settings.draft_model),
            "target": str(settings.target_model),
            "target_kv_bytes_per_token": kv_bytes_per_token,
            "in_process_runner": runner_meta,
        },
        "settings": settings.as_json(),
        "prompts": {"count": len(prompt_ids), "ids": prompt_ids, "file": str(settings.files / "prompts.jsonl")},
        "method": {
            "peak_rss": "edge-agent and bench.hf_runner: wait4 ru_maxrss of that child; verifier: /proc/PID VmHWM, "
            "reset (clear_refs 5) before each run, one verifier per placement",
            "kv_peak_bytes": "in-process: bytes of the target's cache tensors after each forward (hook); verifier: "
            "(prompt + output + largest block) tokens x the target's KV bytes per token measured on "
            "real cache tensors",
            "rtt": "wire systems run once per RTT through tools/netproxy.py; in-process and edge-local systems run "
            "once per placement and have rtt_ms null",
            "warmup": "every child first answers one warmup prompt that is left out of the numbers",
            "acceptance_by_position": "rounds that accepted draft position i / rounds that drafted it (k > i)",
        },
        "runs": [_run_document(run, runs, settings.greedy) for run in runs],
    }
