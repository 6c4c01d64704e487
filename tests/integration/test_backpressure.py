"""The edge under a full verifier (RESOURCE_EXHAUSTED): resends after the server's retry hint,
falls back locally in accept-unverified mode, and otherwise stops with a clear error."""

import asyncio
import time

import grpc
import pytest

from cloud.batch_step import ForwardStep
from cloud.grpc_server import create_server
from cloud.quotas import KeyLimits
from cloud.sessions import RETRY_AFTER_IN_USE_MS, SessionLimits
from cloud.verifier import Verifier, VerifierLimits
from edge.drafting.kpolicy import FixedK
from edge.round.generate import TimeoutPolicy, cloud_only_generate, speculative_generate
from edge.transport.client import CapacityRetry, VerifierClient
from shared import wire
from shared.errors import CapacityExceeded
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from shared.protocol import OpenSessionRequest, OpenSessionResult, SessionConfig
from tests.harness import TargetEngine, cap_kv, gen_config, make_drafter, random_prompt, running_verifier

HINT_MS = 40


class AdmitsAfterRejections(Verifier):
    """A real verifier that first answers `rejections` OpenSession calls with RESOURCE_EXHAUSTED
    and a retry hint, as a full admission queue does, then serves normally. Only the admission
    decision is scripted; server, wire (the hint in trailing metadata) and client are the real
    ones. Verify refusals come from the real KV cap in the tests below."""

    def __init__(self, *args, rejections: int, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.rejections = rejections

    def begin_open(
        self, req: OpenSessionRequest, session_id: str | None = None, owner: str = ""
    ) -> ForwardStep[OpenSessionResult]:
        if self.rejections > 0:
            self.rejections -= 1
            raise CapacityExceeded("queue full", retry_after_ms=HINT_MS)
        return super().begin_open(req, session_id, owner)


def test_edge_resends_after_the_retry_hint_and_output_is_unchanged(target_engine: TargetEngine, draft_model) -> None:
    prompt = random_prompt(7, length=6)

    async def run() -> None:
        async with running_verifier(target_engine) as (direct, _):
            reference = (await cloud_only_generate(prompt, direct, gen_config(max_new_tokens=20))).token_ids
        server, port = create_server(AdmitsAfterRejections(target_engine(), "tiny", rejections=3), "127.0.0.1:0")
        await server.start()
        client = VerifierClient(f"127.0.0.1:{port}", 10, capacity_retry=CapacityRetry(max_retries=3, backoff_s=0.001))
        try:
            start = time.perf_counter()
            result = await speculative_generate(
                prompt,
                make_drafter(draft_model),
                client,
                FixedK(4),
                gen_config(max_new_tokens=20, timeouts=TimeoutPolicy(soft_deadline_s=5)),
            )
            elapsed = time.perf_counter() - start
        finally:
            await client.close()
            await server.stop(None)
        assert result.token_ids == reference and result.reopens == 0
        assert client.stats.capacity_rejections == 3
        # Each wait honours the hint (never earlier; jitter only adds), though the backoff is 1 ms.
        assert client.stats.capacity_wait_s >= 3 * HINT_MS / 1000 and elapsed >= 3 * HINT_MS / 1000

    asyncio.run(run())


class RefusesWithOneTrailer(pb_grpc.VerifierServicer):
    """A gRPC verifier that answers its first `refusals` OpenSession calls RESOURCE_EXHAUSTED with
    the retry hint under one trailer name only, then opens a session."""

    def __init__(self, trailer: str, refusals: int) -> None:
        self.trailer, self.refusals = trailer, refusals

    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext) -> pb.OpenSessionResponse:  # noqa: N802
        if self.refusals > 0:
            self.refusals -= 1
            context.set_trailing_metadata(((self.trailer, str(HINT_MS)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        return pb.OpenSessionResponse(session_id="s1", position=len(request.prompt_tokens), max_draft_tokens=8)


@pytest.mark.parametrize("trailer", [wire.RETRY_AFTER_MS_KEY, wire.RETRY_PUSHBACK_MS_KEY])
def test_the_hint_is_read_under_either_trailer_and_resends_count_in_the_calls_bytes(trailer: str) -> None:
    """The project's trailer or gRPC's own retry pushback: either holds the resends back for the
    hint. The reply's bytes are every send's request and the one answer."""
    request = OpenSessionRequest(list(range(1, 9)), SessionConfig())

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_VerifierServicer_to_server(RefusesWithOneTrailer(trailer, refusals=2), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = VerifierClient(f"127.0.0.1:{port}", 10, capacity_retry=CapacityRetry(max_retries=3, backoff_s=0.001))
        try:
            opened = await client.open_session(request)
        finally:
            await client.close()
            await server.stop(None)
        assert opened.position == 8 and client.stats.capacity_rejections == 2
        assert client.stats.capacity_wait_s >= 2 * HINT_MS / 1000  # a 1 ms backoff alone would wait far less
        sent = wire.open_request_to_pb(request).ByteSize()
        answer = pb.OpenSessionResponse(session_id="s1", position=8, max_draft_tokens=8).ByteSize()
        assert opened.wire.up == 3 * sent and opened.wire.down == answer

    asyncio.run(run())


def test_a_refused_call_carries_its_bytes_in_the_error() -> None:
    """Refused for good: the CapacityExceeded raised holds what every send put on the wire."""
    request = OpenSessionRequest(list(range(1, 9)), SessionConfig())

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_VerifierServicer_to_server(RefusesWithOneTrailer(wire.RETRY_PUSHBACK_MS_KEY, refusals=5), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = VerifierClient(f"127.0.0.1:{port}", 10, capacity_retry=CapacityRetry(max_retries=1, backoff_s=0.001))
        try:
            with pytest.raises(CapacityExceeded) as refused:
                await client.open_session(request)
        finally:
            await client.close()
            await server.stop(None)
        assert refused.value.retry_after_ms == HINT_MS
        assert refused.value.wire.up == 2 * wire.open_request_to_pb(request).ByteSize() and refused.value.wire.down == 0

    asyncio.run(run())


def test_a_capacity_refusal_carries_the_hint_under_both_trailers(target_engine: TargetEngine) -> None:
    """A real cap (one session per key, the one already open): a plain gRPC client reads
    RESOURCE_EXHAUSTED with the retry hint under the project's trailer and under gRPC's own
    retry pushback, the same number in both."""
    limits = VerifierLimits(sessions=SessionLimits(per_key=KeyLimits(max_sessions=1)))
    request = pb.OpenSessionRequest(prompt_tokens=random_prompt(2, length=4), vocab_size=96)

    async def run() -> None:
        async with running_verifier(target_engine, limits) as (client, _):
            async with grpc.aio.insecure_channel(client.target) as channel:
                stub = pb_grpc.VerifierStub(channel)
                await stub.OpenSession(request)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.OpenSession(request)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        trailers = dict(refused.value.trailing_metadata())
        assert int(trailers[wire.RETRY_AFTER_MS_KEY]) == RETRY_AFTER_IN_USE_MS
        assert trailers[wire.RETRY_PUSHBACK_MS_KEY] == trailers[wire.RETRY_AFTER_MS_KEY]

    asyncio.run(run())


def test_edge_gives_up_after_its_retries_when_the_prompt_never_fits(target_engine: TargetEngine) -> None:
    """The verifier's real KV cap: a prompt over it is refused (RESOURCE_EXHAUSTED, no hint)
    every time; the edge resends max_retries times, then raises; the server keeps serving."""

    async def run() -> None:
        async with running_verifier(target_engine) as (client, verifier):
            cap_kv(verifier, 8)
            client.capacity_retry = CapacityRetry(max_retries=2, backoff_s=0.001)
            with pytest.raises(CapacityExceeded):
                await client.open_session(OpenSessionRequest(random_prompt(1, length=20), gen_config().session))
            assert client.stats.capacity_rejections == 3
            opened = await client.open_session(OpenSessionRequest(random_prompt(1, length=4), gen_config().session))
            assert opened.position == 4

    asyncio.run(run())


@pytest.mark.parametrize("mode", ["accept-unverified", "provisional"])
def test_verify_refused_for_good_falls_back_locally_only_in_accept_unverified(
    target_engine: TargetEngine, draft_model, mode
) -> None:
    """Sessions grow past the real KV cap, so every later Verify is refused: accept-unverified
    finishes on the edge (each such token counted unverified); provisional mode never makes
    unverified text final, so it stops with the verifier's RESOURCE_EXHAUSTED."""
    prompt = random_prompt(3, length=6)
    timeouts = TimeoutPolicy(soft_deadline_s=5, mode=mode)  # type: ignore[arg-type]

    async def run() -> None:
        async with running_verifier(target_engine) as (client, verifier):
            cap_kv(verifier, 12)
            client.capacity_retry = CapacityRetry(max_retries=1, backoff_s=0.001)
            run = speculative_generate(
                prompt, make_drafter(draft_model), client, FixedK(3), gen_config(max_new_tokens=20, timeouts=timeouts)
            )
            if mode == "provisional":
                with pytest.raises(CapacityExceeded):
                    await run
                return
            result = await run
            assert len(result.token_ids) == 20 and result.unverified_tokens > 0
            assert result.rounds >= 1  # the first rounds fitted and were verified
            assert client.stats.capacity_rejections >= 2 * result.unverified_tokens  # each: a send and a resend

    asyncio.run(run())
