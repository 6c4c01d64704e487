"""`edge-agent serve` as a user runs it: a subprocess on port 0 against a real cloud-verifier
subprocess, driven with the real `openai` client. At temperature 0 the served text equals
`edge-agent --mode cloud_only`; stop strings, the `speculative` extension, concurrent streams,
a client that goes away, and errors in OpenAI's shape.

The server drafts with a soft deadline of 10 microseconds, so every round shows provisional
tokens (and retracts some): the text must still be the target's own."""

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.serve_procs import ENV, SERVE_READY, Server, serve_cmd, start, start_verifier
from tests.tiny_models import save_pair
from tools.netproxy import FaultProxy, LinkConditions

PROMPTS = {"p0": "w5 w9", "p1": "w12 w40 w7", "p2": "w3", "p3": "w60 w61 w62 w63"}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def verifier(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """(gRPC address, HTTP port) of a cloud-verifier subprocess."""
    server, address, http_port = start_verifier(models[1], tmp_path_factory.mktemp("verifier") / "verifier.log")
    yield address, http_port
    assert server.stop() == 0


@pytest.fixture(scope="module")
def served(models: tuple[Path, Path], verifier: tuple[str, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cmd = serve_cmd(
        models[0],
        verifier[0],
        "--max-new-tokens",
        str(MAX_TOKENS),
        "--k",
        "3",
        "--verify-timeout-ms",
        "0.01",
        "--reconnect-window-s",
        "2",
    )
    server = start(cmd, tmp_path_factory.mktemp("serve") / "serve.log", SERVE_READY)
    yield server
    assert server.stop() == 0  # SIGTERM: a clean stop


@pytest.fixture(scope="module")
def client(served: Server) -> OpenAI:
    return OpenAI(base_url=served.match.group(1) + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(
    models: tuple[Path, Path],
    verifier: tuple[str, int],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """The target alone (edge-agent --mode cloud_only) on each prompt, chat template applied."""
    folder = tmp_path_factory.mktemp("expected")
    prompts, out = folder / "prompts.jsonl", folder / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in PROMPTS.items()))
    cmd = [
        sys.executable,
        "-m",
        "edge",
        "--cloud",
        verifier[0],
        "--draft-model",
        str(models[0]),
        "--mode",
        "cloud_only",
        "--prompts",
        str(prompts),
        "--output",
        str(out),
        "--max-new-tokens",
        str(MAX_TOKENS),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def _chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def stream_chat(client: OpenAI, prompt: str, **options: Any) -> tuple[list[str], list[Any]]:
    """(content pieces, every chunk) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(model="any", messages=_chat(prompt), stream=True, **options))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    return pieces, chunks


def verifier_metric(port: int, name: str, **labels: str) -> float:
    """Sum of a metric's samples with these labels, from the verifier's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    total = 0.0
    for match in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE):
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        total += float(match.group(2)) if all(got.get(k) == v for k, v in labels.items()) else 0.0
    return total


def test_chat_equals_the_target_alone_with_stats(client: OpenAI, expected: dict[str, dict[str, Any]]) -> None:
    for key in ("p0", "p1"):
        reply = client.chat.completions.create(model="any", messages=_chat(PROMPTS[key]), temperature=0)
        assert reply.choices[0].message.content == expected[key]["text"]
        assert reply.usage is not None and reply.usage.completion_tokens == len(expected[key]["token_ids"])
        stats = reply.model_extra["speculative_decoding"]  # type: ignore[index]
        assert stats["ran"] and stats["reason"] is None and stats["exact"]
        # auto mode: one pass per round, per token the target decoded itself, and the prefill
        decoded = stats["tokens_by_mode"].get("cloud_only", 0)
        assert stats["rounds"] > 0 and stats["target_forward_passes"] == stats["rounds"] + decoded + 1
        assert sum(stats["tokens_by_mode"].values()) == reply.usage.completion_tokens
        assert stats["mode_switches"][0]["why"] == "start"
        assert sum(stats["drafted_per_position"]) == stats["draft_tokens"] > 0
        assert sum(stats["accepted_per_position"]) == stats["accepted_tokens"]
        assert stats["bytes_up"] > 0 and stats["bytes_down"] > 0 and stats["provisional_tokens"] > 0


def test_streamed_chat_equals_the_target_alone(client: OpenAI, expected: dict[str, dict[str, Any]]) -> None:
    pieces, chunks = stream_chat(client, PROMPTS["p1"], stream_options={"include_usage": True})
    assert "".join(pieces) == expected["p1"]["text"] and len(pieces) > 2  # one piece per verified round
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    last = chunks[-1]
    assert not last.choices and last.usage.completion_tokens == MAX_TOKENS
    assert last.model_extra["speculative_decoding"]["rounds"] > 0
    assert all("speculative" not in c.model_extra for c in chunks)  # previews only when asked


def test_provisional_previews_are_marked_and_never_content(client: OpenAI, expected: dict[str, dict[str, Any]]) -> None:
    pieces, chunks = stream_chat(client, PROMPTS["p0"], extra_body={"speculative": {"provisional": True}})
    previews = [c.model_extra["speculative"]["provisional"] for c in chunks if "speculative" in c.model_extra]
    assert previews and "".join(pieces) == expected["p0"]["text"]
    assert chunks[-1].model_extra["speculative_decoding"]["provisional_tokens"] > 0


def test_stop_string_split_across_rounds(client: OpenAI, expected: dict[str, dict[str, Any]]) -> None:
    pieces, _ = stream_chat(client, PROMPTS["p2"])
    # The end of one verified round and the start of the next.
    boundary = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[boundary][-2:] + pieces[boundary + 1][:2]
    full = expected["p2"]["text"]
    want = full[: full.index(stop)]
    got, chunks = stream_chat(client, PROMPTS["p2"], stop=[stop, "never seen"])
    assert "".join(got) == want and not any(stop in piece for piece in got)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    reply = client.chat.completions.create(model="any", messages=_chat(PROMPTS["p2"]), stop=stop)
    assert reply.choices[0].message.content == want and reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens < MAX_TOKENS  # it stopped generating


def test_disabled_speculation_makes_no_verify_calls(
    client: OpenAI, expected: dict[str, dict[str, Any]], verifier: tuple[str, int]
) -> None:
    before = verifier_metric(verifier[1], "specdec_requests_total", method="Verify")
    reply = client.chat.completions.create(
        model="any", messages=_chat(PROMPTS["p3"]), extra_body={"speculative": {"enabled": False}}
    )
    assert verifier_metric(verifier[1], "specdec_requests_total", method="Verify") == before
    assert reply.choices[0].message.content == expected["p3"]["text"]
    stats = reply.model_extra["speculative_decoding"]  # type: ignore[index]
    assert not stats["ran"] and "disabled by the request" in stats["reason"] and stats["rounds"] == 0


def test_four_concurrent_streams_stay_apart(client: OpenAI, expected: dict[str, dict[str, Any]]) -> None:
    def one(key: str) -> tuple[str, float, float]:
        start = time.monotonic()
        pieces, _ = stream_chat(client, PROMPTS[key], extra_body={"speculative": {"k": 2}})
        return "".join(pieces), start, time.monotonic()

    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(PROMPTS, pool.map(one, PROMPTS), strict=True))
    assert {key: text for key, (text, _, _) in results.items()} == {key: r["text"] for key, r in expected.items()}
    assert max(start for _, start, _ in results.values()) < min(end for _, _, end in results.values())  # overlapped


def test_a_conversations_next_turn_feeds_the_drafter_only_what_is_new(client: OpenAI) -> None:
    """The client resends the whole conversation; the drafter begins from the last turn's draft
    KV (the conversation cache) and computes only the new tokens' KV."""

    def turn(messages: list[dict[str, str]]) -> tuple[str, int, dict[str, Any]]:
        reply = client.chat.completions.create(
            model="any", messages=messages, temperature=0, extra_body={"speculative": {"enabled": True}}
        )
        assert reply.usage is not None
        return reply.choices[0].message.content or "", reply.usage.prompt_tokens, reply.model_extra["speculative_decoding"]  # type: ignore[index]

    messages = _chat(" ".join(f"w{i}" for i in range(20, 60)))
    answer, first_prompt, first = turn(messages)
    assert first["draft_reused_tokens"] + first["draft_prefilled_tokens"] == first_prompt
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "w5 w9"}]
    _, second_prompt, second = turn(messages)
    # All of the first turn's prompt but its last token, which this chat template does not repeat
    assert second["draft_reused_tokens"] >= first_prompt - 1
    assert second["draft_prefilled_tokens"] == second_prompt - second["draft_reused_tokens"]
    assert second["exact"] and second["draft_tokens"] > 0


def test_a_client_that_goes_away_frees_its_session(client: OpenAI, served: Server, verifier: tuple[str, int]) -> None:
    stream = client.chat.completions.create(model="any", messages=_chat(PROMPTS["p0"]), stream=True, max_tokens=900)
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert verifier_metric(verifier[1], "specdec_open_sessions") >= 1
    stream.close()
    deadline = time.monotonic() + 20
    while verifier_metric(verifier[1], "specdec_open_sessions") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert verifier_metric(verifier[1], "specdec_open_sessions") == 0
    assert re.search(r"client gone after \d+ tokens; generation cancelled", served.log.read_text())


def test_each_request_drafts_from_every_earlier_requests_figures(
    models: tuple[Path, Path], verifier: tuple[str, int], tmp_path: Path
) -> None:
    """The cost k policy's figures (the verify pass, the network, drafting) live with the serve
    process, not with a request: each short request starts from every round the ones before it
    measured, so the 10th plans from the first nine's."""
    cmd = serve_cmd(models[0], verifier[0], "--mode", "speculative", "--max-new-tokens", "10")
    server = start(cmd, tmp_path / "serve.log", SERVE_READY)
    try:
        client = OpenAI(base_url=server.match.group(1) + "/v1", api_key="unused", max_retries=0, timeout=120)
        measured = 0
        for number in range(10):
            reply = client.chat.completions.create(model="any", messages=_chat(PROMPTS[f"p{number % 4}"]), temperature=0)
            stats = reply.model_extra["speculative_decoding"]  # type: ignore[index]
            assert stats["k_policy"] == "cost"
            assert stats["k_costs_rounds"] == measured, number
            measured += stats["drafted_per_position"][0]  # the rounds that drafted: each one measured
        assert measured >= 9
    finally:
        assert server.stop() == 0


def test_sampling_repeats_with_a_seed_and_varies_without(client: OpenAI) -> None:
    def sample(**options: Any) -> tuple[str, int]:
        reply = client.chat.completions.create(model="any", messages=_chat("w7 w8"), temperature=1.0, **options)
        return reply.choices[0].message.content or "", reply.model_extra["speculative_decoding"]["seed"]  # type: ignore[index]

    assert sample(seed=11) == sample(seed=11) and sample(seed=11)[1] == 11
    assert sample()[1] != sample()[1]  # no seed (and none given to the server): a fresh one each time


@pytest.fixture
def proxy(verifier: tuple[str, int]) -> Iterator[tuple[FaultProxy, asyncio.AbstractEventLoop]]:
    """A fault proxy in front of the verifier, on an event loop of its own thread; 20 ms RTT, so
    a stream is still running when its connections are dropped."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    host, port = verifier[0].rsplit(":", 1)
    fault = FaultProxy(host, int(port), LinkConditions(rtt_ms=20))
    asyncio.run_coroutine_threadsafe(fault.start(), loop).result(10)
    yield fault, loop
    asyncio.run_coroutine_threadsafe(fault.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_a_verifier_lost_midstream_repeats_no_text(
    models: tuple[Path, Path],
    proxy: tuple[FaultProxy, asyncio.AbstractEventLoop],
    expected: dict[str, dict[str, Any]],
    tmp_path: Path,
) -> None:
    fault, loop = proxy
    cmd = serve_cmd(models[0], fault.address, "--max-new-tokens", str(MAX_TOKENS), "--k", "3", "--reconnect-window-s", "30")
    server = start(cmd, tmp_path / "serve.log", SERVE_READY)
    try:
        api = OpenAI(base_url=server.match.group(1) + "/v1", api_key="unused", max_retries=0, timeout=120)
        pieces: list[str] = []
        stats: dict[str, Any] = {}
        for chunk in api.chat.completions.create(model="any", messages=_chat(PROMPTS["p1"]), stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if len(pieces) <= 8:  # cut every connection to the verifier as each of the first pieces comes:
                    loop.call_soon_threadsafe(fault.drop_connections)  # a cut as a round drafts needs no reopen
            stats = chunk.model_extra.get("speculative_decoding", stats)  # on the finish chunk
        assert "".join(pieces) == expected["p1"]["text"]
        assert stats["reopens"] >= 1  # a Verify was in flight (20 ms RTT) when one of the cuts came
    finally:
        assert server.stop() == 0


TOOLS: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def test_tools_the_model_does_not_call_leave_the_text_its_own(client: OpenAI, expected: dict[str, dict[str, Any]]) -> None:
    """Under tool_choice auto, text without a call is the reply as it was: the content, whole
    or streamed, with the target's own tokens (the tiny template shows no tools)."""
    reply = client.chat.completions.create(model="any", messages=_chat(PROMPTS["p0"]), tools=TOOLS, temperature=0)
    choice = reply.choices[0]
    assert choice.message.content == expected["p0"]["text"] and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    pieces, chunks = stream_chat(client, PROMPTS["p0"], tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    assert "".join(pieces) == expected["p0"]["text"]
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_the_responses_api_equals_the_target_alone(client: OpenAI, expected: dict[str, dict[str, Any]]) -> None:
    response = client.responses.create(model="any", input=PROMPTS["p1"], temperature=0, max_output_tokens=MAX_TOKENS)
    assert response.output_text == expected["p1"]["text"]
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.usage is not None and response.usage.output_tokens == MAX_TOKENS
    assert response.model_extra["speculative_decoding"]["exact"]  # type: ignore[index]
    events = list(client.responses.create(model="any", input=PROMPTS["p1"], temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]  # type: ignore[union-attr]
    assert "".join(deltas) == expected["p1"]["text"] and len(deltas) > 2  # one per verified round
    assert events[-1].type == "response.incomplete" and [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 2}, "n"),
        ({"extra_body": {"speculative": {"k": 2, "depth": 3}}}, "speculative.depth"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 3.5}, "temperature"),
        ({"extra_body": {"temperature": "hot"}}, "temperature"),
        ({"stop": ["w5", ""]}, "stop"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"extra_body": {"logit_bias": {"5": 3}}}, "logit_bias"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ],
)
def test_bad_fields_are_openai_400s(client: OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="any", messages=_chat("w5"), **body)
    err = caught.value
    assert err.status_code == 400 and err.type == "invalid_request_error" and err.param == param
    assert param.split(".")[-1] in err.message and "Traceback" not in err.message


def test_key_page_and_an_unreachable_cloud(models: tuple[Path, Path], tmp_path: Path) -> None:
    """--serve-api-key guards /v1/*; the page and /health stay open; a verifier that cannot be
    reached is a 503 with Retry-After, streamed or not."""
    cmd = serve_cmd(models[0], "127.0.0.1:1", "--drafter", "ngram", "--serve-api-key", "sekret", "--reconnect-window-s", "0.3")
    server = start(cmd, tmp_path / "serve.log", SERVE_READY)
    try:
        base = server.match.group(1)
        with urllib.request.urlopen(base + "/health", timeout=10) as reply:
            assert json.load(reply)["status"] == "ok"
        with urllib.request.urlopen(base + "/?prompt=w5", timeout=10) as reply:
            assert "/v1/chat/completions" in reply.read().decode()
        with pytest.raises(openai.AuthenticationError) as refused:
            OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        assert refused.value.code == "invalid_api_key"
        keyed = OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in keyed.models.list()] == ["qwen2.5-coder-1.5b-instruct"]
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as away:
                keyed.chat.completions.create(model="any", messages=_chat("w5"), stream=stream)
            assert away.value.status_code == 503 and away.value.code == "cloud_unavailable"
            assert int(away.value.response.headers["retry-after"]) > 0
    finally:
        assert server.stop() == 0


LEAN = """
import sys
from importlib.abc import MetaPathFinder

class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn"):
            raise ImportError(f"{name} is not installed")
        return None

sys.meta_path.insert(0, Missing())
from edge.__main__ import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def test_serve_without_fastapi_says_what_to_install(models: tuple[Path, Path]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", LEAN, "--draft-model", str(models[0])], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "pip install 'specedge[serve]'" in done.stderr
