"""The edge's tokenizer: the model folder's tokenizer.json (HF `tokenizers`) and its chat
template (jinja2), without transformers.

Ids must be the verifier's ids, whatever runtime drafts, so both runtimes tokenize with the
same files the verifier's model was saved with; tests hold this against transformers'
AutoTokenizer on the prompts and chat templates the project uses.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from shared.errors import ConfigError
from shared.tokenizer_card import read_chat_template

# transformers' clean_up_tokenization: spaces before punctuation and English contractions.
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: not readable JSON ({err})") from None
    return data if isinstance(data, dict) else {}


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_environment() -> ImmutableSandboxedEnvironment:
    """What transformers gives chat templates: a sandbox, trimmed blocks, loop controls."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class EdgeTokenizer:
    def __init__(self, folder: str | Path) -> None:
        path = Path(folder).expanduser()
        if path.is_file():
            path = path.parent  # a GGUF named directly: its tokenizer lies beside it
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"{path} has no tokenizer.json (the edge tokenizes with the verifier's tokenizer files)")
        self.backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.path = path / "tokenizer.json"  # grammars read it (shared/grammar.py)
        config = _read_json(path / "tokenizer_config.json")
        self.special_tokens = {
            key: text for key, value in config.items() if key.endswith("_token") and (text := _token_text(value)) is not None
        }
        self.eos_token_id = self._id(self.special_tokens.get("eos_token"))
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template: str | None = read_chat_template(path)
        generation = _read_json(path / "generation_config.json").get("eos_token_id")
        self.generation_eos: list[int] = [generation] if isinstance(generation, int) else list(generation or [])

    def use_chat_template(self, template: str) -> None:
        """Render prompts with `template` from now on (the target's, when the draft's differs)."""
        self.chat_template = template

    def _id(self, token: str | None) -> int | None:
        return self.backend.token_to_id(token) if token is not None else None

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS and the model's generation EOS ids (Qwen: <|im_end|>, <|endoftext|>)."""
        ids = set(self.generation_eos)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))
        if self.clean_up_spaces:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The chat template over `messages`; tools as transformers passes them (a list of
        {"type": "function", "function": {name, description, parameters}}), None for none."""
        if self.chat_template is None:
            raise ConfigError("the model has no chat template (use --no-chat)")
        template = _template_environment().from_string(self.chat_template)
        return template.render(
            messages=messages,
            tools=tools or None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
