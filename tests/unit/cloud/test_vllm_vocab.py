"""How the vLLM engine keeps a live session's sampling inside its vocabulary, without vLLM: with
speculative decoding on, vLLM's rejection sampler applies bad words and allowed token ids (not a
logit bias); its engine core refuses an allowed list over 1,024 tokens, and that refusal ends
every request, so a session neither mask fits is not given to it."""

from types import SimpleNamespace

import pytest

from cloud.engine.vllm import VLLM_MAX_BANNED, VLLM_MAX_TOKEN_LIST, limit_vocab


def _params() -> SimpleNamespace:
    return SimpleNamespace(allowed_token_ids=None, _bad_words_token_ids=None)


def test_a_padded_target_bans_its_padding_rows() -> None:
    """Qwen2.5's 7B pads its 151,936 tokens to 152,064 rows: 128 banned rows, no token list."""
    params = _params()
    limit_vocab(params, 151_936, 152_064)
    assert params._bad_words_token_ids == [[token] for token in range(151_936, 152_064)]
    assert params.allowed_token_ids is None


@pytest.mark.parametrize(
    ("vocab", "width", "banned", "allowed"),
    [
        (152_064, 152_064, 0, 0),  # the session's vocabulary is the model's
        (152_100, 152_064, 0, 0),  # wider than the rows: nothing to hide
        (500, 100_000, 0, 500),  # a short vocabulary in many rows: listed
        (100_000 - VLLM_MAX_BANNED, 100_000, VLLM_MAX_BANNED, 0),
        (VLLM_MAX_TOKEN_LIST, VLLM_MAX_TOKEN_LIST + VLLM_MAX_BANNED + 1, 0, VLLM_MAX_TOKEN_LIST),
    ],
)
def test_the_mask_that_fits_is_given(vocab: int, width: int, banned: int, allowed: int) -> None:
    params = _params()
    limit_vocab(params, vocab, width)
    assert len(params._bad_words_token_ids or []) == banned
    assert len(params.allowed_token_ids or []) == allowed


def test_a_vocabulary_no_mask_can_hold_is_refused_so_the_session_keeps_the_forward_pass() -> None:
    with pytest.raises(ValueError, match="cannot be given"):
        limit_vocab(_params(), 50_000, 152_064)
