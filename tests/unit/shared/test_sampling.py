"""Our logits processors agree with transformers' own (the reference a user expects)."""

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shared.protocol import SamplingParams
from shared.sampling.verifier_torch import penalized_logits, probs_from_logits, truncate_top_k

V = 50


def _hf_probs(logits: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    ids = torch.tensor([history])
    scores = logits[None].clone()
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    return scores.softmax(dim=-1)[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.6, repetition_penalty=1.3),
    ],
)
def test_matches_transformers_processors_per_row(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=gen) * 3  # rows predict after context + followers[:i]
    context = torch.randint(0, V, (12,), generator=gen).tolist()
    followers = torch.randint(0, V, (3,), generator=gen).tolist()
    ours = probs_from_logits(penalized_logits(logits, context, followers, params, V), params)
    for row in range(4):
        expected = _hf_probs(logits[row], context + followers[:row], params)
        torch.testing.assert_close(ours[row], expected, atol=1e-6, rtol=1e-5)


def test_padded_vocab_rows_are_cut() -> None:
    logits = torch.zeros(2, V + 7)
    logits[:, V:] = 100.0  # padded rows of an embedding must never win
    out = penalized_logits(logits, [1], [2], SamplingParams(), V)
    assert out.shape == (2, V) and int(out[0].argmax()) < V


def test_truncate_top_k_keeps_k_and_renormalises() -> None:
    probs = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(1)), dim=-1)
    out = truncate_top_k(probs, 4)
    assert ((out > 0).sum(dim=-1) == 4).all()
    torch.testing.assert_close(out.sum(dim=-1), torch.ones(3))
    assert torch.equal(out.argmax(dim=-1), probs.argmax(dim=-1))
