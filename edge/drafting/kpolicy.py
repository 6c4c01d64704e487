"""How many tokens to draft next round. Every policy here is lossless: it only changes how
much is drafted, never what is committed."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge.drafting.feedback import RoundFeedback
from edge.drafting.round_costs import Array, RoundCosts


class KPolicy(Protocol):
    """How many tokens to draft next; it learns from each verified round (RoundFeedback)."""

    def next_k(self) -> int: ...

    def update(self, feedback: RoundFeedback) -> None: ...


@dataclass
class FixedK:
    k: int

    def next_k(self) -> int:
        return self.k

    def update(self, feedback: RoundFeedback) -> None:
        pass


class LaRatioK:
    """The la-ratio rule: start at k_start, +1 when accepted/k over the last `window` rounds
    is >= raise_at, -1 when <= lower_at, clamped to [k_min, k_max]."""

    def __init__(
        self, k_start: int = 6, k_min: int = 3, k_max: int = 12, raise_at: float = 0.8, lower_at: float = 0.4, window: int = 1
    ) -> None:
        if not k_min <= k_start <= k_max:
            raise ValueError(f"k_start {k_start} outside [{k_min}, {k_max}]")
        self.k, self.k_min, self.k_max = k_start, k_min, k_max
        self.raise_at, self.lower_at = raise_at, lower_at
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)

    def next_k(self) -> int:
        return self.k

    def update(self, feedback: RoundFeedback) -> None:
        if feedback.k <= 0:
            return
        self._recent.append((feedback.k, feedback.accepted_len))
        ratio = sum(a for _, a in self._recent) / sum(d for d, _ in self._recent)
        if ratio >= self.raise_at:
            self.k = min(self.k + 1, self.k_max)
        elif ratio <= self.lower_at:
            self.k = max(self.k - 1, self.k_min)


class EgagK:
    """Entropy-adaptive gamma (EGAG): the EMA of the draft's normalised entropy sets k
    between gamma_min and gamma_max (confident draft -> long blocks). The drafter also stops a
    block early at a token above `stop_bits` (see stop_bits)."""

    def __init__(
        self, gamma_min: int = 2, gamma_max: int = 12, ema_beta: float = 0.7, h_max_bits: float = 4.0, stop_bits: float = 3.5
    ) -> None:
        if not 0 < gamma_min <= gamma_max:
            raise ValueError("need 0 < gamma_min <= gamma_max")
        self.gamma_min, self.gamma_max = gamma_min, gamma_max
        self.ema_beta, self.h_max_bits, self.stop_bits = ema_beta, h_max_bits, stop_bits
        self.normalized_entropy = 0.5  # prior before any round

    def next_k(self) -> int:
        span = self.gamma_max - self.gamma_min
        return self.gamma_min + round(span * (1.0 - self.normalized_entropy))

    def update(self, feedback: RoundFeedback) -> None:
        if feedback.k <= 0:
            return
        h = min(feedback.mean_entropy_bits / self.h_max_bits, 1.0)
        self.normalized_entropy = self.ema_beta * self.normalized_entropy + (1 - self.ema_beta) * h


class CostK:
    """Pick k to maximise the expected tokens per second of the next rounds, from measured
    estimates (RoundCosts: acceptance given an accepted prefix, this generation's own, and the
    process's drafting time's and verify time's fixed and per-unit parts and the network's share
    of a round). A slower link makes each
    round dearer, so longer blocks pay: on 100 ms RTT it picks a larger k than on loopback.

    tokens(k) = 1 + sum over j <= k of a_1 ... a_j, the accepted prefix plus the recovered/bonus
    token, where a_1 is the text's acceptance times the process's factor for a block's first
    draft and a_2 ... its acceptance times the factor for the drafts after it
    (RoundCosts.depth_factors: a draft after an accepted one passes more often than the first);
    cloud(k) = verify(k + 1 rows) + network;
    round(k) = draft(k) + cloud(k), draft(k) a fixed part and a part per token.
    With overlap the edge drafts ahead while the cloud works (up to k + 1 tokens: a guess of the
    bonus, then the next block) and reads the reply once the token it is drafting is done, so
    the wait is max(cloud(k), tokens drafted ahead * draft(k) / k). What it drafted ahead is
    kept only when the whole block passed and the bonus is the token guessed (probability
    a_1 ... a_(k+1)); then the next block needs only the rest drafted, else all k as without
    overlap.

    Now and then a round drafts another size than the best k, so the verify time stays measured
    at more than one size even when the best k holds still (RoundCosts.explore: after
    `explore_every` rounds at one size, sooner while the slope is not measured). That state
    lives with the costs, so it carries from one generation to the next as they do.
    """

    def __init__(
        self,
        k_min: int = 1,
        k_max: int = 12,
        overlap: bool = False,
        costs: RoundCosts | None = None,
        explore_every: int = 16,
    ) -> None:
        if not 0 < k_min <= k_max:
            raise ValueError("need 0 < k_min <= k_max")
        self.costs = costs if costs is not None else RoundCosts()  # the machine's and the link's, shared
        self.text_acceptance = self.costs.generation_acceptance()  # this generation's own
        self.k_min, self.k_max, self.overlap = k_min, k_max, overlap
        self.explore_every = explore_every
        self._probing: int | None = None  # the k of a probe handed out and not yet verified

    def round_ms(self, k: int, depths: Array | None = None) -> float:
        c = self.costs
        cloud = c.verify_ms(k + 1) + c.net_ms
        if not self.overlap:
            return c.draft_ms(k) + cloud
        per_token = c.draft_ms(k) / k
        # While the call is out the edge drafts ahead a token at a time (a bonus guess, then the
        # next block) and reads the reply at the end of the token it is drafting.
        ahead = min(k + 1, max(math.ceil(cloud / per_token), 1)) if per_token > 0 else k + 1
        wait = max(cloud, ahead * per_token)
        depths = self.depth_acceptance() if depths is None else depths
        kept = float(np.prod(depths[: k + 1])) if ahead > 1 else 0.0
        return wait + kept * (k - (ahead - 1)) * per_token + (1 - kept) * k * per_token

    def tokens_per_s(self, k: int, depths: Array | None = None) -> float:
        """Expected committed tokens per second at k, by the current estimates (`depths`: the
        depth_acceptance() a caller trying every k computed once)."""
        depths = self.depth_acceptance() if depths is None else depths
        return 1000.0 * self.expected_tokens(k, depths) / self.round_ms(k, depths)

    def depth_acceptance(self) -> Array:
        """This text's acceptance at each depth of a block up to k_max (and the bonus guess
        after it): its own pooled figure times the process's factor for the depth, below 1."""
        return np.minimum(self.acceptance * self.costs.depth_factors(self.k_max + 1), 0.99)

    def expected_tokens(self, k: int, depths: Array | None = None) -> float:
        """The accepted prefix plus the recovered/bonus token: 1 + sum over j <= k of the
        chance that the first j drafts all pass."""
        depths = self.depth_acceptance() if depths is None else depths
        return 1.0 + float(np.cumprod(depths[:k]).sum())

    @property
    def acceptance(self) -> float:
        return min(self.text_acceptance.value, 0.99)  # a block never passes for certain

    def best_k(self) -> int:
        depths = self.depth_acceptance()
        return max(range(self.k_min, self.k_max + 1), key=lambda k: self.tokens_per_s(k, depths))

    def next_k(self) -> int:
        best = self.best_k()
        k = self.costs.explore(best, self.k_min, self.k_max, self.explore_every)
        self._probing = k if k != best else None
        return k

    def update(self, feedback: RoundFeedback) -> None:
        if feedback.k <= 0:
            return
        self.costs.update(feedback, probe=self._probing is not None and feedback.k == self._probing)
        self._probing = None
        self.text_acceptance.add_round(feedback)
