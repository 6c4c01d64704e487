"""Tokens an engine makes on its own thread, handed to the asyncio tasks that stream them.

A followed Generate stream on an engine that decodes ahead (vLLM) reads its tokens from a
TokenFeed instead of a batcher pass per token: the engine puts each step's new tokens of
every followed session, and the event loop is woken once for all the feeds written since it
last looked (one wake-up a step, however many streams). A stream that falls behind takes all
its waiting tokens in one chunk.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection


class FeedHub:
    """The feeds of one event loop, and the one pending wake-up of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._written: set[TokenFeed] = set()  # feeds with tokens their readers were not woken for
        self._wake_pending = False

    def feed(self) -> TokenFeed:
        return TokenFeed(self)

    def _written_to(self, feed: TokenFeed) -> None:
        """(under the lock) feed has something new: wake the loop unless a wake-up is pending."""
        self._written.add(feed)
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop has closed: nobody reads the feeds any more
                self._wake_pending = False

    def _deliver(self) -> None:
        with self._lock:
            written, self._written = self._written, set()
            self._wake_pending = False
        for feed in written:
            feed._ready.set()


class TokenFeed:
    """One stream's tokens: written from any thread (`put`, `fail`), read on the loop (`take`)."""

    def __init__(self, hub: FeedHub) -> None:
        self._hub = hub
        self._tokens: list[int] = []
        self._step_ms = 0.0
        self._error: Exception | None = None
        self._ready = asyncio.Event()

    def put(self, tokens: list[int], step_ms: float) -> None:
        """A step's new tokens, and how long the step took."""
        if not tokens:
            return
        with self._hub._lock:
            self._tokens.extend(tokens)
            self._step_ms = step_ms
            self._hub._written_to(self)

    def fail(self, error: Exception) -> None:
        """No more tokens will come: the reader gets the tokens already put, then `error`."""
        with self._hub._lock:
            if self._error is None:
                self._error = error
                self._hub._written_to(self)

    async def take(self) -> tuple[list[int], float]:
        """Every token put since the last take (waiting for one), with the last step's time in
        ms; the failure once no token is left."""
        while True:
            with self._hub._lock:
                tokens, self._tokens = self._tokens, []
                error, step_ms = self._error, self._step_ms
                self._ready.clear()
            if tokens:
                return tokens, step_ms
            if error is not None:
                raise error
            await self._ready.wait()


def taken_part(tokens: list[int], left: int, stops: Collection[int]) -> tuple[list[int], bool]:
    """The tokens of a take that belong to its stream (a followed Generate stream, a Decode
    stretch): at most the `left` it still has, up to its first stop token; and whether a stop
    token ended them. The engine may have decoded past either."""
    tokens = tokens[:left]
    stop = next((i for i, token in enumerate(tokens) if token in stops), None)
    return (tokens, False) if stop is None else (tokens[: stop + 1], True)
