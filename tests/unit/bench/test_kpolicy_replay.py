"""bench/studies/kpolicy_replay.py without a model: match runs, policies played on them, and the
cost policy's recovery from a disturbed machine or link."""

import dataclasses
import random
import statistics
from collections.abc import Callable

import pytest

from bench.studies.kpolicy_replay import ReplayClock, RoundCost, compare, match_runs, play, replay
from edge.drafting.feedback import RoundFeedback
from edge.drafting.kpolicy import CostK, FixedK, KPolicy
from edge.drafting.round_costs import RoundCosts


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


# ---- recovery from a disturbance ------------------------------------------------------------
# Rounds replayed at recorded costs with a disturbance; the cost policy (one RoundCosts, a
# replay clock) must come back to the k a quiet run of the same costs settles on.

QUIET = RoundCost(draft_ms=10.0, verify_fixed_ms=150.0, verify_per_row_ms=12.0, net_ms=5.0)  # best fixed k: 5
SLOW_LINK = RoundCost(draft_ms=10.0, verify_fixed_ms=40.0, verify_per_row_ms=12.0, net_ms=5.0)  # 3 on 5 ms, 5 on 80


def synthetic_runs(tokens: int, acceptance: float, seed: int) -> list[int]:
    """L(p) of a draft whose every token matches the target's with probability `acceptance`."""
    rng = random.Random(seed)
    return match_runs([int(rng.random() < acceptance) for _ in range(tokens)], [1] * tokens)


def cost_policy(clock: ReplayClock) -> tuple[RoundCosts, Callable[[], KPolicy]]:
    costs = RoundCosts(clock=clock)
    return costs, lambda: CostK(costs=costs)


def quiet_k(cost: RoundCost, seed: int = 1) -> int:
    """The k a quiet run settles on: the median of its last 100 rounds."""
    clock = ReplayClock()
    _, policy_for = cost_policy(clock)
    ks = replay(policy_for, [synthetic_runs(2000, 0.8, seed)], lambda _: cost, clock).ks[0]
    return int(statistics.median(ks[-100:]))


def settled(ks: list[int], target: int, within: int) -> bool:
    """Whether k is within 1 of `target` from round `within` on (probes aside: the median of
    every 10 rounds)."""
    windows = [ks[i : i + 10] for i in range(within, len(ks) - 9, 10)]
    return bool(windows) and all(abs(statistics.median(w) - target) <= 1 for w in windows)


def test_the_quiet_runs_settle_where_the_best_fixed_k_is() -> None:
    """The references the recovery tests hold the policy to."""
    assert 4 <= quiet_k(QUIET) <= 6
    assert quiet_k(SLOW_LINK) <= 3 and quiet_k(dataclasses.replace(SLOW_LINK, net_ms=80.0)) >= 4


def test_two_slow_early_rounds_do_not_pin_k_to_one() -> None:
    """Two slow rounds of a shared machine first (729 ms for 3 rows, 2,218 ms for 5 rows), then
    120 quiet ones: k leaves 1 and is within 1 of the quiet run's within 30 rounds."""
    clock = ReplayClock()
    costs, _ = cost_policy(clock)
    policy = CostK(costs=costs)
    for k, verify in ((2, 729.0), (4, 2218.0)):
        clock.seconds += (10.0 * k + verify + 5.0) / 1000.0
        policy.update(RoundFeedback(k, k // 2, 0.0, 10.0 * k, verify + 5.0, verify))
    ks = replay(lambda: policy, [synthetic_runs(2000, 0.8, 2)], lambda _: QUIET, clock, max_rounds=120).ks[0]
    assert max(ks[:30]) > 1
    assert settled(ks, quiet_k(QUIET), 30), ks


def test_a_cpu_hog_on_the_verifier_is_forgotten_once_it_ends() -> None:
    """The verifier 3x slower for the first 40 rounds, then as quiet: within 30 rounds of the
    end, k is within 1 of the quiet run's."""
    hogged = RoundCost(QUIET.draft_ms, 3 * QUIET.verify_fixed_ms, 3 * QUIET.verify_per_row_ms, QUIET.net_ms)
    clock = ReplayClock()
    _, policy_for = cost_policy(clock)
    ks = replay(policy_for, [synthetic_runs(2000, 0.8, 3)], lambda n: hogged if n < 40 else QUIET, clock).ks[0]
    assert settled(ks[40:160], quiet_k(QUIET), 30), ks


def test_an_rtt_step_is_followed_both_ways() -> None:
    """RTT 5 -> 80 -> 5 ms, 80 rounds each: within 20 rounds of each step k is within 1 of what
    a quiet run at that RTT settles on."""
    slow = dataclasses.replace(SLOW_LINK, net_ms=80.0)
    clock = ReplayClock()
    _, policy_for = cost_policy(clock)
    ks = replay(policy_for, [synthetic_runs(3000, 0.8, 4)], lambda n: slow if 80 <= n < 160 else SLOW_LINK, clock).ks[0]
    near, far = quiet_k(SLOW_LINK), quiet_k(slow)
    assert settled(ks[80:160], far, 20), ks[80:160]
    assert settled(ks[160:240], near, 20), ks[160:240]


def test_a_serve_process_of_short_generations_keeps_what_it_learned() -> None:
    """Ten generations of six rounds each, as `edge-agent serve` answers short requests: the
    tenth drafts its first round from what the first nine measured, not from the prior; after a
    first generation on a noisy machine (the verifier 3x slower), the process is within 1 of
    the quiet k within five generations."""
    noisy = RoundCost(QUIET.draft_ms, 3 * QUIET.verify_fixed_ms, 3 * QUIET.verify_per_row_ms, QUIET.net_ms)
    clock = ReplayClock()
    costs, policy_for = cost_policy(clock)
    outputs = [synthetic_runs(200, 0.8, 10 + i) for i in range(9)]
    ks = replay(policy_for, outputs, lambda n: noisy if n < 6 else QUIET, clock, max_rounds=6).ks
    learned, prior = CostK(costs=costs).best_k(), CostK().best_k()
    assert learned != prior
    assert replay(policy_for, [synthetic_runs(200, 0.8, 19)], lambda _: QUIET, clock, max_rounds=1).ks[0] == [learned]
    # A generation's own text then moves its k (acceptance is per text): the process's part is
    # what each starts from, and all its rounds together.
    target = quiet_k(QUIET)
    assert all(abs(g[0] - target) <= 1 for g in ks[5:]), ks
    assert abs(statistics.median(k for g in ks[5:] for k in g) - target) <= 1, ks
