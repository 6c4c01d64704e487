"""The body of `POST /v1/responses` (OpenAI's Responses API, for text and function tools) and
the chat request it amounts to: `instructions` as a system message first, `input` (a string,
or message / function_call / function_call_output items) as the conversation, flat function
tools as chat's nested ones, `text.format` as `response_format`, `max_output_tokens` as
`max_completion_tokens`.

Nothing is stored: `store` is accepted (and changes nothing), `previous_response_id` and
`conversation` are refused, as are the built-in tools, background runs, reasoning and the
other fields this server cannot honour. Metadata (`metadata`, `user`, `service_tier`, the
prompt cache's hints, `safety_identifier`) is accepted. `seed` and the `speculative` object
are this server's extensions, as in chat requests.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from edge.serve.openai_api import ChatRequest, Speculative, StreamOptions, json_object_text, parse_request, refuse
from edge.serve.structured import NAME_PATTERN, JsonObjectFormat, TextFormat
from edge.serve.tagged import tagged
from shared.errors import InvalidParameter


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Loose(BaseModel):
    # Items echoed back from an earlier response carry ids, statuses, annotations: not read.
    model_config = ConfigDict(extra="ignore")


class TextContent(_Loose):
    type: Literal["input_text", "output_text"]
    text: str


def _joined(content: list[TextContent]) -> str:
    return "".join(part.text for part in content)


def _text_as_part(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class MessageItem(_Loose):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[TextContent]

    _text = field_validator("content", mode="before")(_text_as_part)


class FunctionCallItem(_Loose):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str

    _arguments = field_validator("arguments")(json_object_text)


class FunctionCallOutputItem(_Loose):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[TextContent]

    _text = field_validator("output", mode="before")(_text_as_part)


if TYPE_CHECKING:
    InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
else:
    InputItem = tagged(
        {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem},
        'an input item is a "message", "function_call" or "function_call_output"',
        untyped="message",
    )


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class AllowedTools(_Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction] = Field(min_length=1)


if TYPE_CHECKING:
    ToolChoice = Literal["none", "auto", "required"] | NamedFunction | AllowedTools
else:
    ToolChoice = tagged(
        {"str": Literal["none", "auto", "required"], "function": NamedFunction, "allowed_tools": AllowedTools},
        'one of "none", "auto", "required", {"type": "function", "name": ...} or {"type": "allowed_tools", ...}',
    )


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    name: str = Field(pattern=NAME_PATTERN)
    json_schema: Any = Field(alias="schema")  # checked when its grammar is built: 400s name the format
    description: str | None = None
    strict: bool | None = None


if TYPE_CHECKING:
    Format = TextFormat | JsonObjectFormat | JsonSchemaFormat
else:
    Format = tagged(
        {"text": TextFormat, "json_object": JsonObjectFormat, "json_schema": JsonSchemaFormat},
        'the type is "text", "json_object" or "json_schema"',
    )


class TextConfig(_Strict):
    format: Format | None = None
    verbosity: Literal["medium"] | None = None  # the only one there is here


class ResponsesRequest(_Strict):
    model: str | None = None
    input: list[InputItem]  # a string is one user message
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns; nothing is dropped here
    include: list[str] | None = None
    # Metadata: accepted, changes nothing here.
    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is stored either way
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # This server's extensions.
    seed: int | None = None
    speculative: Speculative = Speculative()
    # Refused unless empty.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _user_text(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    _nothing_stored = field_validator("previous_response_id", "conversation")(
        refuse("nothing is stored here: send the whole conversation as input")
    )
    _no_background = field_validator("background")(refuse("background responses are not supported"))
    _no_prompt = field_validator("prompt")(refuse("stored prompts are not supported"))
    _no_reasoning = field_validator("reasoning")(refuse("not supported: the model does not reason"))
    _unsupported = field_validator(
        "max_tool_calls", "top_logprobs", "context_management", "moderation", "image", "access_programs", "include"
    )(refuse("not supported"))

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        called: set[str] = set()
        for i, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _joined(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # one assistant turn: its text and calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                called.add(item.call_id)
            else:
                if item.call_id not in called:
                    param = f"input[{i}].call_id"
                    raise InvalidParameter(f"{param}: no earlier function_call has call_id {item.call_id:.64}", param)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)})
        if not messages:
            raise InvalidParameter("input: no messages", "input")
        return messages

    def _tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None:
            return None
        return [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools]

    def _tool_choice(self) -> Any:
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            return {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, AllowedTools):
            names = [{"type": "function", "function": {"name": t.name}} for t in choice.tools]
            return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": names}}
        return choice

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, JsonSchemaFormat):
            spec = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
            return {"type": "json_schema", "json_schema": spec}
        return fmt.model_dump() if fmt is not None else None

    def chat_request(self) -> ChatRequest:
        """The chat request this response amounts to."""
        body = {
            "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": self._tools(),
            "tool_choice": self._tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self._response_format(),
            "stream": self.stream,
            "seed": self.seed,
            "speculative": self.speculative.model_dump(exclude_unset=True),
        }
        return parse_request(ChatRequest, {key: value for key, value in body.items() if value is not None})

    def echo(self) -> dict[str, Any]:
        """The request's fields a response repeats."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,  # never stored
            "temperature": self.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "top_p": self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }


# Chat's field names for a converted request, as the Responses API names them.
_RENAMES = [
    (r"^response_format", "text.format"),
    (r"^max_(completion_)?tokens", "max_output_tokens"),
    (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"^tool_choice\.function\.", "tool_choice."),
    (r"^tool_choice\.allowed_tools\.", "tool_choice."),
    (r"^messages(\[\d+\])?(\..*)?$", "input"),  # a message index is not an input index
]


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for pattern, replacement in _RENAMES:
        renamed = re.sub(pattern, replacement, param)
        if renamed != param:
            return renamed
    return param


def renamed(err: BaseException) -> BaseException:
    """An error naming a chat field, naming the Responses API's instead."""
    if not isinstance(err, InvalidParameter) or (param := responses_param(err.param)) == err.param:
        return err
    message = str(err)
    if err.param and message.startswith(err.param):
        message = f"{param}{message[len(err.param) :]}"
    return InvalidParameter(message, param)


@contextmanager
def responses_names() -> Iterator[None]:
    """Errors raised inside name the Responses API's fields rather than chat's."""
    try:
        yield
    except InvalidParameter as err:
        raise renamed(err) from None
