"""Which recorded session arrives when, and how long it is: the plan of one load test.

Three arrival sources, all open-loop (an arrival never waits for earlier sessions to finish):
- the recorded traces' own start times (`started_at`), `copies` times over (each copy starts at 0);
- the Azure LLM inference traces 2023 (TIMESTAMP, ContextTokens, GeneratedTokens);
- Poisson arrivals at a fixed rate.
Every offset is multiplied by `scale` (2 = half the rate, 0.5 = twice the rate). Sessions are
taken round-robin from the traces. Lengths: recorded ones unless the Azure row or a cap asks
for others; then the prompt is the recorded prompt tiled (repeated) or cut to the new length, and
the output length is met by cycling the session's recorded draft blocks (loadtest_replay.py).
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from edge.trace import SessionTrace, TraceError


@dataclass(frozen=True)
class AzureRow:
    offset_s: float  # since the first row
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class PlannedSession:
    index: int
    arrival_s: float
    trace: SessionTrace
    prompt_tokens: list[int]
    output_target: int  # tokens to generate
    resized: bool  # lengths differ from the recording: outputs are not compared


@dataclass(frozen=True)
class Caps:
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_sessions: int | None = None
    duration_s: float | None = None  # no arrival after this offset


def _timestamp(text: str) -> datetime:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, one more than datetime parses.
    whole, _, fraction = text.strip().partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction + '000000')[:6]}")


def read_azure(path: Path) -> list[AzureRow]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(rows[0]):
        raise TraceError(f"{path}: expected the Azure 2023 columns TIMESTAMP, ContextTokens, GeneratedTokens")
    first = _timestamp(rows[0]["TIMESTAMP"])
    return [
        AzureRow((_timestamp(r["TIMESTAMP"]) - first).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
        for r in rows
    ]


def tile(tokens: list[int], length: int) -> list[int]:
    """tokens repeated until `length`, then cut: a prompt of the asked length from a recorded one."""
    return (tokens * (length // len(tokens) + 1))[:length]


def _capped(value: int, cap: int | None) -> int:
    return max(1, value if cap is None else min(value, cap))


def _session(
    index: int, arrival_s: float, trace: SessionTrace, caps: Caps, prompt_len: int | None = None, output_len: int | None = None
) -> PlannedSession:
    recorded_prompt, recorded_output = trace.header.prompt_tokens, len(trace.end.output_tokens)
    want_prompt = _capped(prompt_len or len(recorded_prompt), caps.max_prompt_tokens)
    want_output = _capped(output_len or recorded_output, caps.max_output_tokens)
    resized = want_prompt != len(recorded_prompt) or want_output != recorded_output
    return PlannedSession(index, arrival_s, trace, tile(recorded_prompt, want_prompt), want_output, resized)


def _bounded(offsets: list[float], caps: Caps) -> list[float]:
    kept = [t for t in offsets if caps.duration_s is None or t <= caps.duration_s]
    return kept[: caps.max_sessions] if caps.max_sessions is not None else kept


def trace_plan(traces: list[SessionTrace], copies: int, scale: float, caps: Caps) -> list[PlannedSession]:
    first = min(t.header.started_at for t in traces)
    arrivals = sorted(((t.header.started_at - first) * scale, i, t) for i, t in enumerate(traces) for _ in range(copies))
    kept = len(_bounded([a for a, _, _ in arrivals], caps))  # offsets are sorted: a prefix
    return [_session(n, offset, trace, caps) for n, (offset, _, trace) in enumerate(arrivals[:kept])]


def azure_plan(traces: list[SessionTrace], rows: list[AzureRow], scale: float, caps: Caps) -> list[PlannedSession]:
    offsets = _bounded([r.offset_s * scale for r in rows], caps)
    return [
        _session(n, offset, traces[n % len(traces)], caps, row.context_tokens, row.generated_tokens)
        for n, (offset, row) in enumerate(zip(offsets, rows, strict=False))
    ]


def poisson_plan(traces: list[SessionTrace], rate: float, scale: float, caps: Caps, seed: int) -> list[PlannedSession]:
    if caps.max_sessions is None and caps.duration_s is None:
        raise TraceError("Poisson arrivals need --max-sessions or --duration to end")
    rng = random.Random(seed)
    offsets: list[float] = []
    clock = 0.0
    while (caps.max_sessions is None or len(offsets) < caps.max_sessions) and (
        caps.duration_s is None or clock * scale <= caps.duration_s
    ):
        offsets.append(clock * scale)
        clock += rng.expovariate(rate)
    offsets = _bounded(offsets, caps)
    return [_session(n, offset, traces[n % len(traces)], caps) for n, offset in enumerate(offsets)]
