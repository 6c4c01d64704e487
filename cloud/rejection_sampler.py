"""Accept/reject math of speculative decoding. Pure: tensors in, tensors out.

Vocabulary (as in vLLM's rejection sampler):
- *accepted* tokens: the prefix of the draft that the target keeps;
- the *recovered* token: drawn from the residual distribution at the first rejection;
- the *bonus* token: drawn from the target at position k+1 when all k drafts pass.
A round emits the accepted tokens plus exactly one recovered or bonus token.

Modes (temperature > 0) and what the edge must send:
- POINT: deterministic drafts (greedy draft model, n-gram), q = 1. Exact.
- SPARSE: the draft's (truncated) distribution per position. Exact: residual max(p - q, 0).
- SCALAR: only q(y); residual p - 1[v=y] q(y). APPROXIMATE: q off the drafted token is unknown.
- SHORTCUT: only q(y); resample from p on rejection. APPROXIMATE.
- TOP1: accept while the draft is the target's argmax, then sample from p. APPROXIMATE
  (exact only at temperature 0); offered for n-gram drafts as in the NASD design.
Temperature 0 is GREEDY: accept while the draft equals the target argmax. Exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.protocol import AcceptMode, SparseDistribution

# q values come from the wire; the server validates q > 0, this guard keeps the
# ratio finite even if a caller skips validation.
MIN_DRAFT_PROB = 1e-12


@dataclass(frozen=True)
class RoundOutcome:
    accepted_len: int
    next_token: int  # recovered token, or bonus token when bonus is True
    bonus: bool
    accept_probs: torch.Tensor  # [k] min(1, p(y)/q(y)) per draft position (greedy: 0 or 1)


def accept(
    mode: AcceptMode,
    draft_token_ids: torch.Tensor,  # [k] long
    target: torch.Tensor,  # [k + 1, V]: GREEDY: penalised logits; other modes: processed probabilities p
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,  # [k] q(y) of each drafted token: SCALAR and SHORTCUT
    sparse_draft: torch.Tensor | None = None,  # [k, V] the draft's distributions q: SPARSE
) -> RoundOutcome:
    """The one entry point: the accepted prefix of a draft block and the recovered or bonus
    token, by the session's mode. GREEDY takes logits (argmax on logits, as target-only
    decoding does, so no softmax rounding can split a tie differently); POINT drafts have
    q = 1; SPARSE reads q(y) off its distributions."""
    k = draft_token_ids.shape[0]
    if mode is AcceptMode.GREEDY:
        return verify_greedy(draft_token_ids, target)
    if mode is AcceptMode.TOP1:
        return verify_top1(draft_token_ids, target, generator)
    if mode is AcceptMode.SPARSE:
        if sparse_draft is None:
            raise ValueError("SPARSE mode needs the draft distributions")
        q = sparse_draft[torch.arange(k), draft_token_ids]
    elif mode is AcceptMode.POINT:
        q = torch.ones(k)
    elif draft_probs is None:
        raise ValueError(f"{mode.value} mode needs q(y) of every draft token")
    else:
        q = draft_probs
    weights = residual_draft_weights(mode, draft_token_ids, q, sparse_draft, target.shape[-1])
    return rejection_sample(draft_token_ids, q, weights, target, generator)


def dense_draft(sparse: Sequence[SparseDistribution], vocab_size: int) -> torch.Tensor:  # [k, V]
    """The wire's sparse draft distributions (top ids and their probabilities) as dense rows."""
    dense = torch.zeros(len(sparse), vocab_size)
    for i, dist in enumerate(sparse):
        dense[i, torch.tensor(dist.token_ids, dtype=torch.long)] = torch.tensor(dist.probs)
    return dense


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def verify_greedy(
    draft_token_ids: torch.Tensor,  # [k] long
    target_logits: torch.Tensor,  # [k + 1, V] penalised logits
) -> RoundOutcome:
    """Accept while each draft equals the target argmax; the next token is the argmax after."""
    target_argmax = target_logits.argmax(dim=-1)  # [k + 1]
    k = draft_token_ids.shape[0]
    matches = (draft_token_ids == target_argmax[:k]).float()  # [k]
    accepted_len = int(matches.cumprod(dim=0).sum().item()) if k else 0
    return RoundOutcome(accepted_len, int(target_argmax[accepted_len].item()), accepted_len == k, matches)


def verify_top1(
    draft_token_ids: torch.Tensor,  # [k] long
    target_probs: torch.Tensor,  # [k + 1, V]
    generator: torch.Generator,
) -> RoundOutcome:
    """APPROXIMATE: accept while each draft is the target's most likely token; the next token
    is then drawn from p (recovered at a mismatch, bonus after a full match)."""
    target_argmax = target_probs.argmax(dim=-1)  # [k + 1]
    k = draft_token_ids.shape[0]
    matches = (draft_token_ids == target_argmax[:k]).float()  # [k]
    accepted_len = int(matches.cumprod(dim=0).sum().item()) if k else 0
    return RoundOutcome(accepted_len, sample_token(target_probs[accepted_len], generator), accepted_len == k, matches)


def residual_draft_weights(
    mode: AcceptMode,
    draft_token_ids: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor,  # [k] q(y) of each drafted token
    sparse_draft_probs: torch.Tensor | None,  # [k, V] dense q, SPARSE mode only
    vocab_size: int,
) -> torch.Tensor:  # [k, V]
    """The q subtracted from p on a rejection: residual = max(p - q, 0), renormalised."""
    k = draft_token_ids.shape[0]
    if mode is AcceptMode.SPARSE:
        if sparse_draft_probs is None:
            raise ValueError("SPARSE mode needs the draft distribution")
        return sparse_draft_probs
    weights = torch.zeros(k, vocab_size)
    if mode is AcceptMode.POINT:
        weights[torch.arange(k), draft_token_ids] = 1.0
    elif mode is AcceptMode.SCALAR:
        weights[torch.arange(k), draft_token_ids] = draft_probs
    elif mode is not AcceptMode.SHORTCUT:
        raise ValueError(f"{mode} is not a sampling mode")
    return weights


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor,  # [k] q(y) of each drafted token, in (0, 1]
    residual_weights: torch.Tensor,  # [k, V] from residual_draft_weights
    target_probs: torch.Tensor,  # [k + 1, V] processed target distributions
    generator: torch.Generator,
) -> RoundOutcome:
    """Accept draft i with probability min(1, p(y_i) / q(y_i)); at the first rejection draw
    the recovered token from max(p - q, 0); when all pass draw the bonus from p[k]."""
    k = draft_token_ids.shape[0]
    uniform_probs = torch.rand(k, generator=generator)  # [k]
    target_at_draft = target_probs[torch.arange(k), draft_token_ids]  # [k]
    accept_probs = (target_at_draft / draft_probs.clamp_min(MIN_DRAFT_PROB)).clamp(max=1.0)
    rejected = (uniform_probs >= accept_probs).nonzero()
    if rejected.numel() == 0:
        return RoundOutcome(k, sample_token(target_probs[k], generator), True, accept_probs)
    first = int(rejected[0].item())
    residual = (target_probs[first] - residual_weights[first]).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:
        # Only reachable through float error (p <= q everywhere yet a rejection): fall back to p.
        residual = target_probs[first]
    return RoundOutcome(first, sample_token(residual, generator), False, accept_probs)
