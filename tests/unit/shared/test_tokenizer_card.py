"""The tokenizer card: blocks and digests that change with any one token, the first difference
named by id, special tokens and chat templates compared, a folder without tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

from shared.protocol import SpecialToken
from shared.tokenizer_card import (
    BLOCK,
    TokenizerCard,
    block_digest,
    first_token_difference,
    special_difference,
)
from tests.tiny_models import VOCAB, tiny_tokenizer


def _card(folder: Path) -> TokenizerCard:
    card = TokenizerCard.from_folder(folder)
    assert card is not None
    return card


def test_a_folder_card_has_every_token_its_specials_and_template(tmp_path: Path) -> None:
    tiny_tokenizer().save_pretrained(tmp_path)
    card = _card(tmp_path)
    assert len(card.tokens) == VOCAB and card.tokens[:3] == ("<unk>", "<eos>", "w0")
    assert [s.content for s in card.specials] == ["<unk>", "<eos>"]
    assert card.chat_template is not None and "w1" in card.chat_template
    assert len(card.digests()) == 1 and card.template_digest()


def test_one_renamed_token_changes_its_block_digest_and_is_named(tmp_path: Path) -> None:
    tiny_tokenizer().save_pretrained(tmp_path)
    card = _card(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["model"]["vocab"]["zz"] = data["model"]["vocab"].pop("w40")
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    other = _card(tmp_path)
    assert card.digests() != other.digests()
    assert first_token_difference(card.tokens, other.tokens) == (42, "w40", "zz")
    assert first_token_difference(card.tokens, card.tokens) is None
    assert first_token_difference(("a", "b"), ("a",), offset=BLOCK) == (BLOCK + 1, "b", None)


def test_block_digests_cover_every_block() -> None:
    tokens = tuple(f"t{i}" for i in range(BLOCK * 2 + 5))
    card = TokenizerCard(tokens, (), None)
    assert card.digests() == [block_digest(tokens[:BLOCK]), block_digest(tokens[BLOCK : 2 * BLOCK]), block_digest(tokens[-5:])]
    assert card.template_digest() == b""


def test_special_tokens_differences_are_named() -> None:
    a = (SpecialToken(1, "<eos>"), SpecialToken(5, "<im_end>"))
    assert special_difference(a, a) is None
    assert special_difference(a, a[:1]) == "special token id 5 is '<im_end>' in the draft, absent in the target"
    assert (
        special_difference(a[:1], (SpecialToken(1, "</s>"),))
        == "special token id 1 is '<eos>' in the draft, '</s>' in the target"
    )


def test_a_folder_without_tokenizer_json_has_no_card(tmp_path: Path) -> None:
    assert TokenizerCard.from_folder(tmp_path) is None
