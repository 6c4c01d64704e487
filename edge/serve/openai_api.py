"""The OpenAI-compatible request bodies `edge-agent serve` accepts, and what a request asks
of the edge: settings over the server's defaults, its prompt's token ids, its stop strings,
the grammar its output must follow and whether tool calls are read out of it.

Every field of OpenAI's chat API is honoured, accepted as metadata that changes nothing
(`user`, `metadata`, `store`: nothing is stored, `service_tier`, the prompt cache's hints:
caching here is automatic, `safety_identifier`), or refused with a 400 naming it when it asks
for what this server cannot do (n > 1, logprobs, penalties other than 0, logit_bias, audio,
predicted outputs, reasoning, web search, moderation, verbosity, the deprecated functions);
unknown fields are refused too, as OpenAI does. `top_k` and `repetition_penalty` are vLLM's
sampling extras. The `speculative` object is this server's extension (README: "Use it from
your app").
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal, TypeVar

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from edge.config import EdgeSettings
from edge.serve.structured import ResponseFormat, TextFormat, format_grammar
from edge.serve.tagged import is_tag
from edge.serve.tools import ToolChoice, ToolPlan, ToolSpec, plan_tools
from edge.tokenizer import EdgeTokenizer
from shared.errors import InvalidParameter

MAX_STOP_STRINGS = 16


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Speculative(_Strict):
    """Per-request control of speculation; None keeps the server's setting."""

    enabled: bool | None = None  # false: the target alone (cloud_only) for this request
    k: int | None = Field(None, ge=0, le=64)
    k_policy: Literal["fixed", "la-ratio", "egag", "cost"] | None = None
    drafter: Literal["model", "ngram", "hybrid"] | None = None
    strict: bool | None = None  # never show provisional text, wait instead
    provisional: bool = False  # stream provisional text as previews (marked, never content)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; no chunk carries padding


class SamplingRequest(_Strict):
    """What chat and text completions share."""

    model: str | None = None  # any name is answered by the one model served
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    speculative: Speculative = Speculative()

    _stop_list = field_validator("stop", mode="before")(_as_list)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str] | None) -> list[str] | None:
        if value and not all(value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("not supported (use repetition_penalty)")
        return value

    def token_budget(self) -> int | None:
        return self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def tool_plan(self) -> ToolPlan:
        """What the request's tools ask (chat requests have tools; others none)."""
        return ToolPlan()

    def grammar(self, plan: ToolPlan) -> tuple[str, str]:
        """(the grammar the output must follow, the field that asked for it); ("", "") for none."""
        return "", ""

    def prompt_ids(self, tokenizer: EdgeTokenizer, plan: ToolPlan) -> list[int]:
        raise NotImplementedError

    def _sampled(self, base: EdgeSettings) -> bool:
        return (base.temperature if self.temperature is None else self.temperature) > 0

    def _seed(self, base: EdgeSettings) -> int | None:
        """The request's seed; else --seed when the server was given one; else, when sampling, a
        fresh one (as OpenAI: no seed, a new sample each time)."""
        temperature = base.temperature if self.temperature is None else self.temperature
        if self.seed is not None or "seed" in base.model_fields_set or temperature == 0:
            return self.seed
        return secrets.randbelow(2**31)

    def settings_update(self, base: EdgeSettings) -> dict[str, Any]:
        """EdgeSettings fields this request sets over the server's defaults."""
        values: dict[str, Any] = {
            "max_new_tokens": self.token_budget(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "seed": self._seed(base),
        }
        spec = self.speculative
        values |= {"k": spec.k, "k_policy": spec.k_policy, "drafter": spec.drafter, "strict": spec.strict}
        if spec.enabled is False:  # pinned: the target alone
            values["mode"] = "cloud_only"
        elif spec.enabled or (self.seed is not None and self._sampled(base) and base.mode == "auto"):
            # pinned: speculation throughout. A seeded sample must repeat its text, and auto mode's
            # switches follow measured time, while the target's draws differ between its own
            # decoding and a round's: one seed gives one text only on one path.
            values["mode"] = "speculative"
        return {name: value for name, value in values.items() if value is not None}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


def json_object_text(value: str) -> str:
    """A call's arguments, as OpenAI sends them: the text of one JSON object."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError("not a JSON object")
    return value


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str

    _arguments = field_validator("arguments")(json_object_text)


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """As HF chat templates read a call: its arguments parsed (Qwen2.5's writes them with tojson)."""
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, ...: not used by chat templates
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_as_part(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value

    @field_validator("tool_calls")
    @classmethod
    def _assistants_only(cls, value: list[AssistantToolCall] | None, info: ValidationInfo) -> list[AssistantToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has tool calls")
        return value

    @model_validator(mode="after")
    def _tool_answers_a_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])

    def for_template(self, called: dict[str, str]) -> dict[str, Any]:
        """The message as chat templates read it; `called`: the earlier calls' names by id."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.role == "tool":
            message |= {"tool_call_id": self.tool_call_id, "name": called.get(self.tool_call_id or "", "")}
        return message


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages for the chat template; 400 for a tool result no earlier call asked for."""
    called: dict[str, str] = {}
    out = []
    for i, message in enumerate(messages):
        if message.role == "tool" and message.tool_call_id not in called:
            param = f"messages[{i}].tool_call_id"
            raise InvalidParameter(f"{param}: no earlier assistant tool call has id {message.tool_call_id!s:.64}", param)
        out.append(message.for_template(called))
        called |= {call.id: call.function.name for call in message.tool_calls or []}
    return out


def refuse(reason: str) -> Any:
    """A validator for a field this server cannot honour: only its empty values pass."""

    def check(cls: type, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False, {}, []):
            raise ValueError(reason)
        return value

    return classmethod(check)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    response_format: ResponseFormat | None = None
    # Metadata: accepted, changes nothing here.
    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is stored either way
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prefixes are kept per caller, without hints
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # Refused unless empty: what this server cannot do.
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    logit_bias: dict[str, Any] | None = None
    functions: Any = None
    function_call: Any = None

    _no_logprobs = field_validator("logprobs", "top_logprobs")(refuse("logprobs are not supported"))
    _no_audio = field_validator("audio")(refuse("audio output is not supported (text only)"))
    _no_prediction = field_validator("prediction")(refuse("predicted outputs are not supported (the draft model predicts)"))
    _no_reasoning = field_validator("reasoning_effort", "verbosity")(refuse("not supported: the model does not reason"))
    _no_search = field_validator("web_search_options")(refuse("web search is not supported"))
    _no_moderation = field_validator("moderation")(refuse("moderation is not supported"))
    _no_bias = field_validator("logit_bias")(refuse("not supported (use response_format or tools for constrained output)"))
    _no_functions = field_validator("functions", "function_call")(refuse("deprecated by OpenAI: use tools and tool_choice"))

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value and value != ["text"]:
            raise ValueError('only ["text"] is supported')
        return value

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_plan(self) -> ToolPlan:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls is not False)

    def grammar(self, plan: ToolPlan) -> tuple[str, str]:
        fmt = self.response_format
        if plan.forced:
            if fmt is not None and not isinstance(fmt, TextFormat):
                raise InvalidParameter("response_format: a forced tool call is not also a JSON reply", "response_format")
            return plan.grammar, "tool_choice"
        grammar = format_grammar(fmt, "response_format")
        return grammar, "response_format" if grammar else ""

    def prompt_ids(self, tokenizer: EdgeTokenizer, plan: ToolPlan) -> list[int]:
        if tokenizer.chat_template is None:
            raise InvalidParameter("the model has no chat template: send a raw prompt to /v1/completions", "messages")
        messages = template_messages(self.messages)
        try:
            text = tokenizer.render_chat(messages, tools=plan.rendered)
        except TemplateError as err:
            raise InvalidParameter(f"the chat template refused the messages: {err}", "messages") from None
        return _non_empty(tokenizer.encode(text, add_special_tokens=False), "messages")


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] = Field(min_length=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        for name in ("echo", "suffix", "best_of", "logprobs"):
            if getattr(self, name) not in (None, False, 1 if name == "best_of" else None):
                raise ValueError(f"{name} is not supported")
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("one prompt per request (a list holds exactly one string)")
        return self

    def prompt_ids(self, tokenizer: EdgeTokenizer, plan: ToolPlan) -> list[int]:
        text = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return _non_empty(tokenizer.encode(text), "prompt")


R = TypeVar("R", bound=BaseModel)


def _non_empty(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise InvalidParameter("the prompt encodes to no tokens", param)
    return ids


def _param(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic location as OpenAI names a parameter: stop[0], speculative.k."""
    out = ""
    for part in loc:
        if isinstance(part, str) and is_tag(part):
            continue  # a union member's tag, not a field
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out or None


def invalid_parameter(err: ValidationError) -> InvalidParameter:
    """The first problem of a request body, as one line naming the parameter."""
    first = err.errors()[0]
    param = _param(first["loc"])
    if first["type"] == "extra_forbidden":
        return InvalidParameter(f"unknown parameter {param}", param)
    message = first["msg"].removeprefix("Value error, ")
    return InvalidParameter(f"{param}: {message}" if param else message, param)


def parse_request(model: type[R], body: Any) -> R:
    if not isinstance(body, dict):
        raise InvalidParameter("the request body must be a JSON object", None)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise invalid_parameter(err) from None


def request_settings(base: EdgeSettings, update: dict[str, Any]) -> EdgeSettings:
    """The server's settings with this request's values, validated as flags are."""
    try:
        return EdgeSettings.model_validate(base.model_dump() | update)
    except ValidationError as err:
        raise invalid_parameter(err) from None
