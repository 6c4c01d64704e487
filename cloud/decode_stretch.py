"""The target's own decoding on a session (the Decode call): a stretch of tokens, each one a Verify round with no
draft tokens, so decoding and speculative rounds advance one session with one KV and one generator; Generate is such
a call (docs/architecture.md, "Decode stretches and followed streams")."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

from cloud.batch_step import ForwardStep
from cloud.batcher import ForwardBatcher
from cloud.followed_stretch import FollowedStretch
from cloud.token_feed import FeedHub, TokenFeed
from cloud.verifier import DecodeStretchStep, Verifier
from cloud.worker import ModelWorker
from shared.errors import CapacityExceeded, SpecDecError
from shared.protocol import (
    DecodeChunk,
    DecodeRequest,
    GenerateChunk,
    GenerateRequest,
    OpenSessionRequest,
    OpenSessionResult,
    VerifyRequest,
    VerifyResult,
)

R = TypeVar("R")


@dataclass(frozen=True)
class SessionCalls:
    """One call's view of the verifier: its model, its batcher, the API key it runs for and its
    deadline (a time.perf_counter() time, None: no deadline); the model worker and the feeds of
    the event loop, for streams that follow their engine's decoding."""

    verifier: Verifier
    batcher: ForwardBatcher
    key: str
    deadline: float | None
    worker: ModelWorker
    feeds: FeedHub

    async def open(self, req: OpenSessionRequest) -> OpenSessionResult:
        """A new session: its prefill is one more step for the batcher (rounds of open sessions
        share its forward passes), held from eviction by its id while its chunks run."""
        return await self._opening(req, self.verifier.begin_open, self.verifier.sessions.new_id(), round_trip=True)

    async def verify(self, req: VerifyRequest, stretch: DecodeStretchStep | None = None) -> VerifyResult:
        """One round (the caller holds its session from eviction), or a token of a stretch."""
        tokens = len(req.committed_tokens) + len(req.draft_tokens) + 1
        begin = partial(self.verifier.begin_verify, req, self.key, stretch)
        return await self.batcher.submit(req.session_id, tokens, begin, self.deadline, key=self.key, round_trip=stretch is None)

    async def decode(self, req: DecodeRequest, new_id: str = "", reserved: bool = False) -> AsyncGenerator[DecodeChunk, None]:
        """A Decode stretch of up to `max_tokens` tokens, its session held from eviction between
        them. A call that opens its session (under `new_id`, else a new one; `reserved`: with KV
        for the whole stretch) gets the prefill and the first token from ONE forward pass, in
        the first chunk with the opened session."""
        self.verifier.checks.decode(req)
        session_id = req.session_id if req.open is None else new_id or self.verifier.sessions.new_id()
        with self.verifier.sessions.holding(session_id):
            async with aclosing(self._stretch(req, session_id, reserved)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _stretch(self, req: DecodeRequest, session_id: str, reserved: bool) -> AsyncGenerator[DecodeChunk, None]:
        """A step a token, each a round with no drafts batched with other sessions' steps (the
        first one its session's prefill too, when the call opens it), until the engine decodes
        the rest on its own (then the call reads it, cloud/followed_stretch.py)."""
        catchup, stops, position, produced = req.committed_tokens, frozenset(req.stop_token_ids), req.base_position, 0
        may_follow = self.verifier.engine.decodes_ahead
        while True:
            if produced and may_follow:
                may_follow, feed = False, self.feeds.feed()
                left = req.max_tokens - produced
                follow = await self.worker.run(self.verifier.follow_stretch, session_id, self.key, left, stops, feed)
                if follow is not None:
                    async with aclosing(self._followed(follow, feed)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    if follow.finished:
                        return
                    position, produced = follow.position, req.max_tokens - follow.left  # the rest: a step a token
            start, stretch = time.perf_counter(), DecodeStretchStep(req.max_tokens - produced, stops)
            opened: OpenSessionResult | None = None
            if req.open is not None and not produced:
                begin = partial(self.verifier.begin_open_decode, stretch=replace(stretch, reserved=reserved))
                first = await self._opening(req.open, begin, session_id)
                opened, result = first
            else:
                result = await self.verify(VerifyRequest(session_id, position, [], committed_tokens=catchup), stretch)
            catchup, position, produced = [], result.new_base_position, produced + 1
            finished = result.next_token in stops or produced == req.max_tokens
            yield _chunk(result, start, finished, opened)
            if finished:
                return

    async def _followed(self, follow: FollowedStretch, feed: TokenFeed) -> AsyncGenerator[DecodeChunk, None]:
        """A chunk of each take from the feed, until the stretch ends or the engine stops decoding
        it; its session takes the tokens before any other step of it, however the call ends."""
        committed = False
        try:
            while not follow.finished:
                start = time.perf_counter()
                try:
                    tokens, forward_ms = await feed.take()
                except CapacityExceeded:
                    raise  # the engine has no KV for it: the stretch fails, as its steps would
                except SpecDecError:  # it stopped short (the context's end, the session gone)
                    break
                tokens = follow.take(tokens)
                step_ms = (time.perf_counter() - start) * 1000.0
                yield DecodeChunk(tokens, follow.position, forward_ms, step_ms, follow.finished)
            await self.worker.run(follow.commit)
            committed = True
        finally:
            if not committed:
                self.worker.submit(follow.commit)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """A Generate stream: the Decode call that serves it (Verifier.as_decode), its session
        held from eviction while it runs and closed however it ends (its KV may stay as a kept
        prefix of its scope)."""
        decode, session_id = self.verifier.as_decode(req), self.verifier.sessions.new_id()
        try:
            async with aclosing(self.decode(decode, session_id, reserved=True)) as chunks:
                async for chunk in chunks:
                    opened = chunk.opened
                    reuse_token, reused = (opened.reuse_token, opened.reused_tokens) if opened else ("", 0)
                    yield GenerateChunk(
                        chunk.tokens, chunk.forward_ms, chunk.finished, reuse_token=reuse_token, reused_tokens=reused
                    )
        finally:
            self.worker.submit(partial(self.verifier.sessions.retire, session_id))

    async def _opening(
        self,
        req: OpenSessionRequest,
        begin: Callable[[OpenSessionRequest, str, str], ForwardStep[R]],
        session_id: str,
        round_trip: bool = False,
    ) -> R:
        """A new session's first step (`begin`: its prefill, or its prefill and first token),
        admitted against the caller's deadline and held from eviction by its id.
        `round_trip`: its next step is its client's first round."""
        sessions = self.verifier.sessions
        with sessions.holding(session_id):
            # what the prefill computes, as far as can be told before it runs: the prompt but for
            # what its scope's kept KV holds; the key is charged what it computed once it ran
            scope = self.verifier.scopes.known(self.key, req.reuse_token)
            fed = len(req.prompt_tokens) - sessions.reusable(scope.name, req.prompt_tokens)
            step = partial(begin, req, session_id, self.key)
            result = await self.batcher.submit(
                session_id, fed, step, self.deadline, admitting=True, key=self.key, round_trip=round_trip
            )
            opened = result[0] if isinstance(result, tuple) else result
            assert isinstance(opened, OpenSessionResult)
            self.batcher.settle(self.key, fed, len(req.prompt_tokens) - opened.reused_tokens)
            return result


def _chunk(result: VerifyResult, start: float, finished: bool, opened: OpenSessionResult | None = None) -> DecodeChunk:
    """One token of a stretch: its server time since `start` (perf_counter), queue included."""
    step_ms = (time.perf_counter() - start) * 1000.0
    return DecodeChunk([result.next_token], result.new_base_position, result.metrics.forward_ms, step_ms, finished, opened)
