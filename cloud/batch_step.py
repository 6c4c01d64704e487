"""One batch step, a straight line: the steps of several sessions and streams (a round, a
prefill or a chunk of it, a Generate token) -> ONE forward pass of the target -> ONE batched
accept over every round of the pass (cloud/rejection_sampler.py) -> each step commits its
own result.

A step is one sequence's share of the pass (ForwardStep); what it does with its rows and
how it is put back after a failure is its StepWork. A failed pass leaves every cache as it
was; a step that fails after the pass (in the accept or its commit) is undone alone, so it
never fails or corrupts the others of its pass.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from cloud.engine import Engine, SessionKV
from cloud.rejection_sampler import AcceptedRound, RejectionSampler, RoundLogits
from shared.errors import SessionNotFound, SpecDecError, VerifierFault

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
    argmax_vocab: int = 0  # > 0: work reads only each row's argmax among these ids (an engine may send less)

    def split(self, chunk: int) -> tuple[ForwardStep[Partial], ForwardStep[R]] | None:
        """A long prefill as two steps for consecutive passes: the first `chunk` tokens
        (their result is PARTIAL), then the rest, which keeps the rows and the work. Each
        part undoes the whole step. None when the block is short enough to feed at once."""
        head = min(chunk, len(self.block) - self.keep)
        if chunk <= 0 or head <= 0 or len(self.block) <= chunk:
            return None
        first = ForwardStep(self.cache, self.block[:head], 1, _Head(self.work), argmax_vocab=sys.maxsize)  # no row read
        return first, ForwardStep(self.cache, self.block[head:], self.keep, self.work, self.argmax_vocab)


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
    fed = [step for step, _ in steps if step.block]  # a one-token prompt has nothing to prefill
    forward_start = time.perf_counter()
    try:
        caches, blocks, keeps = [s.cache for s in fed], [s.block for s in fed], [s.keep for s in fed]
        logits = runner.engine.forward(caches, blocks, keeps, [s.argmax_vocab for s in fed]) if fed else []
    except BaseException:
        for step, _ in steps:
            step.work.undo()
        raise
    forward_ms = (time.perf_counter() - forward_start) * 1000.0
    runner.passes += 1 if fed else 0
    rows_of = iter(logits)
    rows = [next(rows_of) if step.block else torch.empty(0) for step, _ in steps]
    accepted = _accept_rounds(runner.sampler, [step.work for step, _ in steps], rows)
    return [
        _finish(step, step_rows, outcome, forward_ms, queue_ms)
        for (step, queue_ms), step_rows, outcome in zip(steps, rows, accepted, strict=True)
    ]


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
