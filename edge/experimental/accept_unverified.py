"""--accept-unverified (LOSSY), a timeout mode: a round the cloud does not answer by the soft
deadline, or still answers "full" once the client's resends run out, makes the first pending
token final without a verdict. The round loop commits it, counts it (unverified_tokens) and
sends it to the cloud later as catch-up; the rest of the block waits for the next round."""

from __future__ import annotations

from edge.drafting.drafter import Draft
from edge.round.generation import TimeoutPolicy


class AcceptUnverified:
    @classmethod
    def when_on(cls, policy: TimeoutPolicy) -> AcceptUnverified | None:
        """The policy in accept-unverified mode, else None (the other modes wait or stop)."""
        return cls() if policy.mode == "accept-unverified" else None

    def gives_up(self, pending: Draft) -> bool:
        """Whether a round past its soft deadline is abandoned: only with a token to make final."""
        return bool(pending.token_ids)

    def final_token(self, pending: Draft) -> tuple[list[int], Draft]:
        """The token made final unverified, and the pending block that remains."""
        return pending.token_ids[:1], pending.tail(1)
