"""What `POST /v1/responses` answers, in OpenAI's shapes: a response object, or its stream of
named events, each with a `sequence_number`:

    response.created, response.in_progress,
    per message: response.output_item.added, response.content_part.added,
        response.output_text.delta..., response.output_text.done,
        response.content_part.done, response.output_item.done;
    per call: response.output_item.added, response.function_call_arguments.delta,
        response.function_call_arguments.done, response.output_item.done;
    response.completed (response.incomplete when max_output_tokens cut it short).

The output is the text's pieces in order: a message item for each stretch of content, a
function_call item for each call. `output_text` is the SDK's to compute. A failure once the
stream has begun is an `error` event and then `response.failed`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from edge.serve.openai_replies import error_reply, sse
from edge.serve.responses_api import renamed
from edge.serve.tool_calls import Piece, ToolCall


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def response_usage(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _function_call(item_id: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
    }


def output_items(pieces: list[Piece]) -> list[dict[str, Any]]:
    """A whole reply's output: consecutive content pieces make one message."""
    items: list[dict[str, Any]] = []
    for piece in pieces:
        if piece.call is not None:
            items.append(_function_call(_id("fc"), piece.call, piece.call.arguments, "completed"))
        elif items and items[-1]["type"] == "message":
            items[-1]["content"][0]["text"] += piece.text
        elif piece.text:
            items.append(_message(_id("msg"), piece.text, "completed"))
    return items


class ResponsesReply:
    """One response, whole or as events; `echo`: the request's fields a response repeats
    (instructions, tools, tool_choice, text, metadata, ...)."""

    previews = False  # provisional text belongs to chat streams

    def __init__(self, model: str, echo: dict[str, Any]) -> None:
        self.model, self.echo = model, echo
        self._id = _id("resp")
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # streamed output so far
        self.open_text: str | None = None  # the text of the message being streamed, if one is

    @property
    def id(self) -> str:
        return self._id

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, **extra: Any
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self._id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
            **extra,
        }

    def body(self, pieces: list[Piece], finish: str, usage: dict[str, int], stats: dict[str, Any]) -> dict[str, Any]:
        status = "incomplete" if finish == "length" else "completed"
        return self.response(status, output_items(pieces), response_usage(usage), speculative_decoding=stats)

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(payload, event=kind)

    def opening(self) -> list[str]:
        snapshot = self.response("in_progress", [])
        return [self._event("response.created", response=snapshot), self._event("response.in_progress", response=snapshot)]

    def pieces(self, pieces: list[Piece]) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            out += self._call(piece.call) if piece.call is not None else self._text(piece.text)
        return out

    def _text(self, text: str) -> list[str]:
        out = []
        index = len(self.items) - 1
        if self.open_text is None:
            self.open_text, index = "", len(self.items)
            self.items.append(_message(_id("msg"), None, "in_progress"))
            item_id = self.items[index]["id"]
            out.append(self._event("response.output_item.added", output_index=index, item=self.items[index]))
            part = {"item_id": item_id, "output_index": index, "content_index": 0, "part": _text_part("")}
            out.append(self._event("response.content_part.added", **part))
        self.open_text += text
        where = {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}
        out.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        return out

    def _close_text(self) -> list[str]:
        if self.open_text is None:
            return []
        index, text = len(self.items) - 1, self.open_text
        self.open_text = None
        item = self.items[index] = _message(self.items[index]["id"], text, "completed")
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=_text_part(text)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, call: ToolCall) -> list[str]:
        out = self._close_text()
        index, item_id = len(self.items), _id("fc")
        self.items.append(_function_call(item_id, call, call.arguments, "completed"))
        where = {"item_id": item_id, "output_index": index}
        return [
            *out,
            self._event("response.output_item.added", output_index=index, item=_function_call(item_id, call, "", "in_progress")),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=self.items[index]),
        ]

    def provisional(self, text: str) -> list[str]:
        return []

    def named(self, err: BaseException) -> BaseException:
        return renamed(err)

    def failed(self, err: BaseException) -> list[str]:
        error = error_reply(err).body["error"]
        failed = self.response("failed", self.items, error={"code": error["code"] or error["type"], "message": error["message"]})
        return [
            self._event("error", code=error["code"], message=error["message"], param=error["param"]),
            self._event("response.failed", response=failed),
        ]

    def closing(self, finish: str, usage: dict[str, int], stats: dict[str, Any]) -> list[str]:
        out = self._close_text()
        status = "incomplete" if finish == "length" else "completed"
        final = self.response(status, self.items, response_usage(usage), speculative_decoding=stats)
        return [*out, self._event(f"response.{status}", response=final)]

    def end(self) -> list[str]:
        return []
