"""Tools, structured output, OpenAI's chat fields and the Responses API through the HTTP app,
over a scripted engine (tests/serve_scripted.py) and the real openai client: what the chat
template is given, the grammar each request asks for, the replies' and streams' shapes, and
the 400s, each naming its field."""

import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from edge.serve.structured import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH
from shared.errors import CloudUnavailable
from shared.grammar import GrammarRefused
from tests.serve_scripted import ScriptedEngine, openai_client, scripted_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


PARIS = call_text("get_weather", {"city": "Paris"})
TOKYO = call_text("get_weather", {"city": "Tokyo"})


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> tuple[ScriptedEngine, TestClient]:
    return scripted_app(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def engine(app: tuple[ScriptedEngine, TestClient]) -> ScriptedEngine:
    app[0].say("")
    return app[0]


@pytest.fixture
def client(app: tuple[ScriptedEngine, TestClient]) -> OpenAI:
    return openai_client(app[1])


def refused(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    assert caught.value.type == "invalid_request_error" and "Traceback" not in caught.value.message
    return caught.value


# ---- chat: tools in, tool calls out ---------------------------------------------------------


def test_tools_reach_the_template_and_a_call_comes_back(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say("Checking.\n", PARIS[:20], PARIS[20:])
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    prompt = engine.started[-1].prompt
    assert "# Tools" in prompt and json.dumps(WEATHER) in prompt and json.dumps(TIME) in prompt
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert engine.started[-1].grammar == ""  # auto: unconstrained


def test_a_call_alone_has_null_content_and_two_calls_come_back_in_order(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say(PARIS + "\n" + TOKYO)
    message = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS).choices[0].message
    assert message.content is None
    assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls or []] == ["Paris", "Tokyo"]


def test_parallel_tool_calls_false_keeps_the_first_call(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say(PARIS + "\n" + TOKYO)
    message = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, parallel_tool_calls=False).choices[0].message
    assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls or []] == ["Paris"]


def test_text_that_is_no_call_is_content(engine: ScriptedEngine, client: OpenAI) -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    for text in (broken, call_text("launch_rockets", {}), "<tool_call>\n{", "No tools needed."):
        engine.say(text)
        choice = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS).choices[0]
        assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_tool_choice_none_renders_the_tools_and_parses_nothing(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say(PARIS)
    choice = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none").choices[0]
    assert choice.message.content == PARIS and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert "# Tools" in engine.started[-1].prompt and engine.started[-1].grammar == ""


def test_streamed_calls_accumulate_in_the_sdk_to_the_whole_reply(engine: ScriptedEngine, client: OpenAI) -> None:
    text = "Let me look.\n" + PARIS + "\n" + TOKYO
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]  # tags split across events
    engine.say(*pieces)
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    heads = [d.tool_calls[0] for d in deltas if d.tool_calls and d.tool_calls[0].id]
    assert [(h.index, h.type, h.function.name, h.function.arguments) for h in heads] == [
        (0, "function", "get_weather", ""),
        (1, "function", "get_weather", ""),
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    engine.say(*pieces)
    with client.chat.completions.stream(model="m", messages=ASK, tools=TOOLS) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me look."
    calls = final.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Tokyo"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_a_conversation_with_calls_and_results_renders_as_the_template_expects(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say("It is 18 °C in Paris.")
    args = json.dumps({"city": "Paris"})
    messages: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 °C"},
    ]
    reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert reply.choices[0].message.content == "It is 18 °C in Paris."
    prompt = engine.started[-1].prompt
    assert f"<|im_start|>assistant\n{PARIS}<|im_end|>\n" in prompt  # as the model writes a call
    assert "<|im_start|>user\n<tool_response>\n18 °C\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in prompt


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "18"}], "messages[1].tool_call_id"),
        ([*ASK, {"role": "tool", "content": "18"}], "messages[1]"),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
        ),
        ([{"role": "user", "content": "hi", "tool_calls": []}, {"role": "function", "content": "x"}], "messages[1].role"),
    ],
)
def test_bad_tool_messages_are_400s_naming_them(client: OpenAI, messages: list[Any], param: str) -> None:
    err = refused(lambda: client.chat.completions.create(model="m", messages=messages, tools=TOOLS))
    assert err.param == param


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": [[[[]]]] * 9000}}}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(client: OpenAI, options: dict[str, Any], param: str) -> None:
    err = refused(lambda: client.chat.completions.create(model="m", messages=ASK, **options))
    assert err.param == param


def _lark(engine: ScriptedEngine) -> str:
    """The Lark text of the last request's grammar."""
    grammar = engine.started[-1].grammar
    assert grammar.startswith("start:")
    return grammar


def test_required_and_named_tool_choice_ask_for_a_call_grammar(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say(PARIS)
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required")
    assert reply.choices[0].finish_reason == "tool_calls"
    lark = _lark(engine)
    assert '"get_weather"' in lark and '"get_time"' in lark and '("\\n" call)*' in lark
    named = {"type": "function", "function": {"name": "get_time"}}
    client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    lark = _lark(engine)
    assert '"get_time"' in lark and "get_weather" not in lark.split("%json", 1)[1] and "call)*" not in lark
    allowed = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [WEATHER | {"function": {"name": "get_weather"}}]},
    }
    client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=allowed)  # type: ignore[arg-type]
    assert "get_time" not in _lark(engine).split("%json", 1)[1]
    assert "get_time" in engine.started[-1].prompt  # every tool is still shown to the model


# ---- chat: structured output ----------------------------------------------------------------


def test_response_formats_ask_for_their_grammars(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say('{"a": 1}')
    client.chat.completions.create(model="m", messages=ASK, response_format={"type": "text"})
    assert engine.started[-1].grammar == ""
    client.chat.completions.create(model="m", messages=ASK, response_format={"type": "json_object"})
    assert json.loads(engine.started[-1].grammar)["grammars"][0]["json_schema"]["type"] == "object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(model="m", messages=ASK, response_format=fmt)
    assert reply.choices[0].message.content == '{"a": 1}'
    assert json.loads(engine.started[-1].grammar)["grammars"][0]["json_schema"]["properties"] == schema["properties"]


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "object", "description": "x" * MAX_SCHEMA_BYTES}, "larger than"),
        (_nested(MAX_SCHEMA_DEPTH), "deeper than"),
        ("an object, please", "object or a boolean"),
    ],
)
def test_schemas_too_large_or_deep_are_400s_that_do_not_echo_them(client: OpenAI, schema: Any, words: str) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    err = refused(lambda: client.chat.completions.create(model="m", messages=ASK, response_format=fmt))
    assert err.param == "response_format" and words in err.message and len(err.message) < 200


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format",
        ),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_a_grammar_the_engine_refuses_is_a_400_naming_the_field_that_asked(
    engine: ScriptedEngine, client: OpenAI, options: dict[str, Any], param: str
) -> None:
    engine.refuse = GrammarRefused("the grammar was refused: Invalid type", None)
    for stream in (False, True):
        err = refused(lambda s=stream: client.chat.completions.create(model="m", messages=ASK, stream=s, **options))  # type: ignore[misc]
        assert err.param == param and "Invalid type" in err.message


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
    ],
)
def test_bad_response_formats_are_400s(client: OpenAI, body: dict[str, Any]) -> None:
    err = refused(lambda: client.chat.completions.create(model="m", messages=ASK, extra_body=body))
    assert err.param is not None and err.param.startswith("response_format")


# ---- chat: every field OpenAI defines -------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"5": 10}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("reasoning_effort", "high"),
        ("verbosity", "low"),
        ("web_search_options", {"search_context_size": "low"}),
        ("moderation", {"model": "omni"}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("logprobs", True),
        ("top_logprobs", 2),
        ("n", 3),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.5),
        ("surprise", 1),
    ],
)
def test_fields_this_server_cannot_honour_are_400s_naming_them(client: OpenAI, field: str, value: Any) -> None:
    err = refused(lambda: client.chat.completions.create(model="m", messages=ASK, extra_body={field: value}))
    assert err.param == field


def test_metadata_fields_and_empty_values_are_accepted(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say("ok")
    reply = client.chat.completions.create(
        model="m",
        messages=ASK,
        user="u",
        metadata={"team": "a"},
        store=True,
        service_tier="auto",
        prompt_cache_key="k",
        prompt_cache_retention="24h",
        safety_identifier="s",
        modalities=["text"],
        logit_bias={},
        stream_options=None,
        extra_body={"audio": None, "reasoning_effort": None, "prompt_cache_options": {"mode": "implicit"}},
    )
    assert reply.choices[0].message.content == "ok"


def test_a_body_nested_too_deep_to_parse_is_a_400(app: tuple[ScriptedEngine, TestClient]) -> None:
    reply = app[1].post("/v1/chat/completions", content=b"[" * 200_000, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


# ---- the Responses API ----------------------------------------------------------------------

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]


def test_a_string_input_with_instructions(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say("Bonjour", " !")
    response = client.responses.create(
        model="m", input="Say hi", instructions="Speak French.", max_output_tokens=9, metadata={"k": "v"}
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "Bonjour !" and response.metadata == {"k": "v"}
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert (
        response.usage is not None and response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    )
    started = engine.started[-1]
    assert started.prompt.startswith("<|im_start|>system\nSpeak French.<|im_end|>\n<|im_start|>user\nSay hi<|im_end|>")
    assert started.settings.max_new_tokens == 9


def test_function_calls_and_their_outputs_as_input_items(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say("Checking.\n" + PARIS)
    first = client.responses.create(model="m", input="Weather in Paris?", tools=[FLAT_WEATHER])  # type: ignore[list-item]
    message, call = first.output
    assert message.type == "message" and call.type == "function_call"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    engine.say("18 °C.")
    items: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],  # the output as the next input, as OpenAI's docs do
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 °C"},
    ]
    second = client.responses.create(model="m", input=items, tools=[FLAT_WEATHER])  # type: ignore[list-item]
    assert second.output_text == "18 °C."
    prompt = engine.started[-1].prompt
    assert (
        f"<|im_start|>assistant\nChecking.\n{PARIS}<|im_end|>" in prompt and "<tool_response>\n18 °C\n</tool_response>" in prompt
    )


def test_a_stream_of_events_the_sdk_accumulates(
    engine: ScriptedEngine, client: OpenAI, app: tuple[ScriptedEngine, TestClient]
) -> None:
    text = "Checking.\n" + PARIS + "\nDone."
    engine.say(*[text[i : i + 5] for i in range(0, len(text), 5)])
    with client.responses.stream(model="m", input="Weather?", tools=[FLAT_WEATHER]) as stream:  # type: ignore[list-item]
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.count("response.function_call_arguments.done") == 1 and kinds.count("response.output_item.done") == 3
    assert [item.type for item in final.output] == ["message", "function_call", "message"]
    assert final.output_text == "Checking.Done."
    engine.say("x")
    raw = app[1].post("/v1/responses", json={"input": "hi", "stream": True}).text
    frames = [frame.split("\n") for frame in raw.strip().split("\n\n")]
    assert all(f[0] == f"event: {json.loads(f[1][6:])['type']}" for f in frames)  # each event named


def test_max_output_tokens_cut_short_is_incomplete(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say("a b c", finish="length")
    response = client.responses.create(model="m", input="count", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    engine.say("a b c", finish="length")
    kinds = [e.type for e in client.responses.create(model="m", input="count", max_output_tokens=3, stream=True)]
    assert kinds[-1] == "response.incomplete"


def test_a_failure_midstream_is_an_error_event_then_failed(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say("partial")
    engine.error = CloudUnavailable("gone")
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-1].response.status == "failed"  # type: ignore[union-attr]


def test_text_format_and_tool_choice_ask_for_grammars(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say('{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt: Any = {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}
    response = client.responses.create(model="m", input="json", text=fmt)
    assert json.loads(response.output_text) == {"a": 1} and response.text.format.type == "json_schema"  # type: ignore[union-attr]
    assert json.loads(engine.started[-1].grammar)["grammars"][0]["json_schema"]["properties"] == schema["properties"]
    engine.say(PARIS)
    choice: Any = {"type": "function", "name": "get_weather"}
    response = client.responses.create(model="m", input="w", tools=[FLAT_WEATHER], tool_choice=choice)  # type: ignore[list-item]
    assert '"get_weather"' in _lark(engine) and response.output[0].type == "function_call"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [FLAT_WEATHER, FLAT_WEATHER]}, "tools[1].name"),
        ({"input": "hi", "tools": [FLAT_WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": _nested(40)}}}, "text.format"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
        ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "18"}]}, "input[0].call_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"input": "hi", "surprise": 1}, "surprise"),
    ],
)
def test_responses_fields_are_400s_naming_them(client: OpenAI, body: dict[str, Any], param: str) -> None:
    err = refused(lambda: client.post("/responses", body=body, cast_to=object))
    assert err.param is not None and err.param.startswith(param), err.param


def test_responses_accepts_store_and_metadata_and_stores_nothing(engine: ScriptedEngine, client: OpenAI) -> None:
    engine.say("ok")
    response = client.responses.create(model="m", input="hi", store=True, user="u", service_tier="auto", truncation="disabled")
    assert response.output_text == "ok" and response.store is False
