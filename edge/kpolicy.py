"""How many tokens to draft next round."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol


class KPolicy(Protocol):
    def next_k(self) -> int: ...

    def observe(self, k: int, accepted_len: int) -> None: ...


@dataclass
class FixedK:
    k: int

    def next_k(self) -> int:
        return self.k

    def observe(self, k: int, accepted_len: int) -> None:
        pass


class LaRatioK:
    """The seed default: start at k_start, +1 when accepted/k over the last `window` rounds
    is >= raise_at, -1 when <= lower_at, clamped to [k_min, k_max]. Lossless: it only changes
    how much is drafted."""

    def __init__(self, k_start: int = 6, k_min: int = 3, k_max: int = 12, raise_at: float = 0.8,
                 lower_at: float = 0.4, window: int = 1) -> None:
        if not k_min <= k_start <= k_max:
            raise ValueError(f"k_start {k_start} outside [{k_min}, {k_max}]")
        self.k, self.k_min, self.k_max = k_start, k_min, k_max
        self.raise_at, self.lower_at = raise_at, lower_at
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)

    def next_k(self) -> int:
        return self.k

    def observe(self, k: int, accepted_len: int) -> None:
        if k <= 0:
            return
        self._recent.append((k, accepted_len))
        ratio = sum(a for _, a in self._recent) / sum(d for d, _ in self._recent)
        if ratio >= self.raise_at:
            self.k = min(self.k + 1, self.k_max)
        elif ratio <= self.lower_at:
            self.k = max(self.k - 1, self.k_min)


def make_k_policy(name: str, k: int) -> KPolicy:
    if name == "fixed":
        return FixedK(k)
    if name == "la-ratio":
        return LaRatioK()
    raise ValueError(f"unknown k policy {name!r}: expected fixed or la-ratio")
