"""Freed memory handed back to the system when the verifier goes idle.

A session's KV grows a token at a time and is freed when the session ends, and a long prefill's
activations are freed after its pass. glibc's allocator keeps freed pages for reuse, so a
verifier left idle after a load holds memory no session uses: 20 to 70 MiB each time on the
1.5B target on a CPU. `malloc_trim(0)` returns those pages. It runs on the model worker (no
forward pass allocates meanwhile), only when the verifier holds no session and has run a forward
pass since the last trim, at most once per check interval.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from functools import partial

from cloud.logs import log_event
from cloud.state import ServerState

log = logging.getLogger("cloud-verifier")
IDLE_CHECK_S = 10.0


def malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0), or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return partial(trim, 0)  # 0: keep no padding at the heap's top


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


async def trim_when_idle(state: ServerState, every_s: float = IDLE_CHECK_S) -> None:
    """Forever: every `every_s`, trim the heap if the verifier is idle and has worked since the last trim."""
    trim = malloc_trim()
    if trim is None:
        return
    trimmed_at = -1  # forward passes run when the heap was last trimmed
    while True:
        await asyncio.sleep(every_s)
        verifier = state.verifier
        if verifier is None or len(verifier.sessions.snapshot()) or verifier.forward_passes == trimmed_at:
            continue
        before = resident_bytes()
        await state.worker.run(trim)
        trimmed_at = verifier.forward_passes
        freed = before - resident_bytes()
        log_event(log, logging.INFO, f"idle: returned {freed / 2**20:.0f} MiB of freed memory", freed_bytes=freed)
