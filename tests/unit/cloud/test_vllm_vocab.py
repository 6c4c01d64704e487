"""How the vLLM engine keeps vLLM's own decoding inside a session's vocabulary, without vLLM:
its engine core refuses lists longer than 1,024 tokens, and that refusal ends every request."""

import pytest

from cloud.engine.vllm import VLLM_MAX_TOKEN_LIST, VOCAB_MASK_BIAS, vocab_limit


def test_a_padded_target_pushes_its_padding_rows_down() -> None:
    """Qwen2.5's 7B pads its 151,936 tokens to 152,064 rows: 128 biased rows, no token list."""
    limit = vocab_limit(151_936, 152_064)
    assert set(limit) == {"logit_bias"}
    assert sorted(limit["logit_bias"]) == list(range(151_936, 152_064))
    assert set(limit["logit_bias"].values()) == {VOCAB_MASK_BIAS}


@pytest.mark.parametrize(
    ("vocab", "width", "expected"),
    [
        (152_064, 152_064, set()),  # the session's vocabulary is the model's
        (152_100, 152_064, set()),  # wider than the rows: nothing to hide
        (500, 100_000, {"allowed_token_ids"}),  # a short vocabulary in many rows: listed
        (100_000 - VLLM_MAX_TOKEN_LIST, 100_000, {"logit_bias"}),
    ],
)
def test_the_shorter_list_is_given(vocab: int, width: int, expected: set[str]) -> None:
    limit = vocab_limit(vocab, width)
    assert set(limit) == expected
    assert all(len(v) <= VLLM_MAX_TOKEN_LIST for v in limit.values())


def test_a_vocabulary_no_list_can_hold_is_refused_so_the_session_decodes_a_pass_a_token() -> None:
    with pytest.raises(ValueError, match="cannot be given"):
        vocab_limit(50_000, 152_064)
