"""The target's own decoding on a session (the Decode call): a stretch of tokens, each one a
Verify round with no draft tokens, so decoding and speculative rounds advance one session
with one KV and one generator. On an engine with live sessions (vLLM) the session's request
decodes the stretch in one go, each token's step reading the next token it decoded. Each
token is one step for the batcher, batched with other sessions' rounds and other streams'
tokens. Opening a session (its prefill) is one step too, shared by OpenSession and a Decode
call that opens its session. SessionCalls also runs a Generate call (cloud/generate_stream.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from cloud.batch_step import ForwardStep
from cloud.batcher import ForwardBatcher
from cloud.token_feed import FeedHub, TokenFeed
from cloud.verifier import DecodeStretchStep, Verifier
from cloud.worker import ModelWorker
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
        return await self._opening(req, self.verifier.begin_open)

    async def verify(self, req: VerifyRequest, stretch: DecodeStretchStep | None = None) -> VerifyResult:
        """One round (the caller holds its session from eviction), or a token of a stretch."""
        tokens = len(req.committed_tokens) + len(req.draft_tokens) + 1
        begin = partial(self.verifier.begin_verify, req, self.key, stretch)
        return await self.batcher.submit(req.session_id, tokens, begin, self.deadline, key=self.key)

    async def decode(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        """A Decode stretch of up to `max_tokens` tokens, one chunk each. A call that opens its
        session gets the prefill and the first token from ONE forward pass (so its first token
        comes as soon as Generate's would), in the first chunk with the opened session."""
        self.verifier.checks.decode(req)
        session_id, position, first_index = req.session_id, req.base_position, 1
        if req.open is not None:
            start = time.perf_counter()
            opened, first = await self._open_with_first_token(req.open)
            session_id, position, first_index = opened.session_id, first.new_base_position, 2
            finished = first.next_token in req.stop_token_ids or req.max_tokens == 1
            yield _chunk(first, start, finished, opened)
            if finished:
                return
        catchup = req.committed_tokens
        with self.verifier.sessions.holding(session_id):  # no eviction between its tokens
            for produced in range(first_index, req.max_tokens + 1):
                start = time.perf_counter()
                stretch = DecodeStretchStep(req.max_tokens + 1 - produced, frozenset(req.stop_token_ids))
                result = await self.verify(VerifyRequest(session_id, position, [], committed_tokens=catchup), stretch)
                catchup, position = [], result.new_base_position
                finished = result.next_token in req.stop_token_ids or produced == req.max_tokens
                yield _chunk(result, start, finished)
                if finished:
                    return

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
                    first = stream.produced == 0
                    step = stream.begin_step
                    yield await self.batcher.submit(
                        stream.stream_id, len(stream.feed), step, self.deadline, admitting=first, key=self.key
                    )
                    if first and not stream.finished:
                        feed = self.feeds.feed()
                        feed = feed if await self.worker.run(stream.follow, feed) else None
        finally:
            self.worker.submit(stream.close)

    async def _open_with_first_token(self, req: OpenSessionRequest) -> tuple[OpenSessionResult, VerifyResult]:
        return await self._opening(req, self.verifier.begin_open_decode)

    async def _opening(self, req: OpenSessionRequest, begin: Callable[[OpenSessionRequest, str, str], ForwardStep[R]]) -> R:
        """A new session's first step (`begin`: its prefill, or its prefill and first token),
        admitted against the caller's deadline and held from eviction by its new id."""
        sessions = self.verifier.sessions
        session_id = sessions.new_id()
        with sessions.holding(session_id):
            prompt = len(req.prompt_tokens)
            step = partial(begin, req, session_id, self.key)
            return await self.batcher.submit(session_id, prompt, step, self.deadline, admitting=True, key=self.key)


def _chunk(result: VerifyResult, start: float, finished: bool, opened: OpenSessionResult | None = None) -> DecodeChunk:
    """One token of a stretch: its server time since `start` (perf_counter), queue included."""
    step_ms = (time.perf_counter() - start) * 1000.0
    return DecodeChunk([result.next_token], result.new_base_position, result.metrics.forward_ms, step_ms, finished, opened)
