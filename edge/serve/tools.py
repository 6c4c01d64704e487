"""What a request's `tools`, `tool_choice` and `parallel_tool_calls` ask of a generation
(OpenAI's chat shapes; the Responses API's are converted to these):

- the tools go to the chat template, which lists them for the model (Qwen2.5's: a "# Tools"
  section of the system turn), whatever tool_choice says, as OpenAI does;
- "auto" (the default with tools): the model may call; calls are read out of its text
  (edge/serve/tool_calls.py), unconstrained;
- "none": the model is asked not to call: nothing is parsed, the text is the reply;
- "required", a named function, or allowed_tools in "required" mode: a grammar forces the
  output to be calls in the Hermes envelope, each `{"name": <a permitted tool>, "arguments":
  <that tool's parameters>}` (one call, or one or more with parallel_tool_calls);
- allowed_tools limits the calls to some of the tools (all of them still rendered).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edge.serve.structured import NAME_PATTERN, check_schema
from edge.serve.tagged import tagged
from edge.serve.tool_calls import CALL_END, CALL_START
from shared.errors import InvalidParameter
from shared.grammar import GrammarRefused, lark_grammar

# How Qwen2.5's template writes JSON (tojson: ", " and ": "); a forced call is written the same way.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def arguments_schema(self) -> dict[str, Any]:
        """The parameters' schema; none given means no parameters (OpenAI's rule)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class AllowedToolRef(_Strict):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Strict):
    mode: Literal["auto", "required"]
    tools: list[AllowedToolRef] = Field(min_length=1)


class AllowedToolsChoice(_Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


if TYPE_CHECKING:
    ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice
else:
    ToolChoice = tagged(
        {"str": Literal["none", "auto", "required"], "function": NamedToolChoice, "allowed_tools": AllowedToolsChoice},
        'one of "none", "auto", "required", {"type": "function", ...} or {"type": "allowed_tools", ...}',
    )


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools resolved: what the template gets, whether and which calls are read
    out of the text, and the grammar that forces calls ("" when none does)."""

    rendered: list[dict[str, Any]] | None = None  # for the chat template
    parse: bool = False  # read calls out of the text
    names: frozenset[str] = frozenset()  # the tools a call may name
    first_only: bool = False  # parallel_tool_calls false: one call at most
    grammar: str = ""

    @property
    def forced(self) -> bool:
        return bool(self.grammar)


def _choice_names(tools: list[ToolSpec], choice: ToolChoice) -> tuple[str, frozenset[str]]:
    """(mode, the names a call may have) of a tool_choice; 400 for a name that is no tool's."""
    every = frozenset(t.function.name for t in tools)
    if isinstance(choice, str):
        return choice, every
    wanted = [choice.function] if isinstance(choice, NamedToolChoice) else [t.function for t in choice.allowed_tools.tools]
    missing = [f.name for f in wanted if f.name not in every]
    if missing:
        raise InvalidParameter(f"tool_choice: no tool is named {missing[0][:64]!r}", "tool_choice")
    mode = "required" if isinstance(choice, NamedToolChoice) else choice.allowed_tools.mode
    return mode, frozenset(f.name for f in wanted)


def check_tools(tools: list[ToolSpec]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise InvalidParameter(f"tools[{i}].function.name: {name!r} is named twice", f"tools[{i}].function.name")
        seen.add(name)
        check_schema(tool.function.arguments_schema(), f"tools[{i}].function.parameters")


def plan_tools(tools: list[ToolSpec] | None, choice: ToolChoice | None, parallel: bool) -> ToolPlan:
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidParameter("tool_choice: no tools were given", "tool_choice")
        return ToolPlan()
    check_tools(tools)
    rendered = [tool.model_dump(exclude_none=True) for tool in tools]
    mode, names = _choice_names(tools, choice or "auto")
    if mode == "none":
        return ToolPlan(rendered)
    if mode == "auto":
        return ToolPlan(rendered, parse=True, names=names, first_only=not parallel)
    chosen = [t.function for t in tools if t.function.name in names]
    return ToolPlan(rendered, parse=True, names=names, first_only=not parallel, grammar=call_grammar(chosen, parallel))


def _call_schema(function: FunctionSpec) -> dict[str, Any]:
    """One call of `function` as its JSON: {"name": const, "arguments": its parameters}."""
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": function.arguments_schema()},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        # strict false (OpenAI: best effort): keywords the engine lacks are ignored, not refused
        "x-guidance": {**_JSON_STYLE, "lenient": function.strict is False},
    }


def call_lark(functions: list[FunctionSpec], parallel: bool) -> str:
    """The Lark grammar of Hermes calls of these functions: one, or one or more a line apart."""
    start, end = json.dumps(CALL_START + "\n"), json.dumps("\n" + CALL_END)
    rules = [
        "start: call" + (' ("\\n" call)*' if parallel else ""),
        f"call: {start} ({' | '.join(f'fn{i}' for i in range(len(functions)))}) {end}",
    ]
    rules += [f"fn{i}: %json{json.dumps(_call_schema(f))}" for i, f in enumerate(functions)]
    return "\n".join(rules)


def call_grammar(functions: list[FunctionSpec], parallel: bool) -> str:
    try:
        return lark_grammar(call_lark(functions, parallel))
    except (GrammarRefused, ValueError) as err:
        raise InvalidParameter(f"tools: no grammar for the tool calls ({str(err)[:120]})", "tools") from None
