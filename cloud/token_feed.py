"""Tokens an engine makes on its own thread, handed to the asyncio tasks that stream them, with one wake-up of the
event loop a step (docs/architecture.md, "Decode stretches and followed streams")."""

from __future__ import annotations

import asyncio
import threading


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
