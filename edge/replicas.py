"""Which verifier replica serves a session. A verifier keeps a session's KV cache in its own
memory, so every call of a session must reach the replica that opened it. The edge picks a
routing key per generation and sends it with every call as gRPC metadata (SESSION_KEY_HEADER):
a proxy in front of several replicas hashes on it (deploy/haproxy.cfg), and an edge given
several addresses itself (--cloud a:1,b:2) ranks them by rendezvous hashing of the key."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.errors import ConfigError

SESSION_KEY_HEADER = "specdec-session-key"  # the contract with any proxy: README "Running several verifiers"


def new_session_key() -> str:
    """16 hex characters: random, so sessions spread evenly over the replicas."""
    return secrets.token_hex(8)


def split_addresses(target: str) -> list[str]:
    """--cloud's comma-separated HOST:PORT list, in order, without blanks or repeats."""
    addresses = list(dict.fromkeys(a.strip() for a in target.split(",") if a.strip()))
    if not addresses:
        raise ConfigError(f"no verifier address in {target!r}")
    return addresses


def rendezvous_order(key: str, addresses: Sequence[str]) -> list[str]:
    """The addresses by sha256(key + address), highest first: the first serves the key; when it
    is gone the next one does, and the keys of the other replicas stay where they are."""
    return sorted(addresses, key=lambda address: hashlib.sha256((key + address).encode()).digest(), reverse=True)


@dataclass
class ReplicaSet:
    """The replicas of one edge and the ones that answered UNAVAILABLE lately. A dead replica is
    skipped for `down_s`, so the session's reopen goes to the next replica in its order; after
    that it is tried again (a restarted replica takes its keys back, and answers NOT_FOUND for
    sessions it never saw: the edge reopens those on their committed prefix)."""

    addresses: list[str]
    down_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _down_until: dict[str, float] = field(default_factory=dict)

    def pick(self, key: str | None) -> str:
        if len(self.addresses) == 1:
            return self.addresses[0]
        order = rendezvous_order(key or "", self.addresses)
        now = self.clock()
        return next((a for a in order if self._down_until.get(a, 0.0) <= now), order[0])

    def mark_down(self, address: str) -> None:
        if len(self.addresses) > 1:
            self._down_until[address] = self.clock() + self.down_s
