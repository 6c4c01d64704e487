"""Sockets both servers use: the HTTP listener of cloud-verifier and of edge-agent serve."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 maybe in brackets) stays on this machine.
    A name other than localhost may resolve anywhere, so it counts as exposed."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_tcp(host: str, port: int, what: str = "") -> socket.socket:
    """A TCP socket bound to host:port (0 = any free port), not yet listening. Bound here rather
    than in uvicorn so port 0 resolves before serving and a taken port raises OSError."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise OSError(f"could not bind {host}:{port}{' for ' + what if what else ''}: {err.strerror}") from None
    return sock
