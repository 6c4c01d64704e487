"""Property-based fuzzing of `edge-agent serve`'s request bodies (hypothesis): chat completions
and the Responses API with every field drawn, the tool and structured-output fields above all
(tools with good, empty, long and duplicate names, schemas valid, garbage, deep and large,
tool_choice of every shape, tool messages answering calls or nothing, response formats, OpenAI's
metadata and refused fields), and the model's text itself (tool-call blocks whole, cut, malformed).

The app is the real one over the scripted engine (tests/serve_scripted.py), whose `start`
compiles the request's grammar on a real byte-level vocabulary as the real engine does, so a
schema the grammar engine refuses takes the real path. For every case: the status is 200 or
400 (never a 500); a 400 has OpenAI's error shape, names a parameter or none, is short, holds no
exception class name or traceback, and never echoes the long strings planted in the request;
a 200 chat reply's tool calls name offered tools and carry JSON arguments.

SPECDEC_FUZZ_EXAMPLES=N: N examples per property."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.grammar import GrammarVocab
from tests.serve_scripted import ScriptedEngine, scripted_app

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "150"))
PLANT = "Z" * 80  # a long string put in requests: no error may repeat it
LEAK = re.compile(r"Traceback|Exception|Error\(|File \"|pydantic|\bline \d+")


def mostly(clean: st.SearchStrategy[Any], fuzzed: st.SearchStrategy[Any], clean_in_ten: int = 6) -> st.SearchStrategy[Any]:
    """`clean` in clean_in_ten draws of ten, else `fuzzed`: the fields a case is about get past
    the others' checks often enough to be fuzzed deeply."""
    return st.integers(0, 9).flatmap(lambda n: clean if n < clean_in_ten else fuzzed)


VALID_NAMES = st.sampled_from(["get_weather", "get_time", "search"])
NAMES = mostly(VALID_NAMES, st.one_of(st.just(""), st.just(PLANT), st.text(max_size=12)), 8)
SCHEMAS: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.just({"type": "string"}),
        st.just({"type": "integer", "minimum": 0, "maximum": 9}),
        st.just({"enum": ["a", "b"]}),
        st.just({"type": "objekt"}),
        st.booleans(),
        st.integers(),
        st.just({"type": "string", "pattern": "(a"}),
        st.just({"description": PLANT}),
    ),
    lambda inner: st.one_of(
        st.builds(lambda p: {"type": "object", "properties": p}, st.dictionaries(st.text(max_size=6), inner, max_size=4)),
        st.builds(lambda i: {"type": "array", "items": i}, inner),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, max_size=3)),
    ),
    max_leaves=12,
)


def _tool(name: str, schema: Any, strict: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": schema, "strict": strict}}


TOOLS = st.lists(st.builds(_tool, NAMES, SCHEMAS, st.sampled_from([True, False, None, "yes"])), max_size=3)
TOOL_CHOICES = st.one_of(
    st.sampled_from(["auto", "none", "required", "required", "always", None]),
    st.builds(lambda n: {"type": "function", "function": {"name": n}}, NAMES),
    st.builds(
        lambda mode, names: {
            "type": "allowed_tools",
            "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]},
        },
        st.sampled_from(["auto", "required", "sometimes"]),
        st.lists(NAMES, max_size=2),
    ),
    st.integers(),
)
RESPONSE_FORMATS = st.one_of(
    st.none(),
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}, "json"]),
    st.builds(
        lambda schema, strict, name: {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}},
        SCHEMAS,
        st.sampled_from([True, False, None]),
        NAMES,
    ),
)
CALL_IDS = st.sampled_from(["call_1", "call_2", PLANT, ""])
MESSAGES = st.lists(
    st.one_of(
        st.builds(lambda c: {"role": "user", "content": c}, st.one_of(st.text(max_size=20), st.just(PLANT))),
        st.builds(lambda c: {"role": "system", "content": c}, st.text(max_size=20)),
        st.builds(
            lambda i, n, a: {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}],
            },
            CALL_IDS,
            NAMES,
            st.sampled_from(['{"city": "Oslo"}', "{", "[]", PLANT]),
        ),
        st.builds(lambda i, c: {"role": "tool", "tool_call_id": i, "content": c}, CALL_IDS, st.text(max_size=10)),
        st.builds(lambda r: {"role": r, "content": "x"}, st.sampled_from(["bogus", "function", ""])),
    ),
    min_size=1,
    max_size=4,
)
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


EXTRAS = st.dictionaries(
    st.sampled_from(
        [
            "metadata",
            "store",
            "service_tier",
            "user",
            "logit_bias",
            "modalities",
            "audio",
            "prediction",
            "reasoning_effort",
            "verbosity",
            "web_search_options",
            "functions",
            "function_call",
            "parallel_tool_calls",
            "seed",
            "n",
            PLANT[:20],
        ]
    ),
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=8), st.just({"k": PLANT}), st.just(["text"])),
    max_size=3,
)
TEXTS = st.lists(
    st.one_of(
        st.text(max_size=12),
        st.sampled_from(
            [
                "<tool_call>\n",
                "</tool_call>",
                '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                '{"name": ',
                "<tool_",
                "\n",
            ]
        ),
    ),
    max_size=6,
)


class CompilingEngine(ScriptedEngine):
    """The scripted engine, but `start` compiles the grammar as the real engine does."""

    vocab: GrammarVocab | None = None

    def start(self, *args: Any, grammar: str = "", **kwargs: Any) -> Any:
        if grammar and self.vocab is not None:
            self.vocab.compile(grammar)
        return super().start(*args, grammar=grammar, **kwargs)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> tuple[ScriptedEngine, TestClient]:
    folder: Path = tmp_path_factory.mktemp("fuzz-serve")
    engine, http = scripted_app(folder)
    engine.__class__ = CompilingEngine
    engine.vocab = GrammarVocab((folder / "tokenizer.json").read_text(), len(engine.ctx.tokenizer))  # type: ignore[attr-defined]
    return engine, http


def _check(reply: Any, body: dict[str, Any]) -> None:
    assert reply.status_code in (200, 400), (reply.status_code, reply.text[:500], body)
    if reply.status_code == 400:
        error = reply.json()["error"]
        message = error["message"]
        assert message and len(message) < 1000, message
        assert PLANT not in message, message  # a bounded excerpt at most
        assert not LEAK.search(message), message
        assert error["param"] is None or isinstance(error["param"], str)


def _stream_ok(reply: Any) -> None:
    """A streamed reply is whole SSE frames, JSON each, ending in [DONE] (chat) or a final event."""
    frames = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert frames
    for frame in frames:
        if frame != "[DONE]":
            json.loads(frame)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    messages=mostly(st.just(ASK), MESSAGES),
    tools=st.one_of(st.none(), TOOLS),
    tool_choice=TOOL_CHOICES,
    response_format=RESPONSE_FORMATS,
    extras=mostly(st.just({}), EXTRAS),
    text=TEXTS,
    stream=st.booleans(),
)
def test_chat_bodies_fail_alone_and_cleanly(
    app: tuple[ScriptedEngine, TestClient], messages, tools, tool_choice, response_format, extras, text, stream
) -> None:  # type: ignore[no-untyped-def]
    engine, http = app
    engine.say(*text)
    body: dict[str, Any] = {"model": "m", "messages": messages, "stream": stream, **extras}
    for name, value in (("tools", tools), ("tool_choice", tool_choice), ("response_format", response_format)):
        if value is not None:
            body[name] = value
    reply = http.post("/v1/chat/completions", json=body)
    _check(reply, body)
    if reply.status_code != 200:
        return
    if stream:
        _stream_ok(reply)
        return
    offered = {t["function"]["name"] for t in tools or []}
    for call in reply.json()["choices"][0]["message"].get("tool_calls") or []:
        assert call["function"]["name"] in offered
        json.loads(call["function"]["arguments"])


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    input_=st.one_of(
        st.just("Weather in Oslo?"),
        st.text(max_size=20),
        st.just(PLANT),
        st.lists(
            st.one_of(
                st.builds(lambda c: {"type": "message", "role": "user", "content": c}, st.text(max_size=10)),
                st.builds(lambda i, n: {"type": "function_call", "call_id": i, "name": n, "arguments": "{}"}, CALL_IDS, NAMES),
                st.builds(lambda i: {"type": "function_call_output", "call_id": i, "output": "ok"}, CALL_IDS),
                st.just({"type": "reasoning"}),
            ),
            max_size=3,
        ),
    ),
    tools=st.one_of(
        st.none(), st.lists(st.builds(lambda n, s: {"type": "function", "name": n, "parameters": s}, NAMES, SCHEMAS), max_size=2)
    ),
    fmt=st.one_of(
        st.none(),
        st.builds(lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}}, SCHEMAS),
        st.just({"format": "json"}),
    ),
    extras=st.dictionaries(
        st.sampled_from(["store", "previous_response_id", "metadata", "instructions", "max_output_tokens", "conversation"]),
        st.one_of(st.none(), st.booleans(), st.integers(-2, 5), st.text(max_size=6)),
        max_size=2,
    ),
    text=TEXTS,
    stream=st.booleans(),
)
def test_responses_bodies_fail_alone_and_cleanly(
    app: tuple[ScriptedEngine, TestClient], input_, tools, fmt, extras, text, stream
) -> None:  # type: ignore[no-untyped-def]
    engine, http = app
    engine.say(*text)
    body: dict[str, Any] = {"model": "m", "input": input_, "stream": stream, **extras}
    if tools is not None:
        body["tools"] = tools
    if fmt is not None:
        body["text"] = fmt
    reply = http.post("/v1/responses", json=body)
    _check(reply, body)
