"""Structured output at speed: `edge-agent serve` answering JSON-schema requests
(`response_format` json_schema, strict) with speculation, against the target alone under the
same schema (`speculative.enabled` false), and against speculation without the schema on the
same prompts; each prompt and repeat runs all three, in an order that rotates.

    python -m bench.studies.structured_output --out results/structured_output        # the packaged Qwen pair
    python -m bench.studies.structured_output --quick --out /tmp/structured-quick     # tiny random models, seconds

One cloud-verifier (a subprocess on loopback) and one `edge-agent serve` (`--mode speculative`,
the cost k policy) answer every request; the openai client sends them, one at a time. Tokens/s:
completion tokens over the request's wall time. Every constrained answer is checked against its
schema. Forced tokens: the drafts the grammar allowed alone, which cost no drafting (the
response's `speculative_decoding.drafted_by.grammar`). Writes structured_output.json and
report.md into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

import jsonschema
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import settings_parser
from bench.environment import machine, versions
from bench.processes import running
from bench.tiny_models import save_pair
from shared.cli import run_cli, settings_from_args
from shared.models import DRAFT_MODEL, TARGET_MODEL
from shared.models.store import model_folder

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "json_schema_8.jsonl"
QUICK_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["ab", "cd", "abcd"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SYSTEMS = ("speculative+schema", "cloud_only+schema", "speculative")


class StructuredOutputSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_STRUCTURED_")

    draft_model: Path | None = Field(None, description="draft model folder (default: the packaged Qwen 0.5B)")
    target_model: Path | None = Field(None, description="target model folder (default: the packaged Qwen 1.5B)")
    quick: bool = Field(False, description="tiny random models on a byte-level tokenizer (fp32): a smoke run")
    prompts: Path = Field(DEFAULT_PROMPTS, description="JSONL: id, prompt, schema per line")
    max_new_tokens: int = Field(0, ge=0, description="per request (0: 160; --quick: 24)")
    temperature: float = Field(0.0, ge=0.0, description="0: greedy")
    repeats: int = Field(2, ge=1, description="times each prompt runs on every system")
    dtype: str = Field("", description="of models run by transformers (empty: auto; --quick: float32)")
    out: Path = Field(description="folder for structured_output.json, report.md, logs")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the models": ("draft_model", "target_model", "quick"),
        "the measurement": ("prompts", "max_new_tokens", "temperature", "repeats"),
        "runtime": ("dtype",),
        "output": ("out",),
    }

    @model_validator(mode="after")
    def _quick_defaults(self) -> Self:
        self.max_new_tokens = self.max_new_tokens or (24 if self.quick else 160)
        self.dtype = self.dtype or ("float32" if self.quick else "auto")
        return self


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    schema: dict[str, Any]


@dataclass(frozen=True)
class Sample:
    system: str
    task: str
    repeat: int
    elapsed_s: float
    tokens: int
    finish_reason: str
    valid: bool | None  # constrained answers: valid under the schema (None: not constrained)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s else 0.0


def read_tasks(path: Path) -> list[Task]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Task(str(r["id"]), str(r["prompt"]), r["schema"]) for r in rows]


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _request(client: Any, system: str, task: Task, repeat: int, args: StructuredOutputSettings) -> Sample:
    extra: dict[str, Any] = {}
    options: dict[str, Any] = {}
    if system.endswith("+schema"):
        schema = {"name": task.id.replace("-", "_"), "schema": task.schema, "strict": True}
        options["response_format"] = {"type": "json_schema", "json_schema": schema}
    if system.startswith("cloud_only"):
        extra["speculative"] = {"enabled": False}
    start = time.perf_counter()
    reply = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": task.prompt}],
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        extra_body=extra or None,
        **options,
    )
    elapsed = time.perf_counter() - start
    choice = reply.choices[0]
    stats = (reply.model_extra or {}).get("speculative_decoding", {})
    valid = _valid(choice.message.content or "", task.schema) if "schema" in system else None
    tokens = reply.usage.completion_tokens if reply.usage else 0
    return Sample(system, task.id, repeat, elapsed, tokens, choice.finish_reason, valid, stats)


def measure(args: StructuredOutputSettings, base_url: str, tasks: list[Task]) -> list[Sample]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=900)
    for system in SYSTEMS:  # first calls connect, allocate the draft context, fill caches
        _request(client, system, tasks[0], -1, args)
    samples: list[Sample] = []
    for repeat in range(args.repeats):
        for index, task in enumerate(tasks):
            turn = (index + repeat) % len(SYSTEMS)
            for system in SYSTEMS[turn:] + SYSTEMS[:turn]:
                samples.append(_request(client, system, task, repeat, args))
            sys.stderr.write(f"structured_output: repeat {repeat + 1}/{args.repeats}, {task.id}\n")
    return samples


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _total(samples: list[Sample], key: str) -> int:
    return sum(int(s.stats.get(key) or 0) for s in samples)


def _by_source(samples: list[Sample], key: str, source: str) -> int:
    return sum(int((s.stats.get(key) or {}).get(source, 0)) for s in samples)


def summarize(samples: list[Sample]) -> dict[str, Any]:
    systems: dict[str, Any] = {}
    for system in SYSTEMS:
        rows = [s for s in samples if s.system == system]
        tokens, seconds = sum(s.tokens for s in rows), sum(s.elapsed_s for s in rows)
        rounds = _total(rows, "rounds")
        verified = _total(rows, "accepted_tokens") + rounds
        systems[system] = {
            "tokens_per_s": tokens / seconds if seconds else None,  # all its tokens over all its time
            "tokens_per_s_median": _median([s.tokens_per_s for s in rows]),
            "tokens": tokens,
            "runs": len(rows),
            "valid": sum(bool(s.valid) for s in rows) if "schema" in system else None,
            "stopped": sum(s.finish_reason == "stop" for s in rows),
            "tau": verified / rounds if rounds else None,
            "drafted": _total(rows, "draft_tokens"),
            "forced_drafted": _by_source(rows, "drafted_by", "grammar"),
            "forced_accepted": _by_source(rows, "accepted_by", "grammar"),
        }
    return {"systems": systems, "ratios": _ratios(samples)}


def _ratios(samples: list[Sample]) -> dict[str, float | None]:
    """Medians over (task, repeat) of tokens/s ratios, each pair measured side by side."""
    rate = {(s.system, s.task, s.repeat): s.tokens_per_s for s in samples}
    keys = {(s.task, s.repeat) for s in samples}

    def median_ratio(top: str, bottom: str) -> float | None:
        values = [rate[(top, *k)] / rate[(bottom, *k)] for k in keys if rate.get((bottom, *k))]
        return _median(values)

    return {
        "constrained_speculative_over_constrained_cloud_only": median_ratio("speculative+schema", "cloud_only+schema"),
        "constrained_speculative_over_free_speculative": median_ratio("speculative+schema", "speculative"),
    }


def _cell(value: float | int | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def report(result: dict[str, Any]) -> str:
    s, r, settings, m = result["summary"]["systems"], result["summary"]["ratios"], result["settings"], result["machine"]
    lines = [
        "# Structured output: JSON-schema requests on `edge-agent serve`",
        "",
        f"{settings['prompts']} prompts x {settings['repeats']} repeats, max_tokens {settings['max_new_tokens']}, "
        f"temperature {settings['temperature']}; {m['cpu_model']}, {m['cores']} cores ({m['cpu_flags']}), "
        f"{result.get('date', '')}.",
        "",
        "| system | tokens/s (all) | tokens/s median | tokens | valid | stopped | tau | drafted | forced (accepted) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SYSTEMS:
        row = s[name]
        valid = "–" if row["valid"] is None else f"{row['valid']}/{row['runs']}"
        lines.append(
            f"| {name} | {_cell(row['tokens_per_s'])} | {_cell(row['tokens_per_s_median'])} | {row['tokens']} | {valid} | "
            f"{row['stopped']}/{row['runs']} | {_cell(row['tau'], 2)} | {row['drafted']} | "
            f"{row['forced_drafted']} ({row['forced_accepted']}) |"
        )
    lines += [
        "",
        "Paired medians (same prompt and repeat): constrained speculative over constrained cloud_only "
        f"{_cell(r['constrained_speculative_over_constrained_cloud_only'], 2)}x; over unconstrained speculative "
        f"{_cell(r['constrained_speculative_over_free_speculative'], 2)}x.",
        "",
        "tau: tokens per verified round (accepted drafts plus the one the target adds). Forced: drafts the grammar "
        "allowed alone, drafted without a forward pass of the draft model.",
        "",
    ]
    return "\n".join(lines)


def _with_models(args: StructuredOutputSettings) -> StructuredOutputSettings:
    draft, target = args.draft_model, args.target_model
    if args.quick and (draft is None or target is None):
        draft, target = save_pair(args.out / "tiny_models", bpe=True)
    draft = draft or Path(model_folder(None, DRAFT_MODEL))
    target = target or Path(model_folder(None, TARGET_MODEL))
    return args.model_copy(update={"draft_model": draft, "target_model": target})


def _tasks(args: StructuredOutputSettings) -> list[Task]:
    if args.quick:
        return [Task(f"quick-{i}", text, QUICK_SCHEMA) for i, text in enumerate(["ab cd", "abcd ab", "cd"])]
    return read_tasks(args.prompts)


def run(args: StructuredOutputSettings) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    args = _with_models(args)
    tasks = _tasks(args)
    verifier = [sys.executable, "-m", "cloud", "--model", str(args.target_model), "--host", "127.0.0.1", "--port", "0"]
    verifier += ["--http-port", "0", "--dtype", args.dtype]
    with running(verifier, args.out / "verifier.log", r"serving .* on (\S+:\d+)", "cloud-verifier") as (_, address):
        serve = [sys.executable, "-m", "edge", "serve", "--cloud", address, "--port", "0", "--mode", "speculative"]
        serve += ["--draft-model", str(args.draft_model), "--dtype", args.dtype]
        with running(serve, args.out / "serve.log", r"serving on (http://\S+:\d+)", "edge-agent serve") as (_, url):
            samples = measure(args, url, tasks)
    settings = {
        "draft_model": str(args.draft_model),
        "target_model": str(args.target_model),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "repeats": args.repeats,
        "prompts": len(tasks),
        "dtype": args.dtype,
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
    (args.out / "structured_output.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "report.md").write_text(report(result))
    sys.stderr.write(report(result))
    return 0


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.studies.structured_output", __doc__, StructuredOutputSettings)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_cli("structured_output", lambda: run(settings_from_args(StructuredOutputSettings, args)))


if __name__ == "__main__":
    sys.exit(main())
