"""Session trace files (edge/trace.py) and the load test's arrival plans (bench/loadtest_arrivals.py)."""

import json
from pathlib import Path

import pytest

from bench.loadtest_arrivals import Caps, azure_plan, poisson_plan, read_azure, tile, trace_plan
from edge.trace import (
    TRACE_VERSION,
    Event,
    GenerateEvent,
    OpenEvent,
    SessionTrace,
    TraceEnd,
    TraceError,
    TraceHeader,
    VerifyEvent,
    read_trace,
    trace_lines,
    write_trace,
)
from shared.protocol import SamplingParams, SparseDistribution, VerifyRequest

SHIPPED_AZURE = Path(__file__).resolve().parents[3] / "bench" / "data" / "traces" / "azure_conv_2023.csv"


def _trace(started_at: float = 100.0, output: list[int] | None = None) -> SessionTrace:
    header = TraceHeader(
        "speculative",
        [5, 6, 7],
        SamplingParams(0.7, 20, 0.9, 1.1),
        3,
        "sparse",
        96,
        8,
        [1],
        "draft",
        "target",
        started_at,
        {"k_policy": "fixed", "k": 2},
    )
    sparse = [SparseDistribution([9, 10], [0.25, 0.75]), SparseDistribution([11], [1.0])]
    events: list[Event] = [
        OpenEvent(0.001, 0.01, 3, [], 3, 1.5),
        VerifyEvent(
            0.02,
            0.03,
            VerifyRequest("", 3, [9, 11], [0.25, 1.0], [], [True, False], sparse, 0),
            1,
            12,
            False,
            5,
            2.0,
            0.1,
            resends=2,
        ),
        VerifyEvent(0.04, 0.05, VerifyRequest("", 5, [13], [], [4], [], [], 4), error="NOT_FOUND"),
        OpenEvent(0.06, 0.07, 3 + 1_000_003, [9, 12], 5, 1.0),
        GenerateEvent(0.08, 0.09, 0.1, 3, [1], [20, 21, 22]),
    ]
    return SessionTrace(header, events, TraceEnd(0.2, output or [9, 12, 13, 14], "length", 2, 1), "t")


def test_trace_round_trip(tmp_path: Path) -> None:
    trace = _trace()
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace
    first = json.loads(path.read_text().splitlines()[0])
    assert first["type"] == "session" and first["version"] == TRACE_VERSION
    # Token ids and numbers only: no text field anywhere.
    assert "text" not in path.read_text() and 'prompt"' not in path.read_text()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda lines: [lines[0].replace(f'"version":{TRACE_VERSION}', '"version":2'), *lines[1:]], "trace version 2"),
        (lambda lines: lines[1:], "session header first"),
        (lambda lines: lines[:-1], "end line last"),
        (lambda lines: [lines[0], '{"type":"verify","t":0}', *lines[1:]], "malformed"),
        (lambda lines: [lines[0], "{not json", *lines[1:]], "not JSON"),
    ],
)
def test_trace_refuses_other_versions_and_broken_files(tmp_path: Path, change, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(change(trace_lines(_trace()))))
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_tile_repeats_and_cuts() -> None:
    assert tile([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    assert tile([1, 2, 3], 2) == [1, 2]


def test_azure_csv_crlf_seven_digit_timestamps_and_lengths() -> None:
    rows = read_azure(SHIPPED_AZURE)
    assert len(rows) == 19_366  # every row, the last one without a line break
    assert rows[0].offset_s == 0.0 and all(b.offset_s >= a.offset_s for a, b in zip(rows, rows[1:], strict=False))
    assert 3500 < rows[-1].offset_s < 3503  # 58 min 22 s
    plan = azure_plan([_trace()], rows, scale=0.5, caps=Caps(max_prompt_tokens=64, max_output_tokens=16, max_sessions=5))
    assert len(plan) == 5
    for session, row in zip(plan, rows, strict=False):
        assert session.arrival_s == row.offset_s * 0.5
        assert len(session.prompt_tokens) == min(row.context_tokens, 64)
        assert session.output_target == min(row.generated_tokens, 16) and session.resized


def test_trace_and_poisson_plans_respect_copies_and_bounds() -> None:
    traces = [_trace(100.0), _trace(102.0, output=[9, 12, 13])]
    plan = trace_plan(traces, copies=3, scale=2.0, caps=Caps())
    assert [round(p.arrival_s, 6) for p in plan] == [0.0] * 3 + [4.0] * 3
    assert not any(p.resized for p in plan) and plan[3].output_target == 3
    assert len(trace_plan(traces, 3, 1.0, Caps(max_sessions=4))) == 4
    assert len(trace_plan(traces, 3, 1.0, Caps(duration_s=1.0))) == 3
    capped = trace_plan(traces, 1, 1.0, Caps(max_output_tokens=2))
    assert all(p.resized and p.output_target == 2 for p in capped)
    poisson = poisson_plan(traces, rate=50.0, scale=1.0, caps=Caps(max_sessions=200), seed=1)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(poisson, poisson[1:], strict=False)]
    assert len(poisson) == 200 and 0.015 < sum(gaps) / len(gaps) < 0.025  # mean 1/50 s
    with pytest.raises(TraceError):
        poisson_plan(traces, 1.0, 1.0, Caps(), 0)
