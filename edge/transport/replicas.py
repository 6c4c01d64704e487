"""Which verifier replica serves a session. A verifier keeps a session's KV cache in its own
memory, so every call of a session must reach the replica that opened it. The edge picks a
routing key per generation and sends it with every call as gRPC metadata (SESSION_KEY_HEADER):
a proxy in front of several replicas hashes on it (deploy/haproxy.cfg), and an edge given
several addresses itself (--cloud a:1,b:2, or a name that DNS resolves to several addresses)
ranks them by rendezvous hashing of the key."""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.errors import ConfigError

SESSION_KEY_HEADER = "specdec-session-key"  # the contract with any proxy: docs/fleet.md

Resolver = Callable[[str, int], list[str]]  # (host, port) -> its IP addresses, in DNS order


def new_session_key() -> str:
    """16 hex characters: random, so sessions spread evenly over the replicas."""
    return secrets.token_hex(8)


def split_addresses(target: str) -> list[str]:
    """--cloud's comma-separated HOST:PORT list, in order, without blanks or repeats."""
    addresses = list(dict.fromkeys(a.strip() for a in target.split(",") if a.strip()))
    if not addresses:
        raise ConfigError(f"no verifier address in {target!r}")
    return addresses


def resolve_host(host: str, port: int) -> list[str]:
    """The addresses getaddrinfo gives for host:port (IPv4 and IPv6), in its order, once each;
    none when the name does not resolve (gRPC then reports it as it always did)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in found))


def _host_port(address: str) -> tuple[str, int] | None:
    """HOST:PORT or [V6]:PORT split; None for anything else (a gRPC URI such as unix:/path or
    dns:///name, which gRPC resolves itself)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host, int(port)) if (host and ":" not in host) or _is_ip(host) else None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def replica_addresses(target: str, resolve: Resolver = resolve_host) -> dict[str, str | None]:
    """--cloud's replicas: each dial address, with the host name a TLS certificate must carry
    when the address came from DNS (None: the address is as given). A name that resolves to
    several addresses stands for that many replicas (a headless Kubernetes Service, a DNS
    round-robin record); they are resolved once, here."""
    replicas: dict[str, str | None] = {}
    for address in split_addresses(target):
        parts = _host_port(address)
        found = resolve(*parts) if parts is not None and not _is_ip(parts[0]) else []
        if parts is None or len(found) < 2:
            replicas.setdefault(address, None)  # one address: gRPC resolves the name again on reconnects
            continue
        for ip in found:
            replicas.setdefault(f"[{ip}]:{parts[1]}" if ":" in ip else f"{ip}:{parts[1]}", parts[0])
    return replicas


def rendezvous_order(key: str, addresses: Sequence[str]) -> list[str]:
    """The addresses by sha256(key + address), highest first: the first serves the key; when it
    is gone the next one does, and the keys of the other replicas stay where they are."""
    return sorted(addresses, key=lambda address: hashlib.sha256((key + address).encode()).digest(), reverse=True)


@dataclass
class ReplicaSet:
    """The replicas of one edge, the ones that answered UNAVAILABLE lately, and where each open
    session lives. A dead replica is skipped by new sessions and reopens for `down_s`, so a
    session it held reopens on the next replica in its key's order; after that new sessions try
    it again (a restarted replica takes its keys back). A session stays pinned to the replica it
    was opened on: moving it back would only cost a reopen and a second prefill."""

    addresses: list[str]
    down_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    max_pins: int = 10_000  # sessions never closed (an edge killed mid-run) fall out first
    _down_until: dict[str, float] = field(default_factory=dict)
    _pins: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def pick(self, key: str | None, opening: bool = False) -> str:
        """The replica for a call of the session `key`; `opening`: an OpenSession, which goes
        to the first live replica in the key's order rather than where the session was."""
        if len(self.addresses) == 1:
            return self.addresses[0]
        now = self.clock()
        pinned = None if opening or key is None else self._pins.get(key)
        if pinned is not None and self._down_until.get(pinned, 0.0) <= now:
            return pinned
        order = rendezvous_order(key or "", self.addresses)
        return next((a for a in order if self._down_until.get(a, 0.0) <= now), order[0])

    def opened(self, key: str | None, address: str) -> None:
        if key is None or len(self.addresses) == 1:
            return
        self._pins[key] = address
        self._pins.move_to_end(key)
        while len(self._pins) > self.max_pins:
            self._pins.popitem(last=False)

    def closed(self, key: str | None) -> None:
        if key is not None:
            self._pins.pop(key, None)

    def any_up(self) -> bool:
        """Whether some replica has not answered UNAVAILABLE lately."""
        now = self.clock()
        return any(self._down_until.get(a, 0.0) <= now for a in self.addresses)

    def mark_down(self, address: str) -> None:
        if len(self.addresses) > 1:
            self._down_until[address] = self.clock() + self.down_s
