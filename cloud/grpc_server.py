"""grpc.aio server: thin servicer methods that translate (shared/wire.py) and delegate to
the Verifier on one model worker thread; the standard health and reflection services beside it."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from cloud.logs import log_event
from cloud.sessions import session_tag
from cloud.state import ReadinessListener, ServerState
from cloud.verifier import Verifier
from shared import wire
from shared.errors import CapacityExceeded, PositionMismatch, SpecDecError
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

__all__ = ["VerifierServicer", "create_server", "start_server"]

T = TypeVar("T")
MAX_REQUEST_ID = 64  # the edge's ids are 16 characters; a longer one is cut before it is logged or echoed
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
log = logging.getLogger("cloud-verifier")


@dataclass
class _Call:
    """One RPC's bookkeeping: counted by status code and logged once, on the way out."""

    state: ServerState
    method: str
    request: Message
    request_id: str
    started: float = field(default_factory=time.perf_counter)
    sent: int = 0
    session: str = ""  # the reply's session id, for calls whose request has none (OpenSession)
    principal: str = ""  # the caller's API key name (--api-keys-file), set once it is authenticated

    def finish(self, code: str, detail: str = "") -> None:
        self.state.metrics.record_rpc(self.method, code, self.request.ByteSize(), self.sent)
        fields: dict[str, Any] = {
            "method": self.method,
            "code": code,
            "request_id": self.request_id,
            "ms": round((time.perf_counter() - self.started) * 1000.0, 2),
        }
        if session := getattr(self.request, "session_id", "") or self.session:
            fields["session"] = session_tag(session)
        if self.principal:
            fields["principal"] = self.principal
        if prompt := getattr(self.request, "prompt_tokens", None):
            fields["prompt_tokens"] = list(prompt) if self.state.log_prompts else len(prompt)
        if code != "OK":
            log_event(log, logging.WARNING, f"{self.method} failed: {detail}", **fields)
        else:
            log_event(log, logging.DEBUG if self.method == "Verify" else logging.INFO, self.method, **fields)


async def _abort(context: grpc.aio.ServicerContext, err: SpecDecError, request_id: str) -> None:
    if isinstance(err, PositionMismatch):
        context.set_trailing_metadata(((wire.SERVER_POSITION_KEY, str(err.server_position)),))
    elif isinstance(err, CapacityExceeded) and err.retry_after_ms > 0:
        context.set_trailing_metadata(((wire.RETRY_AFTER_MS_KEY, str(err.retry_after_ms)),))
    detail = f"{err} (request_id {request_id})" if err.status == "INTERNAL" else str(err)
    await context.abort(grpc.StatusCode[err.status], detail)


@asynccontextmanager
async def _translating(context: grpc.aio.ServicerContext, call: _Call) -> AsyncIterator[None]:
    """The one place that maps project errors to gRPC status codes, and counts every call's code.
    Every call is authenticated here first, so a refusal is counted and logged like any error."""
    try:
        call.principal = call.state.api_keys.principal(_authorization(context))
        yield
    except SpecDecError as err:
        call.finish(err.status, str(err))
        await _abort(context, err, call.request_id)
    except Exception:  # a bug: logged in full here, the caller gets a status and the request id only
        log.exception("%s failed unexpectedly (request_id=%s)", call.method, call.request_id)
        call.finish("INTERNAL", "unexpected error")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request_id {call.request_id})")
    except BaseException:  # cancelled: the client went away, its deadline passed, or the server stops
        call.finish("CANCELLED", "cancelled")
        raise
    else:
        call.finish("OK")


async def _translated(context: grpc.aio.ServicerContext, call: _Call, reply: Coroutine[Any, Any, T]) -> T:
    try:
        async with _translating(context, call):
            result = await reply
            call.sent = result.ByteSize()  # type: ignore[attr-defined]  # every reply is a protobuf message
            call.session = getattr(result, "session_id", "")
            return result
    finally:
        reply.close()  # a call refused before it ran (authentication) never started its coroutine
    raise AssertionError("unreachable: _translating re-raises or aborts")


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return str(value)
    return None


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _call(self, method: str, request: Message) -> _Call:
        # VerifyRequest carries the edge's request id; other calls (and an empty one) get a fresh id.
        request_id = getattr(request, "request_id", "")[:MAX_REQUEST_ID] or uuid.uuid4().hex[:16]
        return _Call(self.state, method, request, request_id)

    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext) -> pb.OpenSessionResponse:
        call = self._call("OpenSession", request)  # call.principal is set before work() runs

        async def work() -> pb.OpenSessionResponse:
            req = wire.open_request_from_pb(request)
            verifier, batcher = self.state.verifier_for(new_session=True)
            # The prefill is one more step for the batcher: rounds of open sessions share its
            # forward pass. Held from eviction by its id while its chunks run.
            session_id, key = verifier.sessions.new_id(), call.principal
            with verifier.sessions.holding(session_id):
                result = await batcher.submit(
                    session_id,
                    len(req.prompt_tokens),
                    lambda: verifier.begin_open(req, session_id, key),
                    _deadline(context),
                    admitting=True,
                    key=key,
                )
            return wire.open_result_to_pb(result)

        return await _translated(context, call, work())

    async def Verify(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext) -> pb.VerifyResponse:
        call = self._call("Verify", request)

        async def work() -> pb.VerifyResponse:
            req = wire.verify_request_from_pb(request)
            verifier, batcher = self.state.verifier_for(new_session=False)
            tokens = len(req.committed_tokens) + len(req.draft_tokens) + 1
            with verifier.sessions.holding(req.session_id):  # no eviction while its round waits or runs
                result = await batcher.submit(
                    req.session_id,
                    tokens,
                    lambda: verifier.begin_verify(req, call.principal),
                    _deadline(context),
                    key=call.principal,
                )
            self.state.record_round(len(req.draft_tokens), result)
            return wire.verify_result_to_pb(result)

        return await _translated(context, call, work())

    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext) -> pb.CloseSessionResponse:
        call = self._call("CloseSession", request)

        async def work() -> pb.CloseSessionResponse:
            verifier, _ = self.state.verifier_for(new_session=False)
            result = await self.state.worker.run(verifier.close_session, request.session_id, call.principal)
            return wire.close_result_to_pb(result)

        return await _translated(context, call, work())

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        call = self._call("Generate", request)
        async with _translating(context, call):
            req = wire.generate_request_from_pb(request)
            verifier, batcher = self.state.verifier_for(new_session=True)
            stream = verifier.open_generate(req, verifier.sessions.new_id(), call.principal)  # validation only
            deadline = _deadline(context)
            # Continuous batching: each token is one step, batched with other streams' steps and rounds.
            # The first step is the prompt's prefill: admitted only if it can end before the deadline.
            try:
                with verifier.sessions.holding(stream.stream_id):
                    while not stream.finished:
                        chunk = await batcher.submit(
                            stream.stream_id,
                            len(stream.feed),
                            stream.begin_step,
                            deadline,
                            admitting=stream.produced == 0,
                            key=call.principal,
                        )
                        reply = wire.generate_chunk_to_pb(chunk)
                        call.sent += reply.ByteSize()
                        yield reply
            finally:
                self.state.worker.submit(stream.close)  # its KV, however the stream ended


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The caller's deadline as a time.perf_counter() time (gRPC propagates it), or None."""
    left = context.time_remaining()
    return time.perf_counter() + left if left is not None else None


@dataclass(frozen=True)
class _Undecodable:
    """What a request that does not parse as its message type (truncated, invalid UTF-8 in a
    string field) becomes, so the call can answer INVALID_ARGUMENT rather than UNKNOWN."""

    size: int


def _lenient(message: type[Message]) -> Callable[[bytes], Message | _Undecodable]:
    def parse(data: bytes) -> Message | _Undecodable:
        try:
            return message.FromString(data)
        except DecodeError:
            return _Undecodable(len(data))

    return parse


def _refusing_undecodable(state: ServerState, method: str, behavior: Callable[..., Any], streaming: bool) -> Any:
    async def refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
        state.metrics.record_rpc(method, "INVALID_ARGUMENT", request.size, 0)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {method} message")

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        return await behavior(request, context)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        async for reply in behavior(request, context):
            yield reply

    return stream if streaming else unary


def _add_verifier(servicer: VerifierServicer, server: grpc.aio.Server) -> None:
    """The generated add_VerifierServicer_to_server, with requests parsed leniently."""
    requests: dict[str, tuple[type[Message], bool]] = {
        "OpenSession": (pb.OpenSessionRequest, False),
        "Verify": (pb.VerifyRequest, False),
        "CloseSession": (pb.CloseSessionRequest, False),
        "Generate": (pb.GenerateRequest, True),
    }
    handlers = {}
    for method, (request, streaming) in requests.items():
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        behavior = _refusing_undecodable(servicer.state, method, getattr(servicer, method), streaming)
        handlers[method] = make(
            behavior, request_deserializer=_lenient(request), response_serializer=lambda message: message.SerializeToString()
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _health_listener(health: health_aio.HealthServicer) -> ReadinessListener:
    async def update(ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):  # "" is the whole server, as probes ask by default
            await health.set(service, status)

    return update


def create_server(
    source: Verifier | ServerState,
    address: str = "127.0.0.1:0",
    reflect: bool = True,
    *,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Build (not start) a server bound to address, over TLS with `credentials` (cloud/tls.py);
    returns it with the bound port. A state whose model is not loaded yet needs `await
    state.publish()` before start (start_server does it) so the health service says
    NOT_SERVING from the first probe. Health and reflection ask no API key: probes use them."""
    state = source if isinstance(source, ServerState) else ServerState.for_verifier(source)
    server = grpc.aio.server()
    _add_verifier(VerifierServicer(state), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    state.on_readiness(_health_listener(health))
    if reflect:
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port


async def start_server(
    state: ServerState, address: str, reflect: bool = True, *, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, int]:
    server, port = create_server(state, address, reflect, credentials=credentials)
    await state.publish()
    await server.start()
    return server, port
