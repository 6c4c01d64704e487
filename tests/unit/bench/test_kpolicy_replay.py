"""bench/studies/kpolicy_replay.py without a model: match runs, and policies played on them."""

import pytest

from bench.studies.kpolicy_replay import RoundCost, compare, match_runs, play
from edge.drafting.kpolicy import FixedK


def test_match_runs_count_the_drafts_that_would_pass_from_each_position() -> None:
    assert match_runs([1, 2, 9, 4, 5], [1, 2, 3, 4, 5]) == [2, 1, 0, 2, 1]


def test_a_fixed_k_accepts_what_the_run_allows() -> None:
    """An 8-token output whose draft misses only at position 3: L = [3, 2, 1, 0, 4, 3, 2, 1]. With
    k = 2: from position 1 both pass (3 tokens), from 4 both pass (3), and at 7, one token left,
    the round drafts none (1)."""
    runs = match_runs([1, 1, 1, 0, 1, 1, 1, 1], [1] * 8)
    assert runs == [3, 2, 1, 0, 4, 3, 2, 1]
    cost = RoundCost(draft_ms=10.0, verify_fixed_ms=100.0, verify_per_row_ms=0.0, net_ms=0.0)
    got = play(lambda: FixedK(2), [runs], cost)
    assert got["tokens_per_s"] == pytest.approx(1000 * 7 / (120 + 120 + 100))
    assert got["mean_k"] == pytest.approx(4 / 3)


def test_the_cost_policy_drafts_long_where_drafts_always_pass_and_the_pass_is_flat() -> None:
    outputs = [[200 - p for p in range(200)] for _ in range(3)]  # every draft passes
    rates = compare(outputs, RoundCost(draft_ms=5.0, verify_fixed_ms=100.0, verify_per_row_ms=0.0, net_ms=1.0))
    assert rates["cost (default)"]["mean_k"] > 8
    assert rates["cost (default)"]["tokens_per_s"] > 1.5 * rates["k4"]["tokens_per_s"]
