"""One cloud-verifier process: HTTP first (probes answer while the model loads), gRPC beside
it in the same event loop, the model loading on the model worker, then readiness flips.
Beside them: idle sessions and kept prefixes freed once past their TTL, the API keys file
re-read on SIGHUP or a change (cloud/key_reload.py), the heap trimmed when idle.
SIGTERM drains: no new sessions, open ones finish their rounds within a grace period."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc

from cloud.config import VerifierSettings
from cloud.grpc_server import start_server
from cloud.http import HttpServer, create_app, start_http
from cloud.key_reload import watch_keys
from cloud.logs import log_event
from cloud.state import ServerState
from cloud.tls import ServerTls, check_exposure
from cloud.verifier import Verifier
from shared.api_keys import ApiKeys
from shared.errors import EngineFailed
from shared.http_server import stop_signal
from shared.net import is_loopback

log = logging.getLogger("cloud-verifier")
Loader = Callable[[VerifierSettings], Verifier]
STOP_GRACE_S = 1.0  # for rounds still running once the drain period is over
ENGINE_CHECK_S = 1.0  # how often the engine's health is read (an attribute: no pass, no lock)
EXPIRE_S = 2.0  # how often sessions and kept prefixes idle past the TTL are freed
IDLE_CHECK_S = 10.0  # how often the heap is looked at for a trim


@dataclass
class Servers:
    state: ServerState
    grpc: grpc.aio.Server
    grpc_port: int
    http: HttpServer


def server_tls(settings: VerifierSettings) -> ServerTls | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    return ServerTls.checked(settings.tls_cert, settings.tls_key, settings.tls_client_ca)


async def start_servers(settings: VerifierSettings) -> Servers:
    tls = server_tls(settings)
    check_exposure(settings.host, tls, settings.insecure)
    keys = ApiKeys.load(settings.api_keys_file) if settings.api_keys_file else None
    _log_trust(settings, keys)
    state = ServerState(
        settings.max_draft_tokens,
        log_prompts=settings.log_prompts,
        batch_limits=settings.batch_limits(),
        api_keys=keys,
        prefer_speculation_above=settings.prefer_speculation_above,
    )
    security = {"tls": tls is not None, "mtls": bool(tls and tls.client_ca), "api_keys": len(keys.entries) if keys else 0}
    http = await start_http(create_app(state, settings.public_metrics), settings.host, settings.http_port, tls)
    log_event(
        log, logging.INFO, f"http on {settings.host}:{http.port}" + (" (HTTPS)" if tls else ""), http_port=http.port, **security
    )
    credentials = tls.grpc_credentials() if tls else None
    grpc_host = f"[{settings.host}]" if ":" in settings.host and not settings.host.startswith("[") else settings.host  # IPv6
    server, port = await start_server(state, f"{grpc_host}:{settings.port}", settings.reflection, credentials=credentials)
    serving = f"grpc on {settings.host}:{port} (health NOT_SERVING until the model loads)"
    log_event(log, logging.INFO, serving, grpc_port=port, **security)
    return Servers(state, server, port, http)


def _log_trust(settings: VerifierSettings, keys: ApiKeys | None) -> None:
    """Say at start what clients share: no kept prefix crosses clients, unless the operator
    asked for one prefix cache per key (without keys: for every client)."""
    if keys is None and not is_loopback(settings.host):
        exposed = f"no API keys on {settings.host}: any client that reaches the port may open sessions on the model"
        log_event(log, logging.WARNING, f"{exposed} (give --api-keys-file; README: Securing a verifier)", host=settings.host)
    if settings.shared_prefix_cache and settings.prefix_reuse:
        if keys is not None:
            log.info("one prefix cache per API key (--shared-prefix-cache): a key's clients share it, keys never do")
        else:
            log.warning(
                "one prefix cache for every client (--shared-prefix-cache): a client can tell from its prefill time "
                "whether another client's prompt began with the same text"
            )


async def load_model(servers: Servers, settings: VerifierSettings, load: Loader) -> None:
    log_event(log, logging.INFO, "loading model", model=settings.model or "packaged target")
    verifier = await servers.state.worker.run(load, settings)
    await servers.state.set_verifier(verifier)
    # The line scripts and tests wait for: from here on, sessions are served.
    log.info("serving %s on %s:%d", verifier.model_id, settings.host, servers.grpc_port)


async def _sessions_closed(state: ServerState, grace_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + grace_s
    while state.sessions() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


async def shutdown(servers: Servers, grace_s: float) -> None:
    """Refuse new sessions (UNAVAILABLE), wait for open ones to close or grace_s, then stop."""
    await servers.state.drain()
    open_sessions = len(servers.state.sessions())
    log_event(log, logging.INFO, "draining", grace_s=grace_s, open_sessions=open_sessions)
    await _sessions_closed(servers.state, grace_s)
    await servers.grpc.stop(STOP_GRACE_S)  # in-flight rounds finish; new calls are refused
    await servers.http.stop()
    if servers.state.verifier is not None:  # after the last pass (vLLM's processes stop with it)
        await servers.state.worker.run(servers.state.verifier.engine.close)
    servers.state.worker.shutdown()
    log_event(log, logging.INFO, "stopped", left_open=len(servers.state.sessions()))


async def _engine_failed(state: ServerState) -> None:
    """Raise EngineFailed once the loaded engine can run no more passes."""
    while True:
        reason = state.verifier.engine.failure() if state.verifier is not None else None
        if reason:
            raise EngineFailed(f"{reason}; no session can go on, so the verifier stops")
        await asyncio.sleep(ENGINE_CHECK_S)


async def _expire_sessions(state: ServerState) -> None:
    """Forever, once the model is loaded: free the sessions and kept prefixes idle past the TTL
    (on the model worker), so their KV goes with no call arriving, not only at the next one."""
    while True:
        await asyncio.sleep(EXPIRE_S)
        if state.verifier is not None:
            await state.worker.run(state.verifier.sessions.expire)


async def _until_stopped(loading: asyncio.Task[None], failed: asyncio.Task[None]) -> None:
    """Return on SIGINT/SIGTERM; raise if the model fails to load or its engine fails."""
    stopping = stop_signal()
    waiting: set[asyncio.Future[Any]] = {loading, failed, stopping}
    while stopping in waiting:  # a load that succeeds leaves the engine's watch and the signal
        done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for task in done - {stopping}:
            if task.exception() is not None:
                stopping.cancel()
                task.result()


def malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0), or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return partial(trim, 0)  # 0: keep no padding at the heap's top


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


async def trim_when_idle(state: ServerState, every_s: float = IDLE_CHECK_S) -> None:
    """Forever: every `every_s`, hand freed memory back to the system if the verifier holds no
    session and has run a forward pass since the last trim. A session's KV grows a token at a
    time and a long prefill's activations are freed after its pass, and glibc's allocator keeps
    freed pages for reuse: a verifier left idle after a load holds 20 to 70 MiB no session uses
    (the 1.5B target on a CPU). The trim runs on the model worker, so no pass allocates meanwhile."""
    trim = malloc_trim()
    if trim is None:
        return
    trimmed_at = -1  # forward passes run when the heap was last trimmed
    while True:
        await asyncio.sleep(every_s)
        verifier = state.verifier
        if verifier is None or len(verifier.sessions.snapshot()) or verifier.forward_passes == trimmed_at:
            continue
        before = resident_bytes()
        await state.worker.run(trim)
        trimmed_at = verifier.forward_passes
        freed = before - resident_bytes()
        log_event(log, logging.INFO, f"idle: returned {freed / 2**20:.0f} MiB of freed memory", freed_bytes=freed)


async def serve(settings: VerifierSettings, load: Loader) -> None:
    servers = await start_servers(settings)
    loading = asyncio.create_task(load_model(servers, settings, load))
    failed = asyncio.create_task(_engine_failed(servers.state))
    chores = [asyncio.create_task(trim_when_idle(servers.state)), asyncio.create_task(_expire_sessions(servers.state))]
    if settings.api_keys_file:  # without keys there is nothing to reload
        chores.append(asyncio.create_task(watch_keys(servers.state, settings.api_keys_file)))
    grace_s = settings.drain_grace_s
    try:
        await _until_stopped(loading, failed)
    except EngineFailed:
        grace_s = 0.0  # open sessions cannot finish
        raise
    finally:
        for task in (*chores, failed):
            task.cancel()
        loading.cancel()  # a load still running finishes on its thread; the process waits for it
        await shutdown(servers, grace_s)
