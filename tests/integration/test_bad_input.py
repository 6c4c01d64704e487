"""Every bad request gets its own status code and leaves the session as it was."""

import asyncio
import math

import grpc
import pytest

from cloud.sessions import SessionLimits
from cloud.verifier import VerifierLimits
from shared import wire
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from tests.harness import random_prompt, running_verifier

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
]

LIMITS = VerifierLimits(max_draft_tokens=8)


def _valid_verify(sid: str, **changes: object) -> pb.VerifyRequest:
    fields: dict[str, object] = {"session_id": sid, "base_position": len(PROMPT),
                                 "draft_tokens": [5, 6, 7], "draft_probs": [0.5, 0.5, 0.5]}
    fields.update(changes)
    return pb.VerifyRequest(**fields)  # type: ignore[arg-type]



@pytest.mark.parametrize(("name", "changes", "code"), BAD_VERIFY, ids=[c[0] for c in BAD_VERIFY])
def test_bad_verify_gets_its_status_and_session_survives(target_model, name: str, changes: dict, code) -> None:
    async def run() -> None:
        async with running_verifier(target_model, LIMITS) as (client, _):
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
                expected.accepted_len, expected.next_token, expected.new_base_position)

    asyncio.run(run())


@pytest.mark.parametrize(("name", "changes"), BAD_OPEN, ids=[c[0] for c in BAD_OPEN])
def test_bad_open_session_is_invalid_argument(target_model, name: str, changes: dict) -> None:
    async def run() -> None:
        async with running_verifier(target_model, LIMITS) as (client, verifier):
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            fields = {"prompt_tokens": PROMPT, "vocab_size": 96, **changes}
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.OpenSession(pb.OpenSessionRequest(**fields))
            assert err.value.code() == INVALID, err.value.details()
            assert len(verifier.sessions) == 0

    asyncio.run(run())


def test_kv_cap_evicts_least_recent_and_refuses_what_cannot_fit(target_model) -> None:
    async def run() -> None:
        async with running_verifier(target_model, LIMITS) as (client, verifier):
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


def test_unknown_session_close_is_not_found(target_model) -> None:
    async def run() -> None:
        async with running_verifier(target_model, LIMITS) as (client, _):
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.CloseSession(pb.CloseSessionRequest(session_id="missing"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(run())
