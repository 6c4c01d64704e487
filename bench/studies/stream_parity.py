"""Target-only streams through the verifier against vLLM's own server, side by side: N
concurrent streams on each (the same prompts on every server; new ones each repeat, so that no
server's prefix cache serves them), every stream `--new-tokens` tokens, greedy (or
sampled at `--temperature` and `--top-p`, as chat traffic is), no stop token, at each N of
`--streams`.

The verifier's streams are Generate calls (the cloud_only mode, as edge-agent sends them,
through the edge's own client); vLLM's are streaming `/v1/completions` calls with
`ignore_eos` (bench/loadtest_vllm.py's client). Both servers run on the same machine with the
same model (tools/gpu_parity.sh starts them, on a GPU). A level starts its N streams at once;
its throughput is every token over the time from the first start to the last token; TTFT and
TPOT are per stream (TPOT: time after the first token over the tokens after it); tokens a
delivery is how many tokens a chunk (an SSE event) carried. Each level is measured `--repeats`
times per server, the servers in turn; the median run is reported.

With `--stretches`, each verifier also streams the same tokens as Decode stretches (a "LABEL
stretch" row): each stream a Decode call that opens its session, as an auto-mode edge sends
when it lets the target decode, closed after it.

`--cloud` may name several verifiers (LABEL=HOST:PORT, comma-separated: variants of one
setting, side by side), and `--vllm-url` several vLLM servers (LABEL=URL: vLLM alone with other
settings, such as without asynchronous scheduling); every ratio is of the first vLLM server.
With `--metrics` (their /metrics URLs, in the same order) each verifier row also says how many
steps its engine ran in the level and how long a step took (specdec_engine_steps_total,
specdec_engine_step_seconds_total: the vLLM engine).

    python -m bench.studies.stream_parity --cloud 127.0.0.1:50071 --vllm-url http://127.0.0.1:8092 \\
        [--metrics http://127.0.0.1:8091/metrics] [--streams 1,24,64] [--prompt-tokens 200] [--new-tokens 256] \\
        [--vocab 151936] [--temperature 0.7 --top-p 0.95] [--out docs/stream_parity]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import study_settings
from bench.environment import machine_line, provenance, write_result
from bench.loadtest import engine_steps
from bench.loadtest_vllm import PeerServer
from bench.tasks import random_token_ids, sampling_label, session_config
from edge.transport.client import VerifierClient
from shared.cli import run_cli
from shared.errors import ConfigError
from shared.protocol import DecodeRequest, GenerateRequest, OpenSessionRequest, SessionConfig

Stream = Callable[[list[int]], AsyncIterator[int]]  # a prompt -> how many tokens each delivery carries


class StreamParitySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_STREAM_PARITY_")

    cloud: str = Field("", description="the verifier's HOST:PORT, or several as LABEL=HOST:PORT, comma-separated")
    metrics: str = Field("", description="the verifiers' /metrics URLs (loopback), comma-separated, in --cloud's order")
    vllm_url: str = Field(
        "",
        description="vLLM's own server, http://HOST:PORT, or several as LABEL=http://HOST:PORT, comma-separated "
        "(the first is the one the ratios are of; none: no ratios, as when each server is measured alone)",
    )
    streams: str = Field("1,24,64", description="concurrent streams per level, comma-separated")
    prompt_tokens: int = Field(200, ge=1, description="prompt tokens of each stream (random ids)")
    new_tokens: int = Field(256, ge=2, description="tokens each stream generates")
    vocab: int = Field(151936, ge=2, description="the vocabulary the verifier's streams sample from")
    temperature: float = Field(0.0, ge=0, le=2, description="every stream's (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="every sampled stream's nucleus (1: off)")
    repeats: int = Field(3, ge=1, description="runs of each level per server (the median is reported)")
    stretches: bool = Field(False, description="each verifier also streams Decode stretches (a 'LABEL stretch' row)")
    ready_timeout: float = Field(600.0, gt=0, description="seconds to wait for vLLM's server to list its model")
    out: Path = Field(Path("docs/stream_parity"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "servers": ("cloud", "metrics", "vllm_url", "ready_timeout"),
        "streams": ("streams", "prompt_tokens", "new_tokens", "vocab", "temperature", "top_p", "repeats", "stretches"),
        "output": ("out",),
    }


def verifier_stream(client: VerifierClient, config: SessionConfig, new_tokens: int) -> Stream:
    async def stream(prompt: list[int]) -> AsyncIterator[int]:
        async for chunk in client.generate(GenerateRequest(prompt, config, new_tokens)):
            yield len(chunk.tokens)

    return stream


def stretch_stream(client: VerifierClient, config: SessionConfig, new_tokens: int) -> Stream:
    async def stream(prompt: list[int]) -> AsyncIterator[int]:
        opening = DecodeRequest("", 0, new_tokens, open=OpenSessionRequest(prompt, config))
        session = ""
        try:
            async for chunk in client.decode(opening):
                session = session or (chunk.opened.session_id if chunk.opened else "")
                yield len(chunk.tokens)
        finally:
            if session:
                await client.close_session(session)

    return stream


def vllm_stream(server: PeerServer, new_tokens: int, temperature: float, top_p: float) -> Stream:
    def stream(prompt: list[int]) -> AsyncIterator[int]:
        return server.stream_tokens(prompt, new_tokens, temperature, top_p)

    return stream


async def _one(stream: Stream, prompt: list[int]) -> tuple[float, float, int, int]:
    """One stream: when its first token came, when its last did (perf_counter), its tokens and
    deliveries."""
    first = last = 0.0
    tokens = deliveries = 0
    async for n in stream(prompt):
        last = time.perf_counter()
        first = first or last
        tokens += n
        deliveries += 1
    return first, last, tokens, deliveries


def engine_totals(url: str) -> tuple[float, float] | None:
    """(seconds, steps) the verifier's engine ran so far, from its /metrics; None without a URL."""
    if not url:
        return None
    with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310 (a loopback URL the caller gave)
        return engine_steps(reply.read().decode())


async def level(stream: Stream, prompts: list[list[int]], metrics: str = "") -> dict[str, float]:
    """Every prompt streamed at once."""
    before = await asyncio.to_thread(engine_totals, metrics)
    start = time.perf_counter()
    runs = await asyncio.gather(*(_one(stream, p) for p in prompts))
    end = max(last for _, last, _, _ in runs)
    tokens = sum(n for _, _, n, _ in runs)
    tpots = [(last - first) * 1000.0 / (n - 1) for first, last, n, _ in runs if n > 1]
    row = {
        "tokens": tokens,
        "seconds": round(end - start, 4),
        "tok_s": round(tokens / (end - start), 1),
        "ttft_ms_median": round(statistics.median((first - start) * 1000.0 for first, _, _, _ in runs), 2),
        "tpot_ms_median": round(statistics.median(tpots), 3) if tpots else 0.0,
        "tokens_per_delivery": round(tokens / max(sum(d for _, _, _, d in runs), 1), 3),
    }
    after = await asyncio.to_thread(engine_totals, metrics)
    if before is not None and after is not None and after[1] > before[1]:
        (seconds, steps), (seconds_before, steps_before) = after, before
        row["engine_steps"] = steps - steps_before
        row["engine_step_ms_mean"] = round((seconds - seconds_before) * 1000.0 / (steps - steps_before), 3)
    return row


def _labelled(listed: str) -> list[tuple[str, str]]:
    """(label, value) of each comma-separated item, LABEL=VALUE or VALUE ("" as its label)."""
    found = []
    for item in (item.strip() for item in listed.split(",")):
        if item:
            label, _, value = item.rpartition("=")
            found.append((label, value))
    return found


def verifiers(args: StreamParitySettings) -> list[tuple[str, str, str]]:
    """(label, address, metrics URL) of each verifier --cloud names."""
    urls = [url.strip() for url in args.metrics.split(",")] if args.metrics else []
    return [
        (label or "cloud_only", address, urls[i] if i < len(urls) else "")
        for i, (label, address) in enumerate(_labelled(args.cloud))
    ]


def peers(args: StreamParitySettings) -> list[tuple[str, str]]:
    """(label, URL) of each vLLM server --vllm-url names; the first is unlabelled "vllm_alone"."""
    return [(label or ("vllm_alone" if i == 0 else f"vllm_{i}"), url) for i, (label, url) in enumerate(_labelled(args.vllm_url))]


async def measure(args: StreamParitySettings, result: dict[str, Any]) -> None:
    systems: dict[str, tuple[Stream, str]] = {}
    for label, url in peers(args):
        server = await PeerServer.from_url(url).wait_ready(args.ready_timeout)
        systems[label] = (vllm_stream(server, args.new_tokens, args.temperature, args.top_p), "")
    reference = next(iter(systems), None)
    clients = [(label, VerifierClient(address, verify_timeout_s=600.0), url) for label, address, url in verifiers(args)]
    config = session_config(args.vocab, args.temperature, args.top_p)
    for label, client, url in clients:  # each verifier answers (tools/gpu_parity.sh waits for them)
        systems[label] = (verifier_stream(client, config, args.new_tokens), url)
        if args.stretches:
            systems[f"{label} stretch"] = (stretch_stream(client, config, args.new_tokens), url)
    result["systems"], result["reference"] = list(systems), reference
    rng = np.random.default_rng(0)

    def prompts(n: int) -> list[list[int]]:
        return [random_token_ids(rng, args.vocab, args.prompt_tokens) for _ in range(n)]

    try:
        for stream, _ in systems.values():  # warm-up: each server's first streams
            await level(stream, prompts(4))
        for count in (int(n) for n in args.streams.split(",")):
            # New prompts each repeat, the same for every server: a server's prefix cache would
            # serve a repeat's prompts from the one before.
            sets = [prompts(count) for _ in range(args.repeats)]
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
            for same in sets:
                for name, (stream, url) in systems.items():
                    runs[name].append(await level(stream, same, url))
            row: dict[str, Any] = {"streams": count}
            for name, measured in runs.items():
                row[name] = sorted(measured, key=lambda r: r["tok_s"])[len(measured) // 2]
                row[name]["tok_s_runs"] = [r["tok_s"] for r in measured]
            if reference is not None:
                for name in systems:
                    row[name]["over_vllm_alone"] = round(row[name]["tok_s"] / row[reference]["tok_s"], 3)
            result["rows"].append(row)
            write_result(args.out, "stream_parity", result, report(result))  # each level as it comes
    finally:
        for _, client, _ in clients:
            await client.close()


def report(result: dict[str, Any]) -> str:
    sampling = sampling_label(result["temperature"], result["top_p"])
    lines = [
        "# Target-only streams: the verifier (cloud_only, and Decode stretches where asked) against vLLM's own server",
        "",
        f"{machine_line(result['provenance']['machine'])}; {result['prompt_tokens']} prompt tokens and "
        f"{result['new_tokens']} generated tokens a stream, {sampling}; median of {result['repeats']} runs a level.",
        "",
        f"| streams | system | tok/s | / {result['reference'] or 'itself'} | TPOT median, ms | TTFT median, ms "
        "| tokens a delivery | engine steps | ms an engine step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for name in result["systems"]:
            m = row[name]
            steps = f"{m['engine_steps']:,.0f} | {m['engine_step_ms_mean']:.2f}" if "engine_steps" in m else "– | –"
            lines.append(
                f"| {row['streams']} | {name} | {m['tok_s']:,.0f} | {m.get('over_vllm_alone', 1.0):.2f}x | "
                f"{m['tpot_ms_median']:.2f} | {m['ttft_ms_median']:.0f} | {m['tokens_per_delivery']:.2f} | {steps} |"
            )
    return "\n".join(lines) + "\n\nCommand: `" + result["provenance"]["command"] + "`\n"


def main(argv: list[str] | None = None) -> int:
    args, command = study_settings("bench.studies.stream_parity", __doc__, StreamParitySettings, argv)
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "repeats": args.repeats,
        "rows": [],
    }
    if not args.cloud and not args.vllm_url:
        raise ConfigError("nothing to measure: give --cloud, --vllm-url or both")
    asyncio.run(measure(args, result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m bench.studies.stream_parity", main))
