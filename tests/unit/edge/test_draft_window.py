"""--draft-window: the draft model reads only the prompt's last N tokens, then everything after."""

import pytest

from edge.drafting.drafter import Drafter, DrafterConfig
from edge.drafting.runtime_transformers import TransformersDraftLM
from shared.protocol import AcceptMode, SamplingParams
from tests.harness import random_prompt
from tests.tiny_models import tiny_draft, tiny_target


@pytest.fixture(scope="module")
def draft_lm() -> TransformersDraftLM:
    return TransformersDraftLM(tiny_draft(tiny_target(), noise=0.2))


def _drafter(lm: TransformersDraftLM, window: int) -> Drafter:
    return Drafter(lm, DrafterConfig(SamplingParams(), AcceptMode.GREEDY, 96, window=window), seed=1)


def test_a_windowed_drafter_drafts_as_one_given_only_the_window(draft_lm: TransformersDraftLM) -> None:
    prompt, generated = random_prompt(3, length=40), random_prompt(4, length=5)
    windowed, alone = _drafter(draft_lm, 8), _drafter(draft_lm, 0)
    windowed.sync(prompt)
    windowed.prefill()
    assert len(windowed.cache) == 7  # the window but its last token: the prompt's prefill cost 8 tokens, not 40
    windowed.sync(prompt + generated)  # the window's start stays where the prompt put it
    alone.sync(prompt[-8:] + generated)
    assert windowed.propose(4).token_ids == alone.propose(4).token_ids


def test_a_window_wider_than_the_prompt_keeps_all_of_it(draft_lm: TransformersDraftLM) -> None:
    prompt = random_prompt(5, length=6)
    windowed, whole = _drafter(draft_lm, 64), _drafter(draft_lm, 0)
    for drafter in (windowed, whole):
        drafter.sync(prompt)
    assert windowed.propose(5).token_ids == whole.propose(5).token_ids
