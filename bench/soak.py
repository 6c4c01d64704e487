"""`python -m bench.soak`: a long load against one verifier, and whether it came back to idle.

    python -m bench.soak --cloud 127.0.0.1:50051 --metrics-url http://127.0.0.1:8080/metrics \\
             --api-keys-file keys.txt --rate 0.4 --duration 1800 --output soak.json --report soak/

Phases: warm-up (the traces replayed once at their recorded start times, so allocator pools and
the batcher's cost model exist before the baseline), idle (until the verifier holds no session,
then --idle-s of /metrics polls: the baseline), load (Poisson arrivals at --rate for --duration
seconds, sessions taking the keys of --api-keys-file in turn, replayed as `bench.loadtest` does),
idle again (until no session is held, then --idle-s of polls). /metrics is polled every
--poll-s throughout: the verifier's resident memory (process_resident_memory_bytes), its KV
bytes and open sessions.

It reports, start against end: RSS and KV at idle before and after the load; Verify latency p95
in the load's first and last --window-s; errors by status code, split into documented refusals
(RESOURCE_EXHAUSTED: a cap or admission said no, with a retry hint; NOT_FOUND for as many
sessions as the verifier says it evicted) and anything else. Exit status 0 when every check held
(KV back to its idle value, RSS within --rss-slack of it, p95 of the last window within
--p95-slack of the first, no error but documented ones), 3 when one did not,
1 when the soak could not run. A benchmark, not a test: it takes as long as --duration says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from bench.cli import settings_parser
from bench.loadtest import (
    SHIPPED_TRACES,
    LoadRun,
    LoadtestSettings,
    check_targets,
    fetch_metrics,
    poll_metrics,
    replay_load,
    result_settings,
    wait_until_serving,
)
from bench.loadtest_arrivals import poisson_plan, trace_plan
from bench.loadtest_replay import LoadClock
from bench.loadtest_report import ServerSample, machine, percentiles
from edge.trace import read_traces
from shared.cli import run_cli, settings_from_args
from shared.errors import ConfigError

log = logging.getLogger("soak")
REFUSALS = frozenset({"RESOURCE_EXHAUSTED"})  # documented: a cap or admission refused, with a retry hint
EVICTED = "NOT_FOUND"  # documented too when the verifier evicted that many sessions (a cap, a key's own sessions)
CHECKS_FAILED = 3


class SoakSettings(LoadtestSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_SOAK_")

    rate: float | None = Field(0.4, gt=0, description="Poisson session arrivals per second during the load")
    duration: float | None = Field(1800.0, gt=0, description="seconds of arrivals (the load phase)")
    metrics_url: str | None = Field(description="verifier /metrics to poll (loopback): RSS, KV bytes, open sessions")
    window_s: float = Field(300.0, gt=0, description="the first and the last this many seconds of the load are compared")
    idle_s: float = Field(20.0, gt=0, description="seconds of /metrics polls that make an idle value")
    poll_s: float = Field(5.0, gt=0, description="seconds between /metrics polls")
    settle_timeout: float = Field(900.0, gt=0, description="most seconds to wait for the verifier to hold no session")
    warmup: bool = Field(True, description="replay the traces once before the idle baseline")
    rss_slack: float = Field(0.10, ge=0, description="check: idle RSS after the load at most this fraction above before")
    p95_slack: float = Field(0.25, ge=0, description="check: last window's Verify p95 at most this fraction above the first's")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = LoadtestSettings.help_groups | {
        "soak": ("window_s", "idle_s", "poll_s", "settle_timeout", "warmup", "rss_slack", "p95_slack"),
    }


class ServerWatch:
    """Polls /metrics every poll_s from the soak's start until stopped; owns the samples."""

    def __init__(self, s: SoakSettings, clock: LoadClock) -> None:
        self.s, self.clock = s, clock
        self.samples: list[ServerSample] = []

    async def run(self) -> None:
        assert self.s.metrics_url is not None
        await poll_metrics(self.s.metrics_url, self.clock, self.samples, self.s.poll_s, self.s)

    def latest(self) -> ServerSample | None:
        return self.samples[-1] if self.samples else None

    async def until_no_sessions(self) -> float:
        """Wait until the verifier holds no session; the time it took."""
        start = self.clock.now()
        while (last := self.latest()) is None or last.t_s < start or (last.open_sessions or 0) > 0:
            if self.clock.now() - start > self.s.settle_timeout:
                raise ConfigError(f"the verifier still held sessions {self.s.settle_timeout:g} s after the load")
            await asyncio.sleep(self.s.poll_s)
        return self.clock.now() - start

    async def idle_value(self) -> dict[str, float | None]:
        """Median RSS and KV over idle_s of polls (after no session is held)."""
        settled_s = await self.until_no_sessions()
        start = self.clock.now()
        await asyncio.sleep(self.s.idle_s)
        window = [x for x in self.samples if x.t_s >= start]
        return {
            "settled_after_s": round(settled_s, 1),
            "rss_bytes": _median([x.rss_bytes for x in window]),
            "kv_cache_bytes": _median([x.kv_cache_bytes for x in window]),
        }


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known else None


def window_p95(run: LoadRun, start_s: float, end_s: float) -> dict[str, Any]:
    latencies = [r.latency_ms for r in run.clock.rounds if start_s <= r.t_s < end_s]
    return {"from_s": round(start_s, 1), "to_s": round(end_s, 1), "rounds": len(latencies)} | percentiles(latencies)


def verdict(
    s: SoakSettings,
    before: dict[str, Any],
    after: dict[str, Any],
    first: dict[str, Any],
    last: dict[str, Any],
    other_errors: dict[str, int],
) -> dict[str, bool | None]:
    rss0, rss1 = before["rss_bytes"], after["rss_bytes"]
    p0, p1 = first["p95"], last["p95"]
    return {
        "kv_back_to_idle": after["kv_cache_bytes"] == before["kv_cache_bytes"],
        "rss_back_to_idle": None if rss0 is None or rss1 is None else rss1 <= rss0 * (1 + s.rss_slack),
        "p95_stable": None if p0 is None or p1 is None else p1 <= p0 * (1 + s.p95_slack),
        "only_documented_errors": not other_errors,
    }


async def soak(s: SoakSettings) -> dict[str, Any]:
    check_targets(s)
    await wait_until_serving(s)
    traces = read_traces(Path(s.trace) if s.trace else SHIPPED_TRACES)
    if any(t.header.mode != "speculative" for t in traces) and s.mode == "speculative":
        raise ConfigError("speculative replay needs traces recorded in speculative mode")
    inner = s.model_copy(update={"metrics_url": None, "progress": False})  # the watch polls, through every phase
    clock = LoadClock()
    watch = ServerWatch(s, clock)
    poller = asyncio.create_task(watch.run())
    try:
        if s.warmup:
            log.info("warm-up: %d recorded sessions", len(traces))
            await replay_load(inner, trace_plan(traces, 1, 1.0, s.caps()))
        before = await watch.idle_value()
        log.info("idle before: %s; load: %g sessions/s for %g s", before, s.rate, s.duration)
        load_start = clock.now()
        run = await replay_load(inner, poisson_plan(traces, s.rate or 0.0, 1.0, s.caps(), s.seed))
        load_end = load_start + run.wall_s
        after = await watch.idle_value()
        evicted = await asyncio.to_thread(evictions, s)
    finally:
        poller.cancel()
    return _result(s, run, watch.samples, load_start, load_end, before, after, evicted)


def evictions(s: SoakSettings) -> dict[str, float]:
    """specdec_evicted_sessions_total by reason, as the verifier counts them now."""
    assert s.metrics_url is not None
    found = {}
    for line in fetch_metrics(s.metrics_url, s).splitlines():
        if line.startswith("specdec_evicted_sessions_total{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('reason="', 1)[1].split('"', 1)[0]] = float(value)
    return found


def _result(
    s: SoakSettings,
    run: LoadRun,
    samples: list[ServerSample],
    load_start: float,
    load_end: float,
    before: dict[str, Any],
    after: dict[str, Any],
    evicted: dict[str, float],
) -> dict[str, Any]:
    arrivals_end = min(s.duration or run.wall_s, run.wall_s)
    first = window_p95(run, 0.0, min(s.window_s, arrivals_end))
    last = window_p95(run, max(arrivals_end - s.window_s, 0.0), arrivals_end)
    errors = dict(sorted(run.clock.errors_by_code.items()))
    other = unexplained(errors, evicted)
    done = [o for o in run.outcomes if o.error is None]
    compared = [o for o in run.outcomes if o.output_equal is not None]
    return {
        "load": {
            "started_at_s": round(load_start, 1),
            "wall_s": round(run.wall_s, 1),
            "sessions_started": len(run.outcomes),
            "sessions_completed": len(done),
            "rounds": len(run.clock.rounds),
            "verified_tokens": sum(o.verified_tokens for o in run.outcomes),
            "outputs_equal_to_recording": f"{sum(bool(o.output_equal) for o in compared)} of {len(compared)}",
        },
        "idle_before": before,
        "idle_after": after,
        "verify_latency_first_window_ms": first,
        "verify_latency_last_window_ms": last,
        "errors_by_code": errors,
        "evicted_sessions_by_reason": evicted,
        "errors_other_than_refusals": other,
        "checks": verdict(s, before, after, first, last, other),
        "server_samples": [asdict(x) | {"phase": _phase(x.t_s, load_start, load_end)} for x in samples],
        "settings": result_settings(s),
        "machine": machine(),
    }


def unexplained(errors: dict[str, int], evicted: dict[str, float]) -> dict[str, int]:
    """Errors beyond the documented ones: refusals, and a NOT_FOUND for each session the
    verifier says it evicted (a cap made room; the client reopens)."""
    other = {code: n for code, n in errors.items() if code not in REFUSALS}
    if EVICTED in other:
        other[EVICTED] -= min(other[EVICTED], int(sum(evicted.values())))
    return {code: n for code, n in other.items() if n}


def _phase(t_s: float, load_start: float, load_end: float) -> str:
    return "before" if t_s < load_start else ("load" if t_s <= load_end else "after")


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value / 2**20:.1f} MiB"


def markdown(result: dict[str, Any]) -> str:
    b, a, load = result["idle_before"], result["idle_after"], result["load"]
    f, la = result["verify_latency_first_window_ms"], result["verify_latency_last_window_ms"]
    m, s = result["machine"], result["settings"]
    checks = ", ".join(f"{name} {'yes' if ok else ('n/a' if ok is None else 'NO')}" for name, ok in result["checks"].items())
    return "\n".join(
        [
            "# Soak",
            "",
            f"Load: {s['arrivals']} for {s['duration']:g} s against {s['cloud']}; machine {m['platform']}, "
            f"{m['cpu_count']} CPUs ({m.get('cpu_flags', 'flags not recorded')}), commit {m['git_commit'][:12]}.",
            "",
            "| | before the load | after the load |",
            "|---|---|---|",
            f"| verifier RSS at idle | {_mib(b['rss_bytes'])} | {_mib(a['rss_bytes'])} |",
            f"| KV bytes at idle | {_mib(b['kv_cache_bytes'])} | {_mib(a['kv_cache_bytes'])} |",
            f"| Verify p50 / p95 ms (first / last {s['window_s']:g} s of the load) | {f['p50']} / {f['p95']} "
            f"({f['rounds']} rounds) | {la['p50']} / {la['p95']} ({la['rounds']} rounds) |",
            "",
            f"Sessions: {load['sessions_completed']} completed of {load['sessions_started']}; {load['rounds']} rounds; "
            f"outputs equal to the recording: {load['outputs_equal_to_recording']}.",
            f"Errors by code: {result['errors_by_code'] or 'none'}; sessions the verifier evicted, by reason: "
            f"{result['evicted_sessions_by_reason'] or 'none'}; errors other than refusals and NOT_FOUND after "
            f"evictions: {result['errors_other_than_refusals'] or 'none'}.",
            f"Checks: {checks}.",
            "",
        ]
    )


def write_report(result: dict[str, Any], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    samples = result["server_samples"]
    t = [x["t_s"] for x in samples]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    series = [("rss_bytes", "RSS (MiB)"), ("kv_cache_bytes", "KV (MiB)"), ("open_sessions", "open sessions")]
    for ax, (key, label) in zip(axes, series, strict=True):
        scale = 2**20 if key.endswith("bytes") else 1
        ax.plot(t, [None if x[key] is None else x[key] / scale for x in samples], marker=".", markersize=2)
        ax.set_ylabel(label)
        ax.axvspan(result["load"]["started_at_s"], result["load"]["started_at_s"] + result["load"]["wall_s"], alpha=0.1)
    axes[-1].set_xlabel("seconds since the soak began (shaded: the load)")
    fig.tight_layout()
    fig.savefig(folder / "soak.png", dpi=100)
    plt.close(fig)
    (folder / "soak.md").write_text(markdown(result) + "\n![soak](soak.png)\n")


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.soak", __doc__, SoakSettings)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    def run() -> int:
        settings = settings_from_args(SoakSettings, args)
        result = asyncio.run(soak(settings))
        Path(settings.output).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.output).write_text(json.dumps(result, indent=1) + "\n")
        if settings.report:
            write_report(result, Path(settings.report))
        sys.stdout.write(markdown(result))
        return 0 if all(ok is not False for ok in result["checks"].values()) else CHECKS_FAILED

    return run_cli("soak", run)


if __name__ == "__main__":
    sys.exit(main())
