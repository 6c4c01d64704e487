"""On a CUDA machine: (1) the cost of one target forward for 1..16 new tokens (the reason
speculative decoding pays on a GPU: verification is nearly free in k), using the real model
architectures with random weights (timing does not depend on the weights); (2) greedy
speculative == target-only on the GPU through the project's own Verifier and Drafter.

    python -m tools.gpu_probe --draft-config CONFIG_DIR_DRAFT --target-config CONFIG_DIR_TARGET --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from transformers import AutoConfig, AutoModelForCausalLM

from bench.cli import settings_parser
from bench.tiny_models import tiny_draft, tiny_target
from cloud.engine.transformers import TransformersEngine
from cloud.verifier import Verifier
from edge.drafting.drafter import Drafter, DrafterConfig
from edge.drafting.runtime_transformers import TransformersDraftLM
from shared import lm
from shared.cli import run_cli, settings_from_args
from shared.protocol import AcceptMode, GenerateRequest, OpenSessionRequest, SamplingParams, SessionConfig, VerifyRequest


class GpuProbeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_GPU_PROBE_")

    draft_config: str = Field(description="folder with the draft model's config.json (random weights are timed)")
    target_config: str = Field(description="folder with the target model's config.json (random weights are timed)")
    out: Path = Field(description="JSON file for the result")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the models": ("draft_config", "target_config"),
        "output": ("out",),
    }


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m tools.gpu_probe", __doc__, GpuProbeSettings)


def forward_ms(config_dir: str, dtype: torch.dtype, context: int = 512) -> dict[int, float]:
    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().eval()
    out = {}
    for n in (1, 2, 4, 6, 8, 12, 16):
        times = []
        for _ in range(15):
            cache = lm.new_cache(model)
            lm.forward(model, cache, list(range(100, 100 + context)))
            torch.cuda.synchronize()
            start = time.perf_counter()
            lm.forward(model, cache, list(range(7, 7 + n)))
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000)
        out[n] = round(sorted(times)[len(times) // 2], 2)
    return out


def greedy_equality(prompts: int = 20) -> dict[str, int]:
    cpu_target = tiny_target()
    draft = tiny_draft(cpu_target, noise=0.2).to("cuda")  # type: ignore[call-arg,arg-type]  # transformers stub types .to oddly
    target = cpu_target.to("cuda")  # type: ignore[call-arg,arg-type]  # transformers stub types .to oddly
    verifier = Verifier(TransformersEngine(target), "tiny")
    checked = equal = 0
    for k in (1, 3, 8):
        for seed in range(prompts):
            prompt = torch.randint(2, 96, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
            config = SessionConfig(SamplingParams(), 0, AcceptMode.GREEDY, 96)
            reference = [c.tokens[0] for c in verifier.generate(GenerateRequest(prompt, config, 32))]
            drafter = Drafter(TransformersDraftLM(draft), DrafterConfig(SamplingParams(), AcceptMode.GREEDY, 96), seed=1)
            opened = verifier.open_session(OpenSessionRequest(prompt, config))
            committed = list(prompt)
            while len(committed) < len(prompt) + 32:
                drafter.sync(committed)
                block = drafter.propose(k)
                reply = verifier.verify(VerifyRequest(opened.session_id, len(committed), block.token_ids))
                committed += block.token_ids[: reply.accepted_len] + [reply.next_token]
            checked += 1
            equal += committed[len(prompt) : len(prompt) + 32] == reference
    return {"checked": checked, "identical": equal}


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_cli("python -m tools.gpu_probe", lambda: probe(settings_from_args(GpuProbeSettings, args)))


def probe(settings: GpuProbeSettings) -> int:
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "greedy_equality_fp32_cuda": greedy_equality(),
    }
    for name, folder in (("draft_0.5b", settings.draft_config), ("target_1.5b", settings.target_config)):
        result[f"{name}_bf16_forward_ms_by_new_tokens"] = forward_ms(folder, torch.bfloat16)
    with open(settings.out, "w") as handle:
        json.dump(result, handle, indent=2)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
