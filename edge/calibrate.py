"""`edge-calibrate`: derive gating thresholds from a prompt set.

Runs the draft model greedily over the prompts, records each drafted token's signals, sets
T_nll to the chosen percentile of the NLLs (default: 80th), and stores a token-frequency
table of the prompts for the rare-word rule. The other thresholds keep their defaults
unless overridden. Output: the JSON file that `edge-agent --gating-config` reads.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from edge.drafting.drafter import Drafter, DrafterConfig
from edge.drafting.gating import GatingThresholds, TokenSignals, save_gating_config, token_frequencies
from edge.drafting.runtime_transformers import TransformersDraftLM
from edge.prompts import encode_prompt, read_prompts
from edge.tokenizer import EdgeTokenizer
from shared.cli import add_settings_flags, run_cli, settings_from_args
from shared.models import DRAFT_MODEL
from shared.models.store import model_folder
from shared.protocol import AcceptMode, SamplingParams

log = logging.getLogger("edge-calibrate")


class CalibrateSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_CALIBRATE_")

    prompts: str = Field(description="JSONL of prompts ({id, prompt} or Spec-Bench question.jsonl)")
    output: str = Field(description="where to write the gating config (JSON)")
    draft_model: str | None = Field(None, description="draft model folder; default: the packaged Qwen2.5-Coder-0.5B")
    dtype: str = Field("bfloat16", description="float32 | bfloat16 | float16")
    max_prompts: int = Field(20, ge=1, description="prompts to run the draft model on")
    max_new_tokens: int = Field(32, ge=1, description="tokens drafted per prompt")
    nll_percentile: float = Field(80.0, gt=0, lt=100, description="T_nll = this percentile of the drafted NLLs")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the prompts": ("prompts", "max_prompts", "max_new_tokens"),
        "the draft model": ("draft_model", "dtype"),
        "the thresholds": ("nll_percentile", "output"),
    }


def nll_threshold(signals: Sequence[TokenSignals], percentile: float) -> float:
    values = torch.tensor([s.nll for s in signals])
    return float(torch.quantile(values, percentile / 100.0))


def calibrate(settings: CalibrateSettings) -> GatingThresholds:
    folder = model_folder(settings.draft_model, DRAFT_MODEL)
    tokenizer = EdgeTokenizer(folder)
    draft_lm = TransformersDraftLM.load(folder, settings.dtype, "cpu", threads=0, keep_hidden=False)
    prompts = read_prompts(Path(settings.prompts))
    encoded = [encode_prompt(tokenizer, p.text, chat=True) for p in prompts]
    vocab = min(len(tokenizer), draft_lm.logits_width)
    config = DrafterConfig(SamplingParams(), AcceptMode.GREEDY, vocab, signals=True)
    signals: list[TokenSignals] = []
    for ids in encoded[: settings.max_prompts]:
        drafter = Drafter(draft_lm, config, seed=0)
        drafter.sync(ids)
        signals += drafter.propose(settings.max_new_tokens).signals
    thresholds = replace(GatingThresholds(), nll=nll_threshold(signals, settings.nll_percentile))
    counts = token_frequencies(tokenizer.encode(p.text) for p in prompts)
    save_gating_config(Path(settings.output), thresholds, counts)
    hard = sum(thresholds.is_hard(s) for s in signals) / len(signals)
    log.info(
        "%d drafted tokens: T_nll %.3f, hard ratio at these thresholds %.2f; wrote %s",
        len(signals),
        thresholds.nll,
        hard,
        settings.output,
    )
    return thresholds


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(
        prog="edge-calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_settings_flags(made, CalibrateSettings)
    return made


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    def run() -> int:
        calibrate(settings_from_args(CalibrateSettings, args))
        return 0

    return run_cli("edge-calibrate", run)


if __name__ == "__main__":
    sys.exit(main())
