"""A session's Verify rounds on one VerifyRounds call: answered as unary Verify calls are (the
same results, statuses, trailers, metrics), a refused round ends its call and the next round
opens another, and a verifier without VerifyRounds gets unary Verify calls."""

import asyncio

import grpc
import pytest

from cloud.grpc_server import VerifierServicer
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.transport.client import VerifierClient
from shared import wire
from shared.errors import DeadlineExceeded, PositionMismatch
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from shared.protocol import OpenSessionRequest, SessionConfig, VerifyRequest
from tests.harness import TargetEngine, engine_of, random_prompt, running_verifier, serving

PROMPT = random_prompt(3)
GREEDY = SessionConfig(vocab_size=96)


async def _rounds(client: VerifierClient, drafts: list[list[int]]) -> list[tuple[int, int, int]]:
    """One session's greedy rounds of `drafts`: each round's (accepted, next token, position)."""
    opened = await client.open_session(OpenSessionRequest(PROMPT, GREEDY))
    position, seen = opened.position, []
    for block in drafts:
        result = await client.verify(VerifyRequest(opened.session_id, position, block))
        position = result.new_base_position
        seen.append((result.accepted_len, result.next_token, position))
    await client.close_session(opened.session_id)
    return seen


def _verify_count(verifier_state: ServerState, code: str) -> float:
    return verifier_state.metrics.requests.labels("Verify", code)._value.get()


def test_rounds_on_one_stream_answer_as_unary_calls(target_engine: TargetEngine) -> None:
    drafts = [random_prompt(10 + i, 3) for i in range(6)]

    async def run() -> None:
        async with running_verifier(target_engine) as (client, verifier):
            streamed = await _rounds(client, drafts)
            unary_client = VerifierClient(client.target, round_streams=False)
            try:
                unary = await _rounds(unary_client, drafts)
            finally:
                await unary_client.close()
        assert streamed == unary
        assert [p for *_, p in streamed] == sorted({p for *_, p in streamed})  # every round moved on

    asyncio.run(run())


def test_a_session_keeps_one_call_and_each_round_counts_as_a_verify(target_engine: TargetEngine) -> None:
    async def run() -> None:
        verifier = Verifier(engine_of(target_engine), "tiny-target")
        state = ServerState.for_verifier(verifier)
        async with serving(state) as client:
            opened = await client.open_session(OpenSessionRequest(PROMPT, GREEDY))
            position, calls = opened.position, set()
            for i in range(4):
                result = await client.verify(VerifyRequest(opened.session_id, position, random_prompt(20 + i, 2)))
                position = result.new_base_position
                calls.add(id(client._rounds._calls[opened.session_id].call))  # type: ignore[union-attr]
            assert len(calls) == 1  # the four rounds on one call
            assert _verify_count(state, "OK") == 4
            await client.close_session(opened.session_id)
            assert opened.session_id not in client._rounds._calls  # type: ignore[union-attr]

    asyncio.run(run())


def test_a_refused_round_ends_its_call_and_the_next_round_opens_another(target_engine: TargetEngine) -> None:
    async def run() -> None:
        async with running_verifier(target_engine) as (client, _):
            opened = await client.open_session(OpenSessionRequest(PROMPT, GREEDY))
            first = await client.verify(VerifyRequest(opened.session_id, opened.position, [5, 6]))
            rounds = client._rounds
            assert rounds is not None
            before = rounds._calls[opened.session_id].call
            with pytest.raises(PositionMismatch) as err:  # the trailer's position comes back as with Verify
                await client.verify(VerifyRequest(opened.session_id, opened.position, [5, 6]))
            assert err.value.server_position == first.new_base_position
            assert before.done() and opened.session_id not in rounds._calls
            again = await client.verify(VerifyRequest(opened.session_id, first.new_base_position, [7]))
            assert again.new_base_position > first.new_base_position
            assert rounds._calls[opened.session_id].call is not before

    asyncio.run(run())


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"draft_tokens": [5, 960]}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"session_id": "nope"}, grpc.StatusCode.NOT_FOUND),
        ({"base_position": len(PROMPT) + 3}, grpc.StatusCode.FAILED_PRECONDITION),
    ],
    ids=["draft past vocab", "unknown session", "position ahead"],
)
def test_a_bad_round_ends_the_call_with_verifys_status(target_engine: TargetEngine, changes: dict, code) -> None:
    async def run() -> None:
        async with running_verifier(target_engine, VerifierLimits(max_draft_tokens=8)) as (client, _):
            async with grpc.aio.insecure_channel(client.target) as channel:
                stub = pb_grpc.VerifierStub(channel)
                opened = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))
                call = stub.VerifyRounds()
                good = pb.VerifyRequest(session_id=opened.session_id, base_position=len(PROMPT), draft_tokens=[5])
                await call.write(good)
                reply = await call.read()
                fields = {"session_id": opened.session_id, "base_position": reply.new_base_position, "draft_tokens": [5]}
                await call.write(pb.VerifyRequest(**{**fields, **changes}))  # type: ignore[arg-type]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                assert err.value.code() == code, err.value.details()
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    trailers = dict(err.value.trailing_metadata() or ())
                    assert int(trailers[wire.SERVER_POSITION_KEY]) == reply.new_base_position
                # The session is as it was: a round on a new call goes on from where it stood.
                after = await stub.Verify(pb.VerifyRequest(**fields))  # type: ignore[arg-type]
                assert after.new_base_position > reply.new_base_position

    asyncio.run(run())


def test_an_undecodable_round_is_invalid_argument(target_engine: TargetEngine) -> None:
    async def run() -> None:
        async with running_verifier(target_engine) as (client, _):
            async with grpc.aio.insecure_channel(client.target) as channel:
                raw = channel.stream_stream("/specdec.v1.Verifier/VerifyRounds")
                call = raw()
                await call.write(b"\xff\xff\xff")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(run())


def test_a_verifier_without_verify_rounds_gets_unary_verify_calls(target_engine: TargetEngine) -> None:
    """A verifier that predates VerifyRounds (the generated servicer answers UNIMPLEMENTED)."""

    async def run() -> None:
        state = ServerState.for_verifier(Verifier(engine_of(target_engine), "tiny-target"))
        server = grpc.aio.server()
        pb_grpc.add_VerifierServicer_to_server(VerifierServicer(state), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = VerifierClient(f"127.0.0.1:{port}")
        try:
            drafts = [random_prompt(30 + i, 3) for i in range(3)]
            assert len(await _rounds(client, drafts)) == 3
            assert client._rounds is not None and not client._rounds._calls
            assert client._rounds._unary  # asked once, then unary
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(run())


def test_a_round_past_its_deadline_ends_its_call(target_engine: TargetEngine) -> None:
    async def run() -> None:
        async with running_verifier(target_engine) as (client, _):
            opened = await client.open_session(OpenSessionRequest(PROMPT, GREEDY))
            with pytest.raises(DeadlineExceeded):
                await client.verify(VerifyRequest(opened.session_id, opened.position, [5, 6]), timeout_s=1e-6)
            assert client._rounds is not None and opened.session_id not in client._rounds._calls

    asyncio.run(run())


def test_a_cancelled_round_ends_its_call(target_engine: TargetEngine) -> None:
    """Its reply would otherwise answer the session's next round."""

    async def run() -> None:
        async with running_verifier(target_engine) as (client, _):
            opened = await client.open_session(OpenSessionRequest(PROMPT, GREEDY))
            task = asyncio.create_task(client.verify(VerifyRequest(opened.session_id, opened.position, [5, 6])))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client._rounds is not None and opened.session_id not in client._rounds._calls

    asyncio.run(run())
