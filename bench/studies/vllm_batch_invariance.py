"""Whether greedy speculative output equals cloud_only on the vLLM engine in bf16, with and
without vLLM's batch-invariant kernels (`VLLM_BATCH_INVARIANT=1`, GPU only).

A speculative round computes the draft positions in one pass of k+1 tokens beside other
requests; cloud_only decodes one token per step. In fp32 both give the same argmax; in bf16 the
reductions differ with the batch's shape, so a near-tie can flip and the two outputs part. vLLM's
batch-invariant mode makes every kernel reduce the same way whatever the batch: this study
measures whether that makes the two modes agree, and what it costs (cloud_only tokens/s).

For each setting a real cloud-verifier (`--engine vllm`) starts with the variable set, and
edge-agent answers the same prompts in both modes. The draft model defaults to the target
itself (self-drafting: rounds accept often, so most verified positions are drafts); any draft
of the same tokenizer works.

    python -m bench.studies.vllm_batch_invariance --target FOLDER [--draft FOLDER] \\
        [--settings 0,1] [--prompts bench/data/spec_bench_10.jsonl] [--max-new-tokens 64] [--out DIR]
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import settings_parser
from bench.environment import machine_line, provenance, write_result
from bench.processes import BenchError, running
from bench.summarize import first_difference
from shared.cli import settings_from_args

MODES = ("speculative", "cloud_only")


class InvarianceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_INVARIANCE_")

    target: Path = Field(description="the target's HF folder")
    draft: Path | None = Field(None, description="the draft model's folder (default: the target: self-drafting)")
    dtype: str = Field("bfloat16", description="dtype of the target and the draft")
    draft_device: str = Field("auto", description="where the draft runs (transformers): auto | cpu | cuda")
    settings: str = Field("0,1", description="values of VLLM_BATCH_INVARIANT to run, comma-separated")
    prompts: Path = Field(Path("bench/data/spec_bench_10.jsonl"), description="JSONL prompts (Spec-Bench questions)")
    max_new_tokens: int = Field(64, ge=1, description="tokens per answer")
    k: int = Field(4, ge=1, description="draft tokens per round")
    verifier_flags: str = Field("", description="extra cloud-verifier flags, space-separated")
    out: Path = Field(Path("docs/vllm_batch_invariance"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "models": ("target", "draft", "dtype", "draft_device"),
        "runs": ("settings", "prompts", "max_new_tokens", "k", "verifier_flags"),
        "output": ("out",),
    }


def _verifier(args: InvarianceSettings) -> list[str]:
    return [
        sys.executable, "-m", "cloud", "--engine", "vllm", "--model", str(args.target), "--dtype", args.dtype,
        "--port", "0", "--http-port", "0", "--max-sessions", "16", *args.verifier_flags.split(),
    ]  # fmt: skip


def _answers(args: InvarianceSettings, address: str, mode: str, out: Path) -> dict[str, dict[str, Any]]:
    draft = args.draft or args.target
    cmd = [
        sys.executable, "-m", "edge", "--cloud", address, "--prompts", str(args.prompts), "--output", str(out),
        "--mode", mode, "--max-new-tokens", str(args.max_new_tokens), "--k", str(args.k), "--draft-model", str(draft),
        "--draft-runtime", "transformers", "--device", args.draft_device, "--dtype", args.dtype,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise BenchError(f"edge-agent --mode {mode} exited with {done.returncode}: {done.stderr.strip()[-300:]}")
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def run_setting(args: InvarianceSettings, setting: str) -> dict[str, Any]:
    os.environ["VLLM_BATCH_INVARIANT"] = setting  # the verifier inherits it
    log = args.out / f"verifier_{setting}.log"
    records: dict[str, dict[str, dict[str, Any]]] = {}
    row: dict[str, Any] = {}
    with running(_verifier(args), log, r"serving \S+ on (\S+:\d+)", "cloud-verifier") as (_, address):
        for mode in MODES:
            records[mode] = _answers(args, address, mode, args.out / f"{mode}_{setting}.jsonl")
    spec, only = records["speculative"], records["cloud_only"]
    differences = {pid: first_difference(spec[pid]["token_ids"], only[pid]["token_ids"]) for pid in only}
    tokens = {mode: sum(len(r["token_ids"]) for r in records[mode].values()) for mode in MODES}
    seconds = {mode: sum(r["elapsed_s"] for r in records[mode].values()) for mode in MODES}
    rounds = sum(r["rounds"] for r in spec.values())
    row.update(
        prompts=len(only),
        identical=sum(d is None for d in differences.values()),
        first_difference=differences,
        tokens=tokens,
        tau=round(sum(r["accepted_tokens"] + 1 for r in spec.values()) / max(rounds, 1), 2),
        cloud_only_tokens_per_s=round(tokens["cloud_only"] / seconds["cloud_only"], 1),
        speculative_tokens_per_s=round(tokens["speculative"] / seconds["speculative"], 1),
    )
    return row


def _report(result: dict[str, Any]) -> str:
    lines = [
        "# Greedy speculative against cloud_only on vLLM, by VLLM_BATCH_INVARIANT",
        "",
        f"{machine_line(result['provenance']['machine'])}; vLLM {result['provenance']['versions']['vllm']}; "
        f"dtype {result['dtype']}; {result['max_new_tokens']} tokens per answer; k {result['k']}.",
        "",
        "| VLLM_BATCH_INVARIANT | identical answers | first differences | tau | cloud_only tok/s | speculative tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for setting, row in result["settings"].items():
        firsts = sorted(d for d in row["first_difference"].values() if d is not None)
        lines.append(
            f"| {setting} | {row['identical']} / {row['prompts']} | {firsts or '–'} | {row['tau']} | "
            f"{row['cloud_only_tokens_per_s']} | {row['speculative_tokens_per_s']} |"
        )
    return (
        "\n".join(lines)
        + "\n\ntok/s: one edge-agent answering the prompts one after another (the generations' own time). Command: `"
        + result["provenance"]["command"]
        + "`\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = settings_parser("python -m bench.studies.vllm_batch_invariance", __doc__, InvarianceSettings)
    args = settings_from_args(InvarianceSettings, parser.parse_args(argv))
    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "bench.studies.vllm_batch_invariance", *(argv if argv is not None else sys.argv[1:])])
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "settings": {},
    }
    for setting in filter(None, args.settings.split(",")):
        result["settings"][setting] = run_setting(args, setting)
        (args.out / "vllm_batch_invariance.json").write_text(json.dumps(result, indent=2) + "\n")  # so far
    write_result(args.out, "vllm_batch_invariance", result, _report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
