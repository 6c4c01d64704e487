"""The drafter's logits processors and draws, in numpy.

The same semantics as shared/sampling/verifier_torch.py (repetition penalty, then temperature, top-k,
top-p; tests hold the two side by side), so an edge that drafts with llama.cpp or n-grams
never imports torch. Exactness does not hinge on the two agreeing to the last bit: the edge
sends the q it actually sampled from, and the verifier's rule is exact for any q.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shared.protocol import SamplingParams


def penalized_logits(
    logits: np.ndarray,  # [V_model] float32, the row that predicts the next token
    context: Sequence[int],  # every token before that prediction (prompt + committed + drafts)
    params: SamplingParams,
    vocab_size: int,
) -> np.ndarray:  # [vocab_size] float32
    """Cut padded vocabulary rows and apply the repetition penalty (HF semantics)."""
    out = np.array(logits[:vocab_size], dtype=np.float32)  # a copy: the caller's row stays as it was
    if params.repetition_penalty == 1.0 or not context:
        return out
    seen = np.unique(np.fromiter(context, dtype=np.int64))
    seen = seen[seen < vocab_size]
    scores = out[seen]
    penalty = np.float32(params.repetition_penalty)
    out[seen] = np.where(scores < 0, scores * penalty, scores / penalty)
    return out


def softmax(logits: np.ndarray) -> np.ndarray:  # [V] -> [V] float32; -inf entries get 0
    shifted = logits - logits.max()
    weights = np.exp(shifted, dtype=np.float32)
    return weights / weights.sum()


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, top-k and top-p on penalised logits [V] -> probabilities [V]."""
    scaled = logits / np.float32(params.temperature)
    if 0 < params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled).astype(np.float32)
    if 0.0 < params.top_p < 1.0:
        order = np.argsort(-scaled, kind="stable")
        sorted_probs = softmax(scaled[order])
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (np.cumsum(sorted_probs) - sorted_probs) >= params.top_p
        drop = np.empty_like(drop_sorted)
        drop[order] = drop_sorted
        scaled = np.where(drop, -np.inf, scaled).astype(np.float32)
    return softmax(scaled)


def truncate_top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """Keep the k most likely entries of probs [V] and renormalise (k <= 0: unchanged)."""
    if k <= 0 or k >= probs.shape[-1]:
        return probs
    keep = np.argpartition(-probs, k - 1)[:k]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probs [V] (inverse CDF; a zero-probability token is never drawn)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if index >= probs.shape[0] or probs[index] <= 0:  # u * total landed on the very top
        index = int(np.flatnonzero(probs)[-1])
    return index


def entropy_bits(probs: np.ndarray) -> float:
    nonzero = probs[probs > 0].astype(np.float64)
    return float(-(nonzero * np.log2(nonzero)).sum())


def top2_margin(probs: np.ndarray) -> float:
    if probs.shape[0] < 2:
        return float(probs[0]) if probs.shape[0] else 0.0
    top2 = np.partition(probs, -2)[-2:]
    return float(top2[1] - top2[0])


def nll(probs: np.ndarray, token: int) -> float:
    return -math.log(max(float(probs[token]), 1e-30))
