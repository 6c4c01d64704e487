"""Waiting before trying again, the edge's one schedule for it: jittered, capped exponential
delays (Backoff). Two users: the client resending a call the verifier refused for capacity
(edge/transport/client.py CapacityRetry), and the round loop reopening a session after the
verifier went away (Reconnecting, within a window of time). Clock, sleep and random source are
injectable for tests."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from shared.errors import CloudUnavailable, SpecDecError

Sleep = Callable[[float], Awaitable[None]]


class Backoff:
    """Delays first_s, 2 first_s, 4 first_s, ... capped at max_s, each times a random factor
    from `jitter` (the spread keeps edges turned away together from all coming back in the
    same instant). A floor (the server's hint) raises a delay before the jitter, so the
    wait is never shorter than the floor when jitter starts at 1."""

    def __init__(
        self,
        first_s: float,
        max_s: float,
        jitter: tuple[float, float] = (0.5, 1.5),
        *,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.first_s, self.max_s, self.jitter = first_s, max_s, jitter
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.attempts = 0  # delays handed out so far

    def next_delay_s(self, floor_s: float = 0.0) -> float:
        base = min(self.first_s * 2 ** min(self.attempts, 32), self.max_s)
        self.attempts += 1
        return max(floor_s, base) * self.rng.uniform(*self.jitter)


class ReconnectPolicy(Protocol):
    """The fields of edge/round/generation.py TimeoutPolicy that reconnecting reads."""

    @property
    def reconnect_window_s(self) -> float: ...

    @property
    def backoff_s(self) -> float: ...

    @property
    def max_backoff_s(self) -> float: ...


class Reconnecting:
    """The waits of one outage: Backoff delays (jitter x0.5-1.5) until reconnect_window_s has
    passed since the first failure; then the last error, with how long it was tried, is final."""

    def __init__(
        self,
        policy: ReconnectPolicy,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.policy, self.clock = policy, clock
        self.backoff = Backoff(policy.backoff_s, policy.max_backoff_s, sleep=sleep, rng=rng)
        self.started = clock()

    @property
    def attempts(self) -> int:
        return self.backoff.attempts

    async def wait(self, err: SpecDecError) -> None:
        """Sleep before the next attempt; raise CloudUnavailable once the window is spent."""
        elapsed = self.clock() - self.started
        left = self.policy.reconnect_window_s - elapsed
        if left <= 0:
            raise CloudUnavailable(
                f"gave up reconnecting to the verifier after {elapsed:.1f} s and "
                f"{self.attempts} attempts (reconnect window {self.policy.reconnect_window_s:g} s); "
                f"last error: {err}"
            ) from err
        delay = min(self.backoff.next_delay_s(), left)  # one last attempt as the window closes
        await self.backoff.sleep(delay)
