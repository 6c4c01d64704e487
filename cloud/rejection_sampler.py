"""Accept/reject math of speculative decoding: the rounds of one forward pass accepted at once, each with its own
session's draws (docs/architecture.md, "The batched accept"; the modes: "Accept/reject modes: which are exact")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from itertools import groupby
from typing import TypeVar

import numpy as np
import torch

from shared.grammar import allowed_rows
from shared.protocol import AcceptMode, SamplingParams, SessionConfig, SparseDistribution
from shared.sampling.verifier_torch import penalized_logits, probs_from_logits

T = TypeVar("T")
U = TypeVar("U")

# q values come from the wire; the server validates q > 0, this guard keeps the
# ratio finite even if a caller skips validation.
MIN_DRAFT_PROB = 1e-12


@dataclass(frozen=True)
class RoundOutcome:
    accepted_len: int
    next_token: int  # recovered token, or bonus token when bonus is True
    bonus: bool
    accept_probs: list[float]  # [k] min(1, p(y)/q(y)) per draft position (greedy and top1: 0 or 1)


@dataclass(frozen=True)
class RoundDraft:
    """One round's input to the accept: its drafts and the target's distributions after them."""

    mode: AcceptMode
    draft_token_ids: torch.Tensor  # [k] long
    target: torch.Tensor  # [k + 1, V]: GREEDY: penalised logits; other modes: processed probabilities p
    generator: torch.Generator
    draft_probs: torch.Tensor | None = None  # [k] q(y) of each drafted token: SCALAR and SHORTCUT
    sparse_draft: torch.Tensor | None = None  # [k, V] the draft's distributions q: SPARSE


@dataclass(frozen=True)
class _Drawn:
    """What a round reads and draws before the batched decision: q(y) per position [k] and
    the session's uniforms [k] (ones and zeros where the mode reads neither)."""

    q: torch.Tensor
    uniforms: torch.Tensor


@dataclass(frozen=True)
class _Decision:
    accepted_len: int
    accept_probs: list[float]  # [k]
    argmax_next: int  # the target's argmax at the first rejected (or bonus) row


_NOT_DECIDED = LookupError("the round was not decided")  # replaced by each ready round's outcome


def accept_batch(rounds: Sequence[RoundDraft]) -> list[RoundOutcome | Exception]:
    """Every round of a forward pass at once: per round its outcome, or the exception that ended it (the others go
    on); what each mode accepts and draws: docs/architecture.md, "The batched accept", and _residual."""
    drawn = [_guarded(_draw, r) for r in rounds]
    ready = [i for i, d in enumerate(drawn) if isinstance(d, _Drawn)]
    pairs = [(r, d) for r, d in zip(rounds, drawn, strict=True) if isinstance(d, _Drawn)]
    decisions = _each_or_alone(_decide, pairs)
    outcomes: list[RoundOutcome | Exception] = [d if isinstance(d, Exception) else _NOT_DECIDED for d in drawn]
    for i, decision in zip(ready, decisions, strict=True):
        outcomes[i] = decision if isinstance(decision, Exception) else _guarded(_next_token, (rounds[i], decision))
    return outcomes


def _guarded(step: Callable[[T], U], item: T) -> U | Exception:
    try:
        return step(item)
    except Exception as err:  # this round alone fails; the caller undoes it
        return err


def _each_or_alone(step: Callable[[Sequence[T]], list[U]], items: Sequence[T]) -> list[U | Exception]:
    """step over all items at once; should it fail, over each item alone, so that only the
    items that fail by themselves fail."""
    if not items:
        return []
    try:
        return list(step(items))
    except Exception:
        return [_guarded(lambda item: step([item])[0], item) for item in items]


def _draw(r: RoundDraft) -> _Drawn:
    """q(y) of each draft and the round's uniforms, drawn from its session's generator."""
    k = r.draft_token_ids.shape[0]
    if r.mode in (AcceptMode.GREEDY, AcceptMode.TOP1):
        return _Drawn(torch.ones(k), torch.zeros(k))  # argmax modes: no draws here
    if r.mode is AcceptMode.SPARSE:
        if r.sparse_draft is None:
            raise ValueError("SPARSE mode needs the draft distributions")
        q = r.sparse_draft[torch.arange(k), r.draft_token_ids]
    elif r.mode is AcceptMode.POINT:
        q = torch.ones(k)
    elif r.draft_probs is None:
        raise ValueError(f"{r.mode.value} mode needs q(y) of every draft token")
    else:
        q = r.draft_probs
    return _Drawn(q, torch.rand(k, generator=r.generator))


def _decide(batch: Sequence[tuple[RoundDraft, _Drawn]]) -> list[_Decision]:
    """The batched decision over rounds whose targets have one width (rounds of another width
    are decided in their own group)."""
    decisions: dict[int, _Decision] = {}
    indexed = sorted(enumerate(batch), key=lambda item: item[1][0].target.shape[-1])
    for _, group in groupby(indexed, key=lambda item: item[1][0].target.shape[-1]):
        members = list(group)
        for (index, _), decision in zip(members, _decide_one_width([pair for _, pair in members]), strict=True):
            decisions[index] = decision
    return [decisions[i] for i in range(len(batch))]


def _decide_one_width(batch: Sequence[tuple[RoundDraft, _Drawn]]) -> list[_Decision]:
    rounds = [r for r, _ in batch]
    num_draft = torch.tensor([r.draft_token_ids.shape[0] for r in rounds])  # [B]
    cu_num_draft_tokens = num_draft.cumsum(0)  # [B]
    first_draft = cu_num_draft_tokens - num_draft  # [B] offset of each round's drafts
    first_row = first_draft + torch.arange(len(rounds))  # [B] each round's first target row (k + 1 rows each)
    round_of = torch.repeat_interleave(torch.arange(len(rounds)), num_draft)  # [T]
    position = torch.arange(int(num_draft.sum())) - first_draft[round_of]  # [T] index within its round
    draft_ids = torch.cat([r.draft_token_ids for r in rounds])  # [T]
    target = torch.cat([r.target for r in rounds])  # [T + B, V]
    draft_rows = first_row[round_of] + position  # [T]
    argmax = target.argmax(dim=-1)  # [T + B]
    matches = (draft_ids == argmax[draft_rows]).float()  # [T]
    q = torch.cat([d.q for _, d in batch])
    ratio = (target[draft_rows, draft_ids] / q.clamp_min(MIN_DRAFT_PROB)).clamp(max=1.0)  # [T]
    by_argmax = torch.tensor([r.mode in (AcceptMode.GREEDY, AcceptMode.TOP1) for r in rounds])[round_of]  # [T]
    accept_probs = torch.where(by_argmax, matches, ratio)
    rejected = torch.where(by_argmax, matches == 0, torch.cat([d.uniforms for _, d in batch]) >= ratio)
    first_rejected = num_draft.scatter_reduce(0, round_of, torch.where(rejected, position, num_draft[round_of]), "amin")
    next_rows = argmax[first_row + first_rejected]  # [B]
    probs, starts = accept_probs.tolist(), first_draft.tolist()  # lists, as the rounds' results read them
    return [
        _Decision(n, probs[start : start + k], token)
        for n, start, k, token in zip(first_rejected.tolist(), starts, num_draft.tolist(), next_rows.tolist(), strict=True)
    ]


def _next_token(decided: tuple[RoundDraft, _Decision]) -> RoundOutcome:
    """The recovered or bonus token of a decided round, drawn from its session's generator."""
    r, decision = decided
    k, first = r.draft_token_ids.shape[0], decision.accepted_len
    bonus = first == k
    if r.mode is AcceptMode.GREEDY:
        token = decision.argmax_next
    elif r.mode is AcceptMode.TOP1 or bonus:
        token = sample_token(r.target[first], r.generator)
    else:
        token = sample_token(_residual(r, first), r.generator)
    return RoundOutcome(first, token, bonus, decision.accept_probs)


def _residual(r: RoundDraft, first: int) -> torch.Tensor:  # [V]
    """max(p - q, 0) at the first rejected position, q being what the mode knows of the draft:
    POINT the drafted token alone, SCALAR q(y) at it, SHORTCUT nothing, SPARSE its distribution."""
    p = r.target[first]
    if r.mode is AcceptMode.SPARSE:
        assert r.sparse_draft is not None  # _draw refused a SPARSE round without it
        weights = r.sparse_draft[first]
    else:
        weights = torch.zeros(p.shape[-1])
        drafted = int(r.draft_token_ids[first])
        if r.mode is AcceptMode.POINT:
            weights[drafted] = 1.0
        elif r.mode is AcceptMode.SCALAR:
            assert r.draft_probs is not None  # _draw refused a SCALAR round without it
            weights[drafted] = r.draft_probs[first]
    residual = (p - weights).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:
        # Only reachable through float error (p <= q everywhere yet a rejection): fall back to p.
        return p
    return residual


def dense_draft(sparse: Sequence[SparseDistribution], vocab_size: int) -> torch.Tensor:  # [k, V]
    """The wire's sparse draft distributions (top ids and their probabilities) as dense rows."""
    dense = torch.zeros(len(sparse), vocab_size)
    for i, dist in enumerate(sparse):
        dense[i, torch.tensor(dist.token_ids, dtype=torch.long)] = torch.tensor(dist.probs)
    return dense


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass(frozen=True)
class RoundRule:
    """How one round is accepted, before its forward pass: its session's settings and what the
    edge said of its drafts (the drafts themselves are its step's: SessionStep.drafts). A round
    with no drafts draws the session's next token."""

    mode: AcceptMode
    sampling: SamplingParams
    vocab: int  # the session's vocabulary (the logits may be wider: padded embeddings)
    context: Sequence[int]  # tokens before row 0's prediction (prompt + committed)
    draft_probs: Sequence[float]  # q(y) per draft: SCALAR and SHORTCUT
    sparse_draft: Sequence[SparseDistribution]  # the draft's distributions: SPARSE
    generator: torch.Generator  # the session's own
    grammar_rows: np.ndarray | None = None  # [k + 1, words] int32: the tokens its grammar allows at each row

    @classmethod
    def next_token(cls, config: SessionConfig, vocab: int, context: Sequence[int], generator: torch.Generator) -> RoundRule:
        """A round with no drafts: the target's own next token after `context`, drawn as a
        session of `config` draws it."""
        return cls(config.accept_mode, config.sampling, vocab, context, [], [], generator)

    def with_logits(self, logits: torch.Tensor, draft_token_ids: Sequence[int]) -> RoundLogits:
        """The round as its forward pass left it: the target's rows [k + 1, V_model] after the
        committed tokens and each of the step's drafts."""
        own = {f.name: getattr(self, f.name) for f in fields(RoundRule)}
        return RoundLogits(**own, logits=logits, draft_token_ids=draft_token_ids)


@dataclass(frozen=True)
class RoundLogits(RoundRule):
    """One Verify round as its forward pass left it: the target's logits after the last
    committed token and each draft, and what its session's settings make of them."""

    logits: torch.Tensor = field(kw_only=True)  # [k + 1, V_model]
    draft_token_ids: Sequence[int] = field(kw_only=True)


def top_k_rows(probs: torch.Tensor, k: int) -> list[SparseDistribution]:
    """The k most likely tokens of each row of probs [rows, V], as the wire sends them."""
    if k <= 0:
        return []
    top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return [SparseDistribution(ids.tolist(), vals.tolist()) for ids, vals in zip(top.indices, top.values, strict=True)]


@dataclass(frozen=True)
class AcceptedRound:
    outcome: RoundOutcome
    probs: torch.Tensor  # [k + 1, V] the target's processed distributions (want_top_k reads them)


class RejectionSampler:
    """The accept of every round of a forward pass: the logits processors once over the rows of the rounds that
    share settings, then one batched accept (accept_batch); a round never fails another."""

    def accept_rounds(self, rounds: Sequence[RoundLogits]) -> list[AcceptedRound | Exception]:
        targets = _target_distributions(rounds)
        drafts = [
            t if isinstance(t, Exception) else _guarded(lambda pair: self.prepare(*pair), (r, t))
            for r, t in zip(rounds, targets, strict=True)
        ]
        ready = [i for i, d in enumerate(drafts) if isinstance(d, RoundDraft)]
        outcomes = accept_batch([drafts[i] for i in ready])  # type: ignore[misc]  # ready: RoundDrafts only
        accepted: list[AcceptedRound | Exception] = [d if isinstance(d, Exception) else _NOT_DECIDED for d in drafts]
        for i, outcome in zip(ready, outcomes, strict=True):
            target = targets[i]
            assert not isinstance(target, Exception)  # ready rounds have their targets
            accepted[i] = outcome if isinstance(outcome, Exception) else AcceptedRound(outcome, target[1])
        return accepted

    def prepare(self, r: RoundLogits, target: tuple[torch.Tensor, torch.Tensor]) -> RoundDraft:
        """A round's accept input from its penalised logits and its probabilities [k + 1, V]."""
        penalized, probs = target
        greedy = r.mode is AcceptMode.GREEDY
        return RoundDraft(
            r.mode,
            torch.tensor(list(r.draft_token_ids), dtype=torch.long),
            penalized if greedy else probs,
            r.generator,
            draft_probs=torch.tensor(list(r.draft_probs), dtype=torch.float32) if r.mode.reads_draft_probs else None,
            sparse_draft=dense_draft(r.sparse_draft, r.vocab) if r.mode is AcceptMode.SPARSE else None,
        )


def _target_distributions(rounds: Sequence[RoundLogits]) -> list[tuple[torch.Tensor, torch.Tensor] | Exception]:
    """Per round its penalised logits and probabilities [k + 1, V]; the processors run once
    over the stacked rows of each group of rounds with the same settings."""
    groups: dict[tuple[SamplingParams, int, bool], list[int]] = {}
    for i, r in enumerate(rounds):
        groups.setdefault((r.sampling, r.vocab, r.mode is AcceptMode.GREEDY), []).append(i)
    out: list[tuple[torch.Tensor, torch.Tensor] | Exception] = [_NOT_DECIDED] * len(rounds)
    for members in groups.values():
        processed = _each_or_alone(_process_group, [rounds[i] for i in members])
        for i, target in zip(members, processed, strict=True):
            out[i] = target
    return out


def _allowed(logits: torch.Tensor, r: RoundLogits) -> torch.Tensor:
    """logits [k + 1, V] with what the round's grammar refuses at each row masked out: the
    distributions the accept reads are the target's under the grammar."""
    if r.grammar_rows is None:
        return logits
    return logits.masked_fill(~torch.from_numpy(allowed_rows(r.grammar_rows, logits.shape[-1])), float("-inf"))


def _process_group(rounds: Sequence[RoundLogits]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rounds with the same settings: softmax (greedy) or temperature, top-k, top-p over all
    their rows at once (row-wise operations: each row as it would be alone)."""
    params, vocab, greedy = rounds[0].sampling, rounds[0].vocab, rounds[0].mode is AcceptMode.GREEDY
    penalized = torch.cat([_allowed(penalized_logits(r.logits, r.context, r.draft_token_ids, params, vocab), r) for r in rounds])
    probs = penalized.softmax(dim=-1) if greedy else probs_from_logits(penalized, params)
    sizes = [r.logits.shape[0] for r in rounds]
    return list(zip(penalized.split(sizes), probs.split(sizes), strict=True))
