"""Recent rounds for the live page (/v1/stats): one bucket per wall-clock second over a
short window. Prometheus keeps the cumulative view; this keeps what a person watches."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
SAMPLES_PER_SECOND = 256  # latency reservoir per bucket: bounded memory under heavy load


@dataclass
class _Second:
    drafted: list[int]  # per draft position
    accepted: list[int]
    rounds: int = 0
    tokens: int = 0  # accepted + one recovered or bonus token per round
    latencies_ms: list[float] = field(default_factory=list)


def _percentile(sorted_ms: list[float], pct: int) -> float | None:
    """Nearest-rank percentile; None without samples."""
    if not sorted_ms:
        return None
    rank = max(0, -(-pct * len(sorted_ms) // 100) - 1)  # ceil(pct/100 * n) - 1
    return sorted_ms[rank]


def _percentiles(latencies_ms: list[float]) -> dict[str, float | None]:
    ordered = sorted(latencies_ms)
    return {f"p{pct}": _percentile(ordered, pct) for pct in PERCENTILES}


class LiveStats:
    """Not thread-safe: fed and read on the event loop."""

    def __init__(self, max_draft_tokens: int, window_s: int = 60, clock: Callable[[], float] = time.time) -> None:
        self.max_k = max_draft_tokens
        self.window_s = window_s
        self.clock = clock
        self._seconds: dict[int, _Second] = {}
        self._rng = random.Random(0)

    def record_round(self, k: int, accepted_len: int, verify_ms: float) -> None:
        second = int(self.clock())
        bucket = self._seconds.setdefault(second, _Second([0] * self.max_k, [0] * self.max_k))
        bucket.rounds += 1
        bucket.tokens += accepted_len + 1
        self._sample(bucket, verify_ms)
        for position in range(min(k, self.max_k)):
            bucket.drafted[position] += 1
            bucket.accepted[position] += position < accepted_len
        self._forget(second)

    def _sample(self, bucket: _Second, verify_ms: float) -> None:
        """Reservoir sampling: every round of the second is kept with equal probability."""
        if len(bucket.latencies_ms) < SAMPLES_PER_SECOND:
            bucket.latencies_ms.append(verify_ms)
            return
        slot = self._rng.randrange(bucket.rounds)
        if slot < SAMPLES_PER_SECOND:
            bucket.latencies_ms[slot] = verify_ms

    def _forget(self, now_s: int) -> None:
        for second in [s for s in self._seconds if s < now_s - self.window_s]:
            del self._seconds[second]

    def snapshot(self) -> dict[str, Any]:
        """Per-second series over the window's complete seconds (oldest first), and totals that
        include the second under way."""
        now_s = int(self.clock())
        self._forget(now_s)
        seconds = range(now_s - self.window_s, now_s)
        buckets = [self._seconds.get(s) for s in seconds]
        latencies = [_percentiles(b.latencies_ms) if b else None for b in buckets]
        return {
            "window_s": self.window_s,
            "seconds_ago": [s - now_s for s in seconds],
            "rounds_per_s": [b.rounds if b else 0 for b in buckets],
            "tau": [b.tokens / b.rounds if b and b.rounds else None for b in buckets],
            "latency_ms": {f"p{pct}": [p[f"p{pct}"] if p else None for p in latencies] for pct in PERCENTILES},
            "window": self._totals([b for b in [*buckets, self._seconds.get(now_s)] if b]),
        }

    def _totals(self, buckets: list[_Second]) -> dict[str, Any]:
        rounds = sum(b.rounds for b in buckets)
        drafted = [sum(b.drafted[i] for b in buckets) for i in range(self.max_k)]
        accepted = [sum(b.accepted[i] for b in buckets) for i in range(self.max_k)]
        return {
            "rounds": rounds,
            "tau": sum(b.tokens for b in buckets) / rounds if rounds else None,
            "latency_ms": _percentiles([ms for b in buckets for ms in b.latencies_ms]),
            "acceptance_by_position": [a / d if d else None for a, d in zip(accepted, drafted, strict=True)],
            "drafted_by_position": drafted,
        }
