"""When pending tokens are shown before the cloud's verdict. A Verify slower than the soft
deadline makes the next pending token provisional (shown, not final; retracted if the cloud
rejects it), one more per soft deadline; while the verifier is away, provisional mode tops the
pending block up and shows it. Strict mode only waits; accept-unverified shows nothing
provisionally. The round loop (edge/round/session.py) shows and counts the tokens."""

from __future__ import annotations

import asyncio

from edge.round.generation import TimeoutPolicy


class SoftDeadline:
    """When the next pending token of the round in flight is shown (None: never)."""

    def __init__(self, policy: TimeoutPolicy) -> None:
        self.loop = asyncio.get_running_loop()
        self.soft_s = None if policy.mode == "strict" else policy.soft_deadline_s
        self.at = None if self.soft_s is None else self.loop.time() + self.soft_s

    def left_s(self) -> float | None:
        return None if self.at is None else max(self.at - self.loop.time(), 0)

    def passed(self) -> bool:
        return self.at is not None and self.loop.time() >= self.at

    def rearm(self, more_to_show: bool) -> None:
        """The next deadline once one passed; none when nothing is left to show (then the
        round waits for the reply or the call's own deadline)."""
        self.at = self.loop.time() + self.soft_s if self.soft_s and more_to_show else None


def shows_while_away(policy: TimeoutPolicy) -> bool:
    """Provisional mode shows the pending block (topped up to one block) while the verifier is
    away, verified or retracted once a session is back. Strict mode only waits; accept-unverified
    makes nothing final without a reply here either."""
    return policy.mode == "provisional"
