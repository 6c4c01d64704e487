"""The drafter catching up on the committed tokens in auto mode: it prefills the prompt, then
each stretch's tokens. Beside the Decode stream (a worker thread from the moment the first
stretch is sent, while the verifier prefills the same prompt), so speculation can start without
a wait; or, where the verifier runs on this machine's own cores,
between stretches, as running both at once slows the target more than the prefill costs alone
(a 4-token stretch took 3.6 s instead of 1.1 s beside a prefill on a 2-core box). The drafter is
never used by two threads at once: the round loop settles the warmup before it drafts."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from edge.drafting.drafter import DraftSource


class DrafterWarmup:
    def __init__(self, drafter: DraftSource, beside: bool = True) -> None:
        self.drafter, self.beside = drafter, beside
        self._task: asyncio.Future[None] | None = None
        self._prefilled = False  # the prompt is in the drafter's cache

    def follow(self, committed: Sequence[int]) -> None:
        """Prefill up to `committed` in the background, unless a prefill is running (the next
        call catches up the tokens committed meanwhile). Between stretches only: nothing."""
        if not self.beside:
            return
        if self._task is None or self._task.done():
            if self._task is not None:
                self._task.result()  # a failed prefill fails the generation here
            self._task = asyncio.ensure_future(asyncio.to_thread(self._prefill, list(committed)))

    def ready(self) -> bool:
        """Whether the drafter has prefilled the prompt (later catch-ups are short)."""
        return self._prefilled

    async def catch_up(self, committed: Sequence[int]) -> None:
        """At a boundary, when the drafter prefills between stretches: prefill up to
        `committed` now, the target waiting."""
        if self.beside:
            return
        await self.settle()
        self._task = asyncio.ensure_future(asyncio.to_thread(self._prefill, list(committed)))
        await self._task

    async def settle(self) -> None:
        """Wait for the prefill running, if any: then the drafter is the caller's alone."""
        if self._task is not None:
            await self._task

    def _prefill(self, committed: list[int]) -> None:  # in the worker thread
        self.drafter.sync(committed)
        self.drafter.prefill()
        self._prefilled = True
