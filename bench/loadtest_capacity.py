"""`python -m bench.loadtest --find-capacity`: how many concurrent sessions one GPU (or CPU) serves within a
latency target, for each system in the same run on the same sessions: speculative, auto and cloud_only
sessions through the verifier, and the same sessions as plain streaming generations on vLLM's own
server (loadtest_vllm.py), what an operator would run instead.

A level of N sessions is closed-loop: N workers each replay recorded sessions back to back
(loadtest_replay.py, with the recorded edge think-time) for `step_s` seconds, so about N
sessions are in flight for the whole level, not only at its start. Worker starts are spread
over the first tenth of the level, as users do not all press enter at once.

The target is on the inter-token latency as the user sees it (ITL): per session, the time
between one reply's tokens and the next's, the first of a reply's tokens carrying the gap and the
others none (they arrive together). A session's first tokens are its TTFT, not an inter-token
gap. The smoothed ITL (the gap spread over the reply's tokens, what a UI pacing its output shows)
is reported beside it. Or on the time per output token (TPOT), what a reader experiences: per
session, the time from its first tokens to its last over the tokens after the first ones. A
speculative session that gets 3 tokens a round has long gaps and a short TPOT; the ITL target
counts the gaps, the TPOT target the rate, and both are reported for every level. ITLs count
in the steady part of a level only (after the starts are spread, before `step_s`): the ramp and
the tail run fewer than N sessions. Throughput is over the
whole level. A level meets the target when no session ended early, every one of its N
workers got tokens in the steady part (a worker stuck waiting for its first tokens has no
inter-token gaps to count, and would otherwise hide the stall), and the p95s are within it.
With several load processes (`--load-processes`), a level's workers are dealt out to them
round-robin; they share the level's start, and their sessions, rounds and CPU time are summed
into one level.
Search: 1, 2, 4, ... sessions until a level misses (or `max_sessions`), then bisection between
the last level met and the first missed; the capacity is the largest level met (0 when one
session already misses).
"""

from __future__ import annotations

import asyncio
import resource
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.loadtest_arrivals import PlannedSession
from bench.loadtest_replay import Delivery, LoadClock, RoundSample, SessionOutcome, think_gaps
from bench.loadtest_report import percentiles
from edge.trace import SessionTrace, VerifyEvent

START_SPREAD = 0.1  # worker starts are spread over this fraction of a level


@dataclass(frozen=True)
class CapacitySearch:
    slo_itl_p95_ms: float | None  # None: no ITL target (then a TPOT one)
    slo_ttft_p95_ms: float | None = None
    max_sessions: int = 64  # the search stops here even if the target still holds
    step_s: float = 30.0  # seconds each level keeps starting sessions
    slo_tpot_p95_ms: float | None = None
    resolution: float = 0.0  # bisection stops once the gap is within this fraction of the level met (0: to 1 session)

    def met(self, itl_p95: float | None, ttft_p95: float | None, tpot_p95: float | None) -> bool:
        """Whether a level's p95s meet every target set (a p95 with no samples meets none)."""
        targets = ((self.slo_itl_p95_ms, itl_p95), (self.slo_ttft_p95_ms, ttft_p95), (self.slo_tpot_p95_ms, tpot_p95))
        return all(p95 is not None and p95 <= target for target, p95 in targets if target is not None)


# (busy seconds, forward passes) of the verifier so far, or None when it cannot be read
BusyProbe = Callable[[], Awaitable[tuple[float, float] | None]]
# one session of a system, start to end, reporting into the level's clock
SessionRunner = Callable[[PlannedSession, LoadClock], Awaitable[SessionOutcome]]


async def no_probe() -> None:
    """A server that reports no busy time."""
    return None


@dataclass
class LevelShare:
    """What the workers of a level that one load process ran heard (picklable)."""

    deliveries: list[Delivery]
    rounds: list[RoundSample]
    open_changes: list[tuple[float, int]]
    errors_by_code: dict[str, int]
    outcomes: list[SessionOutcome]
    cpu_s: float  # that process's CPU time over its share


# runs the workers `ids` of a level of n sessions, started at t0, in another process
ShareRunner = Callable[[int, list[int], float], Awaitable[LevelShare]]


@dataclass(frozen=True)
class System:
    """One row of the search: how a session runs on it, how busy its server was (if it says),
    and, to spread a level over processes, how a share of its workers runs in one of them."""

    name: str
    run_session: SessionRunner
    probe: BusyProbe = no_probe
    share: ShareRunner | None = None
    processes: int = 1


def cpu_seconds() -> float:
    """CPU time of the load generator so far (this process and the processes it waited for), seconds."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def steady(deliveries: list[Delivery], search: CapacitySearch) -> list[Delivery]:
    """Deliveries while all N sessions were going (all of them if a level is too short for that)."""
    inside = [d for d in deliveries if search.step_s * START_SPREAD <= d.t_s <= search.step_s]
    return inside or deliveries


def itl_as_seen(deliveries: list[Delivery]) -> list[float]:
    return [v for d in deliveries for v in [d.gap_ms] + [0.0] * (d.tokens - 1)]


def itl_smoothed(deliveries: list[Delivery]) -> list[float]:
    return [d.gap_ms / d.tokens for d in deliveries for _ in range(d.tokens)]


def tpot_per_session(deliveries: list[Delivery]) -> list[float]:
    """Per session with tokens after its first ones: the time from its first tokens to its
    last over those later tokens, ms."""
    sessions: dict[int, list[Delivery]] = {}
    for delivery in deliveries:
        sessions.setdefault(delivery.session, []).append(delivery)
    tpots = []
    for own in sessions.values():
        own.sort(key=lambda d: d.t_s)
        later = sum(d.tokens for d in own[1:])
        if later:
            tpots.append((own[-1].t_s - own[0].t_s) * 1000.0 / later)
    return tpots


async def _closed_loop(
    plans: list[PlannedSession],
    n: int,
    run_session: SessionRunner,
    search: CapacitySearch,
    workers: Sequence[int] | None = None,
    clock: LoadClock | None = None,
) -> tuple[LoadClock, list[SessionOutcome]]:
    """Workers `workers` (default: all n) of a level of n sessions, on `clock` (default: one
    starting now)."""
    clock = clock or LoadClock()
    outcomes: list[SessionOutcome] = []

    async def worker(i: int) -> None:
        await asyncio.sleep(search.step_s * START_SPREAD * i / n)
        j = 0
        while j == 0 or clock.now() < search.step_s:
            index = i + j * n  # unique within the level: the clock keys deliveries by it
            plan = replace(plans[index % len(plans)], index=index, arrival_s=clock.now())
            outcomes.append(await run_session(plan, clock))
            j += 1

    await asyncio.gather(*(worker(i) for i in (range(n) if workers is None else workers)))
    return clock, outcomes


async def run_share(
    plans: list[PlannedSession], n: int, run_session: SessionRunner, search: CapacitySearch, ids: list[int], t0: float
) -> LevelShare:
    """One process's share of a level (the workers `ids`), on the level's clock."""
    cpu_before = cpu_seconds()
    clock, outcomes = await _closed_loop(plans, n, run_session, search, ids, LoadClock(t0))
    errors = dict(clock.errors_by_code)
    return LevelShare(clock.deliveries, clock.rounds, clock.open_changes, errors, outcomes, cpu_seconds() - cpu_before)


async def _spread_level(n: int, system: System) -> tuple[LoadClock, list[SessionOutcome], float]:
    """A level dealt out to the system's processes: one clock, every outcome, their CPU time."""
    assert system.share is not None
    clock = LoadClock()
    parts = [list(range(p, n, system.processes)) for p in range(min(system.processes, n))]
    shares = await asyncio.gather(*(system.share(n, ids, clock.t0) for ids in parts))
    outcomes = []
    for share in shares:
        clock.deliveries += share.deliveries
        clock.rounds += share.rounds
        clock.open_changes += share.open_changes
        clock.errors_by_code.update(share.errors_by_code)
        outcomes += share.outcomes
    return clock, outcomes, sum(share.cpu_s for share in shares)


def _level(
    n: int,
    mode: str,
    clock: LoadClock,
    outcomes: list[SessionOutcome],
    wall_s: float,
    busy: tuple[float, float] | None,
    loadgen_cpu_s: float,
    search: CapacitySearch,
) -> dict[str, Any]:
    tokens = sum(o.verified_tokens for o in outcomes)
    failed = [o for o in outcomes if o.error is not None]
    deliveries = steady(clock.deliveries, search)
    itl, ttft = percentiles(itl_as_seen(deliveries)), percentiles([o.ttft_ms for o in outcomes if o.ttft_ms is not None])
    tpot = percentiles(tpot_per_session(clock.deliveries))
    workers_served = len({d.session % n for d in deliveries})  # session index i + j * n runs on worker i
    meets = not failed and workers_served == n and search.met(itl["p95"], ttft["p95"], tpot["p95"])
    return {
        "sessions": n,
        "mode": mode,
        "meets_slo": meets,
        "workers_served": workers_served,
        "wall_s": round(wall_s, 3),
        "sessions_completed": len(outcomes) - len(failed),
        "sessions_failed": len(failed),
        "errors_by_code": dict(sorted(clock.errors_by_code.items())),
        "itl_ms": itl,
        "itl_smoothed_ms": percentiles(itl_smoothed(deliveries)),
        "tpot_ms": tpot,
        "ttft_ms": ttft,
        "verified_tokens_per_s": round(tokens / wall_s, 3) if wall_s else 0.0,
        # target passes each session needed per token (1 for cloud_only; 1/tau speculative)
        "rounds_per_token": round(sum(o.rounds for o in outcomes) / tokens, 4) if tokens else None,
        # replayed rounds whose reply was the recorded one (None: none compared)
        "rounds_as_recorded": _as_recorded(outcomes),
        # passes the verifier ran per token (vLLM: its steps), batching counted: shared passes cost less
        "forward_passes_per_token": round(busy[1] / tokens, 4) if busy and tokens else None,
        "busy_fraction": round(busy[0] / wall_s, 4) if busy and wall_s else None,
        # the load generator's own CPU over the level, in cores: near 1 it measures itself
        "loadgen_cpu_cores": round(loadgen_cpu_s / wall_s, 3) if wall_s else None,
    }


def _as_recorded(outcomes: list[SessionOutcome]) -> float | None:
    compared = sum(o.rounds_compared for o in outcomes)
    differed = sum(o.rounds_differing for o in outcomes)
    return round(1.0 - differed / compared, 4) if compared else None


async def measure(plans: list[PlannedSession], n: int, system: System, search: CapacitySearch) -> dict[str, Any]:
    """One level: n sessions in flight for step_s seconds (then their last sessions end)."""
    before, cpu_before = await system.probe(), cpu_seconds()
    if system.share is not None and system.processes > 1:
        clock, outcomes, share_cpu_s = await _spread_level(n, system)
    else:
        clock, outcomes = await _closed_loop(plans, n, system.run_session, search)
        share_cpu_s = 0.0
    wall_s, cpu_s = clock.now(), cpu_seconds() - cpu_before + share_cpu_s
    after = await system.probe()
    busy = (after[0] - before[0], after[1] - before[1]) if before and after else None
    return _level(n, system.name, clock, outcomes, wall_s, busy, cpu_s, search)


async def search_mode(
    measure_at: Callable[[int], Awaitable[dict[str, Any]]],
    max_sessions: int,
    known: dict[int, dict[str, Any]] | None = None,
    resolution: float = 0.0,
) -> tuple[int, list[dict[str, Any]]]:
    """The largest level meeting the target: doubling, then bisection until the first level
    missed is within `resolution` of the last met (or next to it); every level measured (levels
    `known` from a run cut short are taken as they were)."""
    levels: dict[int, dict[str, Any]] = dict(known or {})

    async def meets(n: int) -> bool:
        if n not in levels:
            levels[n] = await measure_at(n)
        return bool(levels[n]["meets_slo"])

    good, n = 0, 1
    while n <= max_sessions and await meets(n):
        good, n = n, n * 2
    bad = n
    if n > max_sessions:  # every doubling met the target: try the cap itself
        if good < max_sessions and await meets(max_sessions):
            good = max_sessions
        bad = max_sessions + 1 if good == max_sessions else max_sessions
    while bad - good > max(1, int(good * resolution)):
        mid = (good + bad) // 2
        good, bad = (mid, bad) if await meets(mid) else (good, mid)
    return good, [levels[k] for k in sorted(levels)]


def _summary(sessions: int, points: list[dict[str, Any]]) -> dict[str, Any]:
    at = next((p for p in points if p["sessions"] == sessions), None)
    return {
        "sessions": sessions,
        "itl_ms": None if at is None else {"p50": at["itl_ms"]["p50"], "p95": at["itl_ms"]["p95"]},
        "tpot_ms": None if at is None else {"p50": at["tpot_ms"]["p50"], "p95": at["tpot_ms"]["p95"]},
        "verified_tokens_per_s": None if at is None else at["verified_tokens_per_s"],
        "rounds_per_token": None if at is None else at["rounds_per_token"],
        "rounds_as_recorded": None if at is None else at.get("rounds_as_recorded"),
        "forward_passes_per_token": None if at is None else at["forward_passes_per_token"],
        "busy_fraction": None if at is None else at["busy_fraction"],
        "loadgen_cpu_cores": None if at is None else at.get("loadgen_cpu_cores"),
    }


BASELINES = ("vllm_alone", "cloud_only")  # what the gain of speculation is measured against
GAINS = ("speculative", "auto")


def capacity_ratios(capacity: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Sessions of speculative and auto over each baseline measured ("speculative/vllm_alone")."""
    ratios: dict[str, float | None] = {}
    for gain in (g for g in GAINS if g in capacity):
        for base in (b for b in BASELINES if b in capacity):
            sessions = capacity[base]["sessions"]
            ratios[f"{gain}/{base}"] = round(capacity[gain]["sessions"] / sessions, 3) if sessions else None
    return ratios


# what a run heard of each level as it finished: (system, level)
LevelSink = Callable[[str, dict[str, Any]], None]


async def find_capacity(
    plans: list[PlannedSession],
    search: CapacitySearch,
    systems: list[System],
    known: dict[str, dict[int, dict[str, Any]]] | None = None,
    on_level: LevelSink | None = None,
    costs: DraftCosts | None = None,
) -> dict[str, Any]:
    """Each system in turn on the same sessions. `known` holds the levels a run cut short had
    measured (by system, then sessions); `on_level` hears each new level as it finishes."""
    capacity, points = {}, {}
    for system in systems:

        async def at(n: int, system: System = system) -> dict[str, Any]:
            level = await measure(plans, n, system, search)
            if on_level is not None:
                on_level(system.name, level)
            return level

        sessions, points[system.name] = await search_mode(
            at, search.max_sessions, (known or {}).get(system.name), search.resolution
        )
        capacity[system.name] = _summary(sessions, points[system.name])
    return capacity_result(search, capacity, points, costs)


@dataclass(frozen=True)
class DraftCosts:
    """What the replayed edges spend drafting, from the traces: drafts per round and the
    think-time per drafted token (median, as replayed: scaled)."""

    drafts_per_round: float
    draft_ms_per_token: float


def draft_costs(traces: list[SessionTrace], think_scale: float) -> DraftCosts | None:
    per_round, per_token = [], []
    for trace in traces:
        gaps = think_gaps(trace.events)
        for i, event in enumerate(trace.events):
            if isinstance(event, VerifyEvent) and event.error is None:
                k = len(event.request.draft_tokens)
                per_round.append(k)
                if k:
                    per_token.append(gaps[i] * 1000.0 * think_scale / k)
    if not per_token:
        return None
    return DraftCosts(statistics.fmean(per_round), statistics.median(per_token))


def predicted_bound(costs: DraftCosts | None, points: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """ "Speculation at a Distance"'s bound on the sessions speculation adds at the same per-session
    rate: 1 + gamma * t_draft / t_verify, with gamma the drafts per round, t_draft the think-time
    per drafted token and t_verify one session's decode step of the baseline measured (vLLM
    alone's, else cloud_only's TPOT p50 at one session)."""
    base = next((b for b in BASELINES if points.get(b)), None)
    alone = next((p for p in points.get(base or "", []) if p["sessions"] == 1), None)
    t_verify = alone["tpot_ms"]["p50"] if alone else None
    if costs is None or base is None or not t_verify:
        return None
    bound = 1.0 + costs.drafts_per_round * costs.draft_ms_per_token / t_verify
    return {
        "sessions_ratio": round(bound, 2),
        "over": base,
        "drafts_per_round": round(costs.drafts_per_round, 3),
        "draft_ms_per_token": round(costs.draft_ms_per_token, 3),
        "verify_step_ms": t_verify,
    }


def capacity_result(
    search: CapacitySearch,
    capacity: dict[str, dict[str, Any]],
    points: dict[str, list[dict[str, Any]]],
    costs: DraftCosts | None = None,
) -> dict[str, Any]:
    ratios = capacity_ratios(capacity)
    return {
        "mode": "capacity",
        "slo": {
            "itl_p95_ms": search.slo_itl_p95_ms,
            "ttft_p95_ms": search.slo_ttft_p95_ms,
            "tpot_p95_ms": search.slo_tpot_p95_ms,
        },
        "capacity": capacity,
        "capacity_ratio": ratios.get("speculative/cloud_only"),  # kept under its first name
        "ratios": ratios,
        "predicted_bound": predicted_bound(costs, points),
        "levels": points,
    }


def slo_line(slo: dict[str, Any]) -> str:
    """The targets a search ran with, in words: "ITL p95 <= 1500 ms, TPOT p95 <= 400 ms"."""
    names = (("itl_p95_ms", "ITL"), ("ttft_p95_ms", "TTFT"), ("tpot_p95_ms", "TPOT"))
    return ", ".join(f"{name} p95 <= {slo[key]} ms" for key, name in names if slo.get(key))


def ratio_line(result: dict[str, Any]) -> str:
    ratios = result.get("ratios") or {"speculative/cloud_only": result.get("capacity_ratio")}
    return "; ".join(f"{name}: {value if value is not None else '–'}x" for name, value in ratios.items())


def bound_lines(bound: dict[str, Any] | None) -> list[str]:
    if not bound:
        return []
    return [
        f"Predicted bound for speculation over {bound['over']} (1 + gamma * t_draft / t_verify): "
        f"1 + {bound['drafts_per_round']} x {bound['draft_ms_per_token']} ms / {bound['verify_step_ms']} ms = "
        f"{bound['sessions_ratio']}x.",
        "",
    ]


def capacity_markdown(result: dict[str, Any]) -> str:
    slo, cap = result["slo"], result["capacity"]
    lines = [
        f"# Capacity at {slo_line(slo)}",
        "",
        f"Sessions within the target, one system over another: {ratio_line(result)}.",
        "",
        *bound_lines(result.get("predicted_bound")),
        "| system | sessions | ITL p50 / p95 ms | TPOT p50 / p95 ms | tokens/s | target passes per token "
        "(per session, verifier) | rounds as recorded | verifier busy | load generator CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, c in cap.items():
        itl, tpot = c["itl_ms"] or {}, c.get("tpot_ms") or {}
        lines.append(
            f"| {mode} | {c['sessions']} | {itl.get('p50', '–')} / {itl.get('p95', '–')} | "
            f"{tpot.get('p50', '–')} / {tpot.get('p95', '–')} | "
            f"{c['verified_tokens_per_s'] or '–'} | {c['rounds_per_token'] or '–'}, "
            f"{c['forward_passes_per_token'] or '–'} | {c.get('rounds_as_recorded') or '–'} | {c['busy_fraction'] or '–'} | "
            f"{c.get('loadgen_cpu_cores') or '–'} |"
        )
    lines += [
        "",
        "| system | sessions | meets | ITL p95 ms (smoothed) | TPOT p95 ms | TTFT p95 ms | tokens/s | busy | "
        "load generator CPU | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, levels in result["levels"].items():
        lines += [
            f"| {mode} | {p['sessions']} | {'yes' if p['meets_slo'] else 'no'} | {p['itl_ms']['p95']} "
            f"({p['itl_smoothed_ms']['p95']}) | {p['tpot_ms']['p95']} | {p['ttft_ms']['p95']} | "
            f"{p['verified_tokens_per_s']} | {p['busy_fraction']} | {p.get('loadgen_cpu_cores')} | {p['sessions_failed']} |"
            for p in levels
        ]
    return "\n".join(lines) + "\n\n![capacity](capacity.png)\n"


def write_capacity_report(result: dict[str, Any], folder: Path) -> list[Path]:
    """capacity.md and capacity.png (ITL p95, TPOT p95 and throughput against sessions, every system)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, (itl_ax, tpot_ax, tput_ax) = plt.subplots(1, 3, figsize=(14, 3.5))
    for mode, levels in result["levels"].items():
        xs = [p["sessions"] for p in levels]
        itl_ax.plot(xs, [p["itl_ms"]["p95"] for p in levels], marker="o", label=mode)
        tpot_ax.plot(xs, [p["tpot_ms"]["p95"] for p in levels], marker="o", label=mode)
        tput_ax.plot(xs, [p["verified_tokens_per_s"] for p in levels], marker="o", label=mode)
    for ax, key in ((itl_ax, "itl_p95_ms"), (tpot_ax, "tpot_p95_ms")):
        if result["slo"].get(key):
            ax.axhline(result["slo"][key], color="grey", linestyle="--", label="target")
    itl_ax.set(xlabel="concurrent sessions", ylabel="ITL p95 (ms)", title="inter-token latency p95")
    tpot_ax.set(xlabel="concurrent sessions", ylabel="TPOT p95 (ms)", title="time per output token p95")
    tput_ax.set(xlabel="concurrent sessions", ylabel="verified tokens/s", title="throughput")
    for ax in (itl_ax, tpot_ax, tput_ax):
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    plot, summary = folder / "capacity.png", folder / "capacity.md"
    fig.savefig(plot, dpi=100)
    plt.close(fig)
    summary.write_text(capacity_markdown(result))
    return [summary, plot]
