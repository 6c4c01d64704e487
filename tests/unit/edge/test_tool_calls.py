"""Hermes tool calls out of a model's text (edge/serve/tool_calls.py): the whole reply and the
same text streamed in any split give the same content and calls; what does not parse as a
call is content, never an error."""

import json

import pytest

from edge.serve.tool_calls import CALL_END, CALL_START, ToolCallParser, split_reply

NAMES = {"get_weather", "get_time"}


def call_text(name: str, arguments: object, spaced: bool = True) -> str:
    body = (
        json.dumps({"name": name, "arguments": arguments})
        if spaced
        else json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    )
    return f"{CALL_START}\n{body}\n{CALL_END}"


def shapes(text: str, first_only: bool = False) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = split_reply(text, NAMES, first_only)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(text: str, cuts: list[int], first_only: bool = False) -> tuple[str, list[tuple[str, dict]]]:
    parser = ToolCallParser(NAMES, first_only)
    pieces = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        pieces += parser.push(text[a:b])
    pieces += parser.finish()
    content = "".join(p.text for p in pieces if p.call is None)
    return content, [(p.call.name, json.loads(p.call.arguments)) for p in pieces if p.call is not None]


PARIS = call_text("get_weather", {"city": "Paris"})
TOKYO = call_text("get_time", {"tz": "Asia/Tokyo"})

CASES = {
    "plain text": ("Just an answer.\n", ("Just an answer.\n", [])),
    "one call": (PARIS, ("", [("get_weather", {"city": "Paris"})])),
    "text then call": ("Let me check.\n" + PARIS, ("Let me check.", [("get_weather", {"city": "Paris"})])),
    "two calls": (PARIS + "\n" + TOKYO + "\n", ("", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Asia/Tokyo"})])),
    "text after a call": (PARIS + "\nDone.", ("Done.", [("get_weather", {"city": "Paris"})])),
    "compact JSON": (call_text("get_time", {}, spaced=False), ("", [("get_time", {})])),
    "bad JSON": (
        f'{CALL_START}\n{{"name": "get_time", "arguments": {{\n{CALL_END}',
        (f'{CALL_START}\n{{"name": "get_time", "arguments": {{\n{CALL_END}', []),
    ),
    "unknown tool": (call_text("rm_rf", {}), (call_text("rm_rf", {}), [])),
    "arguments not an object": (call_text("get_time", [1]), (call_text("get_time", [1]), [])),
    "arguments as a JSON string": (call_text("get_time", '{"tz": "UTC"}'), ("", [("get_time", {"tz": "UTC"})])),
    "no arguments": (f'{CALL_START}{{"name": "get_time"}}{CALL_END}', ("", [("get_time", {})])),
    "unclosed call": ("Hi " + PARIS[:-5], ("Hi " + PARIS[:-5], [])),
    "partial start tag at the end": ("Hi <tool_ca", ("Hi <tool_ca", [])),
    "a tag-like word": ("a <tool> b <tool_callx> c", ("a <tool> b <tool_callx> c", [])),
    "bad call between good ones": (
        PARIS + "\n" + f"{CALL_START}nope{CALL_END}" + "\n" + TOKYO,
        (f"{CALL_START}nope{CALL_END}", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Asia/Tokyo"})]),
    ),
    "whitespace kept without calls": ("  a  \n\n b \n", ("  a  \n\n b \n", [])),
    "unicode arguments": (call_text("get_weather", {"city": "Zürich 東京"}), ("", [("get_weather", {"city": "Zürich 東京"})])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_whole_reply(name: str) -> None:
    text, want = CASES[name]
    assert shapes(text) == want


@pytest.mark.parametrize("name", list(CASES))
def test_any_split_of_the_stream_gives_the_whole_replys_pieces(name: str) -> None:
    text, want = CASES[name]
    for cut in range(len(text) + 1):
        assert streamed(text, [cut]) == want, cut
    assert streamed(text, list(range(1, len(text)))) == want  # one character at a time


def test_content_before_a_call_is_released_before_the_call_completes() -> None:
    parser = ToolCallParser(NAMES)
    assert [p.text for p in parser.push("Checking the weather. <tool_")] == ["Checking the weather."]
    assert parser.push('call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}') == []
    (piece,) = parser.push("\n</tool_call>")
    assert piece.call is not None and piece.call.name == "get_weather" and piece.call.id.startswith("call_")
    assert json.loads(piece.call.arguments) == {"city": "Oslo"}


def test_first_only_drops_later_calls() -> None:
    assert shapes(PARIS + "\n" + TOKYO, first_only=True) == ("", [("get_weather", {"city": "Paris"})])


def test_without_names_any_name_is_a_call() -> None:
    _, calls = split_reply(call_text("rm_rf", {"path": "/"}))
    assert [c.name for c in calls] == ["rm_rf"]


def test_each_call_has_its_own_id() -> None:
    _, calls = split_reply(PARIS + TOKYO + PARIS, NAMES)
    assert len({c.id for c in calls}) == 3
