"""How many tokens to draft next round. Every policy here is lossless: it only changes how
much is drafted, never what is committed."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from edge.drafting.feedback import RoundFeedback


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


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per round with k drafts accepted i.i.d. with probability alpha:
    (1 - alpha^(k+1)) / (1 - alpha), the accepted prefix plus the recovered/bonus token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class CostK:
    """Pick k to maximise expected tokens per second, from running estimates (EMA) of the
    acceptance rate, the draft time per token, the cloud's verify time (fixed part + per
    token) and the network round trip. A slower link makes each round dearer, so longer
    blocks pay: on 100 ms RTT it picks a larger k than on loopback.

    round_time(k) = k * t_draft + t_verify0 + k * t_verify_per_token + rtt
    With overlap the next block is drafted while the cloud works, so a round costs the
    longer of the two: max(k * t_draft, t_verify(k) + rtt) — drafting that fits inside the
    wait is free, and a slower link buys a longer block.
    """

    def __init__(
        self,
        k_min: int = 1,
        k_max: int = 12,
        ema_beta: float = 0.8,
        alpha0: float = 0.7,
        draft_ms0: float = 50.0,
        verify_ms0: float = 150.0,
        rtt_ms0: float = 1.0,
        overlap: bool = False,
    ) -> None:
        self.overlap = overlap
        self.k_min, self.k_max, self.beta = k_min, k_max, ema_beta
        self.alpha = alpha0
        self.draft_ms_per_token = draft_ms0
        self.verify_ms_fixed = verify_ms0
        self.verify_ms_per_token = 0.0
        self.net_ms = rtt_ms0  # rtt minus the cloud's own time
        self._k = k_min

    def round_ms(self, k: int) -> float:
        drafting = k * self.draft_ms_per_token
        cloud = self.verify_ms_fixed + k * self.verify_ms_per_token + self.net_ms
        return max(drafting, cloud) if self.overlap else drafting + cloud

    def next_k(self) -> int:
        return max(range(self.k_min, self.k_max + 1), key=lambda k: expected_tokens(self.alpha, k) / self.round_ms(k))

    def _ema(self, old: float, new: float) -> float:
        return self.beta * old + (1 - self.beta) * new

    def update(self, feedback: RoundFeedback) -> None:
        if feedback.k <= 0:
            return
        self.alpha = min(self._ema(self.alpha, feedback.alpha_mean), 0.99)
        self.draft_ms_per_token = self._ema(self.draft_ms_per_token, feedback.draft_ms / feedback.k)
        self.net_ms = self._ema(self.net_ms, max(feedback.rtt_ms - feedback.verify_ms, 0.0))
        # Split the verify time into a fixed and a per-token part from two k's seen so far.
        self._fit_verify(feedback.k + 1, feedback.verify_ms)

    def _fit_verify(self, tokens: int, verify_ms: float) -> None:
        predicted = self.verify_ms_fixed + tokens * self.verify_ms_per_token
        error = verify_ms - predicted
        # One step of least-mean-squares on (fixed, per_token); the step is scaled per input.
        rate = 1 - self.beta
        self.verify_ms_fixed = max(self.verify_ms_fixed + rate * error / 2, 0.0)
        self.verify_ms_per_token = max(self.verify_ms_per_token + rate * error / (2 * tokens), 0.0)
