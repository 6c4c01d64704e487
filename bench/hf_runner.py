"""The in-process systems: `target-only` (transformers `generate` of the target alone) and
`hf-assisted` (`generate(assistant_model=draft)`, transformers' own speculative decoding),
each in its own process so its peak RSS is its own. Writes the same per-prompt JSONL record
shape as `edge-agent --prompts F --output F.jsonl`, plus a round log like `--log-rounds`.

    python -m bench.hf_runner --system hf-assisted --target DIR --draft DIR --prompts P.jsonl \\
        --output OUT.jsonl --log-rounds ROUNDS.jsonl --meta META.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from bench.cli import settings_parser
from edge.prompts import encode_prompt, read_prompts
from edge.tokenizer import EdgeTokenizer
from shared import lm
from shared.cli import run_cli, settings_from_args


class HfRunnerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_HF_RUNNER_")

    system: Literal["target-only", "hf-assisted"] = Field(description="the target alone, or assisted by the draft")
    target: str = Field(description="target model folder")
    draft: str = Field(description="draft model folder (its tokenizer and stop ids are the edge's)")
    prompts: str = Field(description="JSONL of prompts (edge-agent's --prompts format)")
    max_new_tokens: int = Field(128, ge=1, description="tokens generated per prompt at most")
    temperature: float = Field(0.0, ge=0, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling at temperature > 0 (1 = off)")
    seed: int = Field(0, description="torch seed, set before each prompt")
    chat: bool = Field(True, description="wrap each prompt in the tokenizer's chat template")
    output: str = Field(description="per-prompt records (JSONL, edge-agent's record shape)")
    log_rounds: str = Field(description="per-round k and accepted length (JSONL, as edge-agent --log-rounds)")
    meta: str = Field(description="JSON: KV bytes per token, generation settings")
    kv_only: bool = Field(False, description="write --meta (KV bytes per token) and stop")
    dtype: str = Field("bfloat16", description="float32 | bfloat16 | float16")
    device: str = Field("auto", description="auto | cpu | cuda")
    threads: int = Field(0, ge=0, description="torch threads (0 = torch's default)")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the models": ("system", "target", "draft"),
        "what to generate": ("prompts", "max_new_tokens", "temperature", "top_p", "seed", "chat"),
        "output": ("output", "log_rounds", "meta", "kv_only"),
        "runtime": ("dtype", "device", "threads"),
    }


class FirstTokenClock(BaseStreamer):
    """Times the first generated token and keeps the size of every later push: generate's
    first push is the prompt, then one push per step (assisted: accepted drafts + one)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft_s = 0.0
        self.pushes: list[int] = []
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        if not self.pushes:
            self.ttft_s = time.perf_counter() - self.start
        self.pushes.append(int(value.numel()))

    def end(self) -> None:
        pass


@dataclass
class ForwardCounter:
    """Counts a model's forward passes and the new tokens of each; for the target it also
    measures the KV cache it holds after each pass (the real tensors, not a formula)."""

    measure_kv: bool = False
    new_tokens: list[int] = field(default_factory=list)
    kv_peak_bytes: int = 0

    def reset(self) -> None:
        self.new_tokens, self.kv_peak_bytes = [], 0

    def hook(self, _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _output: Any) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.new_tokens.append(int(input_ids.shape[-1]) if input_ids is not None else 0)
        cache = kwargs.get("past_key_values")
        if self.measure_kv and cache is not None:
            self.kv_peak_bytes = max(self.kv_peak_bytes, cache_bytes(cache))


def cache_bytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


class MaskBeyondVocab(LogitsProcessor):
    """Ids at or above the shared vocabulary never win, as on the edge and the verifier
    (padded embeddings are wider than the tokenizer)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, self.vocab_size :] = float("-inf")
        return scores


def generation_config(args: HfRunnerSettings, stops: list[int]) -> GenerationConfig:
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": args.temperature, "top_k": None, "top_p": args.top_p}
        if args.temperature > 0
        else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    )
    return GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=stops, pad_token_id=stops[0], **sampling)


def round_log(prompt_id: str, target_inputs: list[int], pushes: list[int], prompt_len: int) -> list[dict[str, Any]]:
    """Per assisted round: k drafts (the target's new tokens minus the one it re-reads, or
    minus the prompt on the first pass) and the accepted drafts (the push minus one).
    Empty when the passes and pushes do not pair up (a transformers change)."""
    if len(target_inputs) != len(pushes):
        return []
    rounds = []
    for index, (fed, pushed) in enumerate(zip(target_inputs, pushes, strict=True)):
        k = fed - (prompt_len if index == 0 else 1)
        rounds.append({"id": prompt_id, "round": index, "k": k, "accepted_len": min(pushed - 1, k)})
    return rounds


def run(args: HfRunnerSettings) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    target_folder, draft_folder = Path(args.target), Path(args.draft)
    tokenizer = EdgeTokenizer(draft_folder)
    target = lm.load_model(target_folder, args.dtype, args.device)
    target_counter = ForwardCounter(measure_kv=True)
    target.register_forward_hook(target_counter.hook, with_kwargs=True)
    draft: PreTrainedModel | None = None
    draft_counter = ForwardCounter()
    if args.system == "hf-assisted":
        draft = lm.load_model(draft_folder, args.dtype, args.device)
        draft.register_forward_hook(draft_counter.hook, with_kwargs=True)
    vocab = min(len(tokenizer), lm.logits_width(target), *([lm.logits_width(draft)] if draft is not None else []))
    stops = sorted(tokenizer.stop_token_ids)
    config = generation_config(args, stops)
    meta = {
        "system": args.system,
        "kv_bytes_per_token": lm.kv_bytes_per_token(target),
        "vocab_size": vocab,
        "stop_token_ids": stops,
        "generation_config": config.to_diff_dict(),
        "assistant_generation_config": draft.generation_config.to_diff_dict() if draft is not None else None,
    }
    Path(args.meta).write_text(json.dumps(meta, indent=2))
    if args.kv_only:
        return 0
    with open(args.output, "w") as out, open(args.log_rounds, "w") as rounds_out:
        for prompt in read_prompts(Path(args.prompts)):
            ids = encode_prompt(tokenizer, prompt.text, args.chat)
            record, rounds = generate_one(args, target, draft, ids, config, vocab, target_counter, draft_counter)
            record = {
                "id": prompt.id,
                "category": prompt.category,
                "mode": args.system,
                "text": tokenizer.decode(record["token_ids"], skip_special_tokens=True),
                **record,
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
            rounds_out.writelines(json.dumps(r | {"id": prompt.id}) + "\n" for r in rounds)
    return 0


def generate_one(
    args: HfRunnerSettings,
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    ids: list[int],
    config: GenerationConfig,
    vocab: int,
    target_counter: ForwardCounter,
    draft_counter: ForwardCounter,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    target_counter.reset()
    draft_counter.reset()
    torch.manual_seed(args.seed)
    output, clock = _generate(target, draft, ids, config, vocab)
    elapsed = time.perf_counter() - clock.start
    tokens = [int(t) for t in output[0, len(ids) :]]
    if tokens and tokens[-1] in config.eos_token_id:
        finish = "stop"
    else:
        tokens = tokens[: args.max_new_tokens]
        finish = "length"
    passes = len(target_counter.new_tokens)
    rounds = round_log("", target_counter.new_tokens, clock.pushes, len(ids)) if draft is not None else []
    drafted = len(draft_counter.new_tokens)  # each assistant forward proposes one candidate
    record: dict[str, Any] = {
        "token_ids": tokens,
        "prompt_tokens": len(ids),
        # target-only: every pass is one token, no rounds; assisted: a round is one target pass
        "rounds": passes if draft is not None else 0,
        "draft_tokens": drafted,
        "accepted_tokens": max(len(tokens) - passes, 0) if draft is not None else 0,
        "target_forward_passes": passes,
        "draft_forward_passes": drafted,
        "elapsed_s": elapsed,
        "ttft_s": clock.ttft_s,
        "bytes_up": 0,
        "bytes_down": 0,
        "verify_bytes_up": 0,
        "verify_bytes_down": 0,
        "finish_reason": finish,
        "kv_peak_bytes": target_counter.kv_peak_bytes,
    }
    return record, [{k: v for k, v in r.items() if k != "id"} for r in rounds]


def _generate(
    target: PreTrainedModel, draft: PreTrainedModel | None, ids: list[int], config: GenerationConfig, vocab: int
) -> tuple[torch.Tensor, FirstTokenClock]:
    """transformers' generate, target alone or assisted by `draft`; the output ids and the clock
    that timed its first token."""
    input_ids = torch.tensor([ids], device=target.device)
    clock = FirstTokenClock()
    with torch.inference_mode():
        # transformers' stubs type generate as a Tensor attribute
        output = target.generate(  # type: ignore[operator]
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            assistant_model=draft,
            streamer=clock,
            logits_processor=LogitsProcessorList([MaskBeyondVocab(vocab)]),
        )
    return output, clock


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.hf_runner", __doc__, HfRunnerSettings)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_cli("bench.hf_runner", lambda: run(settings_from_args(HfRunnerSettings, args)))


if __name__ == "__main__":
    sys.exit(main())
