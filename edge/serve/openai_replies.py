"""What `edge-agent serve` answers, in OpenAI's shapes: a chat or text completion, its stream
chunks, and errors as {"error": {message, type, param, code}} with their HTTP status.

A chunk may carry `speculative: {"provisional": TEXT}`: a preview of text drafted but not
yet verified, following everything streamed so far. It replaces the previous preview and
is dropped by the next content; it is never part of `content`, so a client that reads only
content sees verified text alone.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

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

    def body(self, text: str, finish: str, usage: dict[str, int], stats: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._frame([choice], chunk=False), "usage": usage, "speculative_decoding": stats}

    def chunk(
        self, text: str | None = None, finish: str | None = None, role: bool = False, provisional: str | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
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
