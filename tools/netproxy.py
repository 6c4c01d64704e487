"""A loopback TCP proxy that injects network faults between edge and cloud: one-way delay
(RTT / 2 each way), a bandwidth cap, stalls and dropped connections. Used by the tests and the
benchmarks, so the product never sleeps to fake a slow link."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.cli import add_settings_flags, settings_from_args


@dataclass
class LinkConditions:
    rtt_ms: float = 0.0  # added round-trip time, split evenly between the two directions
    bandwidth_bytes_per_s: float = 0.0  # 0 = unlimited
    stalled: bool = False  # hold all traffic (a verifier that stops answering)


class FaultProxy:
    """Forward 127.0.0.1:<port> to `target`. Conditions may change while it runs."""

    def __init__(self, target_host: str, target_port: int, conditions: LinkConditions | None = None) -> None:
        self.target = (target_host, target_port)
        self.conditions = conditions or LinkConditions()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stall(self) -> None:
        self.conditions.stalled = True
        self._resumed.clear()

    def resume(self) -> None:
        self.conditions.stalled = False
        self._resumed.set()

    def drop_connections(self) -> None:
        """Close every open connection (the client sees the link break)."""
        for writer in list(self._writers):
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_connections()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        self._writers.update((client_writer, server_writer))
        for reader, writer in ((client_reader, server_writer), (server_reader, client_writer)):
            task = asyncio.create_task(self._pump(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks, release each one way-delay after it arrived, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer))
        try:
            while data := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.conditions.rtt_ms / 2000.0, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(Exception):
                await sender

    async def _send(self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                await self._resumed.wait()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
                if self.conditions.bandwidth_bytes_per_s > 0:
                    await asyncio.sleep(len(data) / self.conditions.bandwidth_bytes_per_s)
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


async def _serve(target: str, rtt_ms: float, bandwidth: float) -> None:
    host, port = target.rsplit(":", 1)
    proxy = FaultProxy(host, int(port), LinkConditions(rtt_ms=rtt_ms, bandwidth_bytes_per_s=bandwidth))
    await proxy.start()
    sys.stderr.write(f"netproxy listening on {proxy.address} -> {target} (rtt +{rtt_ms:g} ms)\n")
    sys.stderr.flush()
    await asyncio.Event().wait()


class NetproxySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_NETPROXY_")

    target: str = Field(description="HOST:PORT to forward to")
    rtt_ms: float = Field(0.0, ge=0, description="added round-trip time")
    bandwidth_bytes_per_s: float = Field(0.0, ge=0, description="link cap (0 = unlimited)")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "forwarding": ("target",),
        "the link": ("rtt_ms", "bandwidth_bytes_per_s"),
    }


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(prog="python -m tools.netproxy", description="loopback TCP proxy with added RTT")
    add_settings_flags(made, NetproxySettings)
    return made


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.netproxy --target HOST:PORT --rtt-ms 50`: run until killed."""
    args = settings_from_args(NetproxySettings, parser().parse_args(argv))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.target, args.rtt_ms, args.bandwidth_bytes_per_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
