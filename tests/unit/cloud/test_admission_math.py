"""The batcher's cost model and the loadtest's account of how failed sessions ended."""

import pytest

from bench.loadtest_replay import SessionOutcome
from bench.loadtest_report import ended_by_line
from cloud.batcher import PREFILL_TOKENS, ForwardCost


def test_forward_cost_learns_steps_and_prefill_throughput_apart() -> None:
    cost = ForwardCost()
    assert not cost.known and cost.estimate_ms(500) == 0.0
    cost.observe(5, 400.0)  # a round: a decode step's cost, whatever its few tokens
    assert not cost.known and cost.step_ms == 400.0
    cost.observe(100, 5000.0)  # a prefill: 50 ms per token
    assert cost.known and cost.ms_per_token == pytest.approx(50.0)
    assert cost.estimate_ms(3) == 400.0  # a round costs at least a step
    assert cost.estimate_ms(200) == pytest.approx(10_000.0)
    cost.observe(PREFILL_TOKENS, PREFILL_TOKENS * 100.0)  # slower now: the average moves toward it
    assert 50.0 < cost.ms_per_token < 100.0


def _outcome(error: str | None, opened: bool) -> SessionOutcome:
    out = SessionOutcome(0, "t", "speculative", 0.0, 10, 10, False)
    out.error, out.opened = error, opened
    return out


def test_failed_sessions_say_where_they_ended() -> None:
    assert _outcome(None, True).ended_by is None
    assert _outcome("RESOURCE_EXHAUSTED", False).ended_by == "open RESOURCE_EXHAUSTED"
    assert _outcome("DEADLINE_EXCEEDED", True).ended_by == "round DEADLINE_EXCEEDED"
    result = {"sessions_completed": 8, "sessions_ended_by": {"open RESOURCE_EXHAUSTED": 16, "round DEADLINE_EXCEEDED": 1}}
    assert ended_by_line(result) == (
        "served 8, refused at open 16 (RESOURCE_EXHAUSTED 16), lost in a round 1 (DEADLINE_EXCEEDED 1)"
    )
    assert ended_by_line({"sessions_completed": 3, "sessions_ended_by": {}}) == "served 3"
