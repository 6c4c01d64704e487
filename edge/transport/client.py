"""gRPC client of the verifier: deadlines per call, byte counts, status codes mapped back
to the project's error types, resends after RESOURCE_EXHAUSTED (the server's retry hint, with
jitter), an optional tap that sees every call (edge-agent --record), TLS (mTLS with a client
certificate), an API key sent with every call, and a session's routing key with each of its
calls, over one verifier or several (edge/transport/replicas.py)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

from edge.transport.replicas import SESSION_KEY_HEADER, ReplicaSet, Resolver, replica_addresses, resolve_host
from shared import wire
from shared.errors import (
    ERRORS_BY_STATUS,
    CapacityExceeded,
    CloudUnavailable,
    ConfigError,
    DeadlineExceeded,
    PositionMismatch,
    SpecDecError,
    TlsHandshakeFailed,
    Unauthenticated,
)
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

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# grpc's default reconnect backoff grows to 120 s: an edge would sit idle up to two minutes
# after a restarted verifier is back. Retry the connection within 0.1 to 2 s instead.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class ClientTls:
    """TLS of the channel to the verifier: the CAs to trust (None: the system's), and a client
    certificate and key for a verifier that requires one (mTLS). PEM bytes."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None  # the name to verify the server's certificate against, if not the target's host

    @classmethod
    def from_files(
        cls, ca: str | None = None, cert: str | None = None, key: str | None = None, server_name: str | None = None
    ) -> ClientTls:
        return cls(_read_pem(ca, "--tls-ca"), _read_pem(cert, "--tls-cert"), _read_pem(key, "--tls-key"), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def _read_pem(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{flag} {path}: {err.strerror or err}") from None


@dataclass(frozen=True)
class Traffic:
    """Serialized payload bytes sent and received; the difference of two readings is what
    passed between them."""

    up: int = 0
    down: int = 0

    def __sub__(self, earlier: Traffic) -> Traffic:
        return Traffic(self.up - earlier.up, self.down - earlier.down)


@dataclass
class WireStats:
    bytes_up: int = 0  # serialized request payloads
    bytes_down: int = 0  # serialized response payloads
    capacity_rejections: int = 0  # RESOURCE_EXHAUSTED answers, resent or not
    capacity_wait_s: float = 0.0  # time spent waiting to resend them

    def traffic(self) -> Traffic:
        return Traffic(self.bytes_up, self.bytes_down)


@dataclass(frozen=True)
class CapacityRetry:
    """How a call answered RESOURCE_EXHAUSTED is resent: after the server's retry hint, or
    without one after an exponential backoff, never past the call's own deadline."""

    max_retries: int = 6  # 0: raise CapacityExceeded at once
    backoff_s: float = 0.05  # first wait without a hint; doubled per retry
    max_backoff_s: float = 2.0

    def delay_s(self, retry: int, hint_ms: int) -> float:
        wait = max(hint_ms / 1000.0, min(self.backoff_s * 2**retry, self.max_backoff_s))
        # Never earlier than the hint; the spread keeps edges rejected together from all
        # coming back in the same instant.
        return wait * random.uniform(1.0, 1.5)


class CallTap(Protocol):
    """Sees each finished call with its send and reply times (time.perf_counter()); `error` is
    set when the call failed, after any resends. Used to record sessions."""

    def opened(
        self, req: OpenSessionRequest, result: OpenSessionResult | None, error: SpecDecError | None, sent: float, replied: float
    ) -> None: ...

    def verified(
        self,
        req: VerifyRequest,
        result: VerifyResult | None,
        error: SpecDecError | None,
        sent: float,
        replied: float,
        resends: int,
    ) -> None: ...

    def generated(
        self,
        req: GenerateRequest,
        tokens: list[int],
        error: SpecDecError | None,
        sent: float,
        first: float | None,
        replied: float,
    ) -> None: ...


def _error_from_rpc(err: grpc.aio.AioRpcError) -> SpecDecError:
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        metadata = dict(err.trailing_metadata() or ())
        position = int(metadata.get(wire.SERVER_POSITION_KEY, -1))
        return PositionMismatch(details, position)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        metadata = dict(err.trailing_metadata() or ())
        return CapacityExceeded(f"{code.name}: {details}", int(metadata.get(wire.RETRY_AFTER_MS_KEY, 0)))
    if code == grpc.StatusCode.UNAUTHENTICATED:  # not recoverable: the edge stops, saying why
        return Unauthenticated(
            f"the verifier refused the call ({code.name}): {details}; give its API key with --api-key or SPECDEC_EDGE_API_KEY"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"the verifier did not answer within the call's deadline ({code.name}): {details}")
    if code in _UNREACHABLE and "handshake failed" in details.lower():
        return TlsHandshakeFailed(f"TLS with the verifier failed (check --tls-ca, --tls-server-name): {details}")
    if code in _UNREACHABLE:
        return CloudUnavailable(f"verifier unreachable ({code.name}): {details}")
    return ERRORS_BY_STATUS.get(code.name, SpecDecError)(f"{code.name}: {details}")


class VerifierClient:
    """Calls to one verifier, or to several (`target` "a:1,b:2"): then each session's calls go to
    the replica its key ranks first (rendezvous hashing) and, once that one is unreachable, to the
    next. One channel per address."""

    def __init__(
        self,
        target: str,
        verify_timeout_s: float = 30.0,
        open_timeout_s: float = 600.0,
        capacity_retry: CapacityRetry | None = None,
        *,
        tls: ClientTls | None = None,
        api_key: str | None = None,
        resolve: Resolver = resolve_host,
    ) -> None:
        self.target = target
        self.verify_timeout_s = verify_timeout_s
        self.open_timeout_s = open_timeout_s  # prefill of a long prompt takes longer than a round
        self.capacity_retry = capacity_retry or CapacityRetry()
        self.stats = WireStats()
        self.tap: CallTap | None = None
        # Per-call metadata rather than call credentials: those need a TLS channel, and a
        # plaintext verifier on loopback (or behind --insecure) may ask for a key too.
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        replicas = replica_addresses(target, resolve)  # a name resolving to several: one replica each
        self.replicas = ReplicaSet(list(replicas))
        self._channels = {address: _channel(address, tls, name) for address, name in replicas.items()}
        self._stubs = {address: pb_grpc.VerifierStub(channel) for address, channel in self._channels.items()}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    def _call_metadata(self, session_key: str | None) -> tuple[tuple[str, str], ...] | None:
        metadata = self._metadata + (((SESSION_KEY_HEADER, session_key),) if session_key else ())
        return metadata or None

    async def open_session(self, req: OpenSessionRequest, session_key: str | None = None) -> OpenSessionResult:
        msg = wire.open_request_to_pb(req)
        sent = time.perf_counter()
        try:
            reply: pb.OpenSessionResponse = await self._unary(
                lambda stub: stub.OpenSession, msg, self.open_timeout_s, session_key, opening=True
            )
        except SpecDecError as err:
            if self.tap:
                self.tap.opened(req, None, err, sent, time.perf_counter())
            raise
        result = wire.open_result_from_pb(reply)
        if self.tap:
            self.tap.opened(req, result, None, sent, time.perf_counter())
        return result

    async def verify(self, req: VerifyRequest, timeout_s: float | None = None, session_key: str | None = None) -> VerifyResult:
        msg = wire.verify_request_to_pb(req)
        sent, rejections = time.perf_counter(), self.stats.capacity_rejections
        try:
            reply: pb.VerifyResponse = await self._unary(
                lambda stub: stub.Verify, msg, timeout_s or self.verify_timeout_s, session_key
            )
        except SpecDecError as err:
            if self.tap:
                self.tap.verified(req, None, err, sent, time.perf_counter(), self.stats.capacity_rejections - rejections)
            raise
        result = wire.verify_result_from_pb(reply)
        if self.tap:
            self.tap.verified(req, result, None, sent, time.perf_counter(), self.stats.capacity_rejections - rejections)
        return result

    async def close_session(self, session_id: str, session_key: str | None = None) -> CloseSessionResult:
        msg = pb.CloseSessionRequest(session_id=session_id)
        try:
            reply: pb.CloseSessionResponse = await self._unary(
                lambda stub: stub.CloseSession, msg, self.verify_timeout_s, session_key
            )
        finally:
            self.replicas.closed(session_key)
        return wire.close_result_from_pb(reply)

    async def generate(self, req: GenerateRequest, session_key: str | None = None) -> AsyncIterator[GenerateChunk]:
        """Not resent on RESOURCE_EXHAUSTED: a stream may have yielded tokens already."""
        msg = wire.generate_request_to_pb(req)
        self.stats.bytes_up += msg.ByteSize()
        sent, first, tokens = time.perf_counter(), None, list[int]()
        error: SpecDecError | None = None
        address = self.replicas.pick(session_key)
        try:
            async for chunk in self._stubs[address].Generate(msg, metadata=self._call_metadata(session_key)):
                self.stats.bytes_down += chunk.ByteSize()
                first = first or time.perf_counter()
                tokens += chunk.tokens
                yield wire.generate_chunk_from_pb(chunk)
        except grpc.aio.AioRpcError as err:
            error = _error_from_rpc(err)
            if error.status == "RESOURCE_EXHAUSTED":
                self.stats.capacity_rejections += 1
            if isinstance(error, CloudUnavailable):
                self.replicas.mark_down(address)
            raise error from None
        finally:
            if self.tap:
                self.tap.generated(req, tokens, error, sent, first, time.perf_counter())

    async def _unary(
        self,
        method: Callable[[pb_grpc.VerifierStub], grpc.aio.UnaryUnaryMultiCallable],
        msg,  # type: ignore[no-untyped-def]
        timeout_s: float,
        session_key: str | None,
        opening: bool = False,
    ):
        """One call to the session's replica; a RESOURCE_EXHAUSTED answer is resent per
        capacity_retry, all within timeout_s; an unreachable replica is skipped for a while."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        policy = self.capacity_retry
        for retry in range(policy.max_retries + 1):
            self.stats.bytes_up += msg.ByteSize()
            address = self.replicas.pick(session_key, opening)
            try:
                reply = await method(self._stubs[address])(
                    msg, timeout=max(deadline - loop.time(), 0.001), metadata=self._call_metadata(session_key)
                )
            except grpc.aio.AioRpcError as err:
                error = _error_from_rpc(err)
                if isinstance(error, CloudUnavailable):
                    self.replicas.mark_down(address)
                    # A new session: straight to the next replica (one alone is the caller's to retry).
                    if opening and len(self.replicas.addresses) > 1 and self.replicas.any_up():
                        return await self._unary(method, msg, max(deadline - loop.time(), 0.001), session_key, opening)
                if not isinstance(error, CapacityExceeded):
                    raise error from None
                self.stats.capacity_rejections += 1
                wait = policy.delay_s(retry, error.retry_after_ms)
                if retry == policy.max_retries or loop.time() + wait >= deadline:
                    raise error from None
                self.stats.capacity_wait_s += wait
                await asyncio.sleep(wait)
                continue
            self.stats.bytes_down += reply.ByteSize()
            if opening:
                self.replicas.opened(session_key, address)
            return reply
        raise AssertionError("unreachable: the last retry returns or raises")


def _channel(address: str, tls: ClientTls | None, dns_name: str | None = None) -> grpc.aio.Channel:
    """dns_name: the name `address` was resolved from, which its certificate carries."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
    server_name = tls.server_name or dns_name
    name = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.aio.secure_channel(address, tls.credentials(), options=_CHANNEL_OPTIONS + name)
