"""Wire contract: generated code is current, masks pack bit-exactly, messages round-trip."""

from pathlib import Path

import pytest

from shared import wire
from shared.errors import InvalidRequest
from shared.pb import verifier_pb2 as pb
from shared.protocol import AcceptMode, SamplingParams, SessionConfig, SparseDistribution, VerifyRequest
from tools import protogen


def test_generated_code_is_current() -> None:
    for name, text in protogen.generate().items():
        checked_in = (protogen.OUT_DIR / name).read_text()
        assert checked_in == text, f"shared/pb/{name} is stale: run `make proto`"


def test_proto_file_is_where_the_contract_says() -> None:
    assert (Path(protogen.PROTO_ROOT) / "specdec/v1/verifier.proto").is_file()


@pytest.mark.parametrize("bits", [[], [True], [False] * 8, [True, False, True] * 5, [False] * 9 + [True]])
def test_mask_round_trip(bits: list[bool]) -> None:
    packed = wire.pack_mask(bits)
    assert len(packed) == (len(bits) + 7) // 8
    assert wire.unpack_mask(packed, len(bits)) == bits


def test_mask_is_lsb_first() -> None:
    assert wire.pack_mask([True, False, False, True]) == bytes([0b1001])
    assert wire.pack_mask([False] * 8 + [True]) == bytes([0, 1])


def test_verify_request_round_trip() -> None:
    req = VerifyRequest(
        "s",
        12,
        [5, 6],
        [0.5, 0.25],
        committed_tokens=[3],
        hard_mask=[False, True],
        sparse_draft=[SparseDistribution([5, 9], [0.5, 0.5]), SparseDistribution([6], [1.0])],
        want_top_k=4,
        request_id="r1",
    )
    assert wire.verify_request_from_pb(wire.verify_request_to_pb(req)) == req


def test_wrong_mask_length_is_invalid() -> None:
    msg = pb.VerifyRequest(draft_tokens=[1, 2, 3], hard_mask=b"\x00\x00")
    with pytest.raises(InvalidRequest):
        wire.verify_request_from_pb(msg)


def test_session_config_defaults_and_modes() -> None:
    greedy = wire.config_from_pb(pb.SamplingConfig(), 7, pb.ACCEPT_MODE_SPARSE, 0)
    assert greedy == SessionConfig(SamplingParams(), 7, AcceptMode.GREEDY, 0)
    sampled = wire.config_from_pb(pb.SamplingConfig(temperature=0.8), 1, pb.ACCEPT_MODE_UNSPECIFIED, 50)
    assert sampled.accept_mode is AcceptMode.POINT and sampled.sampling.top_p == 1.0
