"""Cross-session batching: rounds (and Generate steps) that arrive close together run in ONE forward pass of the
target, on the one model worker (what happens around the passes: docs/architecture.md, "The batcher and a batch step")."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from cloud.batch_step import Batch, BatchRunner, ForwardStep, Partial
from cloud.metrics import VerifierMetrics
from cloud.quotas import KeyLimits, TokenRate, key_label
from cloud.worker import ModelWorker
from shared.errors import CapacityExceeded

R = TypeVar("R")


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int = 16  # steps per forward pass (1 = no batching)
    max_batch_wait_ms: float = 2.0  # how long the first step waits for others to join
    max_batch_tokens: int = 2048  # fed tokens per forward (a long prefill runs alone)
    max_queue: int = 256  # waiting steps; past it, RESOURCE_EXHAUSTED
    max_prefill_chunk: int = 256  # prompt tokens fed per pass (0 = a whole prompt in one pass)
    per_key: KeyLimits = KeyLimits()  # queued steps and tokens/s of any one key


PREFILL_TOKENS = 32  # a pass feeding this many tokens or more measures prefill throughput
MARGIN = 1.25  # estimates are compared with deadlines after this factor: a pass may run slower than the last ones
RETURN_WAIT = 0.25  # the share of a pass's time its sessions' next steps are waited for (their replies' round trips)


def _ema(old: float, new: float) -> float:
    return new if not old else 0.8 * old + 0.2 * new


@dataclass
class ForwardCost:
    """What a forward pass costs on this machine, learned from the passes run: a decode
    step (a few tokens) and the time per token of a prefill. Zero until measured."""

    step_ms: float = 0.0
    ms_per_token: float = 0.0

    def observe(self, tokens: int, ms: float) -> None:
        if tokens >= PREFILL_TOKENS:
            self.ms_per_token = _ema(self.ms_per_token, ms / tokens)
        else:
            self.step_ms = _ema(self.step_ms, ms)

    @property
    def known(self) -> bool:
        return self.ms_per_token > 0

    def estimate_ms(self, tokens: int) -> float:
        return max(self.step_ms, tokens * self.ms_per_token)


@dataclass
class _Waiting:
    owner: str  # session or stream: at most one step of each per forward pass
    remaining: int  # tokens this step has still to feed
    begin: Callable[[], ForwardStep[Any]]  # validates on the worker, when its batch runs
    submitted: float
    future: asyncio.Future[Any] = field(repr=False)
    deadline: float | None = None  # time.perf_counter() when the caller stops waiting
    admitting: bool = False  # a new session's prefill: refused (not run late) when it cannot meet its deadline
    key: str = ""  # the API key it runs for
    chunk: int = 0  # tokens fed per pass (0 = all at once)
    round_trip: bool = False  # its owner's next step comes over the network after this one's reply
    step: ForwardStep[Any] | None = None  # once begun: what is left of it (chunked prefills)

    @property
    def tokens(self) -> int:
        """Tokens the next pass feeds for this step."""
        return min(self.remaining, self.chunk) if self.chunk else self.remaining


class ForwardBatcher:
    """Collects steps from concurrent calls and runs them in batches on the model worker."""

    def __init__(self, runner: BatchRunner, worker: ModelWorker, limits: BatchLimits, metrics: VerifierMetrics) -> None:
        self.runner = runner  # the Verifier: each batch is one run_batch on the model worker
        self.worker = worker
        self.limits = limits
        self.metrics = metrics
        self._waiting: list[_Waiting] = []
        self._arrived = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._batch_ms = 0.0  # moving average of recent batches, for the retry hint
        self.cost = ForwardCost()
        self._running_until = 0.0  # when the pass running now should end (perf_counter)
        self._last_owners: frozenset[str] = frozenset()  # whose steps ran in the last pass
        self._returning: frozenset[str] = frozenset()  # of those, the ones whose next step crosses the network
        self._last_ended = 0.0  # when it ended (perf_counter)
        self.rate = TokenRate(limits.per_key.tokens_per_s)

    async def submit(
        self,
        owner: str,
        tokens: int,
        begin: Callable[[], ForwardStep[R]],
        deadline: float | None = None,
        admitting: bool = False,
        key: str = "",
        round_trip: bool = False,
    ) -> R:
        """Run begin() and its forward pass in the next batch with room (a long prefill: in chunks over several
        passes); the step's result. `key` is the API key it runs for; `deadline`, `admitting` and `round_trip`:
        docs/architecture.md, "The batcher and a batch step"."""
        self._check_queue(key)
        if admitting and deadline is not None:
            self._admit(tokens, deadline)
        self.rate.take(key, tokens)
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        chunk, now = self.limits.max_prefill_chunk, time.perf_counter()
        self._waiting.append(_Waiting(owner, tokens, begin, now, future, deadline, admitting, key, chunk, round_trip))
        self.metrics.queue_depth.set(len(self._waiting))
        self._arrived.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await future

    def settle(self, key: str, charged: int, computed: int) -> None:
        """A step charged to `key` for `charged` tokens computed `computed` (a prefill whose
        kept KV was gone, or served more than the estimate): its key pays the difference."""
        self.rate.settle(key, computed - charged)

    def _check_queue(self, key: str) -> None:
        """Refuse a step its key has no room for: over the key's own limit, or the queue is
        full and the key already holds its share of it (so a flood from one key fills the
        queue without locking the others out: the queue may reach twice max_queue)."""
        queued = [w.key for w in self._waiting if not w.future.done()]
        mine = queued.count(key)
        per_key = self.limits.per_key.max_queued
        if per_key and mine >= per_key:
            raise CapacityExceeded(f"{key_label(key)} has {per_key} steps waiting, its limit", self._retry_after_ms())
        if len(queued) < self.limits.max_queue:
            return
        share = self.limits.max_queue // len(set(queued) | {key})
        if mine >= share or len(queued) >= 2 * self.limits.max_queue:
            raise CapacityExceeded(
                f"the verifier's queue is full ({self.limits.max_queue} waiting steps)", self._retry_after_ms()
            )

    def _retry_after_ms(self) -> int:
        batches_ahead = math.ceil(len(self._waiting) / self.limits.max_batch_size)
        return max(1, math.ceil(batches_ahead * max(self._batch_ms, 1.0)))

    def work_ahead_ms(self) -> float:
        """Estimated time until the steps queued now have run: the pass running, the queued
        prefills at the measured throughput, the small steps in shared batches."""
        now = time.perf_counter()
        running = max(self._running_until - now, 0.0) * 1000.0
        live = [w for w in self._waiting if not w.future.done()]
        prefill = sum(w.remaining for w in live if w.remaining >= PREFILL_TOKENS) * self.cost.ms_per_token
        small = math.ceil(sum(1 for w in live if w.tokens < PREFILL_TOKENS) / self.limits.max_batch_size)
        return running + prefill + small * self.cost.step_ms

    def _admit(self, tokens: int, deadline: float) -> None:
        if not self.cost.known:
            return  # nothing measured yet: the first prefill runs alone and is the measurement
        ahead_ms = self.work_ahead_ms()
        need_ms = (ahead_ms + self.cost.estimate_ms(tokens)) * MARGIN
        left_ms = (deadline - time.perf_counter()) * 1000.0
        if need_ms > left_ms:
            raise self._refusal(tokens, need_ms, left_ms, ahead_ms)

    def _refusal(self, tokens: int, need_ms: float, left_ms: float, ahead_ms: float) -> CapacityExceeded:
        self.metrics.admission_refusals.inc()
        return CapacityExceeded(
            f"cannot prefill {tokens} tokens before the call's deadline: about "
            f"{need_ms / 1000:.1f} s of work, {max(left_ms, 0) / 1000:.1f} s left",
            max(1, math.ceil(ahead_ms)),
        )

    async def _run(self) -> None:
        while self._waiting:
            await self._gather()
            batch = self._take()
            if not batch:
                continue
            self._last_owners = frozenset(w.owner for w in batch)
            self._returning = frozenset(w.owner for w in batch if w.round_trip)
            self.metrics.queue_depth.set(len(self._waiting))
            started = time.perf_counter()
            fed = sum(w.tokens for w in batch)
            self._running_until = started + self.cost.estimate_ms(fed) / 1000.0
            try:
                results = await self.worker.run(self._forward, batch)
            except BaseException as err:  # the forward failed: every step of the batch gets the error
                for waiting in batch:
                    if not waiting.future.done():
                        waiting.future.set_exception(err)
                if isinstance(err, asyncio.CancelledError):
                    raise
                continue
            self._last_ended = time.perf_counter()
            elapsed_ms = (self._last_ended - started) * 1000.0
            self._batch_ms = _ema(self._batch_ms, elapsed_ms)
            self.metrics.busy_time.inc(elapsed_ms / 1000.0)
            self.metrics.forward_passes.inc()
            self.cost.observe(sum(w.tokens for w in batch), elapsed_ms)  # what the pass fed, as the steps began
            for waiting, result in zip(batch, results, strict=True):
                if isinstance(result, Partial):  # a chunk of a long prefill: the rest queues again
                    waiting.step = result.rest
                    waiting.remaining = result.rest.tokens
                    waiting.admitting = False  # begun: it finishes rather than being refused
                    self._waiting.append(waiting)
                elif waiting.future.done():  # the caller went away meanwhile
                    continue
                elif isinstance(result, BaseException):
                    waiting.future.set_exception(result)
                else:
                    waiting.future.set_result(result)

    async def _gather(self) -> None:
        """Give the oldest step up to max_batch_wait_ms for others to join it, unless every session of the last pass
        is back; those still coming back from their clients get up to RETURN_WAIT of a pass's time after it (why:
        docs/architecture.md, "The batcher and a batch step")."""
        deadline = self._waiting[0].submitted + self.limits.max_batch_wait_ms / 1000.0
        if self._returning - {w.owner for w in self._waiting}:
            deadline = max(deadline, self._last_ended + RETURN_WAIT * self._batch_ms / 1000.0)
        while (
            len(self._waiting) < self.limits.max_batch_size
            and not self._all_back()
            and (left := deadline - time.perf_counter()) > 0
        ):
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _all_back(self) -> bool:
        """Whether every owner of the last pass has a step waiting (none ran yet: no)."""
        return bool(self._last_owners) and self._last_owners <= {w.owner for w in self._waiting}

    def _take(self) -> list[_Waiting]:
        """The oldest steps that fit one forward pass, one per owner; the rest keep waiting.
        A new session that can no longer meet its deadline is refused here; a prefill joins
        only if the pass still ends before every deadline in it (before any pass was
        measured, at most one prefill runs per pass)."""
        batch: list[_Waiting] = []
        owners: set[str] = set()
        tokens = 0
        keep: list[_Waiting] = []
        now = time.perf_counter()
        for waiting in _fair_order(self._waiting):
            if waiting.future.done():  # cancelled while queued: the caller gave up, do not run it
                if waiting.step is not None:  # a prefill cut off between chunks: drop what it built
                    self.worker.submit(waiting.step.work.undo)
                continue
            if waiting.admitting and waiting.deadline is not None and self.cost.known:
                alone_ms, left_ms = self.cost.estimate_ms(waiting.remaining) * MARGIN, (waiting.deadline - now) * 1000.0
                if alone_ms > left_ms:
                    waiting.future.set_exception(self._refusal(waiting.remaining, alone_ms, left_ms, self.work_ahead_ms()))
                    continue
            fits = not batch or (
                tokens + waiting.tokens <= self.limits.max_batch_tokens and self._in_time(batch, tokens, waiting, now)
            )
            if len(batch) < self.limits.max_batch_size and fits and waiting.owner not in owners:
                batch.append(waiting)
                owners.add(waiting.owner)
                tokens += waiting.tokens
            else:
                keep.append(waiting)
        self._waiting = sorted(keep, key=lambda w: w.submitted)
        return batch

    def _in_time(self, batch: list[_Waiting], tokens: int, joining: _Waiting, now: float) -> bool:
        """Whether `joining` may join `batch` (feeding `tokens` so far) without the pass ending
        after a deadline in it."""
        if joining.tokens < PREFILL_TOKENS:
            return True  # a round or decode step adds next to nothing to a pass
        if not self.cost.known:
            return all(w.tokens < PREFILL_TOKENS for w in batch)  # measure one prefill first
        end = now + self.cost.estimate_ms(tokens + joining.tokens) * MARGIN / 1000.0
        return all(w.deadline is None or end <= w.deadline for w in (*batch, joining))

    def _forward(self, batch: list[_Waiting]) -> list[Any]:
        """On the model worker: begin each step (validation against the session as it is
        now), then one forward pass over those that began."""
        now = time.perf_counter()
        results: list[Any] = [None] * len(batch)
        steps: Batch = []
        began: list[int] = []
        for index, waiting in enumerate(batch):
            try:
                step = waiting.step or waiting.begin()
            except Exception as err:  # a bad request fails alone, never its batch
                results[index], waiting.remaining = err, 0
                continue
            # What it feeds, now that it began: the estimate it queued with may have counted a
            # kept prefix another session took meanwhile.
            waiting.remaining = step.tokens
            steps.append((replace(step, chunk=waiting.chunk), (now - waiting.submitted) * 1000.0))
            began.append(index)
        if steps:
            self.metrics.batch_size.observe(len(steps))
        for index, result in zip(began, self.runner.run_batch(steps), strict=True):
            results[index] = result
        return results


def _fair_order(waiting: list[_Waiting]) -> list[_Waiting]:
    """Steps in rounds across keys: every key's oldest step, then every key's second oldest,
    and so on (age order within a round), so a key with many steps queued cannot push a
    key with few out of the next pass."""
    rounds: list[list[_Waiting]] = []
    seen: dict[str, int] = {}
    for w in sorted(waiting, key=lambda w: w.submitted):
        rank = seen.get(w.key, 0)
        seen[w.key] = rank + 1
        if rank == len(rounds):
            rounds.append([])
        rounds[rank].append(w)
    return [w for steps in rounds for w in steps]
