"""The transport alone: a message's round trip on an open `grpc.aio` bidirectional call to an echo
server in another process, each message sent after a pause, as a session's rounds are (the
edge's round waits while the engine runs, and every thread on the way goes to sleep).

A served round can cost no less than this on the machine at hand: it is the floor under a
`served_rounds` figure (on the 2-core VMs measured, waking a sleeping thread or process took
0.1–0.3 ms, and the echo alone up to 1.4 ms after a 50 ms pause: docs/vllm_overhead.md).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import grpc

from shared.errors import ConfigError

METHOD = "/specdec.bench.Echo/Echo"
START_TIMEOUT_S = 30.0


def _serve(ready: Connection) -> None:
    """The echo server's process: each message straight back, until killed."""

    async def echo(requests: Any, _: grpc.aio.ServicerContext) -> Any:
        async for message in requests:
            yield message

    async def run() -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(echo, request_deserializer=bytes, response_serializer=bytes)
        service, _, method = METHOD.lstrip("/").partition("/")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.send(port)
        await server.wait_for_termination()

    asyncio.run(run())


async def round_trip_ms(pause_s: float, messages: int = 60, size: int = 64, skip: int = 5) -> float:
    """The median round trip, in ms, of `messages` messages of `size` bytes, each sent `pause_s`
    after the last one's echo came back (the first `skip` left out)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=_serve, args=(theirs,), name="grpc-echo", daemon=True)
    server.start()
    try:
        if not ours.poll(START_TIMEOUT_S):
            raise ConfigError(f"the gRPC echo server did not start within {START_TIMEOUT_S:.0f} s")
        port = ours.recv()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(METHOD, request_serializer=bytes, response_deserializer=bytes)()
            payload, times = b"\x01" * size, []
            for _ in range(messages + skip):
                await asyncio.sleep(pause_s)
                began = time.perf_counter()
                await call.write(payload)
                await call.read()
                times.append((time.perf_counter() - began) * 1000.0)
            call.cancel()
        return statistics.median(times[skip:])
    finally:
        server.kill()
        server.join()
