"""A model folder with a real model's architecture and random weights.

    python -m bench.random_weights --config-dir CONFIG_DIR --out OUT_DIR [--seed 0] [--dtype bfloat16] [--device auto]

CONFIG_DIR holds the real model's config.json (and, optionally, its tokenizer files, which are
copied so the folder serves like the real one). The weights are transformers' own random
initialisation. A forward pass costs what the real model's costs (same shapes, same kernels),
so timings and capacity figures carry over; what the model says does not (see
bench/retarget_traces.py for replaying recorded sessions against it). For machines that cannot
fetch the real weights: a GPU box with no network takes a config folder of a few megabytes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from transformers import AutoConfig, AutoModelForCausalLM

from bench.cli import settings_parser
from shared import lm
from shared.cli import run_cli, settings_from_args
from shared.errors import ConfigError

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_random_model(config_dir: Path, out: Path, seed: int, dtype: str, device: str) -> None:
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device(lm.resolve_device(device)):  # initialised where it runs: 1.5B on a CPU takes a while
        model = AutoModelForCausalLM.from_config(config, dtype=lm.resolve_dtype(dtype))
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (config_dir / name).is_file():
            shutil.copy(config_dir / name, out / name)
    model.save_pretrained(out)


class RandomWeightsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_RANDOM_WEIGHTS_")

    config_dir: Path = Field(description="folder with the real model's config.json (and its tokenizer files)")
    out: Path = Field(description="model folder to write")
    seed: int = Field(0, description="torch seed of the random initialisation")
    dtype: str = Field("bfloat16", description="dtype of the saved weights")
    device: str = Field("auto", description="where the weights are initialised (auto: CUDA when there is one)")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "folders": ("config_dir", "out"),
        "the weights": ("seed", "dtype", "device"),
    }


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.random_weights", __doc__, RandomWeightsSettings)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def run() -> int:
        s = settings_from_args(RandomWeightsSettings, args)
        if not (s.config_dir / "config.json").is_file():
            raise ConfigError(f"{s.config_dir} has no config.json")
        write_random_model(s.config_dir, s.out, s.seed, s.dtype, s.device)
        return 0

    return run_cli("python -m bench.random_weights", run)


if __name__ == "__main__":
    sys.exit(main())
