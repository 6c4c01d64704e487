"""What Describe answers: the model, its size and width; the tokenizer's digests, specials and
template digest; one run of tokens on request, refused past its bounds; the decode step measured
on the engine, its KV freed after."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud.engine import KVRequest
from cloud.engine.transformers import TransformersEngine
from cloud.model_card import ModelCard, measure_decode_step
from shared.errors import InvalidRequest
from shared.tokenizer_card import BLOCK, TokenizerCard
from tests.tiny_models import VOCAB, tiny_target, tiny_tokenizer


def _card(tmp_path: Path) -> TokenizerCard:
    tiny_tokenizer().save_pretrained(tmp_path)
    card = TokenizerCard.from_folder(tmp_path)
    assert card is not None
    return card


def test_a_card_with_a_tokenizer_describes_it_and_lists_tokens(tmp_path: Path) -> None:
    tokenizer = _card(tmp_path)
    card = ModelCard("tiny", 1234, VOCAB, tokenizer, decode_step_ms=1.23456)
    d = card.describe()
    assert (d.model_id, d.parameters, d.logits_width, d.has_tokenizer) == ("tiny", 1234, VOCAB, True)
    assert d.tokenizer_size == VOCAB and d.block_size == BLOCK and d.block_digests == tuple(tokenizer.digests())
    assert d.special_tokens == tokenizer.specials and d.chat_template_sha256 == tokenizer.template_digest()
    assert d.decode_step_ms == 1.235 and d.tokens == ()
    assert card.describe(VOCAB - 2, 10).tokens == tokenizer.tokens[-2:]
    assert d.chat_template == "" and card.describe(chat_template=True).chat_template == tokenizer.chat_template


@pytest.mark.parametrize(
    ("start", "count", "message"),
    [(0, BLOCK + 1, f"at most {BLOCK}"), (VOCAB, 1, f"below the tokenizer's size {VOCAB}")],
)
def test_a_bad_token_range_is_refused(tmp_path: Path, start: int, count: int, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        ModelCard("tiny", 1, VOCAB, _card(tmp_path)).describe(start, count)


def test_a_card_without_a_tokenizer_says_so_and_lists_nothing() -> None:
    card = ModelCard("bare.gguf", 0, VOCAB)
    d = card.describe()
    assert not d.has_tokenizer and d.block_digests == () and d.tokenizer_size == 0
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        card.describe(0, 4)


def test_the_decode_step_is_measured_and_its_kv_freed() -> None:
    engine = TransformersEngine(tiny_target())
    engine.plan_kv(KVRequest("slots", max_sessions=1, max_kv_bytes=1 << 30, max_context_tokens=64, slot_tokens=64))
    assert measure_decode_step(engine) > 0
    engine.free(engine.new_kv())  # the pool's one slot is free again: the measurement gave it back
