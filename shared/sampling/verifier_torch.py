"""Logits processors shared by the edge and the cloud.

Both sides must turn logits into the same distribution, or the accept/reject
math compares different things. The order matches transformers' generate():
repetition penalty, then temperature, top-k, top-p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.protocol import SamplingParams


def penalized_logits(
    logits: torch.Tensor,  # [n, V_model]
    context: Sequence[int],  # tokens before the row-0 prediction (prompt + committed)
    followers: Sequence[int],  # token fed after row i (drafts), len >= n - 1
    params: SamplingParams,
    vocab_size: int,
) -> torch.Tensor:  # [n, vocab_size] float32
    """Cut padded vocab rows and apply the repetition penalty row by row.

    Row i predicts the token after context + followers[:i], so the set of seen
    tokens grows by one follower per row.
    """
    out = logits[:, :vocab_size].float()
    if params.repetition_penalty == 1.0:
        return out
    out = out.clone()
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    seen[torch.tensor(list(context), dtype=torch.long)] = True
    for row in range(out.shape[0]):
        scores = out[row]
        penal = torch.where(scores < 0, scores * params.repetition_penalty, scores / params.repetition_penalty)
        out[row] = torch.where(seen, penal, scores)
        if row < len(followers):
            seen[followers[row]] = True
    return out


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p on penalised logits [n, V] -> probabilities [n, V]."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.softmax(dim=-1)


def truncate_top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k most likely entries of each row [n, V] and renormalise (k <= 0: unchanged).

    A drafter that samples from this truncated q can send its whole support in a
    few bytes, which is what makes the sparse mode exact and cheap.
    """
    if k <= 0 or k >= probs.shape[-1]:
        return probs
    top = torch.topk(probs, k, dim=-1)
    out = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
    return out / out.sum(dim=-1, keepdim=True)
