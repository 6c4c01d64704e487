"""Tool calls between the template, the grammar and the parser: the edge renders tools and
calls as transformers does (Qwen2.5's template); the forced-call grammar accepts a call as
that template writes it and refuses what is no call of the permitted tools (what a model
writes under it, the parser reads: tests/integration/test_serve_grammar.py)."""

import json
from pathlib import Path
from typing import Any

import llguidance.hf
import pytest
from llguidance import LLMatcher
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from edge.serve.openai_api import ChatRequest, parse_request, template_messages
from edge.serve.tools import NamedToolChoice, ToolSpec, plan_tools
from edge.tokenizer import EdgeTokenizer
from tests.serve_scripted import QWEN_TEMPLATE, byte_tokenizer

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
CLOCK: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
ARGS = {"city": "Zürich", "days": 3}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "09:00"},
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_tokenizer()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast) -> Path:
    path = tmp_path_factory.mktemp("qwen")
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def test_tools_and_calls_render_as_transformers_renders_them(folder: Path) -> None:
    request = parse_request(ChatRequest, {"messages": CONVERSATION, "tools": [WEATHER, CLOCK]})
    plan = request.tool_plan()
    ours = EdgeTokenizer(folder).render_chat(template_messages(request.messages), tools=plan.rendered)
    messages = template_messages(request.messages)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tools=plan.rendered, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n</tool_call>' in ours
    assert "<tool_response>\nSunny\n</tool_response>\n<tool_response>\n09:00\n</tool_response>" in ours


def _matcher(tokenizer: PreTrainedTokenizerFast, grammar: str) -> Any:
    return LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar)


def accepts(tokenizer: PreTrainedTokenizerFast, grammar: str, text: str) -> bool:
    """The grammar takes the whole text and may end there."""
    matcher = _matcher(tokenizer, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def _call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def _grammar(choice: Any, parallel: bool) -> str:
    return plan_tools([ToolSpec.model_validate(WEATHER), ToolSpec.model_validate(CLOCK)], choice, parallel).grammar


def test_the_forced_grammar_takes_calls_as_the_template_writes_them(tokenizer: PreTrainedTokenizerFast) -> None:
    one, two = _call("get_weather", ARGS), _call("get_time", {})
    assert accepts(tokenizer, _grammar("required", True), one)
    assert accepts(tokenizer, _grammar("required", True), f"{one}\n{two}")
    assert accepts(tokenizer, _grammar("required", False), two)
    assert not accepts(tokenizer, _grammar("required", False), f"{one}\n{two}")  # one call only
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    assert not accepts(tokenizer, _grammar(named, True), one)


@pytest.mark.parametrize(
    "text",
    [
        _call("get_stock", {}),  # no such tool
        _call("get_weather", {"days": 3}),  # a required argument missing
        _call("get_weather", {"city": "Oslo", "days": 0}),  # below its minimum
        _call("get_time", {"x": 1}),  # a tool without parameters takes none
        "Sure! " + _call("get_time", {}),  # text before the call
        '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',  # not the template's spacing
    ],
)
def test_the_forced_grammar_refuses_what_is_no_permitted_call(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    assert not accepts(tokenizer, _grammar("required", True), text)
