"""Prefix reuse: the KV a closed session leaves behind (a kept prefix), for the next session of the same reuse scope
whose prompt starts with the same tokens; a scope never crosses a trust boundary (how entries, scopes and notes work:
docs/architecture.md, "Sessions and kept prefixes"; what a client sees: docs/operations.md, "Who shares")."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Literal

from cloud.engine import SessionKV
from cloud.quotas import HeldBytes
from shared.errors import InvalidRequest
from shared.token_ids import shared_prefix

ReuseMode = Literal["off", "client", "shared"]
MAX_REUSE_TOKEN = 64  # characters; a token this verifier hands out has 32
_NONCE_BYTES = 12
_MAC_BYTES = 12
# A session takes an entry only when the shared prefix covers at least this share of the
# entry's tokens: it continues that conversation. Another conversation that shares only a
# system prompt with it leaves it for its own next turn (llama-server's slot similarity, 0.5).
MIN_SHARED_FRACTION = 0.5
MAX_NOTES_PER_SCOPE = 64  # closed sessions' tokens noted for an engine's own prefix cache, per scope
MAX_NOTES = 1024  # and in all: past it, the scope with the most notes loses its oldest


@dataclass
class KeptPrefix:
    owner: str  # the API key whose session left it ("" without keys): its caps count it
    scope: str  # the reuse scope whose sessions may take it
    tokens: list[int]  # the tokens whose KV `kv` holds, in order
    kv: SessionKV
    nbytes: int
    kept_at: float


@dataclass(frozen=True)
class Note:
    """A closed session's tokens, whose KV an engine's own prefix cache keeps."""

    owner: str
    scope: str
    tokens: list[int]
    kept_at: float


@dataclass
class ReuseTotals:
    """Prompt tokens of new sessions so far: taken from a kept prefix, and computed."""

    reused: int = 0
    prefilled: int = 0


@dataclass
class PrefixCache:
    """The kept prefixes of every scope, least recently kept first. Changed only from the
    verifier's model worker (through the session store, which owns it)."""

    clock: Callable[[], float]
    _entries: OrderedDict[int, KeptPrefix] = field(default_factory=OrderedDict)
    _ids: count[int] = field(default_factory=count)
    totals: ReuseTotals = field(default_factory=ReuseTotals)
    totals_by_owner: dict[str, ReuseTotals] = field(default_factory=dict)  # keys come from the keys file: bounded
    _notes: OrderedDict[int, Note] = field(default_factory=OrderedDict)  # oldest first: each is noted once
    _held: HeldBytes = field(default_factory=HeldBytes)  # the entries' bytes, by owner

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[KeptPrefix]:
        return list(self._entries.values())

    def keep(self, owner: str, scope: str, tokens: list[int], kv: SessionKV, nbytes: int) -> None:
        self.give_back(KeptPrefix(owner, scope, tokens, kv, nbytes, self.clock()))

    def give_back(self, entry: KeptPrefix) -> None:
        """Keep an entry (again: a session that took it was refused before it used it)."""
        self._entries[next(self._ids)] = entry
        self._held.add(entry.owner, entry.nbytes)

    def _pop(self, entry_id: int) -> KeptPrefix:
        entry = self._entries.pop(entry_id)
        self._held.add(entry.owner, -entry.nbytes)
        return entry

    def take(self, scope: str, prompt: list[int], limit: int) -> tuple[KeptPrefix, int] | None:
        """`scope`'s entry sharing the longest prefix (at most `limit` tokens) with `prompt`, and
        that prefix's length; the entry leaves the cache. None: no entry shares enough (the
        caller makes a new handle)."""
        best = self._best(scope, prompt, limit)
        if best is None:
            return None
        entry_id, shared = best
        return self._pop(entry_id), shared

    def reusable(self, scope: str, prompt: list[int]) -> int:
        """How many of `prompt`'s tokens `take` would reuse now, or the engine's own cache
        likely serves (an estimate: the entry may be gone, the engine may have evicted it)."""
        best = self._best(scope, prompt, len(prompt) - 1)
        noted = [shared_prefix(n.tokens, prompt) for n in self._notes.values() if n.scope == scope]
        return min(max([best[1] if best else 0, *noted]), max(len(prompt) - 1, 0))

    def note(self, owner: str, scope: str, tokens: list[int]) -> None:
        """A closed session's tokens, whose KV the engine's own prefix cache keeps. A scope's
        notes are bounded, and past the bound of all, the scope with the most loses first: one
        scope's churn never flushes another's notes."""
        self._notes[next(self._ids)] = Note(owner, scope, tokens, self.clock())
        if sum(n.scope == scope for n in self._notes.values()) > MAX_NOTES_PER_SCOPE:
            self._forget_oldest_note(scope)
        if len(self._notes) > MAX_NOTES:
            per_scope = Counter(n.scope for n in self._notes.values())
            self._forget_oldest_note(per_scope.most_common(1)[0][0])

    def _forget_oldest_note(self, scope: str) -> None:
        del self._notes[next(i for i, n in self._notes.items() if n.scope == scope)]

    def forget_notes(self, kept_before: float | None = None, owner: str | None = None) -> None:
        """Forget the notes kept before `kept_before`, or every note of `owner`."""
        if owner is None:  # the oldest first, up to the first one to stay: every round asks
            while self._notes and kept_before is not None and next(iter(self._notes.values())).kept_at < kept_before:
                self._notes.popitem(last=False)
            return
        for note_id, note in list(self._notes.items()):
            if (kept_before is not None and note.kept_at < kept_before) or note.owner == owner:
                del self._notes[note_id]

    def _best(self, scope: str, prompt: list[int], limit: int) -> tuple[int, int] | None:
        best: tuple[int, int] | None = None
        for entry_id, entry in self._entries.items():
            if entry.scope != scope:
                continue
            shared = min(shared_prefix(entry.tokens, prompt), limit)
            if shared > (best[1] if best else 0) and shared >= MIN_SHARED_FRACTION * len(entry.tokens):
                best = (entry_id, shared)
        return best

    def count_open(self, owner: str, reused: int, prompt: int) -> None:
        for totals in (self.totals, self.totals_by_owner.setdefault(owner, ReuseTotals())):
            totals.reused += reused
            totals.prefilled += prompt - reused

    def _of(self, owner: str | None, scope: str | None) -> list[KeptPrefix]:
        return [e for e in self._entries.values() if owner in (None, e.owner) and scope in (None, e.scope)]

    def nbytes(self, owner: str | None = None, scope: str | None = None) -> int:
        if scope is None:
            return self._held.of(owner)
        return sum(e.nbytes for e in self._of(owner, scope))

    def count(self, owner: str | None = None, scope: str | None = None) -> int:
        return len(self._of(owner, scope))

    def scopes(self, owner: str | None = None) -> set[str]:
        """The scopes holding kept prefixes (of `owner`'s, or every key's)."""
        return {e.scope for e in self._of(owner, None)}

    def pop_oldest(
        self, owner: str | None = None, scope: str | None = None, kept_before: float | None = None
    ) -> SessionKV | None:
        """The handle of the least recently kept entry (of `owner`, of `scope`, kept before
        `kept_before`), removed from the cache; None when there is none."""
        for entry_id, entry in self._entries.items():
            if owner in (None, entry.owner) and scope in (None, entry.scope):
                if kept_before is None or entry.kept_at < kept_before:
                    return self._pop(entry_id).kv
        return None


@dataclass(frozen=True)
class Scope:
    """A session's reuse scope: `name` ("" for none, which shares with no session) and the
    token its client is handed ("" when it needs none)."""

    name: str
    token: str = ""

    @property
    def salt(self) -> str:
        """The scope as an engine with its own prefix cache salts it (a hash: neither key names
        nor tokens reach the engine); "" for none."""
        return hashlib.sha256(b"specedge-prefix-scope:" + self.name.encode()).hexdigest() if self.name else ""


NO_SCOPE = Scope("")


class ReuseScopes:
    """Resolves the scope of each new session from its API key and the token it presents."""

    def __init__(self, mode: ReuseMode, secret: bytes | None = None) -> None:
        self.mode = mode
        self._secret = secret or secrets.token_bytes(32)

    def of(self, owner: str, token: str) -> Scope:
        """The scope of a new session of API key `owner` ("" without keys) presenting `token`:
        a new client's when the token is not one this verifier signed for the key."""
        known = self.known(owner, token)
        return known if known.name or self.mode == "off" else self._client(owner, secrets.token_bytes(_NONCE_BYTES))

    def known(self, owner: str, token: str) -> Scope:
        """The scope `of` gives, but NO_SCOPE where that would be a new one (nothing is kept in
        it): what a session's prefill can reuse, told before the session exists."""
        if len(token) > MAX_REUSE_TOKEN:
            raise InvalidRequest(f"reuse_token is {len(token)} characters, over the limit of {MAX_REUSE_TOKEN}")
        if self.mode == "off":
            return NO_SCOPE
        if self.mode == "shared":
            return Scope(f"key:{owner}")
        nonce = self._nonce(owner, token)
        return self._client(owner, nonce) if nonce else NO_SCOPE

    def _client(self, owner: str, nonce: bytes) -> Scope:
        token = base64.urlsafe_b64encode(nonce + self._mac(owner, nonce)).decode()
        return Scope(f"client:{owner}:{nonce.hex()}", token)

    def _mac(self, owner: str, nonce: bytes) -> bytes:
        return hmac.new(self._secret, owner.encode() + b"\0" + nonce, hashlib.sha256).digest()[:_MAC_BYTES]

    def _nonce(self, owner: str, token: str) -> bytes | None:
        """The nonce of a token this verifier signed for `owner`, or None (empty, malformed,
        another key's or verifier's, or from before a restart)."""
        try:
            raw = base64.urlsafe_b64decode(token.encode())
        except (binascii.Error, ValueError):
            return None
        nonce, mac = raw[:_NONCE_BYTES], raw[_NONCE_BYTES:]
        return nonce if len(nonce) == _NONCE_BYTES and hmac.compare_digest(mac, self._mac(owner, nonce)) else None
