"""What `edge-agent serve` answers, in OpenAI's shapes: a chat or text completion, its stream
chunks, and errors as {"error": {message, type, param, code}} with their HTTP status.

A chat reply's tool calls are `message.tool_calls`; streamed, each call is two chunks: its
index, id, type and name with empty arguments, then its arguments whole (the openai SDK joins
a call's argument fragments by index), and the finish reason is "tool_calls".

A chunk may carry `speculative: {"provisional": TEXT}`: a preview of text drafted but not
yet verified, following everything streamed so far. It replaces the previous preview and
is dropped by the next content; it is never part of `content`, so a client that reads only
content sees verified text alone.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from edge.serve.tool_calls import Piece, ToolCall
from shared.errors import CapacityExceeded, CloudUnavailable, InvalidParameter, SpecDecError, Unauthenticated

CLOUD_RETRY_AFTER_S = 5  # a verifier that is away: its restart takes seconds at least


@dataclass(frozen=True)
class Shape:
    """One response's frame: chat (message / delta) or text completion (text)."""

    kind: Literal["chat", "text"]
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, kind: Literal["chat", "text"], model: str) -> Shape:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, model, f"{prefix}-{uuid.uuid4().hex[:24]}")

    def _frame(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def body(
        self, content: str | None, finish: str, usage: dict[str, int], stats: dict[str, Any], calls: Sequence[ToolCall] = ()
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = [call_json(call) for call in calls]
        else:
            choice["text"] = content or ""
        return {**self._frame([choice], chunk=False), "usage": usage, "speculative_decoding": stats}

    def chunk(
        self,
        text: str | None = None,
        finish: str | None = None,
        role: bool = False,
        provisional: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        frame = self._frame([choice], chunk=True)
        if provisional is not None:
            frame["speculative"] = {"provisional": provisional}
        return frame

    def usage_chunk(self, usage: dict[str, int], stats: dict[str, Any]) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk, with no choices."""
        return {**self._frame([], chunk=True), "usage": usage, "speculative_decoding": stats}


def call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One Server-Sent Event: `data:` a JSON payload, with an `event:` line when named."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class CompletionReply:
    """A chat or text completion, whole or as chunks, from the pieces of its text."""

    previews = True  # streams carry provisional text when the request asks

    def __init__(self, shape: Shape, include_usage: bool) -> None:
        self.shape, self.include_usage = shape, include_usage
        self.calls = 0  # tool calls streamed

    @property
    def id(self) -> str:
        return self.shape.id

    def body(self, pieces: list[Piece], finish: str, usage: dict[str, int], stats: dict[str, Any]) -> dict[str, Any]:
        text = "".join(p.text for p in pieces if p.call is None)
        calls = [p.call for p in pieces if p.call is not None]
        if calls:
            return self.shape.body(text or None, "tool_calls", usage, stats, calls)
        return self.shape.body(text, finish, usage, stats)

    def opening(self) -> list[str]:
        return [sse(self.shape.chunk("", role=True))]

    def pieces(self, pieces: list[Piece]) -> list[str]:
        out = []
        for piece in pieces:
            if piece.call is None:
                out.append(sse(self.shape.chunk(piece.text)))
                continue
            call, index = piece.call, self.calls
            self.calls += 1
            head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            out.append(sse(self.shape.chunk(tool_calls=[head])))
            out.append(sse(self.shape.chunk(tool_calls=[{"index": index, "function": {"arguments": call.arguments}}])))
        return out

    def provisional(self, text: str) -> list[str]:
        return [sse(self.shape.chunk(provisional=text))]

    def named(self, err: BaseException) -> BaseException:
        return err

    def failed(self, err: BaseException) -> list[str]:
        return [sse(error_reply(err).body)]

    def closing(self, finish: str, usage: dict[str, int], stats: dict[str, Any]) -> list[str]:
        last = self.shape.chunk(finish="tool_calls" if self.calls else finish)
        if self.include_usage:
            return [sse(last), sse(self.shape.usage_chunk(usage, stats))]
        return [sse({**last, "speculative_decoding": stats})]

    def end(self) -> list[str]:
        return ["data: [DONE]\n\n"]


@dataclass(frozen=True)
class ErrorReply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_reply(err: BaseException) -> ErrorReply:
    """The one place errors become HTTP statuses; internals stay in the server's log."""
    if isinstance(err, SpecDecError) and err.status == "INVALID_ARGUMENT":
        param = err.param if isinstance(err, InvalidParameter) else None
        return ErrorReply(400, error_body(str(err), "invalid_request_error", param))
    if isinstance(err, CapacityExceeded):
        wait = max(1, math.ceil(err.retry_after_ms / 1000))
        return ErrorReply(
            429,
            error_body("the verifier is at capacity; retry later", "rate_limit_error", code="rate_limit_exceeded"),
            {"Retry-After": str(wait)},
        )
    if isinstance(err, SpecDecError) and err.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED") or isinstance(err, CloudUnavailable):
        return ErrorReply(
            503,
            error_body("the verifier is unavailable; retry later", "server_error", code="cloud_unavailable"),
            {"Retry-After": str(CLOUD_RETRY_AFTER_S)},
        )
    if isinstance(err, Unauthenticated):
        return ErrorReply(500, error_body("the verifier refused this server's credentials (see the server log)", "server_error"))
    return ErrorReply(500, error_body("the request failed on the server (see the server log)", "server_error"))


def http_error_reply(status: int, detail: str, headers: dict[str, str] | None = None) -> ErrorReply:
    """An HTTP-level refusal (no key, no such route, wrong method) in OpenAI's shape."""
    codes = {401: "invalid_api_key", 404: "unknown_url", 405: "method_not_allowed"}
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ErrorReply(status, error_body(detail, kind, code=codes.get(status)), headers or {})
