"""Whose kept prefixes a new session may start from (its reuse scope), so that prefix reuse never
crosses a trust boundary: a scope is one client of one API key, proven by the reuse token the
verifier gave it (a nonce and its HMAC under a secret drawn at start: no state per client), or a
key under `--shared-prefix-cache` (why, and what a client sees: docs/operations.md, "Who shares").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Literal

from shared.errors import InvalidRequest

ReuseMode = Literal["off", "client", "shared"]
MAX_REUSE_TOKEN = 64  # characters; a token this verifier hands out has 32
_NONCE_BYTES = 12
_MAC_BYTES = 12


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
