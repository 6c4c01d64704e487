"""uvicorn inside an event loop it does not own, for cloud-verifier's HTTP side and for
edge-agent serve. Imported only where an HTTP app is served: an edge-only install has no uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from shared.net import bind_tcp


class _EmbeddedServer(uvicorn.Server):
    """Signals stay with the program that embeds it (serve() would install its own handlers
    and re-raise the signal when it stops)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_http(app: Any, host: str, port: int, grace_s: int = 2, **options: Any) -> HttpServer:
    """Serve app on host:port (0 = any free port) in this event loop; returns once it listens.
    `options` go to uvicorn.Config (the TLS files); open requests get `grace_s` at stop."""
    sock = bind_tcp(host, port, "HTTP")
    config = uvicorn.Config(
        app, lifespan="off", access_log=False, log_config=None, log_level="warning", timeout_graceful_shutdown=grace_s, **options
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise OSError(f"HTTP server on {host}:{port} did not start")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1])


def stop_signal() -> asyncio.Task[bool]:
    """A task that ends on SIGINT or SIGTERM (the handlers stay installed)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return asyncio.create_task(stop.wait())
