"""One batch step, a straight line: the steps of several sessions and streams (a round, a
prefill or a chunk of it, a Generate token) -> ONE forward pass of the target -> ONE batched
accept over every round of the pass (cloud/rejection_sampler.py) -> each step commits its
own result. On an engine with live sessions (cloud/engine/__init__.py: LiveSessions) the
steps of live sessions go to the engine as session steps instead, which returns each one's
tokens (its accepted drafts and next token) in place of rows and an accept.

A step is one sequence's share of the pass (ForwardStep); what it does with its rows and
how it is put back after a failure is its StepWork. A failed pass leaves every cache as it
was; a step that fails after the pass (in the accept or its commit) is undone alone, so it
never fails or corrupts the others of its pass.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

import torch

from cloud.engine import Engine, LiveSessions, LiveStep, SessionKV
from cloud.rejection_sampler import AcceptedRound, RejectionSampler, RoundLogits, RoundOutcome
from shared.errors import SessionNotFound, SpecDecError, VerifierFault
from shared.protocol import SparseDistribution

log = logging.getLogger("cloud-verifier")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class StepWork(Protocol[R_co]):
    """What a step does once its forward pass ran, and how it is undone when the pass or its
    own finish fails."""

    def round_logits(self, logits: torch.Tensor) -> RoundLogits | None:
        """A Verify round's input to the batched accept; None for a step that accepts nothing."""
        ...

    def finish(self, logits: torch.Tensor, accepted: AcceptedRound | None, forward_ms: float, queue_ms: float) -> R_co:
        """The step's result, from its rows and (a round) its accepted outcome."""
        ...

    def undo(self) -> None: ...


class Partial:
    """What the head of a split step returns: its tokens are in the cache, the rest follows."""


PARTIAL = Partial()
NO_ROW = sys.maxsize  # a step's argmax_vocab when it reads no row (a prefill)


@dataclass(frozen=True)
class _Head:
    """The first part of a split step: its tokens go into the cache, nothing is returned yet;
    undoing it undoes the whole step."""

    whole: StepWork[Any]

    def round_logits(self, logits: torch.Tensor) -> None:
        return None

    def finish(self, logits: torch.Tensor, accepted: AcceptedRound | None, forward_ms: float, queue_ms: float) -> Partial:
        return PARTIAL

    def undo(self) -> None:
        self.whole.undo()


@dataclass
class ForwardStep(Generic[R]):
    """One sequence's share of a forward pass that may be batched with others: feed `block`
    after `cache`, keep the last `keep` rows of logits, and hand them to `work`."""

    cache: SessionKV
    block: list[int]
    keep: int
    work: StepWork[R]
    argmax_vocab: int = 0  # > 0: work reads only each row's argmax among these ids (an engine may send less); NO_ROW: none
    drafts: int | None = None  # a round: the block's last `drafts` tokens are verified (None: no round)
    ahead: int = 1  # tokens its session reads from this step on without drafts (a live engine may decode them in one go)
    stops: frozenset[int] = frozenset()  # tokens that end such a run
    known: list[int] = field(default_factory=list)  # tokens after the block the session holds (a prefill's last prompt token)
    distributions: bool = False  # a round on a live engine that must return the target's distributions (want_top_k)
    cached: int = 0  # the block's first tokens the engine likely serves from its own prefix cache (a prefill's)
    draft_q: list[SparseDistribution] = field(default_factory=list)  # a sparse round: the edge's q over each draft

    def live(self) -> LiveStep:
        """The step as an engine with live sessions takes it."""
        verified = len(self.block) - (self.drafts or 0)
        fed, reads = self.block[:verified] + self.known, self.argmax_vocab != NO_ROW
        return LiveStep(self.cache, fed, self.block[verified:], reads, self.ahead, self.stops, len(self.known), self.draft_q)

    def split(self, chunk: int) -> tuple[ForwardStep[Partial], ForwardStep[R]] | None:
        """A long prefill as two steps for consecutive passes: the first `chunk` tokens past
        those the engine's own prefix cache likely serves (their result is PARTIAL), then the
        rest, which keeps the rows and the work. Each part undoes the whole step. None when
        the block is short enough to feed at once."""
        size = chunk + self.cached  # a pass computes about `chunk` tokens of it
        head = min(size, len(self.block) - self.keep)
        if chunk <= 0 or head <= 0 or len(self.block) <= size:
            return None
        first = ForwardStep(self.cache, self.block[:head], 1, _Head(self.work), argmax_vocab=NO_ROW)
        return first, replace(self, block=self.block[head:], cached=0)


Batch = list[tuple[ForwardStep[Any], float]]  # each step with the ms it queued


class BatchRunner(Protocol):
    """What the batcher runs its batches on (the Verifier)."""

    def run_batch(self, steps: Batch) -> list[Any]: ...


class BatchStep:
    """Runs batch steps on one engine with one accept; counts the forward passes (a batch of
    one-token prompts runs none)."""

    def __init__(self, engine: Engine, sampler: RejectionSampler) -> None:
        self.engine = engine
        self.sampler = sampler
        self.passes = 0

    def run(self, steps: Batch) -> list[Any]:
        """ONE forward pass over every (step, queue_ms), ONE accept over its rounds; returns
        each step's result, or the exception that ended it."""
        return _run(self, steps)


def _run(runner: BatchStep, steps: Batch) -> list[Any]:
    if not steps:
        return []
    gone = [i for i, (step, _) in enumerate(steps) if runner.engine.freed(step.cache)]
    if gone:  # its session left between two chunks of a prefill: that step alone fails
        kept = iter(_run(runner, [s for i, s in enumerate(steps) if i not in gone]))
        closed = SessionNotFound("the session was closed or evicted while its step waited")
        return [closed if i in gone else next(kept) for i in range(len(steps))]
    engine = runner.engine
    live = [i for i, (step, _) in enumerate(steps) if engine.is_live(step.cache)] if isinstance(engine, LiveSessions) else []
    if not live:
        return _forward_and_accept(runner, steps)
    passed = iter(_forward_and_accept(runner, [s for i, s in enumerate(steps) if i not in live]))
    ran = dict(zip(live, _run_live(runner, [steps[i] for i in live]), strict=True))
    return [ran[i] if i in ran else next(passed) for i in range(len(steps))]


def _forward_and_accept(runner: BatchStep, steps: Batch) -> list[Any]:
    """ONE forward pass over the steps, ONE accept over their rounds."""
    if not steps:
        return []
    fed = [step for step, _ in steps if step.block]  # a one-token prompt has nothing to prefill
    forward_start = time.perf_counter()
    with _undone_on_failure(steps):
        caches, blocks, keeps = [s.cache for s in fed], [s.block for s in fed], [s.keep for s in fed]
        logits = runner.engine.forward(caches, blocks, keeps, [s.argmax_vocab for s in fed]) if fed else []
    forward_ms = (time.perf_counter() - forward_start) * 1000.0
    runner.passes += 1 if fed else 0
    rows_of = iter(logits)
    rows = [next(rows_of) if step.block else torch.empty(0) for step, _ in steps]
    accepted = _accept_rounds(runner.sampler, [step.work for step, _ in steps], rows)
    return [
        _finish(step, step_rows, outcome, forward_ms, queue_ms)
        for (step, queue_ms), step_rows, outcome in zip(steps, rows, accepted, strict=True)
    ]


def _run_live(runner: BatchStep, steps: Batch) -> list[Any]:
    """The steps of live sessions as the engine's session steps: each one's tokens become its
    accepted round (a round, or a Generate token as a round with no drafts), or nothing (a
    prefill)."""
    engine = runner.engine
    assert isinstance(engine, LiveSessions)
    start = time.perf_counter()
    lengths = [step.cache.get_seq_length() for step, _ in steps]
    with _undone_on_failure(steps):
        produced = engine.run_live([step.live() for step, _ in steps])
    forward_ms = (time.perf_counter() - start) * 1000.0
    runner.passes += 1
    results = []
    for (step, queue_ms), tokens, length in zip(steps, produced, lengths, strict=True):
        try:
            if isinstance(tokens, BaseException):
                raise tokens
            probs = (
                _distributions(engine, runner.sampler, step, length)
                if step.distributions
                else torch.empty(0, engine.logits_width)
            )
        except BaseException as err:
            results.append(_finish(step, torch.empty(0), err, forward_ms, queue_ms))
            continue
        rows, accepted = _live_outcome(step, tokens, probs)
        results.append(_finish(step, rows, accepted, forward_ms, queue_ms))
    return results


def _distributions(engine: LiveSessions, sampler: RejectionSampler, step: ForwardStep[Any], length: int) -> torch.Tensor:
    """The target's distributions at a live round's rows, which its live step does not return:
    its rows from the engine, processed as the accept would process them."""
    rows = engine.rows(step.cache, length, step.block, step.keep)
    round_logits = step.work.round_logits(rows)
    assert round_logits is not None  # only rounds ask
    [probs] = sampler.distributions([round_logits])
    if isinstance(probs, Exception):
        raise probs
    return probs


def _live_outcome(step: ForwardStep[Any], tokens: list[int], probs: torch.Tensor) -> tuple[torch.Tensor, AcceptedRound | None]:
    """What a step's work reads of the tokens a live step yielded, as an accepted round with no
    rows: a round's accepted drafts and next token (each draft's acceptance as the 0 or 1 it
    was: the engine reports no p/q) and the distributions it asked for (`probs`, else empty),
    a Generate step's token as a round with no drafts, a prefill nothing."""
    if not tokens:
        return torch.empty(0), None
    drafts, accepted = step.drafts or 0, len(tokens) - 1
    passed = torch.tensor([1.0] * accepted + [0.0] * (drafts - accepted))
    outcome = RoundOutcome(accepted, tokens[-1], accepted == drafts, passed)
    return torch.empty(0), AcceptedRound(outcome, probs)


@contextmanager
def _undone_on_failure(steps: Batch) -> Iterator[None]:
    """A pass that raises leaves every step of it undone (its caches as they were)."""
    try:
        yield
    except BaseException:
        for step, _ in steps:
            step.work.undo()
        raise


def _accept_rounds(
    sampler: RejectionSampler, works: list[StepWork[Any]], rows: list[torch.Tensor]
) -> list[AcceptedRound | BaseException | None]:
    """Per step its accepted round (None for a step that is no round), or what failed it."""
    inputs: list[RoundLogits | BaseException | None] = []
    for work, step_rows in zip(works, rows, strict=True):
        try:
            inputs.append(work.round_logits(step_rows))
        except Exception as err:  # this step alone fails (undone in _finish)
            inputs.append(err)
    rounds = [i for i, r in enumerate(inputs) if isinstance(r, RoundLogits)]
    try:
        outcomes: list[AcceptedRound | Exception] = sampler.accept_rounds([inputs[i] for i in rounds])  # type: ignore[misc]
    except Exception as err:  # a failure of the accept as a whole: each of its rounds fails
        outcomes = [err] * len(rounds)
    out: list[AcceptedRound | BaseException | None] = [r if isinstance(r, BaseException) else None for r in inputs]
    for i, outcome in zip(rounds, outcomes, strict=True):
        out[i] = outcome
    return out


def _finish(
    step: ForwardStep[Any], rows: torch.Tensor, accepted: AcceptedRound | BaseException | None, forward_ms: float, queue_ms: float
) -> Any:
    try:
        if isinstance(accepted, BaseException):
            raise accepted
        return step.work.finish(rows, accepted, forward_ms, queue_ms)
    except SpecDecError as err:
        step.work.undo()
        return err
    except Exception:  # a bug in one step's accept/sample path: that step alone fails
        log.exception("a step failed after the forward pass; undone")
        step.work.undo()
        return VerifierFault("the verifier failed on this step (see its log)")
