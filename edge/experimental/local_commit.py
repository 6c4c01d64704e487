"""--local-commit (LOSSY): an easy block is final without the cloud's verdict. Easy: nothing of
it is on screen yet, no escalation rule hit and its hard ratio is at most R_hard. The round loop
commits it, counts it (local_tokens) and sends it to the cloud later as catch-up."""

from __future__ import annotations

from edge.drafting.drafter import Draft
from edge.drafting.gating import GatingThresholds
from edge.round.generation import Gating, RoundRecord


class LocalCommit:
    def __init__(self, thresholds: GatingThresholds) -> None:
        self.thresholds = thresholds

    @classmethod
    def when_on(cls, gating: Gating | None) -> LocalCommit | None:
        """The policy when --local-commit is on (it needs --gating), else None."""
        return cls(gating.thresholds) if gating is not None and gating.local_commit else None

    def easy_block(self, pending: Draft, shown: int, hard_ratio: float, rule_hit: bool) -> list[int]:
        """The tokens to commit without the cloud: the whole pending block when it is easy, else none."""
        if shown or not pending.token_ids or rule_hit or hard_ratio > self.thresholds.hard_ratio:
            return []
        return pending.token_ids


def local_record(round_index: int, tokens: list[int], accepted_so_far: int, draft_ms: float, hard_ratio: float) -> RoundRecord:
    """The round record of a block committed without the cloud."""
    return RoundRecord(
        round=round_index,
        k=len(tokens),
        draft_tokens=tokens,
        accepted_len=len(tokens),
        next_token=tokens[-1],
        bonus=False,
        la_over_k=1.0,
        alpha_mean=0.0,
        a_cum=accepted_so_far,
        edge_time_ms=draft_ms,
        cloud_verify_ms=0.0,
        rtt_ms=0.0,
        bytes_up=0,
        bytes_down=0,
        hard_ratio=hard_ratio,
        escalated=False,
        catchup=0,
        provisional=0,
        retracted=0,
        local=True,
    )
