"""grpc.aio server: thin servicer methods that translate (shared/wire.py) and delegate to
the Verifier on one model worker thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from cloud.verifier import Verifier
from shared import wire
from shared.errors import PositionMismatch, SpecDecError
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

T = TypeVar("T")


class ModelWorker:
    """Runs model work on one thread so rounds never interleave on a cache and the event
    loop stays free for the network."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run_timed(self, fn: Callable[[float], T]) -> T:
        """Call fn(queue_ms), where queue_ms is how long the call waited for the worker."""
        submitted = time.perf_counter()
        return await self.run(lambda: fn((time.perf_counter() - submitted) * 1000.0))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


async def _abort(context: grpc.aio.ServicerContext, err: SpecDecError) -> None:
    if isinstance(err, PositionMismatch):
        context.set_trailing_metadata(((wire.SERVER_POSITION_KEY, str(err.server_position)),))
    await context.abort(grpc.StatusCode[err.status], str(err))


async def _translated(context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
    """The one place that maps project errors to gRPC status codes."""
    try:
        return await call
    except SpecDecError as err:
        await _abort(context, err)
        raise  # unreachable: abort raises


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, verifier: Verifier, worker: ModelWorker) -> None:
        self.verifier = verifier
        self.worker = worker

    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext) -> pb.OpenSessionResponse:
        async def call() -> pb.OpenSessionResponse:
            req = wire.open_request_from_pb(request)
            return wire.open_result_to_pb(await self.worker.run(self.verifier.open_session, req))
        return await _translated(context, call())

    async def Verify(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext) -> pb.VerifyResponse:
        async def call() -> pb.VerifyResponse:
            req = wire.verify_request_from_pb(request)
            result = await self.worker.run_timed(lambda queue_ms: self.verifier.verify(req, queue_ms))
            return wire.verify_result_to_pb(result)
        return await _translated(context, call())

    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext) -> pb.CloseSessionResponse:
        async def call() -> pb.CloseSessionResponse:
            result = await self.worker.run(self.verifier.close_session, request.session_id)
            return wire.close_result_to_pb(result)
        return await _translated(context, call())

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        try:
            req = wire.generate_request_from_pb(request)
            steps = await self.worker.run(self.verifier.generate, req)
            # Each step runs on the worker, so other sessions' rounds interleave with it.
            while (chunk := await self.worker.run(next, steps, None)) is not None:
                yield wire.generate_chunk_to_pb(chunk)
        except SpecDecError as err:
            await _abort(context, err)


def create_server(verifier: Verifier, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int]:
    """Build (not start) a server bound to address; returns it with the bound port."""
    worker = ModelWorker()
    server = grpc.aio.server()
    pb_grpc.add_VerifierServicer_to_server(VerifierServicer(verifier, worker), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port
