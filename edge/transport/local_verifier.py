"""A verifier for an edge started without --cloud: `cloud-verifier` as a child process on a
loopback port, stopped when the edge exits. The edge never imports the cloud's code, so an
edge-only install stays small; this needs the cloud part installed beside it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence

from shared.errors import ConfigError

log = logging.getLogger("edge-agent")
_READY = re.compile(r"serving .* on (\S+:\d+)")


@contextlib.asynccontextmanager
async def local_verifier(flags: Sequence[str], ready_timeout_s: float = 900.0) -> AsyncIterator[str]:
    """Start `cloud-verifier --port 0 --http-port 0 FLAGS`; yield its gRPC address once it serves
    (a first start may fetch the target model: minutes)."""
    if not _cloud_installed():
        raise ConfigError(
            "no --cloud given and cloud-verifier is not installed here: "
            "pass --cloud HOST:PORT, or install the cloud part ('.[cloud]')"
        )
    cmd = [sys.executable, "-m", "cloud", "--host", "127.0.0.1", "--port", "0", "--http-port", "0", *flags]
    child = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    assert child.stderr is not None
    tail: list[str] = []
    drain: asyncio.Task[None] | None = None
    try:
        address = await asyncio.wait_for(_wait_ready(child.stderr, tail), ready_timeout_s)
        if address is None:
            last = tail[-1] if tail else "no output"
            raise ConfigError(f"the local cloud-verifier exited before serving: {last[:300]}")
        log.info("local verifier on %s (pid %d)", address, child.pid)
        drain = asyncio.create_task(_drain(child.stderr))  # a full pipe would stall the child
        yield address
    except TimeoutError:
        raise ConfigError(f"the local cloud-verifier was not serving after {ready_timeout_s:.0f} s") from None
    finally:
        await _stop(child)
        if drain is not None:
            drain.cancel()


def _cloud_installed() -> bool:
    try:
        return importlib.util.find_spec("cloud") is not None
    except ImportError:  # a finder that refuses it: as good as missing
        return False


async def _wait_ready(stream: asyncio.StreamReader, tail: list[str]) -> str | None:
    while line := (await stream.readline()).decode(errors="replace"):
        tail[:] = [*tail[-4:], line.strip()]
        match = _READY.search(line)
        if match:
            return match.group(1)
    return None


async def _drain(stream: asyncio.StreamReader) -> None:
    while line := await stream.readline():
        log.debug("verifier: %s", line.decode(errors="replace").rstrip())


async def _stop(child: asyncio.subprocess.Process) -> None:
    if child.returncode is not None:
        return
    child.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(child.wait(), 30)
    except TimeoutError:
        child.kill()
        await child.wait()
