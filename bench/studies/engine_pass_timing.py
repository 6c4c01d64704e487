"""What one verifier pass costs on each engine, through the Engine interface the verifier drives
(cloud/engine/): milliseconds per pass by new tokens (one session after `--context` tokens),
the prefill of `--context` tokens, and sessions batched (each with `--batch-new` new tokens).
Every engine is measured in the same run, side by side, after a warm-up; each figure is the
median of `--repeats` passes, the KV cropped back after each, each pass on fresh tokens (as a
round's drafts are: vLLM's prefix cache must not serve them).

The forward-pass engines (transformers, llama.cpp) are measured here; the vLLM engine runs each
session as a live request, and its rounds and steps are measured by bench.studies.vllm_live_rounds
and bench.studies.vllm_step_overhead.

    python -m bench.studies.engine_pass_timing --target FOLDER [--gguf FILE] \\
        [--engines transformers,llama.cpp] [--dtypes float32,bfloat16] [--threads 2] [--out docs/engine_pass_timing]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import study_settings
from bench.environment import machine_line, provenance, write_result
from cloud.engine import KVRequest
from shared.cli import run_cli

if TYPE_CHECKING:
    from cloud.engine.llamacpp import LlamaCppEngine
    from cloud.engine.transformers import TransformersEngine


class PassTimingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_PASS_TIMING_")

    target: Path = Field(description="the target's HF folder (the transformers engine)")
    engines: str = Field("transformers,llama.cpp", description="comma-separated: transformers, llama.cpp")
    gguf: Path | None = Field(None, description="the target's GGUF (the llama.cpp engine; default: the folder's .gguf)")
    dtypes: str = Field("float32,bfloat16", description="transformers dtypes to measure, comma-separated")
    threads: int = Field(2, ge=1, description="CPU threads of every engine")
    device: str = Field("cpu", description="where the transformers engine runs: cpu | cuda")
    context: int = Field(256, ge=1, description="tokens of context before each pass")
    new_tokens: str = Field("1,2,5,8", description="new tokens per pass, comma-separated")
    sessions: str = Field("1,4,16", description="sessions batched in one pass, comma-separated")
    batch_new: int = Field(5, ge=1, description="new tokens per session in a batched pass")
    repeats: int = Field(7, ge=1, description="passes per figure (the median is reported)")
    out: Path = Field(Path("docs/engine_pass_timing"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "engines": ("target", "engines", "gguf", "dtypes", "threads", "device"),
        "passes": ("context", "new_tokens", "sessions", "batch_new", "repeats"),
        "output": ("out",),
    }


@dataclass(frozen=True)
class Measured:
    """One engine as measured, and its name in the report."""

    name: str
    engine: TransformersEngine | LlamaCppEngine


def _engines(args: PassTimingSettings, max_sessions: int) -> list[Measured]:
    from shared import lm

    torch.set_num_threads(args.threads)
    names = set(filter(None, args.engines.split(",")))
    dtypes = list(filter(None, args.dtypes.split(",")))
    engines: list[Measured] = []
    context = args.context + max(int(n) for n in args.new_tokens.split(",")) + args.batch_new
    if "transformers" in names:
        from cloud.engine.transformers import TransformersEngine

        for dtype in dtypes:
            model = lm.load_model(str(args.target), dtype, args.device)
            engines.append(Measured(f"transformers {dtype}", TransformersEngine(model)))
    if "llama.cpp" in names:
        from cloud.engine.llamacpp import LlamaCppEngine, target_gguf

        gguf = args.gguf or target_gguf(args.target)
        engines.append(Measured(f"llama.cpp {gguf.name}", LlamaCppEngine(gguf, threads=args.threads)))
    for measured in engines:
        measured.engine.plan_kv(KVRequest("packed", max_sessions, 1 << 40, context, 0))
    return engines


def _synchronize() -> None:
    """A pass on a GPU is timed to its end, not to its last kernel launch."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _median_ms(passes: list[float]) -> float:
    return round(statistics.median(passes) * 1000.0, 1)


def _time_pass(measured: Measured, kvs: list[Any], blocks: Callable[[], list[list[int]]], repeats: int) -> float:
    """The median time of one pass feeding fresh `blocks()` after `kvs`, cropped back after each."""
    lengths = [kv.get_seq_length() for kv in kvs]
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        fed = blocks()
        start = time.perf_counter()
        measured.engine.forward(kvs, fed, [len(b) for b in fed])
        _synchronize()
        times.append(time.perf_counter() - start)
        for kv, length in zip(kvs, lengths, strict=True):
            measured.engine.crop(kv, length)
    return _median_ms(times[1:])


def measure(measured: Measured, args: PassTimingSettings, vocab: int) -> dict[str, Any]:
    engine = measured.engine
    gen = torch.Generator().manual_seed(0)
    low = min(100, vocab // 2)  # past the special tokens of a real vocabulary

    def tokens(n: int) -> list[int]:
        return torch.randint(low, vocab, (n,), generator=gen).tolist()

    counts, news = [int(n) for n in args.sessions.split(",")], args.new_tokens.split(",")
    kvs = [engine.new_kv() for _ in range(max(counts))]
    try:
        prefill = []
        for kv in kvs:
            start = time.perf_counter()
            engine.forward([kv], [tokens(args.context)], [1])
            _synchronize()
            prefill.append(time.perf_counter() - start)
        by_new = {n: _time_pass(measured, kvs[:1], partial(_blocks, tokens, 1, int(n)), args.repeats) for n in news}
        by_sessions = {
            str(s): _time_pass(measured, kvs[:s], partial(_blocks, tokens, s, args.batch_new), args.repeats) for s in counts
        }
        row: dict[str, Any] = {"prefill_ms": _median_ms(prefill), "ms_by_new_tokens": by_new, "ms_by_sessions": by_sessions}
    finally:
        for kv in kvs:
            engine.free(kv)
    return row


def _blocks(tokens: Callable[[int], list[int]], sessions: int, new: int) -> list[list[int]]:
    return [tokens(new) for _ in range(sessions)]


def _ms(value: float) -> str:
    """Whole milliseconds, with a tenth below 10 ms (a GPU's passes)."""
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _report(result: dict[str, Any]) -> str:
    new = list(next(iter(result["engines"].values()))["ms_by_new_tokens"])
    sessions = list(next(iter(result["engines"].values()))["ms_by_sessions"])
    lines = [
        "# One verifier pass by engine",
        "",
        f"{machine_line(result['provenance']['machine'])}; {result['context']} tokens of context; "
        f"median of {result['repeats']} passes.",
        "",
        "| engine | "
        + " | ".join(f"{n} new" for n in new)
        + f" | prefill {result['context']} | "
        + " | ".join(f"{s} x {result['batch_new']}" for s in sessions)
        + " | 5 new / 1 new |",
        "|---" * (len(new) + len(sessions) + 3) + "|",
    ]
    for name, row in result["engines"].items():
        by_new, by_s = row["ms_by_new_tokens"], row["ms_by_sessions"]
        ratio = by_new.get("5", 0) / by_new["1"] if "5" in by_new else float("nan")
        cells = [_ms(by_new[n]) for n in new] + [_ms(row["prefill_ms"])] + [_ms(by_s[s]) for s in sessions]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return "\n".join(lines) + "\n\nms per pass. Command: `" + result["provenance"]["command"] + "`\n"


def main(argv: list[str] | None = None) -> int:
    args, command = study_settings("bench.studies.engine_pass_timing", __doc__, PassTimingSettings, argv)
    counts = [int(n) for n in args.sessions.split(",")]
    engines = _engines(args, max(counts))
    vocab = min(m.engine.logits_width for m in engines)
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "context": args.context,
        "batch_new": args.batch_new,
        "repeats": args.repeats,
        "threads": args.threads,
        "engines": {m.name: measure(m, args, vocab) for m in engines},
    }
    write_result(args.out, "engine_pass_timing", result, _report(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m bench.studies.engine_pass_timing", main))
