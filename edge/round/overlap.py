"""Overlap: drafting the next block while a Verify is in flight, assuming the block in flight
passes whole. The first token drafted ahead guesses the bonus; the rest are kept as the
next block only if every draft token is accepted and the bonus is that guess. DraftAhead
keeps the tokens it drafted; the round loop reads them back and counts them."""

from __future__ import annotations

import asyncio
import time

from edge.drafting.drafter import Draft, DraftSource
from edge.drafting.feedback import RoundFeedback
from edge.drafting.kpolicy import KPolicy
from edge.round.generation import ms_since


class DraftAhead:
    def __init__(self, enabled: bool, drafter: DraftSource, k_policy: KPolicy, stop_token_ids: frozenset[int]) -> None:
        self.enabled, self.drafter, self.k_policy, self.stop_token_ids = enabled, drafter, k_policy, stop_token_ids
        self.ahead = Draft()  # drafted after the in-flight block
        self.carry: Draft | None = None  # ahead tokens still valid after the reply: the next block

    def drop(self) -> None:
        """The round in flight was lost or given up: what was drafted after it is void."""
        self.ahead = Draft()

    def can_draft(self, pending: list[int], remaining: int) -> bool:
        """Whether to draft one more token after the block in flight (`pending`)."""
        # The first ahead token stands for the bonus; k more make a whole next block.
        if not self.enabled or len(self.ahead) >= self.k_policy.next_k() + 1:
            return False
        tail = (pending + self.ahead.token_ids)[-1:]
        if tail and tail[0] in self.stop_token_ids:
            return False
        # The block, its bonus and the ahead tokens must fit in what is left to generate.
        return len(pending) + 1 + len(self.ahead) < remaining

    async def draft_one(self, context: list[int]) -> float:
        """One more token after `context` (the committed tokens and the block in flight) and the
        tokens already drafted ahead, in a thread: the reply can land meanwhile. Its time in ms."""
        start = time.perf_counter()
        after = context + self.ahead.token_ids

        def step() -> Draft:
            self.drafter.sync(after)
            return self.drafter.propose(1)

        self.ahead.extend(await asyncio.to_thread(step))
        return ms_since(start)

    def drafted(self) -> int:
        """Tokens drafted ahead of the round in flight so far."""
        return len(self.ahead)

    def update(self, feedback: RoundFeedback) -> None:
        """Keep the tokens drafted ahead when the block passed whole and the bonus is the token
        the drafter guessed: they become the next block (take_carry); drop them otherwise."""
        ahead, self.ahead = self.ahead, Draft()
        if ahead.token_ids and feedback.bonus and ahead.token_ids[0] == feedback.next_token:
            self.carry = ahead.tail(1)

    def carried(self) -> int:
        """Tokens kept from the last verified round, waiting to start the next block."""
        return len(self.carry) if self.carry is not None else 0

    def take_carry(self) -> Draft | None:
        carry, self.carry = self.carry, None
        return carry
