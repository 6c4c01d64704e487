"""Per-session verifier state and the store that bounds it (TTL, count, KV bytes, LRU). Caps
never cross API keys: a session or a round that needs room may evict only its own key's idle
sessions, and kept prefixes (cloud/prefix_cache.py) are the first KV to go, fairly
(_free_fairly); why and how: docs/operations.md ("Per-key limits and fairness", "Room")."""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from cloud.engine import SessionKV
from cloud.prefix_cache import KeptPrefix, PrefixCache, ReuseTotals
from cloud.quotas import HeldBytes, KeyLimits, key_label
from shared.errors import CapacityExceeded, SessionNotFound
from shared.grammar import Constraint
from shared.protocol import SessionConfig


def session_tag(session_id: str) -> str:
    """A short hash of a session id for logs and /v1/sessions: it matches lines up without
    handing out the id itself, which is all a caller needs to drive (and read) the session."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:8]


# Why the store drops a session: idle past the TTL; the global session or KV cap (only the key
# that needed the room loses one); a key's own KV cap.
EVICTION_REASONS = ("ttl", "session_cap", "kv_cap", "key_kv_cap")


@dataclass
class Session:
    session_id: str
    config: SessionConfig
    tokens: list[int]  # committed prefix: prompt + generated (grown by SessionStore.extend, which counts its KV)
    cache: SessionKV  # KV of tokens[:-1], held by the verifier's engine
    generator: torch.Generator  # seeded once from config.seed, never reseeded
    created: float
    last_used: float
    rounds: int = 0
    owner: str = ""  # the API key that opened it: no other key can see or drive it
    scope: str = ""  # whose kept prefixes it may start from, and its own KV may serve ("": none)
    reuse_token: str = ""  # what its client is told to send to be in the same scope again
    reused: int = 0  # prompt tokens it did not compute: its scope's kept KV held them
    planned: int = 0  # KV positions reserved ahead (a Generate stream's whole length), counted from the start (SessionStore.plan)
    constraint: Constraint | None = None  # its grammar (None: free text), at tokens[prompt_len:]
    prompt_len: int = 0


class KVFree(Protocol):
    """The engine, as the store sees it: it frees a leaving session's KV."""

    def free(self, kv: SessionKV) -> None: ...


log = logging.getLogger("cloud-verifier")


@dataclass(frozen=True)
class Room:
    """Room asked for under a cap: `need` more than `used()` holds (KV bytes, or engine handles),
    and what each scope holds of the same (`held`)."""

    cap: int
    need: int
    used: Callable[[], int]
    held: Callable[[str], int]

    def short(self) -> bool:
        return self.used() + self.need > self.cap


RETRY_AFTER_IN_USE_MS = 1000  # every session busy: a round ends, or an edge closes one, within about this


@dataclass(frozen=True)
class SessionLimits:
    ttl_s: float = 600.0  # idle time before a session is dropped
    max_sessions: int = 64
    max_kv_bytes: int = 4 << 30  # across all sessions
    per_key: KeyLimits = KeyLimits()  # sessions and KV bytes of any one key


class SessionStore:
    """Sessions in least-recently-used order, changed from the single model worker; what the event loop may run
    (`holding`, `snapshot`): docs/architecture.md, "Sessions and kept prefixes"."""

    def __init__(
        self,
        limits: SessionLimits,
        kv_bytes_per_token: int,
        clock: Callable[[], float] = time.monotonic,
        slot_bytes: int = 0,
        kv: KVFree | None = None,
        keep_prefixes: bool = False,
        note_prefixes: bool = False,
    ) -> None:
        self.limits = limits
        self.kv_bytes_per_token = kv_bytes_per_token
        self.slot_bytes = slot_bytes  # > 0: each session holds one KV slot of this many bytes, whatever its length
        self.clock = clock
        self.kv = kv  # what frees a leaving session's KV (None: it goes with the session object)
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._held = HeldBytes()  # the sessions' KV bytes (session_bytes), by owner
        self._lock = threading.RLock()  # held by every change of _sessions and by snapshot()
        self.busy: Counter[str] = Counter()  # sessions with a step queued or running: never evicted
        self.evictions: Counter[str] = Counter()  # sessions dropped by the store, by reason (ttl, kv_cap, ...)
        self.keep_prefixes = keep_prefixes  # a closed session's KV stays for its key's next session
        self.note_prefixes = note_prefixes  # the engine's own prefix cache keeps it: its tokens are noted
        self.prefixes = PrefixCache(clock)

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
        return iter(self.snapshot())

    def snapshot(self) -> list[Session]:
        """The sessions now, safe to read from another thread than the model worker's."""
        with self._lock:
            return list(self._sessions.values())

    def new_id(self) -> str:
        # 72 random bits in 12 characters: unguessable, and short because it rides in every Verify.
        return secrets.token_urlsafe(9)

    def _of(self, owner: str | None = None, scope: str | None = None) -> list[Session]:
        """The sessions of `owner`'s and of `scope` (None: any)."""
        return [s for s in self._sessions.values() if owner in (None, s.owner) and scope in (None, s.scope)]

    def kv_bytes(self, owner: str | None = None, scope: str | None = None) -> int:
        """KV bytes of every session and kept prefix, or of `owner`'s, or of `scope`'s."""
        held = self._held.of(owner) if scope is None else sum(map(self.session_bytes, self._of(owner, scope)))
        return held + self.prefixes.nbytes(owner, scope)

    def _handles(self, owner: str | None = None, scope: str | None = None) -> int:
        """Engine handles held by sessions and kept prefixes (of `owner`'s, of `scope`'s)."""
        return len(self._of(owner, scope)) + self.prefixes.count(owner, scope)

    def session_bytes(self, session: Session) -> int:
        # A slot is allocated in full from the start.
        return self.slot_bytes or max(len(session.tokens) - 1, session.planned, 0) * self.kv_bytes_per_token

    def extend(self, session: Session, tokens: list[int]) -> None:
        """The session's committed tokens go on by `tokens` (its KV holds all but the last)."""
        before = self.session_bytes(session)
        session.tokens.extend(tokens)
        self._count(session, before)

    def plan(self, session: Session, planned: int) -> None:
        """The session holds `planned` positions reserved ahead (Session.planned)."""
        before = self.session_bytes(session)
        session.planned = planned
        self._count(session, before)

    def _count(self, session: Session, before: int = 0) -> None:
        """What the session holds beyond `before` bytes, into _held (a session that left counts nothing)."""
        with self._lock:
            if self._sessions.get(session.session_id) is session:
                self._held.add(session.owner, self.session_bytes(session) - before)

    def _uncount(self, session: Session) -> None:
        self._held.add(session.owner, -self.session_bytes(session))

    def _free(self, kv: SessionKV) -> None:
        """Free the KV of a session or kept prefix leaving the store."""
        if self.kv is not None:
            self.kv.free(kv)

    def take_prefix(self, scope: str, prompt: list[int]) -> tuple[KeptPrefix, int] | None:
        """A kept prefix of `scope`'s for a new session's prompt (the entry, and the tokens of
        the prompt it holds: at most all but the last), or None."""
        if not scope:
            return None
        with self._lock:
            return self.prefixes.take(scope, prompt, len(prompt) - 1)

    def give_back(self, entry: KeptPrefix) -> None:
        """A kept prefix a new session took, back in the cache (the session was refused), as
        long as its KV now is (the session may have cropped it)."""
        held = entry.kv.get_seq_length()
        entry.tokens, entry.nbytes = entry.tokens[:held], self.slot_bytes or held * self.kv_bytes_per_token
        with self._lock:
            self.prefixes.give_back(entry)

    def reusable(self, scope: str, prompt: list[int]) -> int:
        """Tokens of `prompt` a kept prefix of `scope`'s holds now (safe from the event loop)."""
        if not scope:
            return 0
        with self._lock:
            return self.prefixes.reusable(scope, prompt)

    def _evict_prefix(self, owner: str | None = None, scope: str | None = None, kept_before: float | None = None) -> bool:
        """Free the least recently kept prefix (of `owner`, of `scope`, kept before
        `kept_before`): a kept prefix is only a cache, its scope loses nothing but a re-prefill."""
        with self._lock:
            kv = self.prefixes.pop_oldest(owner, scope, kept_before)
        if kv is None:
            return False
        self._free(kv)
        return True

    def _free_fairly(self, scope: str, owner: str | None, room: Room) -> None:
        """While `room` is short: free `scope`'s own least recently kept prefix, else one of the
        scope (among `owner`'s; every key's: None) that holds the most, if that is more than its
        fair share of the cap. A scope holding less than its share never loses its cache to
        another scope's traffic."""
        while room.short():
            victim = scope if self.prefixes.count(scope=scope) else self._largest_over_share(scope, owner, room)
            if victim is None or not self._evict_prefix(scope=victim):
                return

    def _largest_over_share(self, scope: str, owner: str | None, room: Room) -> str | None:
        """The scope with kept prefixes holding the most, if more than the cap shared evenly by
        every scope that holds any (sessions or kept prefixes) and `scope`."""
        holders = self.prefixes.scopes(owner)
        tenants = holders | {s.scope for s in self._of(owner)} | {scope}
        share = room.cap / max(len(tenants - {""}), 1)
        over = [t for t in holders - {scope} if room.held(t) > share]
        return max(over, key=room.held, default=None)

    def room_for_session(self, scope: str = "", owner: str = "") -> None:
        """Free kept prefixes, fairly, while they and the sessions fill the session caps: each
        holds an engine handle (a llama.cpp sequence, a KV slot) a new session may need, and a
        key's kept prefixes count against its own session cap."""
        by_scope = partial(self._handles, None)
        self._free_fairly(scope, None, Room(self.limits.max_sessions, 1, self._handles, by_scope))
        if per_key := self.limits.per_key.max_sessions:
            self._free_fairly(scope, owner, Room(per_key, 1, partial(self._handles, owner), by_scope))

    def expire(self) -> None:
        now = self.clock()
        while self._evict_prefix(kept_before=now - self.limits.ttl_s):
            pass
        with self._lock:
            self.prefixes.forget_notes(now - self.limits.ttl_s)
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_used < self.limits.ttl_s or self.busy.get(oldest.session_id):
                break
            with self._lock:
                oldest = self._sessions.popitem(last=False)[1]
                self._uncount(oldest)
            self._free(oldest.cache)
            self._count_eviction(oldest, "ttl")

    def get(self, session_id: str, owner: str = "") -> Session:
        """The session, if `owner` opened it: to any other key it does not exist."""
        self.expire()
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            # The id is the caller's input, of any length: name it by its tag, as the logs do.
            raise SessionNotFound(f"session {session_tag(session_id)} (tag) is unknown or was evicted")
        return session

    def holds(self, session: Session) -> bool:
        """Whether `session` is still in the store (not closed or evicted since it was read)."""
        return self._sessions.get(session.session_id) is session

    def touch(self, session: Session) -> None:
        session.last_used = self.clock()
        with self._lock:
            self._sessions.move_to_end(session.session_id)

    def reserve(self, new_tokens: int, keep: str | None = None, owner: str = "", scope: str = "") -> None:
        """Make room for new_tokens more KV positions of one of `owner`'s sessions (of reuse
        `scope`), within the key's cap and the global cap, by freeing kept prefixes fairly, then
        the key's own least recently used sessions, never `keep` or a session with a call in
        flight; raises CapacityExceeded when even that cannot fit them."""
        self.expire()
        if self.slot_bytes:  # a new session takes a whole slot; a round stays inside its own
            need = 0 if keep is not None else self.slot_bytes
        else:
            need = new_tokens * self.kv_bytes_per_token
        per_key = self.limits.per_key.max_kv_bytes
        for cap, whose, reason in ((per_key, owner, "key_kv_cap"), (self.limits.max_kv_bytes, None, "kv_cap")):
            if not cap:
                continue
            if need > cap:
                raise CapacityExceeded(f"{new_tokens} tokens need {need} KV bytes, over the cap of {cap}")
            if self.kv_bytes(whose) + need <= cap:
                continue  # the usual round: room already (a sum over every session: once, not three times)
            self._free_fairly(scope, whose, Room(cap, need, partial(self.kv_bytes, whose), partial(self.kv_bytes, None)))
            while self.kv_bytes(whose) + need > cap and self._evict_one(keep, owner, reason):
                pass
            if self.kv_bytes(whose) + need > cap:
                raise CapacityExceeded(
                    f"the KV-cache memory cap is reached and {key_label(owner)} has no idle session to give up"
                    if whose is None
                    else f"{key_label(owner)} holds its KV-cache cap of {cap} bytes",
                    RETRY_AFTER_IN_USE_MS,
                )

    def add(self, session: Session) -> None:
        # A key at its own session cap is refused rather than losing one of its sessions: an
        # edge opening one session too many would otherwise evict its own live ones in turn.
        owner, per_key = session.owner, self.limits.per_key.max_sessions
        if per_key and self._handles(owner) >= per_key:
            raise CapacityExceeded(f"{key_label(owner)} has all its {per_key} sessions in use", RETRY_AFTER_IN_USE_MS)
        while len(self._sessions) >= self.limits.max_sessions and self._evict_one(None, owner, "session_cap"):
            pass
        if len(self._sessions) >= self.limits.max_sessions:
            raise CapacityExceeded(
                f"all {self.limits.max_sessions} sessions are in use and {key_label(owner)} has no idle one to give up",
                RETRY_AFTER_IN_USE_MS,
            )
        with self._lock:
            self._sessions[session.session_id] = session
        self._count(session)

    def remove(self, session_id: str, owner: str = "") -> Session:
        """Close `owner`'s session: its KV may stay as a kept prefix."""
        session = self.get(session_id, owner)
        self.retire(session_id)
        return session

    def retire(self, session_id: str) -> None:
        """Close a session that ended well if it is still here (a finished Generate stream): its
        KV stays as a kept prefix of its scope when the store keeps them and nothing may still
        write to it (no call of it in flight), else it goes."""
        session = self._pop(session_id)
        if session is None:
            return
        held = session.cache.get_seq_length()
        kept = 0 < held <= len(session.tokens) and bool(session.scope)  # its KV holds its first `held` tokens
        if kept and self.note_prefixes:
            with self._lock:
                self.prefixes.note(session.owner, session.scope, session.tokens[:held])
        if not (kept and self.keep_prefixes) or self.busy.get(session.session_id):
            self._free(session.cache)
            return
        nbytes = self.slot_bytes or held * self.kv_bytes_per_token
        with self._lock:
            self.prefixes.keep(session.owner, session.scope, session.tokens[:held], session.cache, nbytes)

    def discard(self, session_id: str) -> None:
        """Drop a session if it is still here (a prefill that failed, or one evicted meanwhile)."""
        if (session := self._pop(session_id)) is not None:
            self._free(session.cache)

    def end_owner(self, owner: str) -> int:
        """Drop every session (calls in flight or not) and kept prefix of API key `owner`, which
        was removed, and free their KV; how many sessions it had."""
        with self._lock:
            ended = self._of(owner)
            for session in ended:
                del self._sessions[session.session_id]
                self._uncount(session)
            self.prefixes.forget_notes(owner=owner)
        for session in ended:
            self._free(session.cache)
        while self._evict_prefix(owner=owner):
            pass
        return len(ended)

    def _pop(self, session_id: str) -> Session | None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self._uncount(session)
            return session

    def _evict_one(self, keep: str | None, owner: str, reason: str) -> bool:
        """Drop `owner`'s least recently used session that is not `keep` and has no call in
        flight, for `reason`."""
        for sid, session in self._sessions.items():
            if sid != keep and not self.busy.get(sid) and session.owner == owner:
                self._pop(sid)
                self._free(session.cache)
                self._count_eviction(session, reason)
                return True
        return False

    def prefix_totals(self, owner: str | None = None) -> tuple[int, int, int, int]:
        """New sessions' prompt tokens reused and prefilled so far, and the kept prefixes now
        (entries, bytes): every key's, or `owner`'s; safe to read from the event loop."""
        with self._lock:
            prefixes = self.prefixes
            totals = prefixes.totals if owner is None else prefixes.totals_by_owner.get(owner, ReuseTotals())
            return totals.reused, totals.prefilled, prefixes.count(owner), prefixes.nbytes(owner)

    def eviction_totals(self) -> dict[str, int]:
        """Sessions evicted so far by reason (safe to read from the event loop)."""
        with self._lock:
            return dict(self.evictions)

    def _count_eviction(self, session: Session, reason: str) -> None:
        with self._lock:
            self.evictions[reason] += 1
        owner = f"key {session.owner!r}" if session.owner else "no API key"
        log.info("evicted session %s of %s: %s", session_tag(session.session_id), owner, reason)
