"""Structured output and forced tool calls through a real `edge-agent serve` and a real
cloud-verifier, with tiny random models on a byte-fallback BPE tokenizer (one a grammar can
steer byte by byte), driven with the openai client: every reply validates against its schema
or parses as calls of the named tools, and greedy constrained output is the target's own
(speculation on equals speculation off, token for token)."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.serve_procs import SERVE_READY, Server, serve_cmd, start, start_verifier
from tests.tiny_models import llama_bpe_tokenizer, save_convertible_pair

# Short, so prompts stay well inside the tiny models' 1024 positions; tools as Qwen2.5 lists them.
TEMPLATE = (
    "{% if tools %}<s>tools:{% for t in tools %} {{ t | tojson }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}<s>assistant:"
)
# compact (llguidance's x-guidance option): a random model, free to lay the JSON out, pads it
# with whitespace until max_tokens
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
SCHEMA = {
    "type": "object",
    "properties": {"x": {"enum": ["ab", "cd", "abcd"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["x", "n"],
    "additionalProperties": False,
    **COMPACT,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "abcd ab cd"}]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    draft, target = save_convertible_pair(tmp_path_factory.mktemp("models"))
    tokenizer = llama_bpe_tokenizer()
    tokenizer.chat_template = TEMPLATE
    for path in (draft, target):
        tokenizer.save_pretrained(path)
    return draft, target


@pytest.fixture(scope="module")
def served(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("logs")
    verifier, address, _ = start_verifier(models[1], logs / "verifier.log")
    cmd = serve_cmd(models[0], address, "--max-new-tokens", str(MAX_TOKENS), "--k", "3", "--mode", "speculative")
    server = start(cmd, logs / "serve.log", SERVE_READY)
    yield server
    assert server.stop() == 0
    assert verifier.stop() == 0


@pytest.fixture(scope="module")
def client(served: Server) -> OpenAI:
    return OpenAI(base_url=served.match.group(1) + "/v1", api_key="unused", max_retries=0, timeout=300)


def _json_schema(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def test_json_schema_replies_validate_greedy_sampled_and_streamed(client: OpenAI) -> None:
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model="m", messages=ASK, response_format=_json_schema(SCHEMA), temperature=temperature, seed=3
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)
    stream = client.chat.completions.create(model="m", messages=ASK, response_format=_json_schema(SCHEMA), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_constrained_greedy_output_is_the_targets_own(client: OpenAI) -> None:
    def text(enabled: bool) -> str:
        reply = client.chat.completions.create(
            model="m",
            messages=ASK,
            response_format=_json_schema(SCHEMA),
            temperature=0,
            extra_body={"speculative": {"enabled": enabled}},
        )
        stats = reply.model_extra["speculative_decoding"]  # type: ignore[index]
        assert stats["ran"] is enabled and stats["exact"]
        return reply.choices[0].message.content or ""

    assert text(True) == text(False)


def test_json_object_is_an_object(client: OpenAI) -> None:
    reply = client.chat.completions.create(model="m", messages=ASK, response_format={"type": "json_object"}, max_tokens=400)
    if reply.choices[0].finish_reason == "stop":  # a random model may write a long object
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    else:
        assert (reply.choices[0].message.content or "").startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_gives_calls_of_the_tools(client: OpenAI, stream: bool) -> None:
    options: Any = {"model": "m", "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required"}
    if stream:
        with client.chat.completions.stream(**options, stream_options={"include_usage": True}) as events:
            reply = events.get_final_completion()
    else:
        reply = client.chat.completions.create(**options)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert calls
    if choice.message.content is not None:  # a random model may call until max_tokens cuts a call short
        assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS
        assert choice.message.content.startswith("<tool_call>")
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
        else:
            assert arguments == {}


def test_a_named_function_without_parallel_calls_is_one_call_of_it(client: OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named, parallel_tool_calls=False, temperature=temperature
        )
        (call,) = reply.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]


def test_the_responses_api_under_a_schema_and_a_forced_call(client: OpenAI) -> None:
    fmt: Any = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}}
    response = client.responses.create(model="m", input="abcd", text=fmt)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    tool: Any = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
    with client.responses.stream(
        model="m", input="abcd", tools=[tool], tool_choice="required", parallel_tool_calls=False
    ) as events:
        final = events.get_final_response()
    assert final.status == "completed"
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]


def test_a_schema_the_grammar_engine_refuses_is_a_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=ASK, response_format=_json_schema({"type": "objekt"}))
    assert caught.value.param == "response_format" and "objekt" not in caught.value.message.split(":", 1)[0]


class Thing(BaseModel):
    """SCHEMA as a pydantic model, as LangChain's structured output takes one."""

    model_config = ConfigDict(json_schema_extra=COMPACT)

    x: Literal["ab", "cd", "abcd"]
    n: int = Field(ge=0, le=99)


def test_langchain_chat_tools_and_structured_output(served: Server) -> None:
    """LangChain's ChatOpenAI, as agent frameworks drive an OpenAI-compatible endpoint."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=served.match.group(1) + "/v1", api_key="unused", model="m", temperature=0, max_retries=0)
    assert isinstance(chat.invoke("abcd").content, str)
    assert len(list(chat.stream("abcd"))) > 1
    bound = chat.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False)
    (call,) = bound.invoke("abcd").tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])  # type: ignore[index]
    for method in ("json_schema", "function_calling"):  # strict: no properties past Thing's (a random model would add them)
        thing = chat.with_structured_output(Thing, method=method, strict=True).invoke("abcd")  # type: ignore[arg-type]
        assert isinstance(thing, Thing), method


def test_the_llm_cli_with_an_openai_compatible_model_entry(served: Server, tmp_path: Path) -> None:
    """Simon Willison's `llm`: a model entry naming the endpoint, then prompts, a schema and tools."""
    entry = f"- model_id: edge\n  model_name: m\n  api_base: {served.match.group(1)}/v1\n"
    (tmp_path / "extra-openai-models.yaml").write_text(entry + "  supports_tools: true\n  supports_schema: true\n")
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "unused"}

    def llm(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "llm", "-m", "edge", *args], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    assert llm("abcd", "-o", "max_tokens", "16").strip()
    jsonschema.validate(json.loads(llm("abcd", "--schema", json.dumps(SCHEMA))), SCHEMA)
    tool = "def get_time() -> str:\n    return 'noon'\n"
    assert llm("abcd", "--functions", tool, "-o", "max_tokens", "16") is not None  # tools offered: the request is served
