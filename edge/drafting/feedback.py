"""What one verified round tells the parts of the edge that adapt. The round loop builds one
RoundFeedback after each round the cloud answered and gives it to each of them through the
same call, `update(feedback)`: the drafter (an n-gram store learns the target's top-k), the
k policy (how much to draft next) and overlap (whether the tokens drafted ahead still hold)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shared.protocol import SparseDistribution


@dataclass(frozen=True)
class RoundFeedback:
    k: int  # tokens drafted this round
    accepted_len: int
    alpha_mean: float  # the cloud's mean min(1, p/q) over all the drafts (its round log's figure)
    draft_ms: float  # edge time spent drafting the block
    rtt_ms: float  # wall time of the Verify call (network + cloud)
    verify_ms: float  # cloud time of the round
    mean_entropy_bits: float = 0.0  # of the draft distributions (when gating signals are on)
    next_token: int = -1  # the cloud's recovered or bonus token
    bonus: bool = False  # every draft was accepted and next_token follows them
    context: list[int] = field(default_factory=list)  # the last committed tokens before the block
    draft_tokens: list[int] = field(default_factory=list)
    target_top_k: list[SparseDistribution] = field(default_factory=list)  # per verified position, when asked for
    # The cloud's mean min(1, p/q) over the drafts verified on an accepted prefix (the accepted
    # ones and the first rejected one); None: not reported, the round's outcome stands for it.
    alpha_prefix: float | None = None
    drafted: int | None = None  # tokens drafted in draft_ms (a block may start from tokens drafted earlier); None: k
    catchup: int = 0  # committed tokens the round's pass verified before the drafts

    def top_k_contexts(self) -> list[list[int]]:
        """The tokens before each position the target's top-k describes."""
        return [self.context + self.draft_tokens[:i] for i in range(len(self.target_top_k))]


class Learner(Protocol):
    """A part that adapts to the cloud's verdicts; it changes only its own state."""

    def update(self, feedback: RoundFeedback) -> None: ...
