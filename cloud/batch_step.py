"""One batch step, a straight line: the steps of several sessions and streams -> ONE call of the engine -> each
step commits its own outcome, or fails alone (docs/architecture.md, "The batcher and a batch step")."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

from cloud.engine import Engine, PromptChunk, SessionStep, StepOutcome
from cloud.rejection_sampler import RoundRule
from shared.errors import SessionNotFound, SpecDecError, VerifierFault

log = logging.getLogger("cloud-verifier")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class StepWork(Protocol[R_co]):
    """What a step reads and does once the engine ran it, and how it is undone when the batch or
    its own finish fails."""

    def rule(self) -> RoundRule | None:
        """How the step's drafts are accepted and its next token drawn; None for a step that
        reads nothing (a prefill)."""

    def finish(self, outcome: StepOutcome | None, forward_ms: float, queue_ms: float) -> R_co:
        """The step's result, from its outcome (None for a step that reads nothing)."""

    def undo(self) -> None: ...


@dataclass(frozen=True)
class Partial:
    """What a step returns when the engine computed only part of its new tokens (a chunk of a
    long prompt): they are in the cache, and `rest` feeds the others in a later batch."""

    rest: ForwardStep[Any]


@dataclass(frozen=True)
class ForwardStep(SessionStep, Generic[R]):
    """One sequence's share of a batch: a session step whose outcome goes to `work`, which
    also gives its rule as the batch runs (`rule` is read from it then)."""

    work: StepWork[R] = field(kw_only=True)

    @property
    def tokens(self) -> int:
        """The tokens it feeds that its KV grows by: those fed but the known ones, and drafts."""
        return self.grows_by + len(self.drafts)

    def with_rule(self) -> ForwardStep[R]:
        """The step as the engine takes it."""
        return replace(self, rule=self.work.rule())

    def rest(self, computed: int) -> ForwardStep[R]:
        """The step but for the first `computed` tokens it feeds, which the engine computed."""
        return replace(self, fed=self.fed[computed:])


Batch = list[tuple[ForwardStep[Any], float]]  # each step with the ms it queued


class BatchRunner(Protocol):
    """What the batcher runs its batches on (the Verifier)."""

    def run_batch(self, steps: Batch) -> list[Any]: ...


class BatchStep:
    """Runs batch steps on one engine; counts the batches that computed tokens (a batch of
    one-token prompts computes none)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.passes = 0

    def run(self, steps: Batch) -> list[Any]:
        """ONE engine call over every (step, queue_ms); returns each step's result, or the
        exception that ended it."""
        if not steps:
            return []
        gone = [i for i, (step, _) in enumerate(steps) if self.engine.freed(step.kv)]
        if gone:  # its session left between two chunks of a prefill: that step alone fails
            kept = iter(self.run([s for i, s in enumerate(steps) if i not in gone]))
            closed = SessionNotFound("the session was closed or evicted while its step waited")
            return [closed if i in gone else next(kept) for i in range(len(steps))]
        start = time.perf_counter()
        with _undone_on_failure(steps):
            session_steps = [step.with_rule() for step, _ in steps]
            outcomes = self.engine.run_steps(session_steps)
        forward_ms = (time.perf_counter() - start) * 1000.0
        self.passes += 1 if any(s.grows_by or s.drafts for s in session_steps) else 0
        results = []
        for (step, queue_ms), outcome in zip(steps, outcomes, strict=True):
            if isinstance(outcome, PromptChunk):  # a chunk of its tokens: the rest follows
                results.append(Partial(step.rest(outcome.computed)))
            else:
                results.append(_finish(step, outcome, forward_ms, queue_ms))
        return results


@contextmanager
def _undone_on_failure(steps: Batch) -> Iterator[None]:
    """A batch that raises leaves every step of it undone (its caches as they were)."""
    try:
        yield
    except BaseException:
        for step, _ in steps:
            step.work.undo()
        raise


def _finish(step: ForwardStep[Any], outcome: StepOutcome | BaseException | None, forward_ms: float, queue_ms: float) -> Any:
    try:
        if isinstance(outcome, BaseException):
            raise outcome
        return step.work.finish(outcome, forward_ms, queue_ms)
    except SpecDecError as err:
        step.work.undo()
        return err
    except Exception:  # a bug in one step's accept/sample path: that step alone fails
        log.exception("a step failed in the engine or its commit; undone")
        step.work.undo()
        return VerifierFault("the verifier failed on this step (see its log)")
