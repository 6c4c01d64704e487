"""The one thread that runs model work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("cloud-verifier")


class ModelWorker:
    """Runs model work on one thread so rounds never interleave on a cache and the event
    loop stays free for the network."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def submit(self, fn: Callable[[], object]) -> None:
        """Run fn after the work queued now, without waiting for it or its result (clean-up when
        a caller has gone: nothing is left to tell if it fails, so it is logged)."""

        def logged() -> None:
            try:
                fn()
            except Exception:
                log.exception("clean-up on the model worker failed")

        with contextlib.suppress(RuntimeError):  # shut down: the process is stopping and its state with it
            self._executor.submit(logged)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
