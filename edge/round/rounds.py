"""The edge's speculative round loop: SpeculativeRun.

One round: draft a block, send it with one Verify, commit the accepted prefix plus the
recovered/bonus token. Around that core, each in its own module:
- edge/round/round_tokens.py: the committed, catch-up and pending tokens, and drafting a block
  (gating ends a block at a hard token);
- edge/round/provisional.py: a Verify slower than the soft deadline makes the next pending token
  provisional (shown, not final; retracted if the cloud rejects it);
- edge/round/recovery.py: a lost call or session reopens a session on the committed prefix within
  the reconnect window, showing the pending block meanwhile (provisional mode);
- edge/round/overlap.py: drafting the next block while the Verify is in flight;
- edge/experimental/local_commit.py: the lossy commits without the cloud (--local-commit, and
  accept-unverified once the soft deadline passes or a full verifier's resends run out;
  the other modes stop with the error);
- edge/round/accounting.py: the round records and the totals.
Drafting runs in a worker thread and the Verify call as a task, so the event loop stays free
(other generations, the HTTP server, gRPC keepalives) while the draft model runs.
"""

from __future__ import annotations

import asyncio

from edge.drafting.drafter import DraftSource
from edge.drafting.kpolicy import KPolicy
from edge.experimental.local_commit import LocalCommit
from edge.round.accounting import RoundAccounting
from edge.round.generation import RECOVERABLE, GenerationConfig, GenerationResult, Observer, Output
from edge.round.overlap import DraftAhead
from edge.round.provisional import Provisional, SoftDeadline
from edge.round.recovery import SessionKeeper
from edge.round.round_tokens import BlockDrafter, RoundTokens
from edge.transport.client import VerifierClient
from shared.errors import CapacityExceeded
from shared.protocol import VerifyRequest, VerifyResult


class SpeculativeRun:
    """One speculative generation; see the module docstring for the rules."""

    def __init__(
        self,
        prompt: list[int],
        drafter: DraftSource,
        client: VerifierClient,
        k_policy: KPolicy,
        cfg: GenerationConfig,
        observer: Observer | None,
    ) -> None:
        self.drafter, self.cfg = drafter, cfg
        self.result = result = GenerationResult()
        self.out = out = Output(cfg, result, observer)
        self.tokens = tokens = RoundTokens(list(prompt))
        self.blocks = BlockDrafter(drafter, k_policy, cfg, tokens, out)
        self.shown = Provisional(cfg.timeouts, tokens, self.blocks, result, out)
        self.sessions = SessionKeeper(client, drafter, cfg, tokens, result, away=self.shown)
        self.overlap = DraftAhead(cfg.overlap, drafter, k_policy, cfg.stop_token_ids, result)
        self.accounting = RoundAccounting(result, k_policy)
        self.local = LocalCommit(cfg.gating, tokens, self.accounting, result, out)

    async def run(self) -> GenerationResult:
        await self.sessions.connect(None)
        try:
            while not self.out.done():
                await self._round()
        finally:
            await self.sessions.close()
        return self.out.finish()

    def _draft(self) -> float:
        """Top the pending block up to k tokens (in a worker thread); the drafting time in ms."""
        limit = self.sessions.current().max_draft_tokens
        self.blocks.restart(self.overlap.take_carry())
        self.shown.fit(limit)
        return self.blocks.fill(limit, self.result)

    async def _round(self) -> None:
        draft_ms = await asyncio.to_thread(self._draft)
        mask, rule_hit = self.blocks.hard_mask()
        hard_ratio = sum(mask) / len(mask) if mask else 0.0
        if self.local.easy_block(hard_ratio, rule_hit, draft_ms):
            return
        tokens = self.tokens
        # q(y) goes on the wire only where the verifier reads it: a smaller uplink.
        probs = tokens.pending.probs if self.cfg.session.accept_mode.reads_draft_probs else []
        req = VerifyRequest(
            self.sessions.current().session_id,
            len(tokens.committed) - len(tokens.catchup),
            tokens.pending.token_ids,
            probs,
            committed_tokens=tokens.catchup,
            hard_mask=mask,
            sparse_draft=tokens.pending.sparse,
            want_top_k=self.drafter.filler_top_k,
        )
        self.accounting.sending()
        reply = await self._verify(req)
        if reply is not None:
            self._apply(req, reply, draft_ms, hard_ratio)

    async def _verify(self, req: VerifyRequest) -> VerifyResult | None:
        """The Verify call with the soft deadline; None when the round was lost (and the
        session recovered, or the block given up in accept-unverified mode). With overlap the
        wait is spent drafting the next block."""
        call = asyncio.ensure_future(self.sessions.verify(req))
        deadline = SoftDeadline(self.cfg.timeouts)
        self.overlap.drop()
        while not call.done():
            if self.overlap.can_draft(self.tokens, self.out.remaining()):
                await self.overlap.draft_one(self.tokens)
            else:
                await asyncio.wait({call}, timeout=deadline.left_s())
            if call.done() or not deadline.passed():
                continue
            if self.cfg.timeouts.mode == "accept-unverified" and self.tokens.pending.token_ids:
                call.cancel()
                self.overlap.drop()
                self.local.unverified_one()
                return None
            self.shown.show_one()
            deadline.rearm(self.shown.more_to_show())
        return await self._reply(call)

    async def _reply(self, call: asyncio.Future[VerifyResult]) -> VerifyResult | None:
        """The finished call's reply, or None once its failure was dealt with."""
        try:
            return call.result()
        except RECOVERABLE as err:
            self.overlap.drop()
            await self.sessions.connect(err)
            return None
        except CapacityExceeded:
            # Still full after the client's resends: accept-unverified falls back locally as on a
            # slow cloud (the block goes out again as catch-up); the other modes never make
            # unverified text final, so they give up with the verifier's answer.
            if self.cfg.timeouts.mode != "accept-unverified":
                raise
            self.overlap.drop()
            if not self.tokens.pending.token_ids:  # a round of k = 0 (the last token): draft it here
                self.drafter.sync(self.tokens.committed)
                self.tokens.pending = self.drafter.propose(1)
            self.local.unverified_one()
            return None

    def _apply(self, req: VerifyRequest, reply: VerifyResult, draft_ms: float, hard_ratio: float) -> None:
        """Commit the cloud's verdict: the accepted prefix and the recovered or bonus token."""
        drafts, accepted = req.draft_tokens, reply.accepted_len
        if reply.target_top_k:
            recent = self.tokens.committed[-64:]  # n-gram contexts are short; no need to copy it all
            self.drafter.learn([recent + drafts[:i] for i in range(len(reply.target_top_k))], reply.target_top_k)
        block, shown = self.tokens.pending, self.tokens.provisional  # shown: on screen, unverified, when the reply came
        new = [*drafts[:accepted], reply.next_token]
        self.tokens.commit_verified(new)
        ahead = self.overlap.keep(reply)
        record = self.accounting.verified(req, reply, block, shown=shown, draft_ms=draft_ms, hard_ratio=hard_ratio, ahead=ahead)
        self.out.commit(new, record)
