"""The one thread that runs model work."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelWorker:
    """Runs model work on one thread so rounds never interleave on a cache and the event
    loop stays free for the network."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run_timed(self, fn: Callable[[float], T]) -> T:
        """Call fn(queue_ms), where queue_ms is how long the call waited for the worker."""
        submitted = time.perf_counter()
        return await self.run(lambda: fn((time.perf_counter() - submitted) * 1000.0))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
