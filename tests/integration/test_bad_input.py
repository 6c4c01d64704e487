"""Every bad request gets its own status code and leaves the session as it was."""

import asyncio
import math

import grpc
import pytest
import torch

from cloud.sessions import SessionLimits
from cloud.verifier import VerifierLimits
from shared import wire
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from tests.harness import TargetEngine, random_prompt, running_verifier

PROMPT = random_prompt(0)
INVALID = grpc.StatusCode.INVALID_ARGUMENT

# (name, changes to a valid k=3 request, expected status)
BAD_VERIFY = [
    ("draft id past vocab", {"draft_tokens": [5, 96, 7]}, INVALID),
    ("negative draft id", {"draft_tokens": [5, -1, 7]}, INVALID),
    ("negative catch-up id", {"committed_tokens": [-4]}, INVALID),
    ("k over the limit", {"draft_tokens": [5] * 9, "draft_probs": [0.5] * 9}, INVALID),
    ("prob zero", {"draft_probs": [0.5, 0.0, 0.5]}, INVALID),
    ("prob above one", {"draft_probs": [0.5, 1.5, 0.5]}, INVALID),
    ("prob NaN", {"draft_probs": [0.5, math.nan, 0.5]}, INVALID),
    ("probs count", {"draft_probs": [0.5, 0.5]}, INVALID),
    ("mask length", {"hard_mask": b"\x01\x00"}, INVALID),
    ("sparse in greedy session", {"sparse_draft": [pb.SparseDistribution(token_ids=[5], probs=[1.0])] * 3}, INVALID),
    ("top-k over the cap", {"want_top_k": 1000}, INVALID),
    ("unknown session", {"session_id": "nope"}, grpc.StatusCode.NOT_FOUND),
    ("position behind", {"base_position": len(PROMPT) - 1}, grpc.StatusCode.FAILED_PRECONDITION),
    ("position ahead", {"base_position": len(PROMPT) + 5}, grpc.StatusCode.FAILED_PRECONDITION),
]

BAD_OPEN = [
    ("empty prompt", {"prompt_tokens": []}),
    ("prompt id past vocab", {"prompt_tokens": [1, 2, 500]}),
    ("negative temperature", {"sampling": pb.SamplingConfig(temperature=-1.0)}),
    ("top_p above one", {"sampling": pb.SamplingConfig(temperature=1.0, top_p=1.5)}),
    ("vocab larger than the model", {"vocab_size": 4096}),
    # Settings that used to pass and then sampled NaN (failing every step batched beside them):
    ("temperature 1e-45", {"sampling": pb.SamplingConfig(temperature=1e-45)}),
    ("temperature 1e-40", {"sampling": pb.SamplingConfig(temperature=1e-40)}),
    ("temperature inf", {"sampling": pb.SamplingConfig(temperature=math.inf, repetition_penalty=3.4e38)}),
    ("temperature NaN", {"sampling": pb.SamplingConfig(temperature=math.nan)}),
    ("repetition penalty 1e-40", {"sampling": pb.SamplingConfig(temperature=1.0, repetition_penalty=1e-40)}),
    ("repetition penalty NaN", {"sampling": pb.SamplingConfig(temperature=1.0, repetition_penalty=math.nan)}),
    ("negative repetition penalty", {"sampling": pb.SamplingConfig(temperature=1.0, repetition_penalty=-2.0)}),
    ("top_p NaN", {"sampling": pb.SamplingConfig(temperature=1.0, top_p=math.nan)}),
    ("negative top_p", {"sampling": pb.SamplingConfig(temperature=1.0, top_p=-0.5)}),
    ("unknown accept mode", {"sampling": pb.SamplingConfig(temperature=1.0), "accept_mode": 99}),
]

LIMITS = VerifierLimits(max_draft_tokens=8)


def _valid_verify(sid: str, **changes: object) -> pb.VerifyRequest:
    fields: dict[str, object] = {
        "session_id": sid,
        "base_position": len(PROMPT),
        "draft_tokens": [5, 6, 7],
        "draft_probs": [0.5, 0.5, 0.5],
    }
    fields.update(changes)
    return pb.VerifyRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "changes", "code"), BAD_VERIFY, ids=[c[0] for c in BAD_VERIFY])
def test_bad_verify_gets_its_status_and_session_survives(target_engine: TargetEngine, name: str, changes: dict, code) -> None:
    async def run() -> None:
        async with running_verifier(target_engine, LIMITS) as (client, _):
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            opened = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Verify(_valid_verify(opened.session_id, **changes))
            assert err.value.code() == code, err.value.details()
            assert err.value.details()  # a readable reason
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                metadata = dict(err.value.trailing_metadata())
                assert metadata[wire.SERVER_POSITION_KEY] == str(len(PROMPT))
            # The session is untouched: a valid round now gives what it gives on a fresh session.
            after = await stub.Verify(_valid_verify(opened.session_id))
            fresh = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))
            expected = await stub.Verify(_valid_verify(fresh.session_id))
            assert (after.accepted_len, after.next_token, after.new_base_position) == (
                expected.accepted_len,
                expected.next_token,
                expected.new_base_position,
            )

    asyncio.run(run())


@pytest.mark.parametrize(("name", "changes"), BAD_OPEN, ids=[c[0] for c in BAD_OPEN])
def test_bad_open_session_is_invalid_argument(target_engine: TargetEngine, name: str, changes: dict) -> None:
    async def run() -> None:
        async with running_verifier(target_engine, LIMITS) as (client, verifier):
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            fields = {"prompt_tokens": PROMPT, "vocab_size": 96, **changes}
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.OpenSession(pb.OpenSessionRequest(**fields))
            assert err.value.code() == INVALID, err.value.details()
            assert len(verifier.sessions) == 0

    asyncio.run(run())


def test_kv_cap_evicts_least_recent_and_refuses_what_cannot_fit(target_engine: TargetEngine) -> None:
    async def run() -> None:
        async with running_verifier(target_engine, LIMITS) as (client, verifier):
            per_token = verifier.sessions.kv_bytes_per_token
            verifier.sessions.limits = SessionLimits(max_kv_bytes=per_token * 20)
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=list(range(2, 30)), vocab_size=96))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))
            second = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))
            third = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))
            with pytest.raises(grpc.aio.AioRpcError) as err:  # evicted as least recently used
                await stub.Verify(_valid_verify(first.session_id))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            for opened in (second, third):
                reply = await stub.Verify(_valid_verify(opened.session_id))
                assert reply.new_base_position > len(PROMPT)

    asyncio.run(run())


def test_unknown_session_close_is_not_found(target_engine: TargetEngine) -> None:
    async def run() -> None:
        async with running_verifier(target_engine, LIMITS) as (client, _):
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.CloseSession(pb.CloseSessionRequest(session_id="missing"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(run())


def test_a_step_that_fails_after_the_forward_fails_alone(forward_pass_engine: TargetEngine) -> None:
    """A bug in one session's accept path, batched in one forward pass with honest sessions
    (first, in the middle, last): that session gets INTERNAL with no exception class in the
    message and its KV undone; the others' rounds equal the same rounds run alone."""
    from cloud.grpc_server import create_server
    from cloud.rejection_sampler import RejectionSampler, RoundDraft, RoundLogits
    from cloud.state import ServerState
    from cloud.verifier import Verifier

    class BrokenForOne(RejectionSampler):
        """The batched accept, failing inside for the rounds of one session."""

        verifier: Verifier
        broken = ""

        def prepare(self, r: RoundLogits, target: tuple[torch.Tensor, torch.Tensor]) -> RoundDraft:
            if self.broken and r.generator is self.verifier.sessions.get(self.broken).generator:
                raise RuntimeError("probability tensor contains inf, nan or element < 0")
            return super().prepare(r, target)

    def outcome(reply: pb.VerifyResponse) -> tuple[int, int, int]:
        return reply.accepted_len, reply.next_token, reply.new_base_position

    async def run() -> None:
        sampler, engine = BrokenForOne(), forward_pass_engine()
        engine.sampler = sampler  # the engine's accept: a forward-pass engine's own
        verifier = sampler.verifier = Verifier(engine, "tiny")
        server, port = create_server(ServerState.for_verifier(verifier), "127.0.0.1:0")
        await server.start()
        stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        try:
            ids = [
                (await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))).session_id for _ in range(4)
            ]
            served: dict[str, list[tuple[int, int, int]]] = {sid: [] for sid in ids}
            for bad in (0, 1, 3):
                sampler.broken = ids[bad]
                before = {sid: list(verifier.sessions.get(sid).tokens) for sid in ids}
                replies = await asyncio.gather(
                    *(stub.Verify(_valid_verify(sid, base_position=len(before[sid]))) for sid in ids), return_exceptions=True
                )
                for sid, reply in zip(ids, replies, strict=True):
                    stored = verifier.sessions.get(sid)
                    assert stored.cache.get_seq_length() == len(stored.tokens) - 1  # KV holds the committed prefix
                    if sid == sampler.broken:
                        assert isinstance(reply, grpc.aio.AioRpcError) and reply.code() == grpc.StatusCode.INTERNAL
                        assert "RuntimeError" not in reply.details() and "request_id" in reply.details()
                        assert stored.tokens == before[sid]
                    else:
                        assert isinstance(reply, pb.VerifyResponse), reply
                        served[sid].append(outcome(reply))
            sampler.broken = ""
            for sid in ids:  # the same rounds, alone, on a fresh session
                alone = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))
                position, replay = len(PROMPT), []
                for _ in served[sid]:
                    reply = await stub.Verify(_valid_verify(alone.session_id, base_position=position))
                    replay.append(outcome(reply))
                    position = reply.new_base_position
                assert replay == served[sid]
        finally:
            await server.stop(None)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("method", "frame"),
    [
        ("Verify", b"\x0a\x02\xff\xfe"),  # session_id with invalid UTF-8
        ("Verify", b"\x0a\x40abc"),  # truncated: a 64-byte string with 3 bytes
        ("OpenSession", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"),  # a varint that never ends
        ("Generate", b"\x0a\x05\x01"),  # truncated packed prompt
    ],
)
def test_undecodable_frames_are_invalid_argument(target_engine: TargetEngine, method: str, frame: bytes) -> None:
    async def run() -> None:
        async with running_verifier(target_engine, LIMITS) as (client, _):
            channel = grpc.aio.insecure_channel(client.target)
            path = f"/specdec.v1.Verifier/{method}"
            call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
                path, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                reply = call(frame)
                if method == "Generate":
                    async for _ in reply:
                        pass
                else:
                    await reply
            assert err.value.code() == INVALID, err.value.details()
            # The server goes on serving.
            stub = pb_grpc.VerifierStub(channel)
            opened = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))
            assert (await stub.Verify(_valid_verify(opened.session_id))).new_base_position > len(PROMPT)
            await channel.close()

    asyncio.run(run())


def test_errors_never_echo_a_long_session_id(target_engine: TargetEngine) -> None:
    async def run() -> None:
        async with running_verifier(target_engine, LIMITS) as (client, _):
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            for call in (
                stub.Verify(_valid_verify("x" * 16_000)),
                stub.CloseSession(pb.CloseSessionRequest(session_id="y" * 16_000)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                assert len(err.value.details()) < 200 and "xxxx" not in err.value.details()

    asyncio.run(run())


def test_a_full_store_never_evicts_a_session_whose_round_is_in_flight(target_engine: TargetEngine) -> None:
    """One session allowed; Verify(A) and OpenSession(B) race in the same batches. A's rounds
    never fail (its session is held while its round waits or runs); B is refused with
    RESOURCE_EXHAUSTED while A is busy, and never anyone gets UNKNOWN or INTERNAL."""
    limits = VerifierLimits(max_draft_tokens=8, sessions=SessionLimits(max_sessions=1))

    async def run() -> None:
        async with running_verifier(target_engine, limits) as (client, _):
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            codes: dict[str, int] = {}
            for _ in range(10):
                opened = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96))
                verify, other = await asyncio.gather(
                    stub.Verify(_valid_verify(opened.session_id)),
                    stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT, vocab_size=96)),
                    return_exceptions=True,
                )
                assert isinstance(verify, pb.VerifyResponse), verify
                code = other.code().name if isinstance(other, grpc.aio.AioRpcError) else "OK"
                codes[code] = codes.get(code, 0) + 1
                session_id = other.session_id if isinstance(other, pb.OpenSessionResponse) else opened.session_id
                await stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))
            assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"} and codes.get("RESOURCE_EXHAUSTED", 0) > 0, codes

    asyncio.run(run())
