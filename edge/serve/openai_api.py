"""The OpenAI-compatible request bodies `edge-agent serve` accepts, and what a request asks
of the edge: settings over the server's defaults, its prompt's token ids, its stop strings.

Fields OpenAI defines and this server cannot honour (n > 1, logprobs, penalties other than
0) are refused with a 400 naming them rather than ignored; unknown fields are refused too,
as OpenAI does. `top_k` and `repetition_penalty` are vLLM's sampling extras. The
`speculative` object is this server's extension (README: "Use it from your app").
"""

from __future__ import annotations

import secrets
from typing import Any, Literal, TypeVar

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edge.config import EdgeSettings
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


class StreamOptions(BaseModel):
    include_usage: bool = False


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, ...: not used by chat templates
    role: Literal["system", "developer", "user", "assistant"]
    content: list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_as_part(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value

    def for_template(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": "".join(part.text for part in self.content or [])}


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _no_logprobs(self) -> ChatRequest:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_ids(self, tokenizer: EdgeTokenizer) -> list[int]:
        if tokenizer.chat_template is None:
            raise InvalidParameter("the model has no chat template: send a raw prompt to /v1/completions", "messages")
        try:
            text = tokenizer.render_chat([m.for_template() for m in self.messages])
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

    def prompt_ids(self, tokenizer: EdgeTokenizer) -> list[int]:
        text = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return _non_empty(tokenizer.encode(text), "prompt")


R = TypeVar("R", bound=SamplingRequest)


def _non_empty(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise InvalidParameter("the prompt encodes to no tokens", param)
    return ids


def _param(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic location as OpenAI names a parameter: stop[0], speculative.k."""
    out = ""
    for part in loc:
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
