"""`python -m bench.chat_turns`: time to first token, turn by turn, of a multi-turn chat that
resends the whole conversation every turn, as chat clients do. A scripted coding chat
(bench/data/chat_script.json) goes to `edge-agent serve` through the openai client, streaming;
each turn sends the system prompt and every earlier user turn and actual reply again, so the
prompt grows turn by turn: the last of its 8 turns carries about 7,000 characters of the script
(some 2,000 tokens of a BPE tokenizer such as Qwen's) and the seven replies before it.

    python -m bench.chat_turns --out results/chat_turns          # the packaged Qwen pair; a verifier and a server started here
    python -m bench.chat_turns --engine llama.cpp --target-model target.gguf --threads 2 --out DIR
    python -m bench.chat_turns --cloud 127.0.0.1:50051 --cloud-metrics-url http://127.0.0.1:8080/metrics --out DIR
    python -m bench.chat_turns --serve http://127.0.0.1:8000 --out DIR
    python -m bench.chat_turns --quick --out /tmp/chat-quick     # tiny random models, 3 short turns, seconds

Without --cloud and --serve, a cloud-verifier and an `edge-agent serve` start here as child
processes on loopback ports (their logs in --out); with --cloud only the server starts, against
that verifier; --serve measures a running server. Each repeat is a fresh conversation whose
system prompt opens with its number (and --tag), so that no repeat finds an earlier one's
conversation in a cache of recent prompts. One warm-up request (another system prompt) goes
first and is left out of the numbers.

Per turn: prompt tokens (the server's usage; else counted with --tokenizer), TTFT (request sent
to the first non-empty content delta), total time, tokens generated, tokens/s after the first
token, and the change over the turn of every counter of the verifier's and the edge's /metrics
whose name holds `reused` or `prefilled` (where their addresses are known). Writes
chat_turns.json and report.md into --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, cast

from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.chat_turns_report import markdown, summarize
from bench.cli import settings_parser
from bench.environment import git_state, provenance, write_result
from bench.processes import running
from shared.cli import run_cli, settings_from_args

log = logging.getLogger("bench.chat_turns")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_SCRIPT = REPO / "bench" / "data" / "chat_script.json"
COUNTER_WORDS = ("reused", "prefilled")  # the prompt-reuse counters of the verifier and the edge
WARMUP = [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Say hello."}]


class ChatTurnsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_CHAT_TURNS_")

    cloud: str | None = Field(None, description="a running cloud-verifier's gRPC address (default: start one here)")
    cloud_metrics_url: str | None = Field(None, description="its /metrics, to read counters from (a started one's is known)")
    serve: str | None = Field(None, description="a running edge-agent serve's URL (default: start one here)")
    serve_metrics_url: str | None = Field(None, description="its edge's /metrics (--metrics-port; a started one's is known)")
    api_key: SecretStr | None = Field(
        None, description="the verifier's API key: a started server sends it, /metrics is read with it"
    )
    serve_api_key: SecretStr | None = Field(None, description="--serve's key for /v1/*")
    engine: Literal["transformers", "llama.cpp", "vllm"] = Field("transformers", description="the started verifier's --engine")
    target_model: str | None = Field(None, description="the started verifier's --model (default: the packaged target)")
    draft_model: str | None = Field(None, description="the started server's --draft-model (default: the packaged draft)")
    quick: bool = Field(False, description="tiny random models (fp32, 3 turns of 8 tokens): a smoke run")
    dtype: str = Field("", description="of models run by transformers or vLLM (empty: auto; --quick: float32)")
    threads: int = Field(0, ge=0, description="CPU threads of each started process (0 = each runtime's default)")
    mode: Literal["auto", "speculative", "cloud_only"] = Field("auto", description="the started server's --mode")
    verifier_flags: str = Field("", description="more flags for the started cloud-verifier")
    edge_flags: str = Field("", description="more flags for the started edge-agent serve")
    script: Path = Field(DEFAULT_SCRIPT, description="the chat: JSON with `system` and the user `turns`")
    turns: int = Field(0, ge=0, description="the script's first N user turns (0: all; --quick: 3)")
    max_new_tokens: int = Field(0, ge=0, description="max_tokens of each turn (0: 96; --quick: 8)")
    temperature: float = Field(0.0, ge=0, le=2, description="of each turn (0: greedy)")
    repeats: int = Field(1, ge=1, description="conversations, each a fresh one (its own system prompt)")
    tag: str = Field(
        "",
        description="words beside each conversation's number in its system prompt: a run's own name, so that a rerun "
        "against running servers does not find this run's conversations in their caches",
    )
    tokenizer: str | None = Field(
        None, description="tokenizer folder to count prompt tokens where the server's usage does not (default: the models')"
    )
    out: Path = Field(description="folder for chat_turns.json, report.md and the child processes' logs")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "running servers": ("cloud", "cloud_metrics_url", "serve", "serve_metrics_url", "api_key", "serve_api_key"),
        "started servers": (
            "engine",
            "target_model",
            "draft_model",
            "quick",
            "dtype",
            "threads",
            "mode",
            "verifier_flags",
            "edge_flags",
        ),
        "the chat": ("script", "turns", "max_new_tokens", "temperature", "repeats", "tag", "tokenizer"),
        "output": ("out",),
    }

    @model_validator(mode="after")
    def _defaults(self) -> Self:
        if self.cloud and self.serve:
            raise ValueError("--cloud starts a server against that verifier; --serve measures a running one: give one")
        self.turns = self.turns or (3 if self.quick else 0)
        self.max_new_tokens = self.max_new_tokens or (8 if self.quick else 96)
        self.dtype = self.dtype or ("float32" if self.quick else "auto")
        return self


@dataclass(frozen=True)
class Script:
    system: str
    turns: list[str]
    description: str = ""


def read_script(path: Path, turns: int) -> Script:
    """The chat of `path`, its first `turns` user turns (0: all)."""
    data = json.loads(path.read_text())
    script = Script(data["system"], list(data["turns"]), data.get("description", ""))
    if turns > len(script.turns):
        raise ValueError(f"--turns {turns}: {path} has {len(script.turns)}")
    return Script(script.system, script.turns[: turns or None], script.description)


@dataclass(frozen=True)
class StreamedReply:
    """One streamed chat completion as its client saw it."""

    text: str
    ttft_s: float | None  # request sent -> first non-empty content delta; None: no content came
    total_s: float
    prompt_tokens: int | None  # the server's usage (stream_options.include_usage); None: not sent
    completion_tokens: int | None
    stats: dict[str, Any]  # edge-agent serve's `speculative_decoding` object; {} from other servers


def stream_chat(client: Any, messages: list[dict[str, str]], max_tokens: int, temperature: float) -> StreamedReply:
    """Send one chat completion to an openai client, streaming, and time it."""
    start, first, pieces, usage, stats = time.perf_counter(), None, [], None, {}
    stream = client.chat.completions.create(
        model="any",
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage, stats = chunk.usage, (chunk.model_extra or {}).get("speculative_decoding", {})
    total = time.perf_counter() - start
    return StreamedReply(
        "".join(pieces),
        None if first is None else first - start,
        total,
        None if usage is None else usage.prompt_tokens,
        None if usage is None else usage.completion_tokens,
        stats,
    )


@dataclass(frozen=True)
class Endpoints:
    serve_url: str
    cloud_metrics_url: str | None
    edge_metrics_url: str | None


def _logged_port(log_file: Path, pattern: str) -> int | None:
    found = re.search(pattern, log_file.read_text())
    return int(found.group(1)) if found else None


def _metrics_url(port: int | None) -> str | None:
    return None if port is None else f"http://127.0.0.1:{port}/metrics"


def _tiny_models(s: ChatTurnsSettings) -> tuple[str, str]:
    """--quick's tiny pair (draft folder, target): a folder, or for llama.cpp its GGUF."""
    from bench.tiny_models import save_gguf, save_pair

    draft, target = save_pair(s.out / "tiny_models", vllm=s.engine == "vllm")
    if s.engine != "llama.cpp":
        return str(draft), str(target)
    from transformers import AutoModelForCausalLM

    return str(draft), str(save_gguf(AutoModelForCausalLM.from_pretrained(target), target / "target.gguf"))


def verifier_command(s: ChatTurnsSettings, target: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "cloud", "--engine", s.engine, "--host", "127.0.0.1", "--port", "0", "--http-port", "0"]
    cmd += ["--dtype", s.dtype, "--threads", str(s.threads)] + (["--model", target] if target else [])
    return cmd + shlex.split(s.verifier_flags)


def serve_command(s: ChatTurnsSettings, cloud: str, draft: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "edge", "serve", "--cloud", cloud, "--port", "0", "--metrics-port", "0", "--mode", s.mode]
    cmd += ["--dtype", s.dtype, "--threads", str(s.threads), "--draft-threads", str(s.threads)]
    return cmd + (["--draft-model", draft] if draft else []) + shlex.split(s.edge_flags)


@contextmanager
def endpoints(s: ChatTurnsSettings) -> Iterator[Endpoints]:
    """The server to measure and the /metrics to read: --serve's, or those of the processes
    started here (a verifier unless --cloud, and edge-agent serve), stopped on exit."""
    if s.serve:
        yield Endpoints(s.serve.rstrip("/"), s.cloud_metrics_url, s.serve_metrics_url)
        return
    draft, target = _tiny_models(s) if s.quick else (s.draft_model, s.target_model)
    env = {**os.environ} | ({"SPECDEC_EDGE_API_KEY": s.api_key.get_secret_value()} if s.api_key else {})
    with _verifier(s, target) as (cloud, cloud_metrics):
        serve_log = s.out / "serve.log"
        ready = r"serving on (http://\S+:\d+)"
        with running(serve_command(s, cloud, draft), serve_log, ready, "edge-agent serve", env=env) as (_, url):
            edge_metrics = s.serve_metrics_url or _metrics_url(_logged_port(serve_log, r"edge metrics on \S+:(\d+)"))
            yield Endpoints(url, cloud_metrics, edge_metrics)


@contextmanager
def _verifier(s: ChatTurnsSettings, target: str | None) -> Iterator[tuple[str, str | None]]:
    """(gRPC address, /metrics URL) of --cloud, or of a verifier started here."""
    if s.cloud:
        yield s.cloud, s.cloud_metrics_url
        return
    verifier_log = s.out / "verifier.log"
    with running(verifier_command(s, target), verifier_log, r"serving .* on (\S+:\d+)", "cloud-verifier") as (_, address):
        yield address, _metrics_url(_logged_port(verifier_log, r"http on \S+:(\d+)"))


def read_counters(url: str | None, api_key: SecretStr | None = None) -> dict[str, float] | None:
    """Every counter (or gauge) sample of a /metrics whose name holds a COUNTER_WORDS word, by
    its series (name{labels}); None where there is no URL or it could not be read."""
    if url is None:
        return None
    headers = {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
            text = reply.read().decode()
    except OSError as err:
        log.warning("%s not read: %s", url, err)
        return None
    found = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("counter", "gauge", "unknown"):
            continue
        for sample in family.samples:
            if any(word in sample.name for word in COUNTER_WORDS) and not sample.name.endswith("_created"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                found[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return found


def _increase(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {series: value - before.get(series, 0.0) for series, value in after.items()}


class Counters:
    """The reuse counters of the verifier and the edge, read before and after each turn."""

    def __init__(self, where: Endpoints, api_key: SecretStr | None) -> None:
        self.urls = {"verifier": (where.cloud_metrics_url, api_key), "edge": (where.edge_metrics_url, None)}

    def read(self) -> dict[str, dict[str, float] | None]:
        return {side: read_counters(url, key) for side, (url, key) in self.urls.items()}

    @staticmethod
    def increase(before: dict[str, dict[str, float] | None], after: dict[str, dict[str, float] | None]) -> dict[str, Any]:
        return {side: _increase(before[side], after[side]) for side in before}


class PromptCounter:
    """Prompt tokens with a tokenizer's chat template, for a server whose usage does not say."""

    def __init__(self, folder: str | None) -> None:
        self.folder, self.tokenizer = folder, cast(Any, None)  # loaded on first use

    def __call__(self, messages: list[dict[str, str]]) -> int | None:
        if self.folder is None or not Path(self.folder).is_dir():
            return None
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        return len(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


@dataclass(frozen=True)
class Turn:
    turn: int  # 1-based
    prompt_tokens: int | None
    prompt_tokens_from: str  # "usage" (the server's) | "tokenizer" | "unknown"
    ttft_s: float | None
    total_s: float
    completion_tokens: int | None
    decode_tokens_per_s: float | None  # tokens after the first over the time after the first
    counters: dict[str, Any]  # verifier / edge: each matching series' increase over the turn (None: not read)
    speculative_decoding: dict[str, Any]
    reply: str


def _decode_rate(reply: StreamedReply) -> float | None:
    tokens, ttft = reply.completion_tokens, reply.ttft_s
    if tokens is None or ttft is None or tokens < 2 or reply.total_s <= ttft:
        return None
    return (tokens - 1) / (reply.total_s - ttft)


def conversation_tag(repeat: int, quick: bool, tag: str = "") -> str:
    """What opens a repeat's system prompt, so that its tokens differ from every other repeat's
    from the first few on; the tiny models' tokenizer knows only the words w0..w93."""
    return f"Conversation {repeat + 1}" + (f" of {tag}" if tag else "") + (f" w{3 + repeat % 90}" if quick else "") + "."


def converse(
    client: Any, s: ChatTurnsSettings, script: Script, repeat: int, counters: Counters, count: PromptCounter
) -> dict[str, Any]:
    """One conversation of the script: each turn resends all before it, with the actual replies."""
    system = f"{conversation_tag(repeat, s.quick, s.tag)} {script.system}"
    messages, turns = [{"role": "system", "content": system}], []
    for number, text in enumerate(script.turns, start=1):
        messages.append({"role": "user", "content": text})
        before = counters.read()
        reply = stream_chat(client, messages, s.max_new_tokens, s.temperature)
        after = counters.read()
        prompt_tokens, source = reply.prompt_tokens, "usage"
        if prompt_tokens is None:
            prompt_tokens = count(messages)
            source = "unknown" if prompt_tokens is None else "tokenizer"
        turns.append(
            Turn(
                number,
                prompt_tokens,
                source,
                reply.ttft_s,
                reply.total_s,
                reply.completion_tokens,
                _decode_rate(reply),
                Counters.increase(before, after),
                reply.stats,
                reply.text,
            )
        )
        messages.append({"role": "assistant", "content": reply.text})
        sys.stderr.write(
            f"chat_turns: repeat {repeat + 1}/{s.repeats}, turn {number}/{len(script.turns)}: "
            f"{prompt_tokens} prompt tokens, TTFT {_ms(reply.ttft_s)}\n"
        )
    return {"repeat": repeat + 1, "system_prompt": system, "turns": [asdict(t) for t in turns]}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _settings(s: ChatTurnsSettings, script: Script) -> dict[str, Any]:
    started = not s.serve
    return {
        "serve": s.serve or "started",
        "cloud": s.cloud or ("started" if started else None),
        "engine": s.engine if started and not s.cloud else None,
        "target_model": s.target_model or ("tiny random" if s.quick else None),
        "draft_model": s.draft_model or ("tiny random" if s.quick else None),
        "mode": s.mode if started else None,
        "dtype": s.dtype if started else None,
        "threads": s.threads if started else None,
        "verifier_flags": s.verifier_flags,
        "edge_flags": s.edge_flags,
        "quick": s.quick,
        "script": str(s.script),
        "script_description": script.description,
        "turns": len(script.turns),
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "repeats": s.repeats,
        "tag": s.tag,
    }


def run(s: ChatTurnsSettings, command: str) -> int:
    from openai import OpenAI

    s.out.mkdir(parents=True, exist_ok=True)
    script = read_script(s.script, s.turns)
    key = s.serve_api_key.get_secret_value() if s.serve_api_key else "unused"
    with endpoints(s) as where:
        client = OpenAI(base_url=where.serve_url + "/v1", api_key=key, max_retries=0, timeout=1800)
        counters = Counters(where, s.api_key)
        count = PromptCounter(s.tokenizer or s.draft_model or s.target_model)
        stream_chat(client, WARMUP, min(8, s.max_new_tokens), s.temperature)  # connects, allocates, fills caches
        found = counters.read()
        conversations = [converse(client, s, script, repeat, counters, count) for repeat in range(s.repeats)]
    result = {
        **provenance(command),
        "git": git_state(REPO),
        "settings": _settings(s, script),
        "metrics": {side: {"read": series is not None, "series": sorted(series or {})} for side, series in found.items()},
        "summary": summarize(conversations),
        "repeats": conversations,
    }
    write_result(s.out, "chat_turns", result, markdown(result))
    return 0


def _redacted(argv: list[str]) -> list[str]:
    """The command line as the result records it: API keys left out."""
    secret = ("--api-key", "--serve-api-key")
    shown = []
    for i, arg in enumerate(argv):
        flag = arg.split("=", 1)[0]
        shown.append("***" if i and argv[i - 1] in secret else f"{flag}=***" if "=" in arg and flag in secret else arg)
    return shown


PROG = "python -m bench.chat_turns"


def parser() -> argparse.ArgumentParser:
    return settings_parser(PROG, __doc__, ChatTurnsSettings)


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(given)
    return run_cli(PROG, lambda: run(settings_from_args(ChatTurnsSettings, args), " ".join([PROG, *_redacted(given)])))


if __name__ == "__main__":
    sys.exit(main())
