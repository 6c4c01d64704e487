"""The target's own decoding on a session (the Decode call): a stretch of tokens, each one a
Verify round with no draft tokens, so decoding and speculative rounds advance one session
with one KV and one generator. Each token is one step for the batcher, batched with other
sessions' rounds and other streams' tokens; on an engine that decodes ahead (vLLM) only the
first is (cloud/followed_stretch.py). Opening a session (its prefill) is one step too, shared
by OpenSession and a Decode call that opens its session. SessionCalls also runs a Generate
call (cloud/generate_stream.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
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
        return await self._opening(req, self.verifier.begin_open, round_trip=True)

    async def verify(self, req: VerifyRequest, stretch: DecodeStretchStep | None = None) -> VerifyResult:
        """One round (the caller holds its session from eviction), or a token of a stretch."""
        tokens = len(req.committed_tokens) + len(req.draft_tokens) + 1
        begin = partial(self.verifier.begin_verify, req, self.key, stretch)
        return await self.batcher.submit(req.session_id, tokens, begin, self.deadline, key=self.key, round_trip=stretch is None)

    async def decode(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        """A Decode stretch of up to `max_tokens` tokens. A call that opens its session gets the
        prefill and the first token from ONE forward pass (so its first token comes as soon as
        Generate's would), in the first chunk with the opened session."""
        self.verifier.checks.decode(req)
        session_id, position, produced = req.session_id, req.base_position, 0
        if req.open is not None:
            start = time.perf_counter()
            stretch = DecodeStretchStep(req.max_tokens, frozenset(req.stop_token_ids))
            opened, first = await self._opening(req.open, partial(self.verifier.begin_open_decode, stretch=stretch))
            session_id, position, produced = opened.session_id, first.new_base_position, 1
            finished = first.next_token in req.stop_token_ids or req.max_tokens == 1
            yield _chunk(first, start, finished, opened)
            if finished:
                return
        with self.verifier.sessions.holding(session_id):  # no eviction between its tokens
            async with aclosing(self._stretch(req, session_id, position, produced)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _stretch(
        self, req: DecodeRequest, session_id: str, position: int, produced: int
    ) -> AsyncGenerator[DecodeChunk, None]:
        """The stretch after its first `produced` tokens: a step a token, each a round with no
        drafts batched with other sessions' steps, until the engine decodes the rest on its own
        (then the call reads it, cloud/followed_stretch.py)."""
        catchup, stops = req.committed_tokens, frozenset(req.stop_token_ids)
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
            start = time.perf_counter()
            stretch = DecodeStretchStep(req.max_tokens - produced, stops)
            result = await self.verify(VerifyRequest(session_id, position, [], committed_tokens=catchup), stretch)
            catchup, position, produced = [], result.new_base_position, produced + 1
            finished = result.next_token in stops or produced == req.max_tokens
            yield _chunk(result, start, finished)
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
        """A Generate stream: its first step admitted against the deadline; the rest read from
        the engine's own decoding where it follows it, else one step a token, each batched with
        other streams' steps and rounds. Its KV goes however the stream ends."""
        stream = self.verifier.open_generate(req, self.verifier.sessions.new_id(), self.key)  # validation only
        feed: TokenFeed | None = None
        try:
            with self.verifier.sessions.holding(stream.stream_id):
                while not stream.finished:
                    if feed is not None:
                        yield stream.take(*await feed.take())
                        continue
                    first, fed = stream.produced == 0, stream.tokens_to_feed
                    step = stream.begin_step
                    chunk = await self.batcher.submit(stream.stream_id, fed, step, self.deadline, admitting=first, key=self.key)
                    if first:
                        self.batcher.settle(self.key, fed, len(req.prompt_tokens) - chunk.reused_tokens)
                    yield chunk
                    if first and not stream.finished:
                        feed = self.feeds.feed()
                        feed = feed if await self.worker.run(stream.follow, feed) else None
        finally:
            self.worker.submit(stream.close)

    async def _opening(
        self, req: OpenSessionRequest, begin: Callable[[OpenSessionRequest, str, str], ForwardStep[R]], round_trip: bool = False
    ) -> R:
        """A new session's first step (`begin`: its prefill, or its prefill and first token),
        admitted against the caller's deadline and held from eviction by its new id.
        `round_trip`: its next step is its client's first round."""
        sessions = self.verifier.sessions
        session_id = sessions.new_id()
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
