"""The HTTP side of `edge-agent serve`: OpenAI's chat and text completions (JSON, or
Server-Sent Events with `stream`), /v1/models, /health and the chat page at /.

A client that goes away (its connection closed) cancels its generation, which closes its
cloud session. A stream's status is decided by its first event: an error before any text
(the verifier unavailable, full) is answered with its HTTP status; later ones arrive as an
`error` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from edge.serve.engine import Engine, Event, Generation
from edge.serve.openai_api import ChatRequest, CompletionRequest, SamplingRequest, parse_request, request_settings
from edge.serve.openai_replies import ErrorReply, Shape, error_reply, http_error_reply
from edge.serve.stats import speculation_stats, usage
from shared.api_keys import ApiKeys
from shared.errors import InvalidParameter, SpecDecError, Unauthenticated

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of a stream


@dataclass(frozen=True)
class ServeInfo:
    model: str  # the name /v1/models lists and responses carry
    api_keys: ApiKeys  # the Bearer keys of /v1/*, each naming its caller; none: open to one local user
    cloud: str  # the verifier's address


def _json_reply(reply: ErrorReply) -> JSONResponse:
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client went away first (then `work` is cancelled)."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


def _finish_reason(gen: Generation, event: Event) -> str:
    assert event.result is not None
    return "stop" if gen.streamer.stopped or event.result.finish_reason == "stop" else "length"


class _Completion:
    """One request of `caller` (its API key's name) from its parsed body to its response."""

    def __init__(self, engine: Engine, info: ServeInfo, req: SamplingRequest, kind: Literal["chat", "text"], caller: str) -> None:
        self.engine, self.req, self.caller = engine, req, caller
        self.shape = Shape.new(kind, info.model)

    def _final(self, gen: Generation, event: Event) -> tuple[dict[str, int], dict[str, Any]]:
        assert event.result is not None
        draft_prompt = (gen.draft_reused_tokens, gen.draft_prefilled_tokens)
        disabled = self.req.speculative.enabled is False
        stats = speculation_stats(event.result, gen.settings, disabled, draft_prompt, gen.k_costs_rounds)
        return usage(gen.prompt_tokens, event.result), stats

    async def respond(self, request: Request, prompt_ids: list[int]) -> Response:
        base = self.engine.ctx.settings
        settings = request_settings(base, self.req.settings_update(base))
        previews = self.req.stream and self.req.speculative.provisional
        gen = self.engine.start(self.shape.id, settings, prompt_ids, self.req.stop or [], previews, caller=self.caller)
        events = gen.events()
        if not self.req.stream:
            return await self._whole(request, gen, events)
        first = await _unless_gone(request, anext(events))
        if first is None:
            gen.cancel()
            return Response(status_code=204)  # nobody is listening
        if first.kind == "error":
            assert first.error is not None
            return _json_reply(error_reply(first.error))

        async def stop() -> None:  # also when the client left before the stream began
            gen.cancel()

        return StreamingResponse(
            self._stream(gen, first, events), media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(stop)
        )

    async def _whole(self, request: Request, gen: Generation, events: AsyncIterator[Event]) -> Response:
        async def collect() -> tuple[str, Event]:
            text = ""
            async for event in events:
                if event.kind == "text":
                    text += event.text
                elif event.kind == "error":
                    assert event.error is not None
                    raise event.error
                elif event.kind == "done":
                    return text, event
            raise AssertionError("a generation ends with done or error")

        collected = await _unless_gone(request, collect())
        if collected is None:
            gen.cancel()
            return Response(status_code=204)
        text, done = collected
        use, stats = self._final(gen, done)
        return JSONResponse(self.shape.body(text, _finish_reason(gen, done), use, stats))

    async def _stream(self, gen: Generation, first: Event, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        shape = self.shape
        try:
            yield _sse(shape.chunk("", role=True))
            event: Event | None = first
            while event is not None:
                if event.kind == "text":
                    yield _sse(shape.chunk(event.text))
                elif event.kind == "provisional":
                    yield _sse(shape.chunk(provisional=event.text))
                elif event.kind == "error":
                    assert event.error is not None
                    yield _sse(error_reply(event.error).body)
                else:
                    for chunk in self._last_chunks(gen, event):
                        yield _sse(chunk)
                event = None if event.kind in ("done", "error") else await anext(events)
            yield "data: [DONE]\n\n"
        finally:
            gen.cancel()  # a no-op once done; else the client went away mid-stream

    def _last_chunks(self, gen: Generation, done: Event) -> list[dict[str, Any]]:
        use, stats = self._final(gen, done)
        finish = self.shape.chunk(finish=_finish_reason(gen, done))
        if self.req.include_usage():
            return [finish, self.shape.usage_chunk(use, stats)]
        return [{**finish, "speculative_decoding": stats}]


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise InvalidParameter("the request body is not JSON", None) from None


def _key_guard(keys: ApiKeys) -> Any:
    """A dependency that answers the name of the request's API key ("" without keys), or 401."""

    async def caller(authorization: str | None = Header(None)) -> str:
        try:
            return keys.caller(authorization).name
        except Unauthenticated:
            raise HTTPException(
                401, "missing or wrong API key (send Authorization: Bearer KEY)", headers={"WWW-Authenticate": "Bearer"}
            ) from None

    return Depends(caller)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SpecDecError)
    async def spec_error(_request: Request, err: SpecDecError) -> JSONResponse:
        return _json_reply(error_reply(err))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _json_reply(http_error_reply(err.status_code, str(err.detail), dict(err.headers or {})))

    @app.exception_handler(Exception)
    async def internal(_request: Request, err: Exception) -> JSONResponse:
        return _json_reply(error_reply(err))


def create_app(engine: Engine, info: ServeInfo) -> FastAPI:
    # No /docs: its page pulls scripts from a CDN.
    app = FastAPI(title="edge-agent serve", docs_url=None, redoc_url=None, openapi_url=None)
    page = (resources.files("edge.serve") / "static" / "chat.html").read_text(encoding="utf-8")
    guard = _key_guard(info.api_keys)
    started = int(time.time())
    _error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        lm = engine.ctx.draft_lm
        return {
            "status": "ok",
            "model": info.model,
            "cloud": info.cloud,
            "mode": engine.ctx.settings.mode,
            "draft_runtime": lm.runtime if lm is not None else None,
            "generating": len(engine.running),
        }

    @app.get("/v1/models", dependencies=[guard])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": info.model, "object": "model", "created": started, "owned_by": "specedge"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request, caller: str = guard) -> Response:
        req = parse_request(ChatRequest, await _body(request))
        ids = req.prompt_ids(engine.ctx.tokenizer)
        return await _Completion(engine, info, req, "chat", caller).respond(request, ids)

    @app.post("/v1/completions")
    async def completions(request: Request, caller: str = guard) -> Response:
        req = parse_request(CompletionRequest, await _body(request))
        ids = req.prompt_ids(engine.ctx.tokenizer)
        return await _Completion(engine, info, req, "text", caller).respond(request, ids)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> str:
        return page

    return app
