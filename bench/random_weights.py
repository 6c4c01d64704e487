"""A model folder with a real model's architecture and random weights.

    python -m bench.random_weights CONFIG_DIR OUT_DIR [--seed 0] [--dtype bfloat16] [--device auto]

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

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shared import lm

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="random_weights", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config_dir", type=Path, help="folder with the real model's config.json")
    parser.add_argument("out", type=Path, help="model folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    if not (args.config_dir / "config.json").is_file():
        sys.stderr.write(f"random_weights: {args.config_dir} has no config.json\n")
        return 2
    write_random_model(args.config_dir, args.out, args.seed, args.dtype, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
