"""Check the edge's tokenizer against transformers' AutoTokenizer on a model folder and a
prompt file: prompt ids with and without the chat template, and decoded text.

    python -m tools.check_tokenizer --model MODEL_FOLDER --prompts PROMPTS.jsonl

Prints one JSON line with the counts; exits 1 on any difference."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from transformers import AutoTokenizer

from bench.cli import settings_parser
from edge.prompts import encode_prompt, read_prompts
from edge.tokenizer import EdgeTokenizer
from shared.cli import run_cli, settings_from_args


class CheckTokenizerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_CHECK_TOKENIZER_")

    model: str = Field(description="model folder holding the tokenizer to compare")
    prompts: Path = Field(description="JSONL of prompts (edge-agent's --prompts format)")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {"what to compare": ("model", "prompts")}


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m tools.check_tokenizer", __doc__, CheckTokenizerSettings)


def compare(folder: str, prompts_file: Path) -> int:
    """Print the counts; 0 when every prompt's ids and text agree, else 1."""
    ours, theirs = EdgeTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    prompts = read_prompts(prompts_file)
    counts = {"prompts": len(prompts), "chat_ids_equal": 0, "plain_ids_equal": 0, "decoded_equal": 0, "tokens": 0}
    for prompt in prompts:
        rendered = theirs.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
        want = theirs(rendered, add_special_tokens=False).input_ids
        got = encode_prompt(ours, prompt.text, chat=True)
        counts["chat_ids_equal"] += got == want
        counts["plain_ids_equal"] += encode_prompt(ours, prompt.text, chat=False) == theirs(prompt.text).input_ids
        counts["decoded_equal"] += ours.decode(got, skip_special_tokens=True) == theirs.decode(want, skip_special_tokens=True)
        counts["tokens"] += len(want)
    sys.stdout.write(json.dumps({**counts, "stop_ids": sorted(ours.stop_token_ids)}) + "\n")
    equal = [counts[key] for key in ("chat_ids_equal", "plain_ids_equal", "decoded_equal")]
    return 0 if all(n == len(prompts) for n in equal) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def run() -> int:
        s = settings_from_args(CheckTokenizerSettings, args)
        return compare(s.model, s.prompts)

    return run_cli("python -m tools.check_tokenizer", run)


if __name__ == "__main__":
    sys.exit(main())
