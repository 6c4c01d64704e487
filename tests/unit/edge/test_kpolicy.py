"""k policies stay within their bounds and move in the right direction (the cost policy:
test_round_costs.py)."""

import pytest

from edge.drafting.feedback import RoundFeedback
from edge.drafting.kpolicy import CostK, EgagK, FixedK, LaRatioK


def _obs(
    k: int,
    accepted: int,
    alpha: float = 0.8,
    entropy: float = 1.0,
    rtt_ms: float = 160.0,
    verify_ms: float = 150.0,
    draft_ms_per_token: float = 40.0,
) -> RoundFeedback:
    return RoundFeedback(k, accepted, alpha, draft_ms_per_token * k, rtt_ms, verify_ms, entropy)


def test_fixed_never_moves() -> None:
    policy = FixedK(5)
    for accepted in (0, 5, 2):
        policy.update(_obs(5, accepted))
        assert policy.next_k() == 5


def test_la_ratio_rises_to_max_and_falls_to_min() -> None:
    policy = LaRatioK(k_start=6, k_min=3, k_max=12)
    seen = []
    for _ in range(10):
        k = policy.next_k()
        policy.update(_obs(k, k))  # everything accepted
        seen.append(policy.next_k())
    assert seen[0] == 7 and seen[-1] == 12 and max(seen) == 12
    for _ in range(15):
        policy.update(_obs(policy.next_k(), 0))
    assert policy.next_k() == 3


def test_la_ratio_middle_band_holds() -> None:
    policy = LaRatioK(k_start=6)
    policy.update(_obs(6, 3))  # 0.5: between 0.4 and 0.8
    assert policy.next_k() == 6


def test_la_ratio_rejects_a_start_outside_its_range() -> None:
    with pytest.raises(ValueError):
        LaRatioK(k_start=2, k_min=3)


def test_egag_follows_draft_entropy_within_bounds() -> None:
    confident, unsure = EgagK(2, 12), EgagK(2, 12)
    for _ in range(20):
        confident.update(_obs(confident.next_k(), 1, entropy=0.05))
        unsure.update(_obs(unsure.next_k(), 1, entropy=9.0))
    assert confident.next_k() >= 11 and unsure.next_k() == 2
    assert all(2 <= p.next_k() <= 12 for p in (confident, unsure))


def test_expected_tokens_before_any_round_are_geometric() -> None:
    """With no depth measured, every depth takes the text's acceptance: 1 + a + a^2 + ... ."""
    policy = CostK(k_max=12)
    a = policy.acceptance
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(2) == pytest.approx(1 + a + a * a)
    assert policy.expected_tokens(12) == pytest.approx((1 - a**13) / (1 - a))


def test_the_default_policy_is_cost_and_a_given_k_makes_it_fixed() -> None:
    from edge.config import FIXED_K, EdgeSettings

    assert EdgeSettings().resolved_k_policy() == "cost"
    assert (EdgeSettings(k=6).resolved_k_policy(), EdgeSettings(k=6).fixed_k()) == ("fixed", 6)
    assert EdgeSettings(k=6, k_policy="la-ratio").resolved_k_policy() == "la-ratio"
    assert EdgeSettings(k_policy="fixed").fixed_k() == FIXED_K
