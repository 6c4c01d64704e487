"""The fleet benchmark's Markdown report (fleet.md) from its fleet.json dictionary."""

from __future__ import annotations

from typing import Any

import numpy as np


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    return {"p50": round(float(np.percentile(values, 50)), 3), "p95": round(float(np.percentile(values, 95)), 3)}


def _ms(figures: dict[str, Any]) -> str:
    return f"p50 {figures['p50']} ms, p95 {figures['p95']} ms"


def markdown(result: dict[str, Any]) -> str:
    machine, over, fail = result["machine"], result["proxy_overhead"], result["failover"]
    settings = result["settings"]
    lines = [
        "# Fleet: three verifiers behind HAProxy, one SIGKILLed",
        "",
        f"`{result['command']}`, {result['date_utc']} UTC, commit `{result['git_commit']}`"
        + (" (with uncommitted changes)" if result["git_dirty"] else ""),
        "",
        f"Machine: {machine['cpu_model']}, {machine['cores']} cores, {machine['memory_gib']} GiB; "
        f"CPU flags: {machine['cpu_flags']}. Models: {result['models']} (the figures are the fleet's, not a model's).",
        "",
        "## What the proxy adds to a Verify call",
        "",
        f"{over['pairs']} pairs of Verify calls, each pair one through HAProxy (deploy/haproxy.cfg) and one straight "
        "to the replica HAProxy sent that session to, on two sessions of the same replica, in alternating order; "
        "wall time at the edge's client.",
        "",
        "| path | Verify wall time |",
        "|---|---|",
        f"| through HAProxy | {_ms(over['proxy_ms'])} |",
        f"| direct to the replica | {_ms(over['direct_ms'])} |",
        f"| **added by the proxy** (per pair) | **{_ms(over['added_ms'])}** |",
        "",
        "## A replica SIGKILLed mid-run",
        "",
        f"{fail['sessions']} concurrent speculative sessions (greedy, fp32, k = 4, {settings['max_new_tokens']} tokens) "
        f"through HAProxy over {settings['replicas']} replicas; replica {fail['killed_replica']} SIGKILLed once it had "
        f"served {fail['kill_after_rounds']} rounds of the run.",
        "",
        "| | |",
        "|---|---|",
        f"| sessions completed | {fail['completed']} of {fail['sessions']} |",
        f"| outputs equal to cloud_only's | {fail['equal_to_cloud_only']} of {fail['sessions']} |",
        f"| reopens | {fail['reopens']} ({fail['sessions_reopened']} sessions) |",
        f"| time between commits, sessions not on the killed replica | {_ms(fail['round_gap_ms_unaffected'])}, "
        f"max {fail['round_gap_ms_unaffected']['max']} ms |",
        f"| the stalled gap of each reopened session | {', '.join(f'{s:g}' for s in fail['stall_ms_affected'])} ms |",
        f"| **extra latency from the kill** (stalled gap minus the usual p50) | **{_ms(fail['extra_ms_affected'])}** |",
        f"| session wall time, reopened / not | p50 {fail['wall_s_affected']['p50']} s / {fail['wall_s_unaffected']['p50']} s |",
        "",
    ]
    if fail["errors"]:
        lines += ["Sessions that failed: " + "; ".join(fail["errors"]), ""]
    lines += ["![dashboard](dashboard.png)", "", "*The Grafana dashboard's queries over this run (tiny random models).*", ""]
    return "\n".join(lines)
