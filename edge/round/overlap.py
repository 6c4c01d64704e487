"""Overlap: drafting the next block while a Verify is in flight, assuming the block in flight
passes whole. The first token drafted ahead guesses the bonus; the rest are kept as the
next block only if every draft token is accepted and the bonus is that guess."""

from __future__ import annotations

import asyncio
import time

from edge.drafting.drafter import Draft, DraftSource
from edge.drafting.kpolicy import KPolicy
from edge.round.generation import GenerationResult, ms_since
from edge.round.round_tokens import RoundTokens
from shared.protocol import VerifyResult


class DraftAhead:
    def __init__(
        self, enabled: bool, drafter: DraftSource, k_policy: KPolicy, stop_token_ids: frozenset[int], result: GenerationResult
    ) -> None:
        self.enabled, self.drafter, self.k_policy = enabled, drafter, k_policy
        self.stop_token_ids, self.result = stop_token_ids, result
        self.ahead = Draft()  # drafted after the in-flight block
        self.carry: Draft | None = None  # ahead tokens still valid after the reply: the next block

    def drop(self) -> None:
        """The round in flight was lost or given up: what was drafted after it is void."""
        self.ahead = Draft()

    def can_draft(self, tokens: RoundTokens, remaining: int) -> bool:
        # The first ahead token stands for the bonus; k more make a whole next block.
        if not self.enabled or len(self.ahead) >= self.k_policy.next_k() + 1:
            return False
        tail = (tokens.pending.token_ids + self.ahead.token_ids)[-1:]
        if tail and tail[0] in self.stop_token_ids:
            return False
        # The block, its bonus and the ahead tokens must fit in what is left to generate.
        return len(tokens.pending) + 1 + len(self.ahead) < remaining

    async def draft_one(self, tokens: RoundTokens) -> None:
        """One more token after the in-flight block (in a thread: the reply can land meanwhile)."""
        start = time.perf_counter()
        context = tokens.committed + tokens.pending.token_ids + self.ahead.token_ids

        def step() -> Draft:
            self.drafter.sync(context)
            return self.drafter.propose(1)

        self.ahead.extend(await asyncio.to_thread(step))
        self.result.overlap_draft_ms += ms_since(start)

    def keep(self, reply: VerifyResult) -> tuple[int, int]:
        """Keep the tokens drafted ahead when the block passed whole and the bonus is the
        token the drafter guessed; they become the next block. Returns (drafted, kept)."""
        ahead, self.ahead = self.ahead, Draft()
        kept = 0
        if ahead.token_ids and reply.bonus and ahead.token_ids[0] == reply.next_token:
            self.carry = ahead.tail(1)
            kept = len(self.carry)
        self.result.ahead_drafted += len(ahead)
        self.result.ahead_used += kept
        return len(ahead), kept

    def take_carry(self) -> Draft | None:
        carry, self.carry = self.carry, None
        return carry
