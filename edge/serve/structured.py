"""Structured output: `response_format` as OpenAI's chat API defines it (`text.format` in the
Responses API), and the grammar each asks of the generation.

A JSON schema is bounded before anything compiles it (its JSON size and nesting depth), and
an error about it names the field and never echoes the schema. Compiling and the grammar's
own limits are shared/grammar.py's (at Engine.start).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edge.serve.tagged import tagged
from shared.errors import InvalidParameter
from shared.grammar import GrammarRefused, json_schema_grammar

MAX_SCHEMA_BYTES = 32 * 1024  # a schema's JSON: ample for a tool's or a reply's fields
MAX_SCHEMA_DEPTH = 32  # nested objects and arrays in a schema's JSON
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    json_schema: Any = Field(alias="schema")  # checked when its grammar is built: 400s name the format
    strict: bool | None = None


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


if TYPE_CHECKING:
    ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat
else:
    ResponseFormat = tagged(
        {"text": TextFormat, "json_object": JsonObjectFormat, "json_schema": JsonSchemaFormat},
        'the type is "text", "json_object" or "json_schema"',
    )


def _depth(value: Any) -> int:
    """How deeply objects and arrays nest in a JSON value (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_schema(schema: Any, param: str) -> None:
    """A schema small and shallow enough to compile; InvalidParameter naming `param` if not."""
    if not isinstance(schema, dict | bool):
        raise InvalidParameter(f"{param}: a JSON schema is an object or a boolean", param)
    if len(json.dumps(schema).encode()) > MAX_SCHEMA_BYTES:
        raise InvalidParameter(f"{param}: the schema is larger than {MAX_SCHEMA_BYTES // 1024} KiB", param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidParameter(f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param)


def lenient(schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    """strict false (OpenAI: best effort): keywords the grammar engine does not implement are
    ignored rather than refused. Otherwise (true, or absent) the schema is followed as given."""
    if strict is not False:
        return schema
    options = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(options if isinstance(options, dict) else {}), "lenient": True}}


def schema_grammar(schema: dict[str, Any] | bool, strict: bool | None, param: str) -> str:
    check_schema(schema, param)
    if isinstance(schema, bool):  # true: any JSON value; false: none
        schema = {} if schema else {"not": {}}
    try:
        return json_schema_grammar(lenient(schema, strict))
    except GrammarRefused as err:
        raise refused(err, param) from None


def refused(err: InvalidParameter, param: str) -> InvalidParameter:
    """A grammar's refusal as a 400 naming the request's field."""
    message = str(err)
    return InvalidParameter(message if message.startswith(param) else f"{param}: {message}", param)


def format_grammar(fmt: TextFormat | JsonObjectFormat | JsonSchemaFormat | None, param: str) -> str:
    """The grammar a response format asks for ("" for free text)."""
    if isinstance(fmt, JsonObjectFormat):
        return json_schema_grammar({"type": "object"})
    if isinstance(fmt, JsonSchemaFormat):
        spec = fmt.json_schema
        return schema_grammar(spec.json_schema, spec.strict, param)
    return ""
