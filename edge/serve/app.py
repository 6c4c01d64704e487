"""The HTTP side of `edge-agent serve`: OpenAI's chat and text completions and its Responses
API (JSON, or Server-Sent Events with `stream`), /v1/models, /health and the chat page at /.

A client that goes away (its connection closed) cancels its generation, which closes its
cloud session. A stream's status is decided by its first event: an error before any text
(the verifier unavailable, full) is answered with its HTTP status; later ones arrive as an
`error` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from edge.serve.engine import Engine, Event, Generation
from edge.serve.openai_api import ChatRequest, CompletionRequest, SamplingRequest, parse_request, request_settings
from edge.serve.openai_replies import CompletionReply, ErrorReply, Shape, error_reply, http_error_reply
from edge.serve.responses_api import ResponsesRequest, responses_names
from edge.serve.responses_replies import ResponsesReply
from edge.serve.stats import speculation_stats, usage
from edge.serve.structured import refused
from edge.serve.tool_calls import Piece, ToolCallParser
from edge.serve.tools import ToolPlan
from edge.tokenizer import EdgeTokenizer
from shared.api_keys import ApiKeys
from shared.errors import InvalidParameter, SpecDecError, Unauthenticated
from shared.grammar import GrammarRefused

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of a stream


@dataclass(frozen=True)
class ServeInfo:
    model: str  # the name /v1/models lists and responses carry
    api_keys: ApiKeys  # the Bearer keys of /v1/*, each naming its caller; none: open to one local user
    cloud: str  # the verifier's address


def _json_reply(reply: ErrorReply) -> JSONResponse:
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


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


class Reply(Protocol):
    """One response's shapes (a chat or text completion, a Responses object), whole or as
    Server-Sent Events, from the pieces of the generated text."""

    previews: bool  # whether streams carry provisional text

    @property
    def id(self) -> str: ...

    def body(self, pieces: list[Piece], finish: str, usage: dict[str, int], stats: dict[str, Any]) -> dict[str, Any]: ...
    def opening(self) -> list[str]: ...
    def pieces(self, pieces: list[Piece]) -> list[str]: ...
    def provisional(self, text: str) -> list[str]: ...
    def named(self, err: BaseException) -> BaseException: ...  # an error naming the fields as this API does
    def failed(self, err: BaseException) -> list[str]: ...
    def closing(self, finish: str, usage: dict[str, int], stats: dict[str, Any]) -> list[str]: ...
    def end(self) -> list[str]: ...


class _Reader:
    """The generated text as pieces: content, and tool calls where the request reads them."""

    def __init__(self, plan: ToolPlan) -> None:
        self.parser = ToolCallParser(plan.names, plan.first_only) if plan.parse else None

    def push(self, text: str) -> list[Piece]:
        return self.parser.push(text) if self.parser is not None else [Piece(text)] if text else []

    def finish(self) -> list[Piece]:
        return self.parser.finish() if self.parser is not None else []


class _Completion:
    """One request of `caller` (its API key's name) from its parsed body to its response."""

    def __init__(self, engine: Engine, req: SamplingRequest, reply: Reply, caller: str) -> None:
        self.engine, self.req, self.reply, self.caller = engine, req, reply, caller
        self.plan = req.tool_plan()
        self.grammar, self.grammar_param = req.grammar(self.plan)
        self.reader = _Reader(self.plan)

    def _final(self, gen: Generation, event: Event) -> tuple[dict[str, int], dict[str, Any]]:
        assert event.result is not None
        draft_prompt = (gen.draft_reused_tokens, gen.draft_prefilled_tokens)
        disabled = self.req.speculative.enabled is False
        stats = speculation_stats(event.result, gen.settings, disabled, draft_prompt, gen.k_costs_rounds)
        return usage(gen.prompt_tokens, event.result), stats

    def _named(self, err: BaseException) -> BaseException:
        """An error as the client reads it: a grammar's refusal names the field that asked for
        the grammar, and each field is named as the reply's API names it."""
        if isinstance(err, GrammarRefused) and self.grammar_param:
            err = refused(err, self.grammar_param)
        return self.reply.named(err)

    def _start(self, prompt_ids: list[int]) -> Generation:
        base = self.engine.ctx.settings
        settings = request_settings(base, self.req.settings_update(base))
        previews = self.req.stream and self.req.speculative.provisional and self.reply.previews
        try:
            return self.engine.start(
                self.reply.id, settings, prompt_ids, self.req.stop or [], previews, caller=self.caller, grammar=self.grammar
            )
        except GrammarRefused as err:
            raise self._named(err) from None

    async def respond(self, request: Request, tokenizer: EdgeTokenizer) -> Response:
        gen = self._start(self.req.prompt_ids(tokenizer, self.plan))
        events = gen.events()
        if not self.req.stream:
            return await self._whole(request, gen, events)
        first = await _unless_gone(request, anext(events))
        if first is None:
            gen.cancel()
            return Response(status_code=204)  # nobody is listening
        if first.kind == "error":
            assert first.error is not None
            return _json_reply(error_reply(self._named(first.error)))

        async def stop() -> None:  # also when the client left before the stream began
            gen.cancel()

        return StreamingResponse(
            self._stream(gen, first, events), media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(stop)
        )

    async def _whole(self, request: Request, gen: Generation, events: AsyncIterator[Event]) -> Response:
        async def collect() -> tuple[list[Piece], Event]:
            pieces: list[Piece] = []
            async for event in events:
                if event.kind == "text":
                    pieces += self.reader.push(event.text)
                elif event.kind == "error":
                    assert event.error is not None
                    raise self._named(event.error)
                elif event.kind == "done":
                    return pieces + self.reader.finish(), event
            raise AssertionError("a generation ends with done or error")

        collected = await _unless_gone(request, collect())
        if collected is None:
            gen.cancel()
            return Response(status_code=204)
        pieces, done = collected
        use, stats = self._final(gen, done)
        return JSONResponse(self.reply.body(pieces, _finish_reason(gen, done), use, stats))

    async def _stream(self, gen: Generation, first: Event, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        reply = self.reply
        try:
            for frame in reply.opening():
                yield frame
            event: Event | None = first
            while event is not None:
                for frame in self._frames(gen, event):
                    yield frame
                event = None if event.kind in ("done", "error") else await anext(events)
            for frame in reply.end():
                yield frame
        finally:
            gen.cancel()  # a no-op once done; else the client went away mid-stream

    def _frames(self, gen: Generation, event: Event) -> list[str]:
        if event.kind == "text":
            return self.reply.pieces(self.reader.push(event.text))
        if event.kind == "provisional":
            return self.reply.provisional(event.text)
        if event.kind == "error":
            assert event.error is not None
            return self.reply.failed(self._named(event.error))
        use, stats = self._final(gen, event)
        return self.reply.pieces(self.reader.finish()) + self.reply.closing(_finish_reason(gen, event), use, stats)


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to parse
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
        reply = CompletionReply(Shape.new("chat", info.model), req.include_usage())
        return await _Completion(engine, req, reply, caller).respond(request, engine.ctx.tokenizer)

    @app.post("/v1/completions")
    async def completions(request: Request, caller: str = guard) -> Response:
        req = parse_request(CompletionRequest, await _body(request))
        reply = CompletionReply(Shape.new("text", info.model), req.include_usage())
        return await _Completion(engine, req, reply, caller).respond(request, engine.ctx.tokenizer)

    @app.post("/v1/responses")
    async def responses(request: Request, caller: str = guard) -> Response:
        with responses_names():  # errors name the Responses API's fields
            asked = parse_request(ResponsesRequest, await _body(request))
            req = asked.chat_request()
            reply = ResponsesReply(info.model, asked.echo())
            return await _Completion(engine, req, reply, caller).respond(request, engine.ctx.tokenizer)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> str:
        return page

    return app
