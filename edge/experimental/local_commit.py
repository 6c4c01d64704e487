"""Tokens made final without the cloud's verdict (lossy, counted, sent later as catch-up):
an easy block with --local-commit, and with accept-unverified the first pending token of a
round the cloud did not answer in time."""

from __future__ import annotations

from edge.drafting.drafter import Draft
from edge.round.accounting import RoundAccounting
from edge.round.generation import Gating, GenerationResult, Output
from edge.round.round_tokens import RoundTokens


class LocalCommit:
    def __init__(
        self, gating: Gating | None, tokens: RoundTokens, accounting: RoundAccounting, result: GenerationResult, out: Output
    ) -> None:
        self.gating, self.tokens, self.accounting, self.result, self.out = gating, tokens, accounting, result, out

    def easy_block(self, hard_ratio: float, rule_hit: bool, draft_ms: float) -> bool:
        """LOSSY (--local-commit): an easy block is final without the cloud; whether it was."""
        gating = self.gating
        block = self.tokens.pending.tail(self.tokens.provisional)
        if gating is None or not gating.local_commit or self.tokens.provisional or not block.token_ids:
            return False
        if rule_hit or hard_ratio > gating.thresholds.hard_ratio:
            return False
        committed = block.token_ids
        self.tokens.commit_unsent(committed)
        self.tokens.pending = Draft()
        self.out.commit(committed, self.accounting.local(committed, draft_ms, hard_ratio))
        return True

    def unverified_one(self) -> None:
        """Accept-unverified (lossy): the first pending token becomes final, counted as
        unverified, and reaches the cloud as catch-up."""
        tokens = self.tokens
        token = tokens.pending.token_ids[0]
        tokens.commit_unsent([token])
        tokens.pending = tokens.pending.tail(1)
        self.result.unverified_tokens += 1
        self.out.commit([token], None)
