"""Per-session verifier state and the store that bounds it (TTL, count, KV bytes, LRU)."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from shared.errors import CapacityExceeded, SessionNotFound
from shared.protocol import SessionConfig


def session_tag(session_id: str) -> str:
    """A short hash of a session id for logs and /v1/sessions: it matches lines up without
    handing out the id itself, which is all a caller needs to drive (and read) the session."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:8]


@dataclass
class Session:
    session_id: str
    config: SessionConfig
    tokens: list[int]  # committed prefix: prompt + generated
    cache: DynamicCache  # KV of tokens[:-1]
    generator: torch.Generator  # seeded once from config.seed, never reseeded
    created: float
    last_used: float
    rounds: int = 0
    stats: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SessionLimits:
    ttl_s: float = 600.0  # idle time before a session is dropped
    max_sessions: int = 64
    max_kv_bytes: int = 4 << 30  # across all sessions


class SessionStore:
    """Sessions in least-recently-used order. Not thread-safe: the verifier calls it from
    its single model worker; only `holding` runs on the event loop (one counter update under
    the GIL), which is what keeps a session with a call in flight from being evicted."""

    def __init__(self, limits: SessionLimits, kv_bytes_per_token: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.kv_bytes_per_token = kv_bytes_per_token
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.busy: Counter[str] = Counter()  # sessions with a step queued or running: never evicted

    @contextmanager
    def holding(self, session_id: str) -> Iterator[None]:
        """Keep `session_id` from eviction while a call's step for it waits or runs."""
        self.busy[session_id] += 1
        try:
            yield
        finally:
            self.busy[session_id] -= 1
            if self.busy[session_id] <= 0:
                del self.busy[session_id]

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def new_id(self) -> str:
        # 72 random bits in 12 characters: unguessable, and short because it rides in every Verify.
        return secrets.token_urlsafe(9)

    def kv_bytes(self) -> int:
        return sum(self._session_bytes(s) for s in self._sessions.values())

    def _session_bytes(self, session: Session) -> int:
        return max(len(session.tokens) - 1, 0) * self.kv_bytes_per_token

    def expire(self) -> None:
        now = self.clock()
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_used < self.limits.ttl_s or self.busy.get(oldest.session_id):
                break
            self._sessions.popitem(last=False)

    def get(self, session_id: str) -> Session:
        self.expire()
        session = self._sessions.get(session_id)
        if session is None:
            # The id is the caller's input, of any length: name it by its tag, as the logs do.
            raise SessionNotFound(f"session {session_tag(session_id)} (tag) is unknown or was evicted")
        return session

    def touch(self, session: Session) -> None:
        session.last_used = self.clock()
        self._sessions.move_to_end(session.session_id)

    def reserve(self, new_tokens: int, keep: str | None = None) -> None:
        """Make room for new_tokens more KV positions, evicting least-recently-used sessions
        other than `keep`; raises CapacityExceeded when even that cannot fit them."""
        self.expire()
        need = new_tokens * self.kv_bytes_per_token
        if need > self.limits.max_kv_bytes:
            raise CapacityExceeded(
                f"{new_tokens} tokens need {need} KV bytes, over the cap of {self.limits.max_kv_bytes}")
        while self.kv_bytes() + need > self.limits.max_kv_bytes and self._evict_one(keep):
            pass
        if self.kv_bytes() + need > self.limits.max_kv_bytes:
            raise CapacityExceeded("KV-cache memory cap reached")

    def add(self, session: Session) -> None:
        while len(self._sessions) >= self.limits.max_sessions and self._evict_one(None):
            pass
        if len(self._sessions) >= self.limits.max_sessions:
            raise CapacityExceeded(f"all {self.limits.max_sessions} sessions are in use")
        self._sessions[session.session_id] = session

    def remove(self, session_id: str) -> Session:
        session = self.get(session_id)
        del self._sessions[session_id]
        return session

    def discard(self, session_id: str) -> None:
        """Drop a session if it is still here (a prefill that failed, or one evicted meanwhile)."""
        self._sessions.pop(session_id, None)

    def _evict_one(self, keep: str | None) -> bool:
        """Drop the least recently used session that is not `keep` and has no call in flight."""
        for sid in self._sessions:
            if sid != keep and not self.busy.get(sid):
                del self._sessions[sid]
                return True
        return False
