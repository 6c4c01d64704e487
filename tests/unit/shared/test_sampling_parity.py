"""The edge's numpy logits processors against shared/sampling/verifier_torch.py (the cloud's, in torch):
same penalised logits, same distributions, same truncation; draws follow the distribution."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from shared.protocol import SamplingParams
from shared.sampling import edge_numpy
from shared.sampling.verifier_torch import penalized_logits, probs_from_logits, truncate_top_k

V = 40


def _logits(seed: int, width: int = V + 3) -> np.ndarray:  # padded rows past V, as real vocabularies have
    return (np.random.default_rng(seed).standard_normal(width) * 3).astype(np.float32)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=12, top_p=0.6, repetition_penalty=1.3),
        SamplingParams(temperature=0.5, repetition_penalty=0.8),
    ],
)
def test_numpy_processors_equal_the_cloud_ones(params: SamplingParams) -> None:
    for seed in range(20):
        logits = _logits(seed)
        context = [int(t) for t in np.random.default_rng(100 + seed).integers(0, V, 9)]
        ours = edge_numpy.penalized_logits(logits, context, params, V)
        theirs = penalized_logits(torch.from_numpy(logits)[None], context, [], params, V)[0]
        np.testing.assert_array_equal(ours, theirs.numpy())
        probs = edge_numpy.probs_from_logits(ours, params)
        want = probs_from_logits(theirs[None], params)[0].numpy()
        np.testing.assert_array_equal(probs > 0, want > 0)  # the same support
        np.testing.assert_allclose(probs, want, atol=1e-6)
        for k in (1, 4, V):
            np.testing.assert_allclose(
                edge_numpy.truncate_top_k(probs, k), truncate_top_k(torch.from_numpy(probs)[None], k)[0].numpy(), atol=1e-6
            )


def test_penalty_leaves_the_callers_row_alone() -> None:
    logits = _logits(1)
    before = logits.copy()
    edge_numpy.penalized_logits(logits, [1, 2, 3], SamplingParams(1.0, repetition_penalty=2.0), V)
    np.testing.assert_array_equal(logits, before)


def test_draws_follow_the_distribution_and_never_hit_a_zero() -> None:
    probs = edge_numpy.truncate_top_k(edge_numpy.probs_from_logits(_logits(3)[:V], SamplingParams(1.0)), 6)
    rng = np.random.Generator(np.random.PCG64(0))
    draws = np.array([edge_numpy.sample_token(probs, rng) for _ in range(6000)])
    assert set(draws.tolist()) <= set(np.flatnonzero(probs).tolist())
    counts = np.bincount(draws, minlength=V)[probs > 0]
    expected = probs[probs > 0].astype(np.float64)
    assert chisquare(counts, expected / expected.sum() * len(draws)).pvalue > 1e-3


def test_signals_of_a_point_mass() -> None:
    q = np.zeros(5, dtype=np.float32)
    q[2] = 1.0
    assert edge_numpy.entropy_bits(q) == 0.0
    assert edge_numpy.top2_margin(q) == 1.0
    assert edge_numpy.nll(q, 2) == 0.0
