"""Showing pending tokens before the cloud's verdict. A Verify slower than the soft deadline
makes the next pending token provisional (shown, not final; retracted if the cloud rejects
it), one more per soft deadline; while the verifier is away, the pending block is topped up
and shown. Strict mode only waits; accept-unverified shows nothing provisionally."""

from __future__ import annotations

import asyncio

from edge.round.generation import GenerationResult, Output, TimeoutPolicy
from edge.round.round_tokens import BlockDrafter, RoundTokens
from shared.protocol import OpenSessionResult


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


class Provisional:
    """The provisional tokens of a generation: shown one at a time (the observer, and the
    edge's metrics, count one token per call), counted, and cut back to a session's limit."""

    def __init__(
        self, policy: TimeoutPolicy, tokens: RoundTokens, blocks: BlockDrafter, result: GenerationResult, out: Output
    ) -> None:
        self.policy, self.tokens, self.blocks, self.result, self.out = policy, tokens, blocks, result, out

    def more_to_show(self) -> bool:
        return self.tokens.provisional < len(self.tokens.pending)

    def show_one(self) -> None:
        """One more pending token on screen, unverified (none left: nothing happens)."""
        tokens = self.tokens
        if tokens.provisional < len(tokens.pending):
            tokens.provisional += 1
            self.result.provisional_tokens += 1
            self.out.show_provisional(tokens.pending.token_ids[: tokens.provisional])

    def while_away(self, session: OpenSessionResult | None) -> None:
        """Provisional mode: while the verifier is away, top the pending block up to one block
        and show it provisionally; verified (or retracted) once a session is back. Strict mode
        only waits; accept-unverified makes nothing final without a reply here either."""
        if self.policy.mode != "provisional":
            return
        room = self.blocks.room(session.max_draft_tokens if session is not None else None)
        if len(self.tokens.pending) < room:
            self.blocks.top_up(room)
        while self.more_to_show():
            self.show_one()

    def fit(self, max_draft_tokens: int) -> None:
        """Tokens shown while away, before this session's limit was known, past that limit
        are retracted."""
        tokens = self.tokens
        if tokens.provisional > max_draft_tokens:
            self.result.retracted_tokens += tokens.provisional - max_draft_tokens
            tokens.provisional = max_draft_tokens
            tokens.pending = tokens.pending.head(tokens.provisional)
