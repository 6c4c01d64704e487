"""Rendezvous hashing of session keys over verifier replicas, the skip of a dead replica, and the
routing key sent as metadata with every call of a session."""

import asyncio

import grpc
import pytest

from edge.transport.client import VerifierClient
from edge.transport.replicas import SESSION_KEY_HEADER, ReplicaSet, new_session_key, rendezvous_order, split_addresses
from shared.errors import ConfigError
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

ADDRESSES = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
KEYS = [f"{i:016x}" for i in range(3000)]


def test_split_addresses() -> None:
    assert split_addresses("a:1, b:2,,a:1") == ["a:1", "b:2"]
    assert split_addresses("a:1") == ["a:1"]
    with pytest.raises(ConfigError):
        split_addresses(" , ")


def test_keys_spread_evenly_and_the_order_ignores_the_list_order() -> None:
    firsts = [rendezvous_order(key, ADDRESSES)[0] for key in KEYS]
    assert all(abs(firsts.count(a) - len(KEYS) / 3) < len(KEYS) * 0.05 for a in ADDRESSES)
    assert all(rendezvous_order(key, ADDRESSES) == rendezvous_order(key, ADDRESSES[::-1]) for key in KEYS[:50])
    assert len(new_session_key()) == 16 and new_session_key() != new_session_key()


def test_a_replica_gone_moves_only_its_own_keys() -> None:
    survivors = ADDRESSES[:2]
    for key in KEYS:
        order = rendezvous_order(key, ADDRESSES)
        moved_to = rendezvous_order(key, survivors)[0]
        # A key of a survivor stays; a key of the gone replica goes to the next in its own order.
        assert moved_to == (order[0] if order[0] in survivors else order[1])


def test_a_dead_replica_is_skipped_for_a_while() -> None:
    now = [0.0]
    replicas = ReplicaSet(list(ADDRESSES), down_s=10, clock=lambda: now[0])
    key = KEYS[0]
    first, second, _ = rendezvous_order(key, ADDRESSES)
    assert replicas.pick(key) == first
    replicas.mark_down(first)
    assert replicas.pick(key) == second
    now[0] = 10.0  # back in the running: a restarted replica takes its keys back
    assert replicas.pick(key) == first
    for address in ADDRESSES:
        replicas.mark_down(address)
    assert replicas.pick(key) == first  # all down: the first in the key's order is tried anyway


def test_a_session_stays_where_it_was_opened_after_its_first_replica_is_back() -> None:
    """Moved to the second replica while the first was down, a session keeps calling the second
    once the first is back (moving it again would cost a reopen); its next reopen, and new
    sessions of the same key, go to the first again."""
    now = [0.0]
    replicas = ReplicaSet(list(ADDRESSES), down_s=10, clock=lambda: now[0])
    key = KEYS[1]
    first, second, _ = rendezvous_order(key, ADDRESSES)
    replicas.opened(key, replicas.pick(key, opening=True))
    replicas.mark_down(first)
    assert replicas.pick(key) == second  # the pinned replica is dead: the next one, where it reopens
    replicas.opened(key, replicas.pick(key, opening=True))
    now[0] = 30.0
    assert replicas.pick(key) == second
    assert replicas.pick(key, opening=True) == first
    replicas.mark_down(second)
    assert replicas.pick(key) == first  # pinned to a dead replica: back to the key's order
    replicas.closed(key)
    now[0] = 60.0
    assert replicas.pick(key) == first


def test_pins_are_bounded() -> None:
    replicas = ReplicaSet(list(ADDRESSES), max_pins=3)
    keys = [key for key in KEYS if rendezvous_order(key, ADDRESSES)[0] != ADDRESSES[2]][:5]
    for key in keys:
        replicas.opened(key, ADDRESSES[2])
    assert [replicas.pick(key) for key in keys] == [
        rendezvous_order(keys[0], ADDRESSES)[0],
        rendezvous_order(keys[1], ADDRESSES)[0],
    ] + [ADDRESSES[2]] * 3


class _Recorder(pb_grpc.VerifierServicer):
    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def CloseSession(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.CloseSessionResponse()


def test_the_session_key_travels_with_each_call_to_its_replica() -> None:
    """Two recording servers behind one client: a key's calls all reach the replica its order
    ranks first, carrying the key; a call without a key carries none."""

    async def run() -> None:
        servers, recorders, addresses = [], [], []
        for _ in range(2):
            server, recorder = grpc.aio.server(), _Recorder()
            pb_grpc.add_VerifierServicer_to_server(recorder, server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
            recorders.append(recorder)
        client = VerifierClient(",".join(addresses), api_key="k1")
        try:
            for key in KEYS[:6]:
                await client.close_session("s", session_key=key)
                owner = recorders[addresses.index(rendezvous_order(key, addresses)[0])]
                assert owner.metadata[-1][SESSION_KEY_HEADER] == key
                assert owner.metadata[-1]["authorization"] == "Bearer k1"
            assert sum(len(r.metadata) for r in recorders) == 6
            counts = [len(r.metadata) for r in recorders]
            await client.close_session("s")
            grown = [r for r, n in zip(recorders, counts, strict=True) if len(r.metadata) > n]
            assert len(grown) == 1 and SESSION_KEY_HEADER not in grown[0].metadata[-1]
        finally:
            await client.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(run())
