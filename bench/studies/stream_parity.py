"""Target-only streams through the verifier against vLLM's own server, side by side: N
concurrent streams of the same prompts on each, every stream `--new-tokens` tokens, greedy, no
stop token, at each N of `--streams`.

The verifier's streams are Generate calls (the cloud_only mode, as edge-agent sends them,
through the edge's own client); vLLM's are streaming `/v1/completions` calls with
`ignore_eos` (bench/loadtest_vllm.py's client). Both servers run on the same machine with the
same model (tools/gpu_parity.sh starts them, on a GPU). A level starts its N streams at once;
its throughput is every token over the time from the first start to the last token; TTFT and
TPOT are per stream (TPOT: time after the first token over the tokens after it). Each level is
measured `--repeats` times per server, the servers in turn; the median run is reported.

    python -m bench.studies.stream_parity --cloud 127.0.0.1:50071 --vllm-url http://127.0.0.1:8092 \\
        [--streams 1,24,64] [--prompt-tokens 200] [--new-tokens 256] [--vocab 151936] [--out docs/stream_parity]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import settings_parser
from bench.environment import machine_line, provenance, write_result
from bench.loadtest_vllm import PeerServer
from edge.transport.client import VerifierClient
from shared.cli import settings_from_args
from shared.protocol import GenerateRequest, SessionConfig

Stream = Callable[[list[int]], AsyncIterator[int]]  # a prompt -> how many tokens each delivery carries


class StreamParitySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_STREAM_PARITY_")

    cloud: str = Field(description="the verifier's HOST:PORT")
    vllm_url: str = Field(description="vLLM's own server, http://HOST:PORT")
    streams: str = Field("1,24,64", description="concurrent streams per level, comma-separated")
    prompt_tokens: int = Field(200, ge=1, description="prompt tokens of each stream (random ids)")
    new_tokens: int = Field(256, ge=2, description="tokens each stream generates")
    vocab: int = Field(151936, ge=2, description="the vocabulary the verifier's streams sample from")
    repeats: int = Field(3, ge=1, description="runs of each level per server (the median is reported)")
    ready_timeout: float = Field(600.0, gt=0, description="seconds to wait for vLLM's server to list its model")
    out: Path = Field(Path("docs/stream_parity"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "servers": ("cloud", "vllm_url", "ready_timeout"),
        "streams": ("streams", "prompt_tokens", "new_tokens", "vocab", "repeats"),
        "output": ("out",),
    }


def verifier_stream(client: VerifierClient, vocab: int, new_tokens: int) -> Stream:
    async def stream(prompt: list[int]) -> AsyncIterator[int]:
        async for chunk in client.generate(GenerateRequest(prompt, SessionConfig(vocab_size=vocab), new_tokens)):
            yield len(chunk.tokens)

    return stream


def vllm_stream(server: PeerServer, new_tokens: int) -> Stream:
    def stream(prompt: list[int]) -> AsyncIterator[int]:
        return server.stream_tokens(prompt, new_tokens)

    return stream


async def _one(stream: Stream, prompt: list[int]) -> tuple[float, float, int]:
    """One stream: when its first token came, when its last did (perf_counter), its tokens."""
    first = last = 0.0
    tokens = 0
    async for n in stream(prompt):
        last = time.perf_counter()
        first = first or last
        tokens += n
    return first, last, tokens


async def level(stream: Stream, prompts: list[list[int]]) -> dict[str, float]:
    """Every prompt streamed at once."""
    start = time.perf_counter()
    runs = await asyncio.gather(*(_one(stream, p) for p in prompts))
    end = max(last for _, last, _ in runs)
    tokens = sum(n for _, _, n in runs)
    tpots = [(last - first) * 1000.0 / (n - 1) for first, last, n in runs if n > 1]
    return {
        "tokens": tokens,
        "seconds": round(end - start, 4),
        "tok_s": round(tokens / (end - start), 1),
        "ttft_ms_median": round(statistics.median((first - start) * 1000.0 for first, _, _ in runs), 2),
        "tpot_ms_median": round(statistics.median(tpots), 3) if tpots else 0.0,
    }


async def measure(args: StreamParitySettings, result: dict[str, Any]) -> None:
    client = VerifierClient(args.cloud, verify_timeout_s=600.0)  # the verifier answers (tools/gpu_parity.sh waits for it)
    server = await PeerServer.from_url(args.vllm_url).wait_ready(args.ready_timeout)
    systems = {
        "vllm_alone": vllm_stream(server, args.new_tokens),
        "cloud_only": verifier_stream(client, args.vocab, args.new_tokens),
    }
    rng = np.random.default_rng(0)
    high = min(args.vocab, 30_000)

    def prompts(n: int) -> list[list[int]]:
        return [rng.integers(min(100, high // 2), high, size=args.prompt_tokens).tolist() for _ in range(n)]

    try:
        for stream in systems.values():  # warm-up: each server's first streams
            await level(stream, prompts(4))
        for count in (int(n) for n in args.streams.split(",")):
            same = prompts(count)
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
            for _ in range(args.repeats):
                for name, stream in systems.items():
                    runs[name].append(await level(stream, same))
            row: dict[str, Any] = {"streams": count}
            for name, measured in runs.items():
                row[name] = sorted(measured, key=lambda r: r["tok_s"])[len(measured) // 2]
                row[name]["tok_s_runs"] = [r["tok_s"] for r in measured]
            row["cloud_only_over_vllm_alone"] = round(row["cloud_only"]["tok_s"] / row["vllm_alone"]["tok_s"], 3)
            result["rows"].append(row)
            write_result(args.out, "stream_parity", result, report(result))  # each level as it comes
    finally:
        await client.close()


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Target-only streams: the verifier (cloud_only) against vLLM's own server",
        "",
        f"{machine_line(result['provenance']['machine'])}; {result['prompt_tokens']} prompt tokens and "
        f"{result['new_tokens']} generated tokens a stream, greedy; median of {result['repeats']} runs a level.",
        "",
        "| streams | vLLM alone, tok/s | verifier cloud_only, tok/s | ratio | TPOT median, vLLM / verifier, ms |"
        " TTFT median, vLLM / verifier, ms |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        alone, ours = row["vllm_alone"], row["cloud_only"]
        lines.append(
            f"| {row['streams']} | {alone['tok_s']:,.0f} | {ours['tok_s']:,.0f} | {row['cloud_only_over_vllm_alone']:.2f}x | "
            f"{alone['tpot_ms_median']:.2f} / {ours['tpot_ms_median']:.2f} | "
            f"{alone['ttft_ms_median']:.0f} / {ours['ttft_ms_median']:.0f} |"
        )
    return "\n".join(lines) + "\n\nCommand: `" + result["provenance"]["command"] + "`\n"


def main(argv: list[str] | None = None) -> int:
    parser = settings_parser("python -m bench.studies.stream_parity", __doc__, StreamParitySettings)
    args = settings_from_args(StreamParitySettings, parser.parse_args(argv))
    command = "python -m bench.studies.stream_parity " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rows": [],
    }
    asyncio.run(measure(args, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
