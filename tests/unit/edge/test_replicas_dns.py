"""--cloud NAME:PORT where DNS gives NAME several addresses: one replica per address, under the
same rendezvous hashing; a certificate checked against the name, not the address; a new session
that meets a dead replica goes on to the next one at once. The resolver is injected (DNS here
gives localhost one address); the gRPC calls are real, to servers on 127.0.0.1 and 127.0.0.2."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from edge.transport.client import ClientTls, VerifierClient
from edge.transport.replicas import SESSION_KEY_HEADER, ReplicaSet, rendezvous_order, replica_addresses, resolve_host
from shared.errors import CloudUnavailable
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from shared.protocol import OpenSessionRequest, SessionConfig
from tests.certs import make_pki

HOSTS = ["127.0.0.1", "127.0.0.2"]


def _dns(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    """A resolver answering from `table`, recording what it was asked."""
    asked: list[tuple[str, int]] = []

    def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return table.get(host, [])

    resolve.asked = asked  # type: ignore[attr-defined]
    return resolve


def test_a_name_with_several_addresses_is_that_many_replicas() -> None:
    resolve = _dns({"verifiers.example": ["10.0.0.1", "10.0.0.2", "fd00::3", "10.0.0.1"]})
    assert replica_addresses("verifiers.example:50051", resolve) == {
        "10.0.0.1:50051": "verifiers.example",
        "10.0.0.2:50051": "verifiers.example",
        "[fd00::3]:50051": "verifiers.example",
    }


def test_names_with_one_address_or_none_and_literal_addresses_stay_as_given() -> None:
    resolve = _dns({"one.example": ["10.0.0.9"], "many.example": ["10.0.0.1", "10.0.0.2"]})
    target = "one.example:1, nowhere.example:2, 10.0.0.1:50051, [::1]:3, many.example:50051, unix:/run/v.sock"
    assert replica_addresses(target, resolve) == {
        "one.example:1": None,  # gRPC resolves it again on each reconnect
        "nowhere.example:2": None,
        "10.0.0.1:50051": None,  # the same address reached through many.example is one replica
        "[::1]:3": None,
        "10.0.0.2:50051": "many.example",
        "unix:/run/v.sock": None,
    }
    assert sorted(resolve.asked) == [("many.example", 50051), ("nowhere.example", 2), ("one.example", 1)]


def test_getaddrinfo_resolver_on_this_machine() -> None:
    assert resolve_host("127.0.0.1", 50051) == ["127.0.0.1"]
    assert resolve_host("no such host name", 50051) == []


def _port_free_on_every_host() -> int:
    for _ in range(50):
        with socket.socket() as first:
            first.bind((HOSTS[0], 0))
            port = int(first.getsockname()[1])
            try:
                with socket.socket() as other:
                    other.bind((HOSTS[1], port))
                return port
            except OSError:
                continue
    raise AssertionError("no port free on both loopback addresses")


class _Replica(pb_grpc.VerifierServicer):
    def __init__(self) -> None:
        self.keys: list[str] = []

    async def OpenSession(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.keys.append(dict(context.invocation_metadata())[SESSION_KEY_HEADER])
        return pb.OpenSessionResponse(session_id="s", position=len(request.prompt_tokens), max_draft_tokens=8, vocab_size=96)


@asynccontextmanager
async def _replicas(port: int, tls: tuple[bytes, bytes] | None = None) -> AsyncIterator[list[_Replica]]:
    """One recording server per loopback address, all on `port` (TLS with (cert, key))."""
    servers, replicas = [], []
    for host in HOSTS:
        server, replica = grpc.aio.server(), _Replica()
        pb_grpc.add_VerifierServicer_to_server(replica, server)
        if tls is None:
            server.add_insecure_port(f"{host}:{port}")
        else:
            server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(tls[1], tls[0])]))
        await server.start()
        servers.append(server)
        replicas.append(replica)
    try:
        yield replicas
    finally:
        for server in servers:
            await server.stop(None)


def _open(prompt: list[int]) -> OpenSessionRequest:
    return OpenSessionRequest(prompt, SessionConfig())


def _keys_reaching_each(addresses: list[str], per_address: int) -> list[str]:
    """Session keys whose first rendezvous choice is each address `per_address` times (the port is
    picked at random, so which address a fixed key lands on varies from run to run)."""
    firsts: dict[str, list[str]] = {address: [] for address in addresses}
    for i in range(64 * per_address * len(addresses)):
        key = f"{i:016x}"
        chosen = firsts[rendezvous_order(key, addresses)[0]]
        if len(chosen) < per_address:
            chosen.append(key)
        if all(len(keys) == per_address for keys in firsts.values()):
            return sorted(k for keys in firsts.values() for k in keys)
    raise AssertionError("rendezvous hashing sends no key to some address")


def test_sessions_reach_each_address_of_the_name_by_rendezvous_over_addresses(tmp_path: Path) -> None:
    """Over TLS: the certificate names localhost and 127.0.0.1, not 127.0.0.2, so the calls to
    127.0.0.2 pass only because the channel checks the certificate against the name."""
    port = _port_free_on_every_host()
    pki = make_pki(tmp_path)
    tls = (pki.server_cert.read_bytes(), pki.server_key.read_bytes())
    addresses = [f"{host}:{port}" for host in HOSTS]
    keys = _keys_reaching_each(addresses, per_address=6)

    async def run() -> None:
        async with _replicas(port, tls) as replicas:
            client = VerifierClient(f"localhost:{port}", tls=ClientTls(pki.ca.read_bytes()), resolve=_dns({"localhost": HOSTS}))
            try:
                assert client.replicas.addresses == addresses
                for key in keys:
                    await client.open_session(_open([5, 6, 7]), session_key=key)
            finally:
                await client.close()
            for replica, address in zip(replicas, addresses, strict=True):
                assert replica.keys == [k for k in keys if rendezvous_order(k, addresses)[0] == address]
            assert all(replica.keys for replica in replicas)

    asyncio.run(run())


def test_a_new_session_skips_a_dead_address_at_once() -> None:
    """127.0.0.2 answers, 127.0.0.1 has nothing listening: every OpenSession succeeds on the first
    try, including those whose key ranks the dead address first."""
    port = _port_free_on_every_host()
    addresses = [f"{host}:{port}" for host in HOSTS]
    keys = [f"{i:016x}" for i in range(8)]
    assert any(rendezvous_order(k, addresses)[0] == addresses[0] for k in keys)

    async def run() -> None:
        server, replica = grpc.aio.server(), _Replica()
        pb_grpc.add_VerifierServicer_to_server(replica, server)
        server.add_insecure_port(addresses[1])
        await server.start()
        client = VerifierClient(f"fleet.test:{port}", resolve=_dns({"fleet.test": HOSTS}))
        try:
            for key in keys:
                await client.open_session(_open([5]), session_key=key)
        finally:
            await client.close()
            await server.stop(None)
        assert replica.keys == keys

    asyncio.run(run())


def test_any_up_follows_the_down_marks() -> None:
    now = [0.0]
    replicas = ReplicaSet(["a:1", "b:1"], down_s=10, clock=lambda: now[0])
    replicas.mark_down("a:1")
    assert replicas.any_up()
    replicas.mark_down("b:1")
    assert not replicas.any_up()
    now[0] = 10.0
    assert replicas.any_up()


def test_one_dead_verifier_fails_the_open_once() -> None:
    """With a single address and nothing listening, OpenSession fails at once as UNAVAILABLE
    (the edge's reconnect loop takes over), rather than trying the same address again."""
    port = _port_free_on_every_host()

    async def run() -> None:
        client = VerifierClient(f"127.0.0.1:{port}")
        try:
            with pytest.raises(CloudUnavailable):
                await asyncio.wait_for(client.open_session(_open([5]), session_key="k"), 10)
        finally:
            await client.close()

    asyncio.run(run())
