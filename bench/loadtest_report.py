"""What a load test measured: the RESULT.json dictionary, its Markdown summary, plots over time."""

from __future__ import annotations

import os
import platform
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import environment
from bench.loadtest_replay import LoadClock, SessionOutcome

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ServerSample:
    """One poll of the verifier's /metrics."""

    t_s: float
    kv_cache_bytes: float | None
    open_sessions: float | None
    rss_bytes: float | None = None  # the verifier process's resident memory (process_resident_memory_bytes)


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 95, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in qs}


def machine() -> dict[str, Any]:
    """The bench's machine facts (CPU model and the matmul instructions among them), the
    CPU count and the commit."""
    git = environment.git_state(REPO)
    return environment.machine() | {
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "git_commit": git["commit"] or "unknown",
        "git_dirty": bool(git["dirty"]),
    }


def _open_sessions_at(changes: list[tuple[float, int]], times: list[float]) -> list[int]:
    ordered = sorted(changes)
    out, running, i = [], 0, 0
    for t in times:
        while i < len(ordered) and ordered[i][0] <= t:
            running += ordered[i][1]
            i += 1
        out.append(running)
    return out


def timeline(clock: LoadClock, samples: list[ServerSample], end_s: float, bin_s: float) -> dict[str, Any]:
    """Per bin of bin_s seconds: throughput, Verify latency, sessions in flight, server KV bytes."""
    bins = max(int(np.ceil(end_s / bin_s)), 1)
    tokens, rounds = np.zeros(bins), np.zeros(bins)
    latencies: list[list[float]] = [[] for _ in range(bins)]
    for r in clock.rounds:
        b = min(int(r.t_s / bin_s), bins - 1)
        tokens[b] += r.tokens
        rounds[b] += 1
        latencies[b].append(r.latency_ms)
    ends = [(b + 1) * bin_s for b in range(bins)]
    kv: list[float | None] = []
    for b in range(bins):
        inside = [s.kv_cache_bytes for s in samples if b * bin_s <= s.t_s < ends[b] and s.kv_cache_bytes is not None]
        kv.append(max(inside) if inside else None)
    return {
        "bin_s": bin_s,
        "t_s": ends,
        "tokens_per_s": (tokens / bin_s).round(3).tolist(),
        "rounds_per_s": (rounds / bin_s).round(3).tolist(),
        "latency_p50_ms": [percentiles(v, (50,))["p50"] for v in latencies],
        "latency_p95_ms": [percentiles(v, (95,))["p95"] for v in latencies],
        "open_sessions": _open_sessions_at(clock.open_changes, ends),
        "kv_cache_bytes": kv,
    }


def summarize(
    outcomes: list[SessionOutcome],
    clock: LoadClock,
    samples: list[ServerSample],
    wall_s: float,
    settings: dict[str, Any],
    planned: int,
    bin_s: float = 1.0,
) -> dict[str, Any]:
    done = [o for o in outcomes if o.error is None]
    compared = [o for o in outcomes if o.output_equal is not None]
    queue = [r.queue_ms for r in clock.rounds if r.queue_ms is not None]
    mode = str(settings.get("mode", "speculative"))
    return {
        "mode": mode,
        "sessions_planned": planned,
        "sessions_started": len(outcomes),
        "sessions_completed": len(done),
        "sessions_failed": len(outcomes) - len(done),
        "errors_by_code": dict(sorted(clock.errors_by_code.items())),
        # what ended the failed sessions, and where: "open RESOURCE_EXHAUSTED" is admission
        # refusing a session it could not serve in time; "round ..." a session lost midway
        "sessions_ended_by": dict(sorted(Counter(o.ended_by for o in outcomes if o.ended_by).items())),
        "capacity_rejections": sum(o.capacity_rejections for o in outcomes),
        "wall_s": round(wall_s, 3),
        "verified_tokens": sum(o.verified_tokens for o in outcomes),
        "verified_tokens_per_s": round(sum(o.verified_tokens for o in outcomes) / wall_s, 3) if wall_s else 0.0,
        "output_tokens_per_s": round(sum(o.output_tokens for o in outcomes) / wall_s, 3) if wall_s else 0.0,
        "rounds_per_s": round(len(clock.rounds) / wall_s, 3) if wall_s else 0.0,
        # speculative: Verify round trips; cloud_only: time between Generate chunks (one forward each)
        "latency_kind": "verify_rtt" if mode == "speculative" else "generate_step",
        "verify_latency_ms": percentiles([r.latency_ms for r in clock.rounds]),
        "ttft_ms": percentiles([o.ttft_ms for o in outcomes if o.ttft_ms is not None]),
        "queue_ms": percentiles(queue) if queue else None,
        "tau": round(sum(o.verified_tokens for o in outcomes) / max(sum(o.rounds for o in outcomes), 1), 3),
        "fidelity": {
            "rounds_compared": sum(o.rounds_compared for o in outcomes),
            "accepted_len_mismatches": sum(o.accepted_len_mismatches for o in outcomes),
            "next_token_mismatches": sum(o.next_token_mismatches for o in outcomes),
            "sessions_compared": len(compared),
            "sessions_output_equal": sum(bool(o.output_equal) for o in compared),
        },
        "settings": settings,
        "machine": machine(),
        "timeline": timeline(clock, samples, wall_s, bin_s),
        "sessions": [asdict(o) for o in outcomes],
    }


def ended_by_line(result: dict[str, Any]) -> str:
    """ "served 8, refused at open 16 (RESOURCE_EXHAUSTED 16)": what an operator reads first."""
    ended = result.get("sessions_ended_by", {})
    parts = [f"served {result['sessions_completed']}"]
    for where in ("open", "round"):
        codes = {key.split(" ", 1)[1]: n for key, n in ended.items() if key.startswith(where + " ")}
        if codes:
            label = "refused at open" if where == "open" else "lost in a round"
            parts.append(f"{label} {sum(codes.values())} ({', '.join(f'{c} {n}' for c, n in codes.items())})")
    return ", ".join(parts)


def _cell(value: Any) -> str:
    return "–" if value is None else str(value)


def markdown(result: dict[str, Any]) -> str:
    s, f = result["settings"], result["fidelity"]
    lat, ttft, queue = result["verify_latency_ms"], result["ttft_ms"], result["queue_ms"] or {}
    lines = [
        f"# Load test: {result['mode']}",
        "",
        f"Arrivals: {s['arrivals']}; scale {s['scale']}; think-time scale {s['think_scale']}; "
        f"caps: prompt {_cell(s['max_prompt_tokens'])}, output {_cell(s['max_output_tokens'])} tokens, "
        f"sessions {_cell(s['max_sessions'])}, duration {_cell(s['duration'])} s; verifier {s['cloud']}.",
        f"Machine: {result['machine']['platform']}, {result['machine']['cpu_count']} CPUs "
        f"({result['machine'].get('cpu_flags', 'flags not recorded')}), "
        f"commit {result['machine']['git_commit'][:12]}{' (dirty)' if result['machine']['git_dirty'] else ''}.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| sessions completed / started / planned | {result['sessions_completed']} / {result['sessions_started']} / "
        f"{result['sessions_planned']} |",
        f"| sessions ended early, by where and status | {ended_by_line(result)} |",
        f"| errors by code (recovered or not) | {result['errors_by_code'] or 'none'} |",
        f"| RESOURCE_EXHAUSTED answers (resent or not) | {result['capacity_rejections']} |",
        f"| wall time | {result['wall_s']} s |",
        f"| verified tokens/s | {result['verified_tokens_per_s']} |",
        f"| output tokens/s | {result['output_tokens_per_s']} |",
        f"| rounds/s | {result['rounds_per_s']} |",
        f"| tokens per round (tau) | {result['tau']} |",
        f"| {result['latency_kind']} p50 / p95 / p99 ms | {_cell(lat['p50'])} / {_cell(lat['p95'])} / {_cell(lat['p99'])} |",
        f"| TTFT p50 / p95 ms | {_cell(ttft['p50'])} / {_cell(ttft['p95'])} |",
        f"| server queue p50 / p95 / p99 ms | {_cell(queue.get('p50'))} / {_cell(queue.get('p95'))} / "
        f"{_cell(queue.get('p99'))} |",
        f"| replay fidelity: rounds compared, accepted_len / next-token mismatches | {f['rounds_compared']}, "
        f"{f['accepted_len_mismatches']} / {f['next_token_mismatches']} |",
        f"| outputs equal to the recording | {f['sessions_output_equal']} of {f['sessions_compared']} compared |",
        "",
    ]
    return "\n".join(lines)


def write_report(result: dict[str, Any], folder: Path) -> list[Path]:
    """summary.md and one PNG per series over time; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    summary = folder / "summary.md"
    tl = result["timeline"]
    panels = [
        ("throughput", "tokens/s", {"verified tokens/s": tl["tokens_per_s"]}),
        (
            "latency",
            "ms",
            {f"{result['latency_kind']} p50": tl["latency_p50_ms"], f"{result['latency_kind']} p95": tl["latency_p95_ms"]},
        ),
        ("open_sessions", "sessions", {"sessions in flight": tl["open_sessions"]}),
    ]
    if any(v is not None for v in tl["kv_cache_bytes"]):
        panels.append(
            ("kv_bytes", "MiB", {"specdec_kv_cache_bytes": [None if v is None else v / 2**20 for v in tl["kv_cache_bytes"]]})
        )
    written = [summary]
    text = markdown(result)
    for name, unit, series in panels:
        fig, ax = plt.subplots(figsize=(7, 3))
        for label, values in series.items():
            points = [(t, v) for t, v in zip(tl["t_s"], values, strict=True) if v is not None]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=label, marker=".")
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel(unit)
        ax.set_title(f"{name.replace('_', ' ')} ({result['mode']})")
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
        text += f"\n![{name}]({path.name})\n"
    summary.write_text(text)
    return written
