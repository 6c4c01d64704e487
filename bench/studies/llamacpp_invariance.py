"""Does llama.cpp's output at a position depend on how the pass is composed? A study of the
llama.cpp engine (cloud/engine/llamacpp.py) on a real GGUF target.

For each prompt: greedy-decode `--tokens` tokens one token per pass (as cloud_only runs), then
feed the same tokens again as a verifier would, in blocks of k new tokens per pass, alone and
beside other sessions' blocks in one batched pass. Counted per composition: positions whose
argmax differs from the one-token pass (a greedy speculative run would diverge there), and the
largest logit difference.

    python -m bench.studies.llamacpp_invariance --gguf PATH --tokenizer FOLDER \\
        [--prompts bench/data/spec_bench_10.jsonl] [--tokens 48] [--k 5] [--out docs/llamacpp_invariance]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import study_settings
from bench.environment import provenance
from cloud.engine import KVRequest
from cloud.engine.llamacpp import LlamaCppEngine
from shared.cli import run_cli


class InvarianceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_INVARIANCE_")

    gguf: Path = Field(description="the target's GGUF")
    tokenizer: str = Field(description="a folder holding the target's tokenizer")
    prompts: Path = Field(Path("bench/data/spec_bench_10.jsonl"), description="Spec-Bench questions (first turns)")
    limit: int = Field(10, ge=1, description="prompts to use")
    tokens: int = Field(48, ge=2, description="greedy tokens per prompt")
    k: int = Field(5, ge=1, description="new tokens per verify pass")
    threads: int = Field(2, ge=1, description="llama.cpp threads")
    out: Path = Field(Path("docs/llamacpp_invariance"), description="folder for the JSON result")


@dataclass
class Composition:
    name: str
    positions: int = 0
    argmax_flips: int = 0
    max_abs_diff: float = 0.0

    def add(self, got: torch.Tensor, want: torch.Tensor) -> None:
        self.positions += len(want)
        self.argmax_flips += int((got.argmax(-1) != want.argmax(-1)).sum())
        self.max_abs_diff = max(self.max_abs_diff, float((got - want).abs().max()))


def _prompts(path: Path, tokenizer_folder: str, limit: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    prompts = []
    for line in path.read_text().splitlines()[:limit]:
        turn = json.loads(line)["turns"][0]
        text = tokenizer.apply_chat_template([{"role": "user", "content": turn}], tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text)["input_ids"])
    return prompts


def _one_by_one(engine: LlamaCppEngine, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding one token per pass: the tokens and their logits rows [tokens, V]."""
    kv = engine.new_kv()
    try:
        rows = [engine.forward([kv], [prompt], [1])[0]]
        out = [int(rows[-1].argmax())]
        while len(out) < tokens:
            rows.append(engine.forward([kv], [[out[-1]]], [1])[0])
            out.append(int(rows[-1].argmax()))
        return out, torch.cat(rows)
    finally:
        engine.free(kv)


def _in_blocks(engine: LlamaCppEngine, sessions: list[tuple[list[int], list[int]]], k: int) -> list[torch.Tensor]:
    """The same tokens fed as verify passes: each session's prompt (its last row kept), then k
    tokens a pass, every session's block in one batched pass. Rows [tokens, V] per session."""
    kvs = [engine.new_kv() for _ in sessions]
    try:
        prompts = [p for p, _ in sessions]
        rows = [[r] for r in engine.forward(kvs, prompts, [1] * len(kvs))]
        fed = 0
        while fed < len(sessions[0][1]) - 1:
            blocks = [out[fed : fed + k] for _, out in sessions]
            for i, got in enumerate(engine.forward(kvs, blocks, [len(b) for b in blocks])):
                rows[i].append(got)
            fed += k
        return [torch.cat(r)[: len(out)] for r, (_, out) in zip(rows, sessions, strict=True)]
    finally:
        for kv in kvs:
            engine.free(kv)


def measure(engine: LlamaCppEngine, prompts: list[list[int]], tokens: int, k: int) -> dict[str, Any]:
    references = [_one_by_one(engine, prompt, tokens) for prompt in prompts]
    alone = Composition(f"{k} new tokens a pass, one session")
    batched = Composition(f"{k} new tokens a pass, {len(prompts)} sessions in each pass")
    for prompt, (out, want) in zip(prompts, references, strict=True):
        alone.add(_in_blocks(engine, [(prompt, out)], k)[0], want)
    sessions = [(prompt, out) for prompt, (out, _) in zip(prompts, references, strict=True)]
    for got, (_, want) in zip(_in_blocks(engine, sessions, k), references, strict=True):
        batched.add(got, want)
    return {"prompts": len(prompts), "tokens": tokens, "k": k, "compositions": [vars(alone), vars(batched)]}


def main(argv: list[str] | None = None) -> int:
    args, command = study_settings("bench.studies.llamacpp_invariance", __doc__, InvarianceSettings, argv)
    engine = LlamaCppEngine(args.gguf, threads=args.threads)
    prompts = _prompts(args.prompts, args.tokenizer, args.limit)
    context = max(len(p) for p in prompts) + args.tokens + args.k
    engine.plan_kv(KVRequest("packed", len(prompts), 1 << 40, context, 0))
    result = {"provenance": provenance(command), **measure(engine, prompts, args.tokens, args.k)}
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "llamacpp_invariance.json").write_text(json.dumps(result, indent=2) + "\n")
    for row in result["compositions"]:
        print(f"{row['name']}: {row['argmax_flips']} of {row['positions']} argmax flips, max |dlogit| {row['max_abs_diff']:.2e}")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m bench.studies.llamacpp_invariance", main))
