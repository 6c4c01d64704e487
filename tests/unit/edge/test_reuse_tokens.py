"""The reuse tokens a verifier hands the edge's client, kept per caller (for_caller) and per
verifier address: each caller of one served endpoint sends back only the token it was given,
over a real gRPC channel to a server that hands out one token per client that arrives without."""

import asyncio
import itertools

import grpc

from edge.transport.client import VerifierClient
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from shared.protocol import OpenSessionRequest, SessionConfig


class _TokenIssuer(pb_grpc.VerifierServicer):
    """Answers OpenSession with a new token to a client that sent none; records what came."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self._numbers = itertools.count(1)

    async def OpenSession(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.received.append(request.reuse_token)
        token = request.reuse_token or f"token-{next(self._numbers)}"
        return pb.OpenSessionResponse(session_id="s", position=len(request.prompt_tokens), reuse_token=token)


def test_two_callers_keep_their_own_tokens_for_one_verifier() -> None:
    async def run() -> None:
        server, issuer = grpc.aio.server(), _TokenIssuer()
        pb_grpc.add_VerifierServicer_to_server(issuer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        client = VerifierClient(address)
        alice, bob = client.for_caller("alice"), client.for_caller("bob")
        request = OpenSessionRequest([1, 2, 3], SessionConfig())
        try:
            given = [(await view.open_session(request)).reuse_token for view in (alice, bob, client)]
            assert given == ["token-1", "token-2", "token-3"]  # each its own: none sent the other's
            for view in (bob, alice, client, client.for_caller("alice")):  # a new view of alice: her token
                await view.open_session(request)
            assert issuer.received == ["", "", "", "token-2", "token-1", "token-3", "token-1"]
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(run())
