"""The reconnect schedule: exponential waits, capped, jittered, bounded by the window in time
(a fake clock that the fake sleep advances; no real waiting)."""

import asyncio
import random

import pytest

from edge.round.generate import Reconnecting, TimeoutPolicy
from edge.transport.client import CapacityRetry
from shared.errors import CloudUnavailable


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + 0.01  # each attempt itself takes a little time


def _outage(policy: TimeoutPolicy, fake: FakeTime, seed: int = 0) -> Reconnecting:
    return Reconnecting(policy, fake.clock, fake.sleep, random.Random(seed))


async def _until_given_up(outage: Reconnecting) -> CloudUnavailable:
    with pytest.raises(CloudUnavailable) as caught:
        while True:
            await outage.wait(CloudUnavailable("verifier unreachable (UNAVAILABLE): connection refused"))
    return caught.value


def test_waits_double_from_the_first_and_stop_at_the_cap_with_jitter() -> None:
    policy = TimeoutPolicy(reconnect_window_s=60, backoff_s=0.1, max_backoff_s=2.0)
    fake = FakeTime()
    asyncio.run(_until_given_up(_outage(policy, fake)))
    for n, wait in enumerate(fake.sleeps[:-1]):  # the last is cut to the window's end
        base = min(0.1 * 2**n, 2.0)
        assert 0.5 * base <= wait <= 1.5 * base
    assert max(fake.sleeps) <= 3.0
    # Jittered: the capped waits are not all the same.
    capped = fake.sleeps[10:-1]
    assert len(capped) > 10 and len(set(capped)) == len(capped)


def test_the_window_bounds_the_time_not_the_attempts() -> None:
    policy = TimeoutPolicy(reconnect_window_s=60)
    fake = FakeTime()
    err = asyncio.run(_until_given_up(_outage(policy, fake)))
    spent = fake.now - 1000.0
    assert 60 <= spent <= 60 + 0.02  # one last attempt as the window closes, none after
    assert len(fake.sleeps) > 20  # many more tries than a count of doublings would allow
    assert "after 60.0 s" in str(err) and f"{len(fake.sleeps)} attempts" in str(err)
    assert "connection refused" in str(err)  # the last error says why


def test_a_zero_window_fails_at_the_first_error() -> None:
    fake = FakeTime()
    err = asyncio.run(_until_given_up(_outage(TimeoutPolicy(reconnect_window_s=0), fake)))
    assert fake.sleeps == [] and "0 attempts" in str(err)


def test_spread_differs_between_edges() -> None:
    """Two edges cut off together do not retry in lockstep."""
    schedules = []
    for seed in (1, 2):
        fake = FakeTime()
        asyncio.run(_until_given_up(_outage(TimeoutPolicy(reconnect_window_s=5), fake, seed)))
        schedules.append(fake.sleeps)
    assert schedules[0] != schedules[1]


def test_capacity_waits_honour_the_hint_and_otherwise_double_to_the_cap() -> None:
    """The client's resend schedule (CapacityRetry): the same Backoff, never below the server's
    hint (its jitter starts at x1), doubling from backoff_s without one."""
    backoff = CapacityRetry(backoff_s=0.05, max_backoff_s=2.0).backoff()
    backoff.rng = random.Random(3)
    hinted = [backoff.next_delay_s(floor_s=1.0) for _ in range(3)]
    assert all(1.0 <= wait <= 1.5 for wait in hinted) and len(set(hinted)) == 3
    unhinted = [backoff.next_delay_s() for _ in range(7)]  # attempts 3..9
    for n, wait in enumerate(unhinted, start=3):
        base = min(0.05 * 2**n, 2.0)
        assert base <= wait <= 1.5 * base
    assert backoff.attempts == 10
