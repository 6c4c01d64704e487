"""Cross-session batching: rounds (and Generate steps) that arrive close together run in ONE
forward pass of the target, on the one model worker.

A bounded queue in front of it is the verifier's backpressure: past `max_queue` waiting
steps, a call is refused with RESOURCE_EXHAUSTED and a retry hint (how long the queue ahead
takes to drain at the recent batch time) instead of waiting without bound.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cloud.metrics import VerifierMetrics
from cloud.verifier import ForwardStep, Verifier
from cloud.worker import ModelWorker
from shared.errors import CapacityExceeded

R = TypeVar("R")


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int = 16  # steps per forward pass (1 = no batching)
    max_batch_wait_ms: float = 2.0  # how long the first step waits for others to join
    max_batch_tokens: int = 2048  # fed tokens per forward (a long prefill runs alone)
    max_queue: int = 256  # waiting steps; past it, RESOURCE_EXHAUSTED


@dataclass
class _Waiting:
    owner: str  # session or stream: at most one step of each per forward pass
    tokens: int  # tokens this step feeds, for max_batch_tokens
    begin: Callable[[], ForwardStep[Any]]  # validates on the worker, when its batch runs
    submitted: float
    future: asyncio.Future[Any] = field(repr=False)


class ForwardBatcher:
    """Collects steps from concurrent calls and runs them in batches on the model worker."""

    def __init__(self, verifier: Verifier, worker: ModelWorker, limits: BatchLimits, metrics: VerifierMetrics) -> None:
        self.verifier = verifier
        self.worker = worker
        self.limits = limits
        self.metrics = metrics
        self._waiting: list[_Waiting] = []
        self._arrived = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._batch_ms = 0.0  # moving average of recent batches, for the retry hint

    async def submit(self, owner: str, tokens: int, begin: Callable[[], ForwardStep[R]]) -> R:
        """Run begin() and its forward pass in the next batch with room; the step's result."""
        if len(self._waiting) >= self.limits.max_queue:
            raise CapacityExceeded(f"the verifier's queue is full ({self.limits.max_queue} waiting steps)",
                                   self._retry_after_ms())
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(owner, tokens, begin, time.perf_counter(), future))
        self.metrics.queue_depth.set(len(self._waiting))
        self._arrived.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await future

    def _retry_after_ms(self) -> int:
        batches_ahead = math.ceil(len(self._waiting) / self.limits.max_batch_size)
        return max(1, math.ceil(batches_ahead * max(self._batch_ms, 1.0)))

    async def _run(self) -> None:
        while self._waiting:
            await self._gather()
            batch = self._take()
            if not batch:
                continue
            self.metrics.queue_depth.set(len(self._waiting))
            started = time.perf_counter()
            try:
                results = await self.worker.run(self._forward, batch)
            except BaseException as err:  # the forward failed: every step of the batch gets the error
                for waiting in batch:
                    if not waiting.future.done():
                        waiting.future.set_exception(err)
                if isinstance(err, asyncio.CancelledError):
                    raise
                continue
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            self._batch_ms = elapsed_ms if not self._batch_ms else 0.8 * self._batch_ms + 0.2 * elapsed_ms
            for waiting, result in zip(batch, results, strict=True):
                if waiting.future.done():  # the caller went away meanwhile
                    continue
                if isinstance(result, BaseException):
                    waiting.future.set_exception(result)
                else:
                    waiting.future.set_result(result)

    async def _gather(self) -> None:
        """Give the oldest step up to max_batch_wait_ms for others to join it."""
        deadline = self._waiting[0].submitted + self.limits.max_batch_wait_ms / 1000.0
        while len(self._waiting) < self.limits.max_batch_size and (left := deadline - time.perf_counter()) > 0:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _take(self) -> list[_Waiting]:
        """The oldest steps that fit one forward pass, one per owner; the rest keep waiting."""
        batch: list[_Waiting] = []
        owners: set[str] = set()
        tokens = 0
        keep: list[_Waiting] = []
        for waiting in self._waiting:
            if waiting.future.done():  # cancelled while queued: the caller gave up, do not run it
                continue
            fits = not batch or tokens + waiting.tokens <= self.limits.max_batch_tokens
            if len(batch) < self.limits.max_batch_size and fits and waiting.owner not in owners:
                batch.append(waiting)
                owners.add(waiting.owner)
                tokens += waiting.tokens
            else:
                keep.append(waiting)
        self._waiting = keep
        return batch

    def _forward(self, batch: list[_Waiting]) -> list[Any]:
        """On the model worker: begin each step (validation against the session as it is
        now), then one forward pass over those that began."""
        now = time.perf_counter()
        results: list[Any] = [None] * len(batch)
        steps: list[tuple[ForwardStep[Any], float]] = []
        began: list[int] = []
        for index, waiting in enumerate(batch):
            try:
                steps.append((waiting.begin(), (now - waiting.submitted) * 1000.0))
                began.append(index)
            except Exception as err:  # a bad request fails alone, never its batch
                results[index] = err
        if steps:
            self.metrics.batch_size.observe(len(steps))
        for index, result in zip(began, self.verifier.run_batch(steps), strict=True):
            results[index] = result
        return results
