"""The API keys file re-read while the verifier runs (a real grpc.aio verifier on port 0, real
files, tiny models): a removed key's calls are refused, its streams end UNAUTHENTICATED and all
its KV goes at once while other keys' sessions go on; a rotated key keeps its sessions; a file
that does not parse keeps the keys in force. In a real cloud-verifier process: SIGHUP reloads
the file, and kept prefixes past the TTL are freed with no call arriving."""

import asyncio
import json
import logging
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cloud.key_reload import watch_keys
from cloud.process import Servers
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from tests.harness import TargetEngine, random_prompt
from tests.ops import SETTINGS, metric_samples, running_servers, stub
from tests.serve_procs import Server, start_verifier
from tests.tiny_models import save_pair

PROMPT = random_prompt(7)
RELOADED = "API keys reloaded"
NOT_RELOADED = "API keys not reloaded"


def _auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def _until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Wait until `check()` holds (polled every 20 ms); the seconds it took."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _code(call: Awaitable[Any]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def _round(verifier: pb_grpc.VerifierStub, session: pb.OpenSessionResponse, key: str) -> pb.VerifyResponse:
    request = pb.VerifyRequest(session_id=session.session_id, base_position=session.position, draft_tokens=[4])
    reply: pb.VerifyResponse = await verifier.Verify(request, metadata=_auth(key))
    session.position = reply.new_base_position
    return reply


class _Stream:
    """A Generate or Decode call read to its end in a task: its chunks, and the status it ended with."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.chunks = 0
        self.ended: grpc.aio.AioRpcError | None = None
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for _ in self.call:
                self.chunks += 1
        except grpc.aio.AioRpcError as err:
            self.ended = err


def _get(port: int, path: str, key: str) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=dict(_auth(key)))
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _reloads(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(message)]


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text("A key-of-a-Qm3Zt8\nB key-of-b-Wr5Yp2\n")
    return path


async def _watched(keys_file: Path, target: Any, run: Callable[[Servers, pb_grpc.VerifierStub], Awaitable[None]]) -> None:
    """`run` against a verifier of `target` with `keys_file`, the file watched as `serve` watches it."""
    settings = SETTINGS.model_copy(update={"api_keys_file": str(keys_file)})
    async with running_servers(target, settings=settings) as (servers, loading):
        await loading
        watching = asyncio.create_task(watch_keys(servers.state, str(keys_file)))
        channel, verifier = stub(servers.grpc_port)
        try:
            await run(servers, verifier)
        finally:
            watching.cancel()
            await channel.close()


def test_a_removed_key_loses_its_calls_streams_and_kv_and_the_other_key_goes_on(
    target_engine: TargetEngine, keys_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cloud-verifier")
    a, b = "key-of-a-Qm3Zt8", "key-of-b-Wr5Yp2"

    async def run(servers: Servers, verifier: pb_grpc.VerifierStub) -> None:
        assert servers.state.verifier is not None
        store = servers.state.verifier.sessions
        kept = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=random_prompt(3)), metadata=_auth(a))
        await verifier.CloseSession(pb.CloseSessionRequest(session_id=kept.session_id), metadata=_auth(a))
        session_a = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=_auth(a))
        session_b = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=_auth(b))
        await _round(verifier, session_a, a)
        await _round(verifier, session_b, b)
        # the closed session's KV, kept for A's next one (vLLM keeps it in its own prefix cache)
        assert store.prefix_totals("A")[2] == (0 if servers.state.verifier.engine.caches_prefixes else 1)
        generate = pb.GenerateRequest(prompt_tokens=random_prompt(11, 12), max_new_tokens=800)
        decode = pb.DecodeRequest(session_id=session_a.session_id, base_position=session_a.position, max_tokens=800)
        streams = [_Stream(verifier.Generate(generate, metadata=_auth(a))), _Stream(verifier.Decode(decode, metadata=_auth(a)))]
        await _until(lambda: all(s.chunks >= 3 for s in streams), 30, "A's streams under way")
        # Held in flight: their next steps wait behind this on the model worker.
        gate = threading.Event()
        servers.state.worker.submit(lambda: gate.wait(30))
        try:
            keys_file.write_text("B key-of-b-Wr5Yp2\n")
            await _until(lambda: not any(e.name == "A" for e in servers.state.api_keys.entries), 3, "the reload")
            # Refused at once, as an unknown key, while the model worker is still busy.
            assert await _code(verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=_auth(a))) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            assert await _code(_round(verifier, session_a, a)) == grpc.StatusCode.UNAUTHENTICATED
            assert (await asyncio.to_thread(_get, servers.http.port, "/v1/sessions", a))[0] == 401
        finally:
            gate.set()
        # Within a second: both streams ended, every session and kept prefix of A freed.
        await _until(lambda: all(s.task.done() for s in streams) and store.kv_bytes("A") == 0, 1, "A's streams and KV gone")
        for stream in streams:
            assert stream.ended is not None and stream.ended.code() == grpc.StatusCode.UNAUTHENTICATED, stream.ended
            assert stream.ended.details() == "the API key was removed" and stream.chunks < 800
        assert [s for s in store.snapshot() if s.owner == "A"] == []
        assert store.prefix_totals("A")[2:] == (0, 0)  # no kept prefix of A, no bytes
        # B's session goes on: the same id, a round from where it was.
        before = session_b.position
        reply = await _round(verifier, session_b, b)
        assert reply.new_base_position > before and store.kv_bytes("B") > 0
        # One INFO line naming the removed key, never a key.
        [line] = _reloads(caplog, RELOADED)
        assert line.levelno == logging.INFO
        assert line.fields["removed"] == ["A"] and line.fields["added"] == [] and line.fields["keys"] == 1  # type: ignore[attr-defined]
        assert line.fields["ended_sessions"] >= 1  # type: ignore[attr-defined]
        assert a not in caplog.text and b not in caplog.text

    asyncio.run(_watched(keys_file, target_engine, run))


def test_a_rotated_key_keeps_its_sessions(target_model, keys_file: Path) -> None:  # type: ignore[no-untyped-def]
    old, new, newer = "key-of-a-Qm3Zt8", "new-key-of-a-Hx4Vb7", "newer-key-of-a-Lc9Dn1"

    async def reload(servers: Servers, text: str) -> None:
        before = servers.state.api_keys
        keys_file.write_text(text)
        await _until(lambda: servers.state.api_keys is not before, 3, "the reload")

    async def run(servers: Servers, verifier: pb_grpc.VerifierStub) -> None:
        session = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=_auth(old))
        await _round(verifier, session, old)
        await reload(servers, f"A {old}\nA {new}\nB key-of-b-Wr5Yp2\n")  # both secrets while the callers move
        await _round(verifier, session, old)
        await _round(verifier, session, new)
        await reload(servers, f"A {new}\nB key-of-b-Wr5Yp2\n")  # then the old one goes
        assert await _code(_round(verifier, session, old)) == grpc.StatusCode.UNAUTHENTICATED
        await _round(verifier, session, new)
        await reload(servers, f"A {newer}\nB key-of-b-Wr5Yp2\n")  # or a new secret at once
        reply = await _round(verifier, session, newer)
        assert reply.new_base_position == session.position and session.position > len(PROMPT) + 4

    asyncio.run(_watched(keys_file, target_model, run))


def test_a_file_that_does_not_parse_keeps_the_keys_in_force(
    target_model,  # type: ignore[no-untyped-def]
    keys_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cloud-verifier")
    a = "key-of-a-Qm3Zt8"
    broken = {
        "line 2: expected a key": "A key-of-a-Qm3Zt8\nB secret-in-a-bad-line-Jf6Gs2 and more\n",
        "no keys in it": "# nobody\n\n",
        "No such file": None,  # removed
    }

    async def run(servers: Servers, verifier: pb_grpc.VerifierStub) -> None:
        session = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=_auth(a))
        keys = servers.state.api_keys
        for count, (why, text) in enumerate(broken.items(), start=1):
            if text is None:
                keys_file.unlink()
            else:
                keys_file.write_text(text)
            await _until(lambda n=count: len(_reloads(caplog, NOT_RELOADED)) == n, 3, f"a warning for {why}")  # type: ignore[misc]
            await asyncio.sleep(1.5)  # a poll or more later: still one line for the change
            warnings = _reloads(caplog, NOT_RELOADED)
            assert len(warnings) == count and warnings[-1].levelno == logging.WARNING
            assert why in warnings[-1].getMessage()
            assert servers.state.api_keys is keys
            await _round(verifier, session, a)
        assert "secret-in-a-bad-line" not in caplog.text and a not in caplog.text
        keys_file.write_text("A key-of-a-Qm3Zt8\n")  # back: read again
        await _until(lambda: len(_reloads(caplog, RELOADED)) == 1, 3, "the reload")
        assert _reloads(caplog, RELOADED)[0].fields["removed"] == ["B"]  # type: ignore[attr-defined]
        await _round(verifier, session, a)

    asyncio.run(_watched(keys_file, target_model, run))


# ---- a real cloud-verifier process ---------------------------------------------------------

TTL_S = 2.0


@pytest.fixture(scope="module")
def verifier_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, int, Path]]:
    """cloud-verifier with a keys file and a short session TTL: (server, gRPC address, HTTP port, keys file)."""
    folder = tmp_path_factory.mktemp("reload")
    target = save_pair(folder)[1]
    keys = folder / "keys.txt"
    keys.write_text("A key-of-a-Qm3Zt8\nB key-of-b-Wr5Yp2\n")
    flags = ("--api-keys-file", str(keys), "--session-ttl-s", str(TTL_S))
    server, address, http = start_verifier(target, folder / "verifier.log", *flags)
    yield server, address, http, keys
    assert server.stop() == 0, server.log.read_text()[-3000:]


async def _describe(address: str, key: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        return await _code(pb_grpc.VerifierStub(channel).Describe(pb.DescribeRequest(), metadata=_auth(key)))


def test_sighup_reloads_the_keys_file(verifier_process: tuple[Server, str, int, Path]) -> None:
    """A change the file watch cannot see (same size, mtime and inode) is read on SIGHUP."""
    server, address, _, keys = verifier_process
    before = os.stat(keys)
    keys.write_text("A key-of-a-Qm3Zt8\nC key-of-c-Tn8Kw4\n")
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(keys)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    time.sleep(2.5)  # polls of the file meanwhile: it looks unchanged
    assert RELOADED not in server.log.read_text()
    assert asyncio.run(_describe(address, "key-of-b-Wr5Yp2")) == grpc.StatusCode.OK
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while not (line := re.search(rf"{RELOADED} \(SIGHUP\).*", server.log.read_text())):
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log.read_text()[-3000:]
        time.sleep(0.05)
    assert "added=['C']" in line.group(0) and "removed=['B']" in line.group(0)
    assert asyncio.run(_describe(address, "key-of-b-Wr5Yp2")) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(_describe(address, "key-of-c-Tn8Kw4")) == grpc.StatusCode.OK
    assert "key-of-" not in server.log.read_text()


def test_kept_prefixes_and_sessions_past_the_ttl_are_freed_with_no_call(
    verifier_process: tuple[Server, str, int, Path],
) -> None:
    _, address, http, _ = verifier_process
    a = "key-of-a-Qm3Zt8"

    async def sessions() -> None:
        """One session closed (its KV kept for A's next one), one left open."""
        async with grpc.aio.insecure_channel(address) as channel:
            verifier = pb_grpc.VerifierStub(channel)
            closed = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=_auth(a))
            await verifier.CloseSession(pb.CloseSessionRequest(session_id=closed.session_id), metadata=_auth(a))
            await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=random_prompt(8)), metadata=_auth(a))

    def kept() -> dict[str, int]:
        status, body = _get(http, "/v1/stats", a)
        assert status == 200
        return json.loads(body)["prefix_reuse"]  # type: ignore[no-any-return]

    def ttl_evictions() -> float:
        status, body = _get(http, "/metrics", a)
        assert status == 200
        return metric_samples(body.decode()).get(("specdec_evicted_sessions_total", frozenset({("reason", "ttl")})), 0.0)

    asyncio.run(sessions())
    assert kept()["kept_prefixes"] == 1 and kept()["kept_bytes"] > 0
    evicted = ttl_evictions()
    deadline = time.monotonic() + TTL_S + 10
    while kept()["kept_prefixes"] or ttl_evictions() == evicted:  # HTTP reads expire nothing: the verifier's own task does
        assert time.monotonic() < deadline, kept()
        time.sleep(0.2)
    assert kept()["kept_bytes"] == 0 and ttl_evictions() == evicted + 1
