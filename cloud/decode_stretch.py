"""The target's own decoding on a session (the Decode call): a stretch of tokens, each one a
Verify round with no draft tokens, so decoding and speculative rounds advance one session
with one KV and one generator. Each token is one step for the batcher, batched with other
sessions' rounds and other streams' tokens. Opening a session (its prefill) is one step too,
shared by OpenSession and a Decode call that opens its session."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from cloud.batcher import ForwardBatcher
from cloud.verifier import Verifier
from shared.protocol import DecodeChunk, DecodeRequest, OpenSessionRequest, OpenSessionResult, VerifyRequest, VerifyResult


@dataclass(frozen=True)
class SessionCalls:
    """One call's view of the verifier: its model, its batcher, the API key it runs for and its
    deadline (a time.perf_counter() time, None: no deadline)."""

    verifier: Verifier
    batcher: ForwardBatcher
    key: str
    deadline: float | None

    async def open(self, req: OpenSessionRequest) -> OpenSessionResult:
        """A new session: its prefill is one more step for the batcher (rounds of open sessions
        share its forward passes), held from eviction by its id while its chunks run."""
        verifier = self.verifier
        session_id = verifier.sessions.new_id()
        with verifier.sessions.holding(session_id):
            return await self.batcher.submit(
                session_id,
                len(req.prompt_tokens),
                partial(verifier.begin_open, req, session_id, self.key),
                self.deadline,
                admitting=True,
                key=self.key,
            )

    async def verify(self, req: VerifyRequest) -> VerifyResult:
        """One round (the caller holds its session from eviction)."""
        tokens = len(req.committed_tokens) + len(req.draft_tokens) + 1
        begin = partial(self.verifier.begin_verify, req, self.key)
        return await self.batcher.submit(req.session_id, tokens, begin, self.deadline, key=self.key)

    async def decode(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        """A Decode stretch: its session opened first when asked, then up to `max_tokens`
        tokens, one chunk each (the first carries the opened session). A session the call
        opened goes again if the call fails before its first chunk, as its id never reached
        the client."""
        self.verifier.checks.decode(req)
        if req.open is None:
            async for chunk in self._stretch(req, req.session_id, req.base_position, None):
                yield chunk
            return
        opened = await self.open(req.open)
        stretch = self._stretch(req, opened.session_id, opened.position, opened)
        try:
            first = await anext(stretch)
        except BaseException:
            self.batcher.worker.submit(partial(self.verifier.sessions.discard, opened.session_id))
            raise
        yield first
        async for chunk in stretch:
            yield chunk

    async def _stretch(
        self, req: DecodeRequest, session_id: str, position: int, opened: OpenSessionResult | None
    ) -> AsyncIterator[DecodeChunk]:
        catchup, stops = req.committed_tokens, set(req.stop_token_ids)
        with self.verifier.sessions.holding(session_id):  # no eviction between its tokens
            for produced in range(1, req.max_tokens + 1):
                start = time.perf_counter()
                result = await self.verify(VerifyRequest(session_id, position, [], committed_tokens=catchup))
                catchup, position = [], result.new_base_position
                finished = result.next_token in stops or produced == req.max_tokens
                step_ms = (time.perf_counter() - start) * 1000.0
                yield DecodeChunk([result.next_token], position, result.metrics.forward_ms, step_ms, finished, opened)
                opened = None
                if finished:
                    return
