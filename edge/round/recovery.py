"""The verifier session of one generation, and getting it back. A lost call or session
(deadline, restart, eviction, position drift) reopens a session on the committed prefix, so
nothing final is lost or duplicated; the edge keeps trying (jittered, capped exponential
waits) for the reconnect window, the first OpenSession of a generation included. Every call of
the generation goes through SessionKeeper, which counts its bytes into the result."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from edge.drafting.drafter import DraftSource
from edge.round.generation import RECOVERABLE, GenerationConfig, GenerationResult, Reconnecting, reopened_config
from edge.round.round_tokens import RoundTokens
from edge.transport.client import VerifierClient
from edge.transport.replicas import new_session_key
from shared.errors import CloudUnavailable, SessionNotFound, SpecDecError
from shared.protocol import CloseSessionResult, OpenSessionRequest, OpenSessionResult, VerifyRequest, VerifyResult

Reply = TypeVar("Reply", OpenSessionResult, VerifyResult, CloseSessionResult)


class AwayDisplay(Protocol):
    """What is shown while the verifier is away (edge/round/provisional.py)."""

    def while_away(self, session: OpenSessionResult | None) -> None: ...


class SessionKeeper:
    def __init__(
        self,
        client: VerifierClient,
        drafter: DraftSource,
        cfg: GenerationConfig,
        tokens: RoundTokens,
        result: GenerationResult,
        away: AwayDisplay,
    ) -> None:
        self.client, self.drafter, self.cfg, self.tokens, self.result, self.away = client, drafter, cfg, tokens, result, away
        self.session: OpenSessionResult | None = None
        # One routing key for every call of this generation, reopens included: a proxy or the
        # client's rendezvous hashing keeps them on the replica that holds the session's KV.
        self.session_key = new_session_key()

    def current(self) -> OpenSessionResult:
        assert self.session is not None, "connect() opens the session first"
        return self.session

    async def _open(self) -> None:
        """Open a session on the committed prefix; the drafter prefills it meanwhile."""
        committed = self.tokens.committed
        request = OpenSessionRequest(committed, reopened_config(self.cfg.session, self.result.reopens))
        opening = asyncio.ensure_future(self.client.open_session(request, self.session_key))
        self.drafter.sync(committed)
        await asyncio.to_thread(self.drafter.prefill)
        self.session = await self._counted(opening)
        self.tokens.catchup = []
        self.result.target_forward_passes += 1 if len(committed) > 1 else 0

    async def connect(self, lost: SpecDecError | None) -> None:
        """Open a session on the committed prefix, at once for the first one (`lost` None) or
        after a wait once `lost` ended the last; recoverable failures are retried within the
        reconnect window, showing the pending block meanwhile."""
        outage = Reconnecting(self.cfg.timeouts)
        err = lost
        while True:
            if err is not None:
                self.away.while_away(self.session)
                await outage.wait(err)
                if lost is not None:  # a first open retried is not a reopen: it keeps its seed
                    self.result.reopens += 1
            try:
                await self._open()
                return
            except RECOVERABLE as failed:
                err = failed

    async def verify(self, req: VerifyRequest) -> VerifyResult:
        return await self._counted(self.client.verify(req, session_key=self.session_key))

    async def close(self) -> None:
        if self.session is not None:
            try:
                await self._counted(self.client.close_session(self.session.session_id, self.session_key))
            except (CloudUnavailable, SessionNotFound):
                pass  # the verifier drops idle sessions itself

    async def _counted(self, call: Awaitable[Reply]) -> Reply:
        """The call's reply, its bytes counted into the result (a failed call's too)."""
        try:
            reply = await call
        except SpecDecError as err:
            self.result.count_wire(err.wire)
            raise
        self.result.count_wire(reply.wire)
        return reply
