"""gRPC client of the verifier: deadlines per call, the bytes of each call, status codes mapped
back to the project's error types, resends after RESOURCE_EXHAUSTED (the server's retry hint,
with jitter), an optional tap that sees every call (edge-agent --record), TLS (mTLS with a client
certificate), an API key sent with every call, and a session's routing key with each of its
calls, over one verifier or several (edge/transport/replicas.py). A session's Verify rounds go on
one stream (edge/transport/round_streams.py).

Bytes: every result the client returns carries `wire`, the serialized message sizes that call
sent and received, its resends after capacity refusals included (a Generate stream: each chunk
carries its own bytes, the first one the request's too). A failed call raises a SpecDecError
whose `wire` holds the bytes it had put on the wire, so a caller that goes on after the failure
(reopening a session, resending later) can count them. A call its caller cancels returns nothing
and counts nowhere: whether its request left the process is unknown.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from edge.transport.backoff import Backoff
from edge.transport.replicas import SESSION_KEY_HEADER, ReplicaSet, Resolver, replica_addresses, resolve_host
from edge.transport.round_streams import RoundStreams
from shared import wire
from shared.errors import (
    ERRORS_BY_STATUS,
    CapacityExceeded,
    CloudUnavailable,
    ConfigError,
    DeadlineExceeded,
    PositionMismatch,
    SessionRefused,
    SpecDecError,
    TlsHandshakeFailed,
    Unauthenticated,
)
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from shared.protocol import (
    CloseSessionResult,
    DecodeChunk,
    DecodeRequest,
    GenerateChunk,
    GenerateRequest,
    ModelDescription,
    OpenSessionRequest,
    OpenSessionResult,
    VerifyRequest,
    VerifyResult,
    WireBytes,
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


@dataclass
class CapacityStats:
    """How often the verifier turned this client's calls away for capacity, over all its calls."""

    capacity_rejections: int = 0  # RESOURCE_EXHAUSTED answers, resent or not
    capacity_wait_s: float = 0.0  # time spent waiting to resend them


@dataclass(frozen=True)
class CapacityRetry:
    """How a call answered RESOURCE_EXHAUSTED is resent: after the server's retry hint, or
    without one after an exponential backoff, never past the call's own deadline."""

    max_retries: int = 6  # 0: raise CapacityExceeded at once
    backoff_s: float = 0.05  # first wait without a hint; doubled per retry
    max_backoff_s: float = 2.0

    def backoff(self) -> Backoff:
        """The waits of one call. Never earlier than the hint (jitter from x1)."""
        return Backoff(self.backoff_s, self.max_backoff_s, jitter=(1.0, 1.5))


@dataclass
class _CallBytes:
    """What one call has put on the wire so far (resends included), and how many of its sends
    the verifier refused for capacity."""

    up: int = 0
    down: int = 0
    rejections: int = 0

    def wire(self) -> WireBytes:
        return WireBytes(self.up, self.down)

    def failed(self, error: SpecDecError) -> SpecDecError:
        """`error`, carrying this call's bytes."""
        error.wire = self.wire()
        return error


@dataclass(frozen=True)
class _StreamChunk:
    """One message of a server stream, the bytes not reported before it, and the replica."""

    message: Any
    wire: WireBytes
    address: str


Req = TypeVar("Req")
Res = TypeVar("Res")


@dataclass(frozen=True)
class TappedCall(Generic[Req, Res]):
    """One finished call as a tap sees it: the request, its result or the error that ended it
    (after any resends), and when it was sent and answered (time.perf_counter())."""

    request: Req
    result: Res | None
    error: SpecDecError | None
    sent: float
    replied: float
    resends: int = 0  # capacity refusals resent (Verify)
    first: float | None = None  # when the first chunk came (Generate)


class CallTap(Protocol):
    """Sees each finished call. Used to record sessions (edge/trace_recorder.py)."""

    def opened(self, call: TappedCall[OpenSessionRequest, OpenSessionResult]) -> None: ...

    def verified(self, call: TappedCall[VerifyRequest, VerifyResult]) -> None: ...

    def generated(self, call: TappedCall[GenerateRequest, list[int]]) -> None: ...


def _error_from_rpc(err: grpc.aio.AioRpcError) -> SpecDecError:
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        metadata = dict(err.trailing_metadata() or ())
        if wire.SERVER_POSITION_KEY not in metadata:  # not a position: the session as asked
            return SessionRefused(f"the verifier refused the session: {details}")
        return PositionMismatch(details, int(metadata[wire.SERVER_POSITION_KEY]))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityExceeded(f"{code.name}: {details}", _retry_hint_ms(dict(err.trailing_metadata() or ())))
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


def _retry_hint_ms(metadata: dict[str, str | bytes]) -> int:
    """The server's retry hint: the project's trailer or gRPC's pushback (the same number;
    a negative pushback, gRPC's "do not retry", reads as no hint)."""
    for key in (wire.RETRY_AFTER_MS_KEY, wire.RETRY_PUSHBACK_MS_KEY):
        try:
            return max(int(metadata[key]), 0)
        except (KeyError, ValueError):
            continue
    return 0


class VerifierClient:
    """Calls to one verifier, or to several (`target` "a:1,b:2"): then each session's calls go to
    the replica its key ranks first (rendezvous hashing) and, once that one is unreachable, to the
    next. One channel per address, shared by every generation that uses the client; `tap`, when
    set, sees each call (with_tap gives a generation its own); `caller` names whose reuse tokens
    it sends (for_caller gives each caller of edge-agent serve its own)."""

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
        tap: CallTap | None = None,
        round_streams: bool = True,
    ) -> None:
        self.target = target
        self.verify_timeout_s = verify_timeout_s
        self.open_timeout_s = open_timeout_s  # prefill of a long prompt takes longer than a round
        self.capacity_retry = capacity_retry or CapacityRetry()
        self.stats = CapacityStats()
        self.tap = tap
        # Per-call metadata rather than call credentials: those need a TLS channel, and a
        # plaintext verifier on loopback (or behind --insecure) may ask for a key too.
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        replicas = replica_addresses(target, resolve)  # a name resolving to several: one replica each
        self.replicas = ReplicaSet(list(replicas))
        self._channels = {address: _channel(address, tls, name) for address, name in replicas.items()}
        self._stubs = {address: pb_grpc.VerifierStub(channel) for address, channel in self._channels.items()}
        # Each verifier gives this client a token with its first session; sent with the next
        # ones, the KV of the client's closed sessions serves them (and no other client's ever
        # does). One per replica: each verifier signs its own. And one per caller (caller,
        # address): the callers of one served endpoint are different clients to the verifier,
        # else one's prefill time would tell whether another sent the same prompt.
        self.caller = ""
        self._reuse_tokens: dict[tuple[str, str], str] = {}
        # Each session's rounds on one VerifyRounds call (edge/transport/round_streams.py); None:
        # a unary Verify call each round.
        self._rounds = RoundStreams() if round_streams else None

    def with_tap(self, tap: CallTap) -> VerifierClient:
        """This client with `tap` seeing each call made through it (one generation's calls, for
        edge-agent --record): the same channels, replicas and counters. Close the client it came
        from, not this one."""
        tapped = copy.copy(self)
        tapped.tap = tap
        return tapped

    def for_caller(self, name: str) -> VerifierClient:
        """This client for one caller of edge-agent serve (its API key's name): the same channels,
        replicas and counters, and the reuse tokens of that caller alone. Close the client it
        came from, not this one."""
        view = copy.copy(self)
        view.caller = name
        return view

    async def close(self) -> None:
        if self._rounds:
            self._rounds.close_all()
        for channel in self._channels.values():
            await channel.close()

    def _call_metadata(self, session_key: str | None) -> tuple[tuple[str, str], ...] | None:
        metadata = self._metadata + (((SESSION_KEY_HEADER, session_key),) if session_key else ())
        return metadata or None

    async def open_session(self, req: OpenSessionRequest, session_key: str | None = None) -> OpenSessionResult:
        msg, call = wire.open_request_to_pb(req), _CallBytes()
        sent = time.perf_counter()
        try:
            reply: pb.OpenSessionResponse = await self._unary(
                lambda stub: stub.OpenSession, msg, call, timeout_s=self.open_timeout_s, session_key=session_key, opening=True
            )
        except SpecDecError as err:
            if self.tap:
                self.tap.opened(TappedCall(req, None, err, sent, time.perf_counter()))
            raise
        result = replace(wire.open_result_from_pb(reply), wire=call.wire())
        if self.tap:
            self.tap.opened(TappedCall(req, result, None, sent, time.perf_counter()))
        return result

    async def verify(self, req: VerifyRequest, timeout_s: float | None = None, session_key: str | None = None) -> VerifyResult:
        msg, call = wire.verify_request_to_pb(req), _CallBytes()
        sent = time.perf_counter()
        try:
            reply: pb.VerifyResponse = await self._unary(
                self._rounds.sender if self._rounds else lambda stub: stub.Verify,
                msg,
                call,
                timeout_s=timeout_s or self.verify_timeout_s,
                session_key=session_key,
            )
        except SpecDecError as err:
            if self.tap:
                self.tap.verified(TappedCall(req, None, err, sent, time.perf_counter(), call.rejections))
            raise
        result = replace(wire.verify_result_from_pb(reply), wire=call.wire())
        if self.tap:
            self.tap.verified(TappedCall(req, result, None, sent, time.perf_counter(), call.rejections))
        return result

    async def close_session(self, session_id: str, session_key: str | None = None) -> CloseSessionResult:
        msg, call = pb.CloseSessionRequest(session_id=session_id), _CallBytes()
        if self._rounds:
            self._rounds.close(session_id)
        try:
            reply: pb.CloseSessionResponse = await self._unary(
                lambda stub: stub.CloseSession, msg, call, timeout_s=self.verify_timeout_s, session_key=session_key
            )
        finally:
            self.replicas.closed(session_key)
        return replace(wire.close_result_from_pb(reply), wire=call.wire())

    async def describe(self, tokens_from: int = 0, tokens_count: int = 0, chat_template: bool = False) -> ModelDescription | None:
        """The verifier's model description (and the tokens or chat template asked for); None
        from a verifier too old to have Describe."""
        msg = pb.DescribeRequest(tokens_from=tokens_from, tokens_count=tokens_count, chat_template=chat_template)
        try:
            reply: pb.DescribeResponse = await self._unary(
                lambda stub: stub.Describe, msg, _CallBytes(), timeout_s=self.open_timeout_s, session_key=None
            )
        except SpecDecError as err:
            if str(err).startswith("UNIMPLEMENTED"):
                return None
            raise
        return wire.description_from_pb(reply)

    async def generate(self, req: GenerateRequest, session_key: str | None = None) -> AsyncIterator[GenerateChunk]:
        """Not resent on RESOURCE_EXHAUSTED: a stream may have yielded tokens already. Each
        chunk carries the bytes not yet reported: its own, and the request's on the first."""
        msg = wire.generate_request_to_pb(req)
        sent, first, tokens = time.perf_counter(), None, list[int]()
        error: SpecDecError | None = None
        try:
            async with aclosing(self._stream(lambda stub: stub.Generate, msg, session_key, opening=False)) as chunks:
                async for chunk in chunks:
                    first = first or time.perf_counter()
                    tokens += chunk.message.tokens
                    yield replace(wire.generate_chunk_from_pb(chunk.message), wire=chunk.wire)
        except SpecDecError as err:
            error = err
            raise
        finally:
            if self.tap:
                self.tap.generated(TappedCall(req, tokens, error, sent, time.perf_counter(), first=first))

    async def decode(self, req: DecodeRequest, session_key: str | None = None) -> AsyncIterator[DecodeChunk]:
        """A Decode stretch on the session's replica (a new one when the call opens its session),
        chunk by chunk; not resent, as a stream may have yielded tokens already. Each chunk
        carries the bytes not yet reported. Its deadline is the open timeout when it opens a
        session, else the call timeout per token."""
        msg = wire.decode_request_to_pb(req)
        opening = req.open is not None
        timeout_s = self.open_timeout_s if opening else self.verify_timeout_s * max(req.max_tokens, 1)
        stream = self._stream(lambda stub: stub.Decode, msg, session_key, opening=opening, timeout_s=timeout_s)
        async with aclosing(stream) as chunks:
            async for chunk in chunks:
                if chunk.message.HasField("opened"):
                    self.replicas.opened(session_key, chunk.address)
                yield replace(wire.decode_chunk_from_pb(chunk.message), wire=chunk.wire)

    async def _stream(
        self,
        method: Callable[[pb_grpc.VerifierStub], grpc.aio.UnaryStreamMultiCallable],
        msg,  # type: ignore[no-untyped-def]
        session_key: str | None,
        *,
        opening: bool,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[_StreamChunk, None]:
        """A server stream from the session's replica, each message with the bytes not yet
        reported (the request's on the first); a failure raises the project's error carrying
        the bytes since the last message, and marks an unreachable replica down."""
        address = self.replicas.pick(session_key, opening)
        _send_reuse_token(msg, self._reuse_tokens.get((self.caller, address), ""))
        unreported = _CallBytes(up=msg.ByteSize())
        stream = method(self._stubs[address])(msg, timeout=timeout_s, metadata=self._call_metadata(session_key))
        try:
            async for message in stream:
                self._keep_reuse_token(address, message)
                unreported.down += message.ByteSize()
                reported, unreported = unreported.wire(), _CallBytes()
                yield _StreamChunk(message, reported, address)
        except grpc.aio.AioRpcError as err:
            error = unreported.failed(_error_from_rpc(err))
            if error.status == "RESOURCE_EXHAUSTED":
                self.stats.capacity_rejections += 1
            if isinstance(error, CloudUnavailable):
                self.replicas.mark_down(address)
            raise error from None
        finally:
            stream.cancel()  # a reader that stops early ends the call: the server stops making its tokens

    async def _unary(
        self,
        method: Callable[[pb_grpc.VerifierStub], Callable[..., Awaitable[Any]]],  # a stub's method, or what sends a round
        msg,  # type: ignore[no-untyped-def]
        call: _CallBytes,
        *,
        timeout_s: float,
        session_key: str | None,
        opening: bool = False,
    ):
        """One call to the session's replica, its bytes counted into `call`; a RESOURCE_EXHAUSTED
        answer is resent per capacity_retry, all within timeout_s; an unreachable replica is
        skipped for a while. A raised error carries the call's bytes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        policy, backoff = self.capacity_retry, self.capacity_retry.backoff()
        for retry in range(policy.max_retries + 1):
            address = self.replicas.pick(session_key, opening)
            _send_reuse_token(msg, self._reuse_tokens.get((self.caller, address), ""))
            call.up += msg.ByteSize()
            try:
                reply = await method(self._stubs[address])(
                    msg, timeout=max(deadline - loop.time(), 0.001), metadata=self._call_metadata(session_key)
                )
            except (grpc.aio.AioRpcError, SpecDecError) as err:  # a round on its stream raises the latter
                error = _error_from_rpc(err) if isinstance(err, grpc.aio.AioRpcError) else err
                if isinstance(error, CloudUnavailable):
                    self.replicas.mark_down(address)
                    # A new session: straight to the next replica (one alone is the caller's to retry).
                    if opening and len(self.replicas.addresses) > 1 and self.replicas.any_up():
                        left = max(deadline - loop.time(), 0.001)
                        return await self._unary(method, msg, call, timeout_s=left, session_key=session_key, opening=opening)
                if not isinstance(error, CapacityExceeded):
                    raise call.failed(error) from None
                self.stats.capacity_rejections += 1
                call.rejections += 1
                wait = backoff.next_delay_s(error.retry_after_ms / 1000.0)
                if retry == policy.max_retries or loop.time() + wait >= deadline:
                    raise call.failed(error) from None
                self.stats.capacity_wait_s += wait
                await backoff.sleep(wait)
                continue
            call.down += reply.ByteSize()
            if opening:
                self.replicas.opened(session_key, address)
            self._keep_reuse_token(address, reply)
            return reply
        raise AssertionError("unreachable: the last retry returns or raises")

    def _keep_reuse_token(self, address: str, reply: Message) -> None:
        """The token a verifier gave with a session it opened (OpenSession, Decode, Generate)."""
        if isinstance(reply, pb.DecodeChunk):
            token = reply.opened.reuse_token if reply.HasField("opened") else ""
        else:
            token = getattr(reply, "reuse_token", "")
        if token:
            self._reuse_tokens[self.caller, address] = token


def _send_reuse_token(msg: Message, token: str) -> None:
    """A request that opens a session carries the client's token for that verifier."""
    if isinstance(msg, pb.OpenSessionRequest | pb.GenerateRequest):
        msg.reuse_token = token
    elif isinstance(msg, pb.DecodeRequest) and msg.HasField("open"):
        msg.open.reuse_token = token


def _channel(address: str, tls: ClientTls | None, dns_name: str | None = None) -> grpc.aio.Channel:
    """dns_name: the name `address` was resolved from, which its certificate carries."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
    server_name = tls.server_name or dns_name
    name = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.aio.secure_channel(address, tls.credentials(), options=_CHANNEL_OPTIONS + name)
