"""The API keys file (--api-keys-file) re-read while the verifier runs: on SIGHUP, and when the
file changes (looked at every second: no watch library to install). A file that does not parse
leaves the keys in force; a name that is gone is ended: its sessions and kept prefixes here, its
streams in cloud/interceptors.py. What an operator sees of it: docs/operations.md ("Changing keys").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from cloud.logs import log_event
from cloud.state import ServerState
from shared.api_keys import ApiKeys
from shared.errors import ConfigError

log = logging.getLogger("cloud-verifier")
POLL_S = 1.0  # how often the file is looked at
SETTLE_S = 0.05  # a change is read once the file has stayed as it is for this long (a writer done)

Stamp = tuple[int, int, int] | None  # (mtime_ns, size, inode); None: the file cannot be looked at


def key_names(keys: ApiKeys) -> frozenset[str]:
    return frozenset(entry.name for entry in keys.entries)


def _stamp(path: str) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


async def reload_keys(state: ServerState, path: str, why: str) -> bool:
    """Re-read the keys file into `state` and end the names no longer in it; whether it parsed."""
    try:
        keys = ApiKeys.load(path)
    except ConfigError as err:  # its message names the line, never its text
        log_event(log, logging.WARNING, f"API keys not reloaded ({why}): {err}; the keys in force stay")
        return False
    before, after = key_names(state.api_keys), key_names(keys)
    state.api_keys = keys  # from here on, every call and request of a removed name is refused
    added, removed = sorted(after - before), sorted(before - after)
    ended = sum([await state.end_owner(name) for name in removed])
    reloaded = f"API keys reloaded ({why}): {len(keys.entries)} keys"
    log_event(log, logging.INFO, reloaded, keys=len(keys.entries), added=added, removed=removed, ended_sessions=ended)
    return True


async def _hangup(received: asyncio.Event, timeout_s: float) -> bool:
    """Whether SIGHUP came within `timeout_s` (cleared for the next one)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(received.wait(), timeout_s)
    hung_up = received.is_set()
    received.clear()
    return hung_up


async def _changed(path: str, seen: Stamp) -> bool:
    """Whether the file changed since `seen` and has stopped changing."""
    stamp = _stamp(path)
    if stamp == seen:
        return False
    await asyncio.sleep(SETTLE_S)
    return _stamp(path) == stamp  # still being written: looked at again on the next poll


async def watch_keys(state: ServerState, path: str, every_s: float = POLL_S) -> None:
    """Forever: reload the keys on SIGHUP, or once the file changed."""
    received = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, received.set)
    seen = _stamp(path)  # the file start_servers loaded a moment ago
    try:
        while True:
            hung_up = await _hangup(received, every_s)
            if hung_up or await _changed(path, seen):
                seen = _stamp(path)
                await reload_keys(state, path, "SIGHUP" if hung_up else "the file changed")
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
