"""A tokenizer in a form two machines can compare over the wire: its tokens in blocks, each
block's digest, its special tokens and its chat template's digest.

The edge tokenizes for the target, so a draft and a target must share one tokenizer: the same
text at every id and the same special tokens. The verifier sends its card's digests (a few
hundred bytes for a 150k vocabulary); the edge compares them with its own, asks for the first
block that differs, and names the first id whose token differs. Chat templates may differ (a
base draft beside an instruct target): that is a warning, since the edge renders the prompt.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from shared.errors import ConfigError
from shared.protocol import SpecialToken

BLOCK = 4096  # ids per digest: 38 digests for Qwen's 151,665 tokens


@dataclass(frozen=True)
class TokenizerCard:
    tokens: tuple[str, ...]  # the text of ids 0..len-1 ("" for an id the tokenizer lacks)
    specials: tuple[SpecialToken, ...]  # by id
    chat_template: str | None
    source: str = field(default="", repr=False, compare=False)  # tokenizer.json's text (grammars read it)

    @classmethod
    def of(cls, backend: Tokenizer, chat_template: str | None, source: str = "") -> TokenizerCard:
        vocab = backend.get_vocab(with_added_tokens=True)
        tokens = [""] * (max(vocab.values(), default=-1) + 1)
        for text, index in vocab.items():
            tokens[index] = text
        specials = sorted(
            (SpecialToken(index, added.content) for index, added in backend.get_added_tokens_decoder().items() if added.special),
            key=lambda s: s.id,
        )
        return cls(tuple(tokens), tuple(specials), chat_template, source)

    @classmethod
    def from_folder(cls, folder: str | Path) -> TokenizerCard | None:
        """The card of a model folder's tokenizer.json (None when it has none: a bare GGUF)."""
        path = Path(folder).expanduser()
        path = path.parent if path.is_file() else path
        if not (path / "tokenizer.json").is_file():
            return None
        try:
            source = (path / "tokenizer.json").read_text(encoding="utf-8")
            backend = Tokenizer.from_str(source)
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own Exception types
            raise ConfigError(f"{path / 'tokenizer.json'}: not a tokenizer ({' '.join(str(err).split())[:200]})") from None
        return cls.of(backend, read_chat_template(path), source)

    def block(self, index: int) -> tuple[str, ...]:
        return self.tokens[index * BLOCK : (index + 1) * BLOCK]

    def digests(self) -> list[bytes]:
        return [block_digest(self.block(i)) for i in range((len(self.tokens) + BLOCK - 1) // BLOCK)]

    def template_digest(self) -> bytes:
        return hashlib.sha256(self.chat_template.encode()).digest() if self.chat_template else b""


def block_digest(tokens: tuple[str, ...] | list[str]) -> bytes:
    return hashlib.sha256("\0".join(tokens).encode()).digest()[:8]


def read_chat_template(folder: Path) -> str | None:
    """The chat template transformers would use: chat_template.jinja, else tokenizer_config.json's."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


def first_token_difference(
    draft: tuple[str, ...], target: tuple[str, ...], offset: int = 0
) -> tuple[int, str | None, str | None] | None:
    """(id, draft's token, target's token) at the first id where two runs of tokens differ (None
    for an id one side lacks), counting from `offset`; None when they are equal."""
    for i in range(max(len(draft), len(target))):
        a = draft[i] if i < len(draft) else None
        b = target[i] if i < len(target) else None
        if a != b:
            return offset + i, a, b
    return None


def special_difference(draft: tuple[SpecialToken, ...], target: tuple[SpecialToken, ...]) -> str | None:
    """The first special token one side has and the other has not (or not at that id), in words."""
    a, b = {s.id: s.content for s in draft}, {s.id: s.content for s in target}
    for index in sorted(a.keys() | b.keys()):
        if a.get(index) != b.get(index):
            return (
                f"special token id {index} is {shown_token(a.get(index))} in the draft, {shown_token(b.get(index))} in the target"
            )
    return None


def shown_token(token: str | None) -> str:
    """A token as an error names it: quoted and cut, or 'absent'."""
    return "absent" if token is None else repr(token[:40])
