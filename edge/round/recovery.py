"""The verifier session of one generation: opened on the committed prefix (the drafter
prefills the same tokens meanwhile), its Verify calls, closing it. Every call of a generation,
reopens included, carries one routing key, so a proxy or the client's rendezvous hashing keeps
them on the replica that holds the session's KV. When a call or the session is lost, the round
loop (edge/round/session.py) reopens one on its committed prefix, waiting between tries as
Reconnecting says, for the reconnect window."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from edge.drafting.drafter import DraftSource
from edge.transport.client import VerifierClient
from edge.transport.replicas import new_session_key
from shared.errors import CloudUnavailable, SessionNotFound
from shared.protocol import (
    DecodeChunk,
    DecodeRequest,
    OpenSessionRequest,
    OpenSessionResult,
    SessionConfig,
    VerifyRequest,
    VerifyResult,
    WireBytes,
)


class VerifierSession:
    def __init__(self, client: VerifierClient, drafter: DraftSource) -> None:
        self.client, self.drafter = client, drafter
        self.session: OpenSessionResult | None = None  # the last one opened
        self.live = False  # the last one opened is still usable (not lost)
        self.key = new_session_key()

    def current(self) -> OpenSessionResult:
        assert self.session is not None, "open() opens the session first"
        return self.session

    def max_draft_tokens(self) -> int | None:
        """The open session's limit on a block; None before one was opened."""
        return self.session.max_draft_tokens if self.session is not None else None

    async def open(self, committed: list[int], config: SessionConfig) -> OpenSessionResult:
        """Open a session on the committed prefix; the drafter prefills it meanwhile."""
        opening = asyncio.ensure_future(self.client.open_session(OpenSessionRequest(committed, config), self.key))
        self.drafter.sync(committed)
        await asyncio.to_thread(self.drafter.prefill)
        return self.adopt(await opening)

    def adopt(self, opened: OpenSessionResult) -> OpenSessionResult:
        """The session a call opened (OpenSession, or a Decode stretch that opened it)."""
        self.session, self.live = opened, True
        return opened

    def lose(self) -> None:
        """The session is gone or out of step: the next call opens a new one."""
        self.live = False

    def decode(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        return self.client.decode(req, session_key=self.key)

    async def verify(self, req: VerifyRequest) -> VerifyResult:
        return await self.client.verify(req, session_key=self.key)

    async def close(self) -> WireBytes:
        """Close the session; the bytes of the call (none when no session was opened)."""
        if self.session is None:
            return WireBytes()
        try:
            return (await self.client.close_session(self.session.session_id, self.key)).wire
        except (CloudUnavailable, SessionNotFound) as err:
            return err.wire  # the verifier drops idle sessions itself
