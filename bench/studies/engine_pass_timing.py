"""What one verifier pass costs on each engine, through the Engine interface the verifier drives
(cloud/engine/): milliseconds per pass by new tokens (one session after `--context` tokens),
the prefill of `--context` tokens, and sessions batched (each with `--batch-new` new tokens).
Every engine is measured in the same run, side by side, after a warm-up; each figure is the
median of `--repeats` passes, the KV cropped back after each.

    python -m bench.studies.engine_pass_timing --target FOLDER [--gguf FILE] \\
        [--dtypes float32,bfloat16] [--threads 2] [--out docs/engine_pass_timing]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import settings_parser
from bench.environment import machine_line, provenance
from cloud.engine import Engine, KVRequest
from shared.cli import settings_from_args


class PassTimingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_PASS_TIMING_")

    target: Path = Field(description="the target's HF folder (the transformers engine)")
    gguf: Path | None = Field(None, description="the target's GGUF (the llama.cpp engine; default: the folder's .gguf)")
    dtypes: str = Field("float32,bfloat16", description="transformers dtypes to measure, comma-separated")
    threads: int = Field(2, ge=1, description="CPU threads of every engine")
    context: int = Field(256, ge=1, description="tokens of context before each pass")
    new_tokens: str = Field("1,2,5,8", description="new tokens per pass, comma-separated")
    sessions: str = Field("1,4,16", description="sessions batched in one pass, comma-separated")
    batch_new: int = Field(5, ge=1, description="new tokens per session in a batched pass")
    repeats: int = Field(7, ge=1, description="passes per figure (the median is reported)")
    out: Path = Field(Path("docs/engine_pass_timing"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "engines": ("target", "gguf", "dtypes", "threads"),
        "passes": ("context", "new_tokens", "sessions", "batch_new", "repeats"),
        "output": ("out",),
    }


def _engines(args: PassTimingSettings, max_sessions: int) -> list[tuple[str, Engine]]:
    from cloud.engine.llamacpp import LlamaCppEngine, target_gguf
    from cloud.engine.transformers import TransformersEngine
    from shared import lm

    torch.set_num_threads(args.threads)
    engines: list[tuple[str, Engine]] = []
    for dtype in filter(None, args.dtypes.split(",")):
        engines.append((f"transformers {dtype}", TransformersEngine(lm.load_model(str(args.target), dtype, "cpu"))))
    gguf = args.gguf or target_gguf(args.target)
    engines.append((f"llama.cpp {gguf.name}", LlamaCppEngine(gguf, threads=args.threads)))
    context = args.context + max(int(n) for n in args.new_tokens.split(",")) + args.batch_new
    for _, engine in engines:
        engine.plan_kv(KVRequest("packed", max_sessions, 1 << 40, context, 0))
    return engines


def _median_ms(passes: list[float]) -> float:
    return round(statistics.median(passes) * 1000.0, 1)


def _time_pass(engine: Engine, kvs: list[Any], blocks: list[list[int]], repeats: int) -> float:
    """The median time of one pass feeding `blocks` after `kvs`, cropped back after each."""
    lengths = [kv.get_seq_length() for kv in kvs]
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        engine.forward(kvs, blocks, [len(b) for b in blocks])
        times.append(time.perf_counter() - start)
        for kv, length in zip(kvs, lengths, strict=True):
            engine.crop(kv, length)
    return _median_ms(times[1:])


def measure(engine: Engine, args: PassTimingSettings, vocab: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    low = min(100, vocab // 2)  # past the special tokens of a real vocabulary

    def tokens(n: int) -> list[int]:
        return torch.randint(low, vocab, (n,), generator=gen).tolist()

    counts = [int(n) for n in args.sessions.split(",")]
    kvs = [engine.new_kv() for _ in range(max(counts))]
    try:
        prefill = []
        for kv in kvs:
            start = time.perf_counter()
            engine.forward([kv], [tokens(args.context)], [1])
            prefill.append(time.perf_counter() - start)
        by_new = {n: _time_pass(engine, kvs[:1], [tokens(int(n))], args.repeats) for n in args.new_tokens.split(",")}
        by_sessions = {
            str(s): _time_pass(engine, kvs[:s], [tokens(args.batch_new) for _ in range(s)], args.repeats) for s in counts
        }
    finally:
        for kv in kvs:
            engine.free(kv)
    return {"prefill_ms": _median_ms(prefill), "ms_by_new_tokens": by_new, "ms_by_sessions": by_sessions}


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
        cells = [f"{by_new[n]:.0f}" for n in new] + [f"{row['prefill_ms']:.0f}"] + [f"{by_s[s]:.0f}" for s in sessions]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return "\n".join(lines) + "\n\nms per pass. Command: `" + result["provenance"]["command"] + "`\n"


def main(argv: list[str] | None = None) -> int:
    parser = settings_parser("python -m bench.studies.engine_pass_timing", __doc__, PassTimingSettings)
    args = settings_from_args(PassTimingSettings, parser.parse_args(argv))
    counts = [int(n) for n in args.sessions.split(",")]
    engines = _engines(args, max(counts))
    vocab = min(engine.logits_width for _, engine in engines)
    command = "python -m bench.studies.engine_pass_timing " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "context": args.context,
        "batch_new": args.batch_new,
        "repeats": args.repeats,
        "threads": args.threads,
        "engines": {name: measure(engine, args, vocab) for name, engine in engines},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_pass_timing.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "report.md").write_text(_report(result))
    print(_report(result))  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
