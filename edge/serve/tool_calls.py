"""Tool calls out of a model's text, in the Hermes format Qwen2.5's chat template asks for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. The parser reads text as it streams and hands back, in order, the content
between calls and each call once its closing tag arrives (vLLM's Hermes parser streams the
arguments character by character; OpenAI's shapes allow them in one fragment, and whole
calls are simpler to get right).

The rules, the same streamed or not (a stream's pieces join to the whole reply's):
- text outside the blocks is content, verbatim, except whitespace next to a call (the
  newlines a template puts around blocks); a reply without a call is its text unchanged;
- a block whose body is not one JSON object with a known `name` and an object of
  `arguments` is content, tags and all, as is a block still open when the text ends: an
  unparseable call is the model's text, never an error;
- with `first_only` (parallel_tool_calls false), calls after the first are dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it: text, not a parsed value


@dataclass(frozen=True)
class Piece:
    """One part of a reply, in order: content text, or a call."""

    text: str = ""
    call: ToolCall | None = None


def parse_call(body: str, names: Collection[str] | None) -> ToolCall | None:
    """A block's body as a call, or None. `arguments` may be absent (a call without
    parameters) or a JSON object written as a string (some models quote it)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str):
        return None
    if names is not None and name not in names:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """Characters at the end of `text` that could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Pieces of a reply from its text, pushed as it streams."""

    def __init__(self, names: Collection[str] | None = None, first_only: bool = False) -> None:
        self.names, self.first_only = names, first_only
        self.calls = 0  # calls handed out
        self._buffer = ""  # text not yet decided
        self._spaces = ""  # whitespace held back: dropped if a call follows, content otherwise
        self._in_call = False  # the buffer is a block's body (its start tag consumed)
        self._after_call = False  # the last piece was a call: leading whitespace is dropped

    def push(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """The text has ended: what is left is content (an open block included)."""
        rest = (CALL_START if self._in_call else "") + self._buffer
        if self._after_call:  # whitespace after the last call is dropped
            rest = rest.lstrip()
        tail = self._spaces + rest
        self._buffer, self._spaces, self._in_call = "", "", False
        return [Piece(tail)] if tail else []

    def _step(self, out: list[Piece]) -> bool:
        """Decide what the buffer allows; True while there may be more to decide."""
        if self._in_call:
            end = self._buffer.find(CALL_END)
            if end < 0:
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_END) :]
            self._in_call = False
            self._block(body, out)
            return True
        start = self._buffer.find(CALL_START)
        if start >= 0:
            self._content(self._buffer[:start], out, before_call=True)
            self._buffer, self._in_call = self._buffer[start + len(CALL_START) :], True
            return True
        keep = _partial_suffix(self._buffer, CALL_START)
        text = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(text) :]
        self._content(text, out, before_call=False)
        return False

    def _content(self, text: str, out: list[Piece], before_call: bool) -> None:
        """Content, holding back trailing whitespace (a call may follow it)."""
        if self._after_call:
            text = text.lstrip()
            if not text and not before_call:
                return
        body = text.rstrip()
        if body:
            out.append(Piece(self._spaces + body))
            self._spaces, self._after_call = "", False
        self._spaces += text[len(body) :]

    def _block(self, body: str, out: list[Piece]) -> None:
        call = parse_call(body.strip(), self.names)
        if call is None:  # not a call: the model's text, tags and all
            out.append(Piece(f"{self._spaces}{CALL_START}{body}{CALL_END}"))
            self._spaces, self._after_call = "", False
            return
        self._spaces = ""
        self._after_call = True
        if self.first_only and self.calls:
            return
        self.calls += 1
        out.append(Piece(call=call))


def split_reply(text: str, names: Collection[str] | None = None, first_only: bool = False) -> tuple[str, list[ToolCall]]:
    """A whole reply as (content, calls): the streamed pieces joined."""
    parser = ToolCallParser(names, first_only)
    pieces = parser.push(text) + parser.finish()
    content = "".join(p.text for p in pieces if p.call is None)
    return content, [p.call for p in pieces if p.call is not None]
