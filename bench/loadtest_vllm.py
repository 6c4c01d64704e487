"""The peer of a capacity search: the same sessions as plain streaming generations on vLLM's own
OpenAI-compatible server (`vllm serve MODEL`), what an operator would run instead of the verifier.

Each session is one streaming `/v1/completions` call: the recorded prompt as token ids,
`max_tokens` = the planned output length, greedy, `ignore_eos` (so every system generates the
same number of tokens), and `stream_options.continuous_usage_stats` so each event says how many
tokens it carries (a token that ends inside a multi-byte character arrives with no text).

The client is a small HTTP/1.1 reader over asyncio streams, one connection per session like one
user each: no HTTP library is shared by every environment the load tester runs in (the project's,
vLLM's own, an offline GPU box's), and one asyncio read per event keeps the load generator's own
CPU low. Loopback only, like the rest of the load tester.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from bench.loadtest_arrivals import PlannedSession
from bench.loadtest_replay import LoadClock, RoundSample, SessionOutcome
from shared.errors import ConfigError

SYSTEM = "vllm_alone"
MAX_HEADER_BYTES = 64 * 1024
MAX_ERROR_BYTES = 300  # an error body is quoted at most this long


class PeerError(Exception):
    """A failed call to the peer server; `code` goes into the load test's error counts."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(f"{code}: {detail[:MAX_ERROR_BYTES]}" if detail else code)
        self.code = code


@dataclass(frozen=True)
class PeerServer:
    """Where the peer listens and which model it serves (found with GET /v1/models)."""

    host: str
    port: int
    model: str = ""
    api_key: str | None = None

    @classmethod
    def from_url(cls, url: str, api_key: str | None = None) -> PeerServer:
        parsed = urlparse(url)
        if parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
            raise ConfigError(f"--vllm-url must be http://HOST:PORT, got {url[:100]!r}")
        return cls(parsed.hostname, parsed.port, api_key=api_key)

    def _headers(self, body: bytes | None) -> bytes:
        lines = [f"Host: {self.host}:{self.port}", "Accept: text/event-stream, application/json"]
        if self.api_key:
            lines.append(f"Authorization: Bearer {self.api_key}")
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def _request(self, method: str, path: str, body: bytes | None) -> tuple[int, asyncio.StreamReader, Any]:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=MAX_HEADER_BYTES)
        writer.write(f"{method} {path} HTTP/1.1\r\n".encode() + self._headers(body) + (body or b""))
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
        return status, reader, (writer, headers)

    async def get_json(self, path: str) -> Any:
        status, reader, (writer, headers) = await self._request("GET", path, None)
        try:
            text = b"".join([chunk async for chunk in _body(reader, headers)])
        finally:
            writer.close()
        if status != 200:
            raise PeerError(f"HTTP_{status}", text.decode(errors="replace"))
        return json.loads(text)

    async def served_model(self) -> PeerServer:
        """This server with the model it serves (the first of /v1/models)."""
        listing = await self.get_json("/v1/models")
        return PeerServer(self.host, self.port, str(listing["data"][0]["id"]), self.api_key)

    async def wait_ready(self, timeout_s: float) -> PeerServer:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                return await self.served_model()
            except (OSError, PeerError, ValueError, KeyError, IndexError) as err:
                if loop.time() > deadline:
                    where = f"{self.host}:{self.port}"
                    raise ConfigError(f"the vLLM server at {where} did not list its model within {timeout_s:g} s") from err
                await asyncio.sleep(0.5)

    async def stream_tokens(
        self, prompt: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0
    ) -> AsyncIterator[int]:
        """A streaming completion of exactly max_tokens tokens (greedy unless a temperature is
        given): how many each event carries."""
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
        ).encode()
        status, reader, (writer, headers) = await self._request("POST", "/v1/completions", body)
        try:
            if status != 200:
                text = b"".join([chunk async for chunk in _body(reader, headers)])
                raise PeerError(f"HTTP_{status}", text.decode(errors="replace"))
            seen = 0
            async for event in _events(_body(reader, headers)):
                usage = event.get("usage") or {}
                total = usage.get("completion_tokens")
                if total is None:  # a server without per-event usage: one token per text event
                    total = seen + (1 if event.get("choices") else 0)
                if total > seen:
                    yield total - seen
                    seen = total
        finally:
            writer.close()


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked transfer encoding, a length, or to the close."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while chunk := await reader.read(65536):
            yield chunk


async def _events(body: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """Server-sent events' JSON payloads, up to `data: [DONE]`."""
    pending = b""
    async for chunk in body:
        pending += chunk
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                parsed = json.loads(data)
                if "error" in parsed and not parsed.get("choices"):
                    raise PeerError("STREAM_ERROR", json.dumps(parsed["error"]))
                yield parsed


async def replay_on_peer(plan: PlannedSession, clock: LoadClock, server: PeerServer) -> SessionOutcome:
    """One session as a plain streaming generation on the peer: its TTFT, then one delivery per event."""
    out = SessionOutcome(
        plan.index, plan.trace.name, SYSTEM, plan.arrival_s, len(plan.prompt_tokens), plan.output_target, plan.resized
    )
    clock.open_changes.append((clock.now(), +1))
    out.start_s = last = clock.now()
    try:
        async for tokens in server.stream_tokens(plan.prompt_tokens, plan.output_target):
            now = clock.now()
            if out.ttft_ms is None:
                out.ttft_ms = (now - out.start_s) * 1000.0
                out.opened = True
            else:
                clock.rounds.append(RoundSample(now, (now - last) * 1000.0, tokens, None))
            last = now
            clock.deliver(out.index, tokens)
            out.verified_tokens += tokens
            out.rounds += 1
    except (PeerError, OSError, asyncio.IncompleteReadError, ValueError) as err:
        out.error = err.code if isinstance(err, PeerError) else "CONNECTION"
        out.note_error(clock, out.error)
    finally:
        clock.open_changes.append((clock.now(), -1))
    out.output_tokens = out.verified_tokens
    out.end_s = clock.now()
    return out
