"""What serving costs: `edge-agent serve` driven with the openai client, against edge-agent's
own generate_one in this process, with the same settings on the same prompts, alternating in
one run (each prompt and repeat: both, the one that goes first alternating).

    python -m bench.studies.serve_overhead --draft-model D --target-model T --max-new-tokens 64 --k 4 \\
        --repeats 3 --out results/serve_overhead
    python -m bench.studies.serve_overhead --quick --out /tmp/serve-quick      # tiny random models, seconds

One cloud-verifier (a subprocess on loopback) answers both; the served edge is a second
process with its own copy of the draft model. Time to first token: from the request's start
to its first verified text (API: the first non-empty content delta of a stream; direct: the
first committed token). Tokens/s: completion tokens over the whole request. Greedy, so both
must give the same text; the run says whether they did. Writes serve_overhead.json and
report.md into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.chat_turns import stream_chat
from bench.cli import settings_parser
from bench.environment import machine, versions
from bench.processes import running
from bench.tiny_models import save_pair
from edge.__main__ import generate_one
from edge.config import EdgeSettings
from edge.context import EdgeContext, load_edge, verifier_client
from edge.prompts import Prompt, encode_prompt, read_prompts
from edge.round.generate import RoundRecord
from edge.transport.client import VerifierClient
from shared.cli import run_cli, settings_from_args
from shared.models import DRAFT_MODEL, TARGET_MODEL
from shared.models.store import model_folder

DEFAULT_PROMPTS = [  # short coding and writing asks, like the packaged Qwen-Coder pair is used for
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a Python generator is, with a short example.",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "Write a bash one-liner that counts the lines of every .py file under the current folder.",
    "Summarize the difference between a process and a thread in three sentences.",
    "Write a JavaScript function that debounces another function.",
]
QUICK_PROMPTS = ["w5 w9", "w12 w40 w7", "w60 w61 w62"]


class ServeOverheadSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_SERVE_OVERHEAD_")

    draft_model: Path | None = Field(None, description="draft model folder (default: the packaged Qwen 0.5B)")
    target_model: Path | None = Field(None, description="target model folder (default: the packaged Qwen 1.5B)")
    quick: bool = Field(False, description="tiny random models (fp32, 12 tokens): a smoke run")
    prompts: Path | None = Field(None, description="JSONL of prompts (edge-agent's format); default: six built in")
    max_new_tokens: int = Field(0, ge=0, description="per prompt (0: 64; --quick: 12)")
    k: int = Field(4, ge=0, description="draft tokens per round")
    repeats: int = Field(3, ge=1, description="times each prompt is measured on both paths")
    dtype: str = Field("", description="of models run by transformers (empty: auto; --quick: float32)")
    threads: int = Field(0, ge=0, description="CPU threads per process (0 = each runtime's default)")
    out: Path = Field(description="folder for serve_overhead.json, report.md, logs")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the models": ("draft_model", "target_model", "quick"),
        "the measurement": ("prompts", "max_new_tokens", "k", "repeats"),
        "runtime": ("dtype", "threads"),
        "output": ("out",),
    }

    @model_validator(mode="after")
    def _quick_defaults(self) -> Self:
        self.max_new_tokens = self.max_new_tokens or (12 if self.quick else 64)
        self.dtype = self.dtype or ("float32" if self.quick else "auto")
        return self


@dataclass(frozen=True)
class Sample:
    system: str  # "api" | "direct"
    prompt_id: str
    repeat: int
    ttft_s: float
    elapsed_s: float
    tokens: int
    rounds: int
    text: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s else 0.0


def _api_sample(client: Any, prompt: Prompt, repeat: int, max_tokens: int) -> Sample:
    reply = stream_chat(client, [{"role": "user", "content": prompt.text}], max_tokens, 0.0)
    rounds = reply.stats.get("rounds", 0)
    return Sample("api", prompt.id, repeat, reply.ttft_s or 0.0, reply.total_s, reply.completion_tokens or 0, rounds, reply.text)


class _FirstToken:
    def __init__(self) -> None:
        self.at: float | None = None

    def committed(self, tokens: list[int], record: RoundRecord | None) -> None:
        if tokens and self.at is None:
            self.at = time.perf_counter()

    def provisional(self, tokens: list[int]) -> None:
        pass


async def _direct_sample(ctx: EdgeContext, client: VerifierClient, prompt: Prompt, repeat: int) -> Sample:
    ids = encode_prompt(ctx.tokenizer, prompt.text, chat=True)
    first, start = _FirstToken(), time.perf_counter()
    result = await generate_one(ctx, client, ids, ctx.settings.seed, first)
    elapsed = time.perf_counter() - start
    text = ctx.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return Sample("direct", prompt.id, repeat, (first.at or start) - start, elapsed, len(result.token_ids), result.rounds, text)


async def _measure(args: ServeOverheadSettings, address: str, base_url: str, prompts: list[Prompt]) -> list[Sample]:
    from openai import OpenAI

    api = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    ctx = load_edge(_edge_settings(args, address))
    client = verifier_client(ctx.settings, address)
    samples: list[Sample] = []
    try:
        warm = prompts[0]  # first calls connect, allocate the draft context, fill caches
        _api_sample(api, warm, -1, args.max_new_tokens)
        await _direct_sample(ctx, client, warm, -1)
        for repeat in range(args.repeats):
            for index, prompt in enumerate(prompts):
                api_first = (index + repeat) % 2 == 0
                for system in ("api", "direct") if api_first else ("direct", "api"):
                    if system == "api":
                        samples.append(await asyncio.to_thread(_api_sample, api, prompt, repeat, args.max_new_tokens))
                    else:
                        samples.append(await _direct_sample(ctx, client, prompt, repeat))
                sys.stderr.write(f"serve_overhead: repeat {repeat + 1}/{args.repeats}, prompt {prompt.id}\n")
    finally:
        await client.close()
    return samples


def _edge_settings(args: ServeOverheadSettings, address: str) -> EdgeSettings:
    return EdgeSettings(
        cloud=address,
        draft_model=str(args.draft_model),
        max_new_tokens=args.max_new_tokens,
        k=args.k,
        dtype=args.dtype,
        threads=args.threads,
        draft_threads=args.threads,
    )


def _edge_flags(args: ServeOverheadSettings) -> list[str]:
    return [
        "--draft-model",
        str(args.draft_model),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--k",
        str(args.k),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--draft-threads",
        str(args.threads),
    ]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(samples: list[Sample]) -> dict[str, Any]:
    systems = {}
    for system in ("api", "direct"):
        rows = [s for s in samples if s.system == system]
        systems[system] = {
            "ttft_ms_median": _median([s.ttft_s * 1000 for s in rows]),
            "tokens_per_s_median": _median([s.tokens_per_s for s in rows]),
            "tokens_median": _median([float(s.tokens) for s in rows]),
            "runs": len(rows),
        }
    pairs = [
        (a, d)
        for a in samples
        if a.system == "api"
        for d in samples
        if d.system == "direct" and (d.prompt_id, d.repeat) == (a.prompt_id, a.repeat)
    ]
    return {
        "systems": systems,
        "paired": {
            "ttft_overhead_ms_median": _median([(a.ttft_s - d.ttft_s) * 1000 for a, d in pairs]),
            "tokens_per_s_ratio_median": _median([a.tokens_per_s / d.tokens_per_s for a, d in pairs if d.tokens_per_s]),
            "same_text": sum(a.text == d.text for a, d in pairs),
            "pairs": len(pairs),
        },
    }


def _cell(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def report(result: dict[str, Any]) -> str:
    s, p = result["summary"]["systems"], result["summary"]["paired"]
    lines = [
        "# Serving overhead: `edge-agent serve` (openai client) against `edge-agent` direct",
        "",
        f"{result['settings']['prompts']} prompts x {result['settings']['repeats']} repeats, "
        f"max_new_tokens {result['settings']['max_new_tokens']}, k {result['settings']['k']}, greedy; "
        f"{result['machine']['cpu_model']}, {result['machine']['cores']} cores "
        f"({result['machine']['cpu_flags']}), {result.get('date', '')}.",
        "",
        "| system | TTFT median (ms) | tokens/s median | tokens median | runs |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("api", "served (openai client, streaming)"), ("direct", "edge-agent generate_one")):
        row = s[name]
        lines.append(
            f"| {label} | {_cell(row['ttft_ms_median'])} | {_cell(row['tokens_per_s_median'])} | "
            f"{_cell(row['tokens_median'], 0)} | {row['runs']} |"
        )
    lines += [
        "",
        f"Paired (same prompt and repeat): TTFT overhead median {_cell(p['ttft_overhead_ms_median'])} ms, "
        f"tokens/s ratio median {_cell(p['tokens_per_s_ratio_median'], 3)}; "
        f"same text in {p['same_text']} of {p['pairs']} pairs.",
        "",
    ]
    return "\n".join(lines)


def _prompts(args: ServeOverheadSettings) -> list[Prompt]:
    if args.prompts is not None:
        return read_prompts(args.prompts)
    texts = QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS
    return [Prompt(f"p{i}", text) for i, text in enumerate(texts)]


def _with_models(args: ServeOverheadSettings) -> ServeOverheadSettings:
    """The settings with both model folders named: --quick's tiny pair, else the packaged ones."""
    draft, target = args.draft_model, args.target_model
    if args.quick and (draft is None or target is None):
        draft, target = save_pair(args.out / "tiny_models")
    draft = draft or Path(model_folder(None, DRAFT_MODEL))
    target = target or Path(model_folder(None, TARGET_MODEL))
    return args.model_copy(update={"draft_model": draft, "target_model": target})


def run(args: ServeOverheadSettings) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    args = _with_models(args)
    prompts = _prompts(args)
    verifier = [sys.executable, "-m", "cloud", "--model", str(args.target_model), "--host", "127.0.0.1", "--port", "0"]
    verifier += ["--http-port", "0", "--dtype", args.dtype, "--threads", str(args.threads)]
    with running(verifier, args.out / "verifier.log", r"serving .* on (\S+:\d+)", "cloud-verifier") as (_, address):
        serve = [sys.executable, "-m", "edge", "serve", "--cloud", address, "--port", "0", *_edge_flags(args)]
        with running(serve, args.out / "serve.log", r"serving on (http://\S+:\d+)", "edge-agent serve") as (_, url):
            samples = asyncio.run(_measure(args, address, url, prompts))
    settings = {
        "draft_model": str(args.draft_model),
        "target_model": str(args.target_model),
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "prompts": len(prompts),
        "dtype": args.dtype,
        "threads": args.threads,
        "quick": args.quick,
    }
    result = {
        "settings": settings,
        "machine": machine(),
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
        "summary": summarize(samples),
        "samples": [asdict(s) for s in samples],
    }
    (args.out / "serve_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "report.md").write_text(report(result))
    sys.stderr.write(report(result))
    return 0


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.studies.serve_overhead", __doc__, ServeOverheadSettings)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_cli("serve_overhead", lambda: run(settings_from_args(ServeOverheadSettings, args)))


if __name__ == "__main__":
    sys.exit(main())
