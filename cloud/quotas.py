"""What one API key may take of a verifier, so a heavy client cannot starve the others (the
limits: docs/operations.md, "Per-key limits and fairness"): sessions and KV bytes are enforced
by the session store (cloud/sessions.py), queued steps and fed tokens per second by the batcher
as a step arrives."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.errors import CapacityExceeded


@dataclass(frozen=True)
class KeyLimits:
    max_sessions: int = 0  # open sessions (and Generate streams) per key
    max_kv_bytes: int = 0  # KV-cache bytes those hold
    max_queued: int = 0  # steps waiting for a forward pass
    tokens_per_s: float = 0.0  # tokens fed to the model (prompts, rounds), averaged over a burst


@dataclass
class HeldBytes:
    """KV bytes held, in all and by each API key, kept up to date as holders come, grow and go:
    a round's check against the caps then costs the same at any number of sessions."""

    total: int = 0
    by_owner: Counter[str] = field(default_factory=Counter)

    def add(self, owner: str, nbytes: int) -> None:
        """`nbytes` more held by `owner` (fewer, when negative)."""
        self.total += nbytes
        self.by_owner[owner] += nbytes
        if not self.by_owner[owner]:
            del self.by_owner[owner]

    def of(self, owner: str | None = None) -> int:
        """Bytes held by `owner`, or by every key (None)."""
        return self.total if owner is None else self.by_owner.get(owner, 0)


def key_label(key: str) -> str:
    """How a key is named in errors and logs: its name from the keys file, never the key."""
    return f"key {key!r}" if key else "this client"


@dataclass
class _Bucket:
    level: float
    updated: float


@dataclass
class TokenRate:
    """Fed tokens per key as a token bucket that may go into debt: a call is refused while its
    key's bucket is empty, and a call larger than the bucket (a long prompt) is admitted once
    and paid back over the following seconds, so no prompt is refused for being long."""

    per_s: float
    burst_s: float = 2.0  # an idle key may feed this many seconds' worth at once
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def take(self, key: str, tokens: int) -> None:
        if self.per_s <= 0:
            return
        now = self.clock()
        capacity = self.per_s * self.burst_s
        bucket = self._buckets.setdefault(key, _Bucket(capacity, now))
        bucket.level = min(capacity, bucket.level + (now - bucket.updated) * self.per_s)
        bucket.updated = now
        if bucket.level <= 0:
            wait_ms = math.ceil(-bucket.level / self.per_s * 1000.0) + 1
            raise CapacityExceeded(f"{key_label(key)} is over its rate of {self.per_s:g} tokens/s", wait_ms)
        bucket.level -= tokens

    def settle(self, key: str, tokens: int) -> None:
        """Charge `key` `tokens` more (fewer, when negative) for a call already admitted: what
        it computed, where the charge at its admission was an estimate."""
        if self.per_s > 0 and key in self._buckets:
            self._buckets[key].level -= tokens
