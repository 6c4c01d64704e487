"""Prompt files and prompt encoding."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.tokenizer import EdgeTokenizer
from shared.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    category: str = ""


def _prompt_from_record(record: dict[str, Any], where: str) -> Prompt:
    if "prompt" in record:  # {"id": ..., "prompt": "..."}
        return Prompt(str(record.get("id", where)), str(record["prompt"]), str(record.get("category", "")))
    if "turns" in record and record["turns"]:  # Spec-Bench question.jsonl: first turn
        return Prompt(str(record.get("question_id", where)), str(record["turns"][0]), str(record.get("category", "")))
    raise ConfigError(f"{where}: expected a 'prompt' field or Spec-Bench 'turns'")


def read_prompts(path: Path) -> list[Prompt]:
    """JSONL: {"id", "prompt"} lines, or Spec-Bench's question.jsonl as is."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        prompts.append(_prompt_from_record(record, where))
    if not prompts:
        raise ConfigError(f"{path}: no prompts")
    return prompts


def encode_prompt(tokenizer: EdgeTokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a user prompt, wrapped in the chat template when the model has one."""
    if chat and tokenizer.chat_template:
        ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)
    else:
        ids = tokenizer.encode(text)
    if not ids:
        raise ConfigError("the prompt encodes to no tokens")
    return ids
