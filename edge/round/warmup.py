"""The drafter catching up in a worker thread while the target decodes (auto mode): it
prefills the prompt, then each stretch's tokens, beside the Decode stream, so speculation can
start without a wait. The drafter is never used by two threads at once: the round loop settles
the warmup before it drafts."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from edge.drafting.drafter import DraftSource


class DrafterWarmup:
    def __init__(self, drafter: DraftSource) -> None:
        self.drafter = drafter
        self._task: asyncio.Future[None] | None = None
        self._prefilled = False  # the prompt is in the drafter's cache

    def follow(self, committed: Sequence[int]) -> None:
        """Prefill up to `committed` in the background, unless a prefill is running (the next
        call catches up the tokens committed meanwhile)."""
        if self._task is None or self._task.done():
            if self._task is not None:
                self._task.result()  # a failed prefill fails the generation here
            self._task = asyncio.ensure_future(asyncio.to_thread(self._prefill, list(committed)))

    def ready(self) -> bool:
        """Whether the drafter has prefilled the prompt (later catch-ups are short)."""
        return self._prefilled

    async def settle(self) -> None:
        """Wait for the prefill running, if any: then the drafter is the caller's alone."""
        if self._task is not None:
            await self._task

    def _prefill(self, committed: list[int]) -> None:  # in the worker thread
        self.drafter.sync(committed)
        self.drafter.prefill()
        self._prefilled = True
