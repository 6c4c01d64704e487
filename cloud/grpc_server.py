"""grpc.aio server: thin servicer methods that translate (shared/wire.py) and delegate to
the Verifier on one model worker thread, behind the interceptors of cloud/interceptors.py
(API keys, status codes, per-call metrics and log lines); the standard health and reflection
services beside it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from cloud.decode_stretch import SessionCalls
from cloud.interceptors import ApiKeyInterceptor, ServiceInterceptor, StatusInterceptor, Undecodable, principal
from cloud.state import ReadinessListener, ServerState
from cloud.token_feed import FeedHub
from cloud.verifier import Verifier
from shared import wire
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

__all__ = ["VerifierServicer", "create_server", "start_server"]

SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"]
SERVICE_NAME = SERVICE.full_name
ROUNDS_OF = {"VerifyRounds": "Verify"}  # a stream of requests, each answered as this unary method answers it


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._feeds: FeedHub | None = None  # the event loop's, made on the first call

    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext) -> pb.OpenSessionResponse:
        req = wire.open_request_from_pb(request)
        return wire.open_result_to_pb(await self._calls(context, new_session=True).open(req))

    async def Verify(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext) -> pb.VerifyResponse:
        req = wire.verify_request_from_pb(request)
        calls = self._calls(context, new_session=False)
        with calls.verifier.sessions.holding(req.session_id):  # no eviction while its round waits or runs
            result = await calls.verify(req)
        self.state.record_round(len(req.draft_tokens), result, calls.key)
        return wire.verify_result_to_pb(replace(result, prefer_speculation=self.state.prefers_speculation()))

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeChunk]:
        req = wire.decode_request_from_pb(request)
        async for chunk in self._calls(context, new_session=req.open is not None).decode(req):
            self.state.metrics.decode_tokens.inc(len(chunk.tokens))
            yield wire.decode_chunk_to_pb(replace(chunk, prefer_speculation=self.state.prefers_speculation()))

    def _calls(self, context: grpc.aio.ServicerContext, *, new_session: bool) -> SessionCalls:
        """The verifier as this call sees it. The key is read here: steps run on the model
        worker's thread."""
        verifier, batcher = self.state.verifier_for(new_session=new_session)
        if self._feeds is None:
            self._feeds = FeedHub(asyncio.get_running_loop())
        return SessionCalls(verifier, batcher, principal(), _deadline(context), self.state.worker, self._feeds)

    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext) -> pb.CloseSessionResponse:
        verifier, _ = self.state.verifier_for(new_session=False)
        return wire.close_result_to_pb(await self.state.worker.run(verifier.close_session, request.session_id, principal()))

    async def Describe(self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext) -> pb.DescribeResponse:
        verifier, _ = self.state.verifier_for(new_session=False)
        return wire.description_to_pb(verifier.card.describe(request.tokens_from, request.tokens_count, request.chat_template))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        req = wire.generate_request_from_pb(request)
        async for chunk in self._calls(context, new_session=True).generate(req):
            yield wire.generate_chunk_to_pb(chunk)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The caller's deadline as a time.perf_counter() time (gRPC propagates it), or None."""
    left = context.time_remaining()
    return time.perf_counter() + left if left is not None else None


def _lenient(message: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """Parses a request, or stands in for one that does not parse (StatusInterceptor refuses it)."""

    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message.FromString(data)
        except DecodeError:
            return Undecodable(len(data))

    return parse


def _add_verifier(servicer: VerifierServicer, server: grpc.aio.Server, interceptors: Sequence[ServiceInterceptor]) -> None:
    """The generated add_VerifierServicer_to_server, with requests parsed leniently and each call
    run inside the interceptors (the first is the outermost). VerifyRounds answers each request
    of its stream with the intercepted Verify: a round is checked, counted, logged and refused
    as a Verify call is, and a refusal ends its stream with Verify's status."""

    def intercepted(name: str, streaming: bool) -> Any:
        behavior = getattr(servicer, name)
        for interceptor in reversed(interceptors):
            behavior = interceptor.wrap(name, behavior, streaming=streaming)
        return behavior

    handlers = {}
    for method in SERVICE.methods:
        if method.client_streaming:
            make, behavior = grpc.stream_stream_rpc_method_handler, _each(intercepted(ROUNDS_OF[method.name], False))
        else:
            make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
            behavior = intercepted(method.name, method.server_streaming)
        handlers[method.name] = make(
            behavior,
            request_deserializer=_lenient(getattr(pb, method.input_type.name)),
            response_serializer=lambda message: message.SerializeToString(),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _each(answer: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """A stream of requests answered one by one, in order, each by `answer`."""

    async def rounds(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            yield await answer(request, context)

    return rounds


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
    # The first interceptor is the outermost: a refused key is answered and counted like any error.
    interceptors = (StatusInterceptor(state), ApiKeyInterceptor(state))
    server = grpc.aio.server()
    _add_verifier(VerifierServicer(state), server, interceptors)
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
