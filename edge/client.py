"""gRPC client of the verifier: deadlines per call, byte counts, status codes mapped back
to the project's error types."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from shared import wire
from shared.errors import ERRORS_BY_STATUS, CapacityExceeded, CloudUnavailable, PositionMismatch, SpecDecError
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from shared.protocol import (
    CloseSessionResult,
    GenerateChunk,
    GenerateRequest,
    OpenSessionRequest,
    OpenSessionResult,
    VerifyRequest,
    VerifyResult,
)

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass
class WireStats:
    bytes_up: int = 0  # serialized request payloads
    bytes_down: int = 0  # serialized response payloads


def _error_from_rpc(err: grpc.aio.AioRpcError) -> SpecDecError:
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        metadata = dict(err.trailing_metadata() or ())
        position = int(metadata.get(wire.SERVER_POSITION_KEY, -1))
        return PositionMismatch(details, position)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        metadata = dict(err.trailing_metadata() or ())
        return CapacityExceeded(f"{code.name}: {details}", int(metadata.get(wire.RETRY_AFTER_MS_KEY, 0)))
    if code in _UNREACHABLE:
        return CloudUnavailable(f"verifier unreachable ({code.name}): {details}")
    return ERRORS_BY_STATUS.get(code.name, SpecDecError)(f"{code.name}: {details}")


class VerifierClient:
    def __init__(self, target: str, verify_timeout_s: float = 30.0, open_timeout_s: float = 600.0) -> None:
        self.target = target
        self.verify_timeout_s = verify_timeout_s
        self.open_timeout_s = open_timeout_s  # prefill of a long prompt takes longer than a round
        self.stats = WireStats()
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.VerifierStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def open_session(self, req: OpenSessionRequest) -> OpenSessionResult:
        msg = wire.open_request_to_pb(req)
        reply: pb.OpenSessionResponse = await self._unary(self._stub.OpenSession, msg, self.open_timeout_s)
        return wire.open_result_from_pb(reply)

    async def verify(self, req: VerifyRequest, timeout_s: float | None = None) -> VerifyResult:
        msg = wire.verify_request_to_pb(req)
        reply: pb.VerifyResponse = await self._unary(self._stub.Verify, msg, timeout_s or self.verify_timeout_s)
        return wire.verify_result_from_pb(reply)

    async def close_session(self, session_id: str) -> CloseSessionResult:
        msg = pb.CloseSessionRequest(session_id=session_id)
        reply: pb.CloseSessionResponse = await self._unary(self._stub.CloseSession, msg, self.verify_timeout_s)
        return wire.close_result_from_pb(reply)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        msg = wire.generate_request_to_pb(req)
        self.stats.bytes_up += msg.ByteSize()
        try:
            async for chunk in self._stub.Generate(msg):
                self.stats.bytes_down += chunk.ByteSize()
                yield wire.generate_chunk_from_pb(chunk)
        except grpc.aio.AioRpcError as err:
            raise _error_from_rpc(err) from None

    async def _unary(self, method: grpc.aio.UnaryUnaryMultiCallable, msg, timeout_s: float):  # type: ignore[no-untyped-def]
        self.stats.bytes_up += msg.ByteSize()
        try:
            reply = await method(msg, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise _error_from_rpc(err) from None
        self.stats.bytes_down += reply.ByteSize()
        return reply
