"""The edge's speculative round loop: SpeculativeRun.

One round: draft a block, send it with one Verify, commit the accepted prefix plus the
recovered/bonus token. Around that core:
- gating ends a block at a hard token (lossless) or, with local_commit, commits an easy
  block without the cloud (lossy, counted, sent later as catch-up);
- a Verify slower than the soft deadline makes the first pending draft token *provisional*
  (shown, not final; retracted if the cloud rejects it), or final-but-unverified with
  accept-unverified; strict mode only waits;
- a lost call or session (deadline, restart, eviction, position drift) reopens a session
  with the committed prefix, so nothing final is lost or duplicated; the edge keeps trying
  (jittered, capped exponential waits) for the reconnect window, the first OpenSession of a
  generation and the cloud_only Generate stream included, and meanwhile shows the pending
  block provisionally (provisional mode);
- a full verifier (RESOURCE_EXHAUSTED) is retried by the client after its hint; meanwhile the
  soft deadline applies as above, and once the resends run out accept-unverified goes on
  locally while the other modes stop with the error.
Drafting runs in a worker thread and the Verify call as a task, so drafting ahead while it
is in flight (overlap) fits in.
"""

from __future__ import annotations

import asyncio
import time

from edge.client import VerifierClient
from edge.drafter import Draft, DraftSource, StopRule
from edge.gating import TokenSignals
from edge.generation import (
    RECOVERABLE,
    GenerationConfig,
    GenerationResult,
    Observer,
    Output,
    Reconnecting,
    RoundRecord,
    ms_since,
    reopened_config,
)
from edge.kpolicy import KPolicy, RoundObservation
from edge.replicas import new_session_key
from shared.errors import CapacityExceeded, CloudUnavailable, SessionNotFound, SpecDecError
from shared.protocol import AcceptMode, OpenSessionRequest, OpenSessionResult, VerifyRequest, VerifyResult

SCALAR_MODES = (AcceptMode.SCALAR, AcceptMode.SHORTCUT)


class SpeculativeRun:
    """State of one speculative generation; see the module docstring for the rules."""

    def __init__(
        self,
        prompt: list[int],
        drafter: DraftSource,
        client: VerifierClient,
        k_policy: KPolicy,
        cfg: GenerationConfig,
        observer: Observer | None,
    ) -> None:
        self.drafter, self.client, self.k_policy, self.cfg = drafter, client, k_policy, cfg
        self.result = GenerationResult()
        self.out = Output(cfg, self.result, observer)
        self.committed = list(prompt)  # final: prompt + generated
        self.catchup: list[int] = []  # final, not yet sent to the cloud
        self.pending = Draft()  # drafted, not final; its first `provisional` tokens are shown
        self.provisional = 0
        self.ahead = Draft()  # overlap: drafted after the in-flight block, assuming it all passes
        self.carry: Draft | None = None  # ahead tokens still valid after the reply: the next block
        self.session: OpenSessionResult | None = None
        # One routing key for every call of this generation, reopens included: a proxy or the
        # client's rendezvous hashing keeps them on the replica that holds the session's KV.
        self.session_key = new_session_key()

    # ---- sessions -----------------------------------------------------------------------

    async def _open(self) -> None:
        """Open a session on the committed prefix; the drafter prefills it meanwhile."""
        config = reopened_config(self.cfg.session, self.result.reopens)
        request = OpenSessionRequest(self.committed, config)
        opening = asyncio.ensure_future(self.client.open_session(request, self.session_key))
        self.drafter.sync(self.committed)
        await asyncio.to_thread(self.drafter.prefill)
        self.session = await opening
        self.catchup = []
        self.result.target_forward_passes += 1 if len(self.committed) > 1 else 0

    async def _connect(self, lost: SpecDecError | None) -> None:
        """Open a session on the committed prefix, at once for the first one (`lost` None) or
        after a wait once `lost` ended the last; recoverable failures are retried within the
        reconnect window, showing the pending block meanwhile."""
        outage = Reconnecting(self.cfg.timeouts)
        err = lost
        while True:
            if err is not None:
                self._show_while_away()
                await outage.wait(err)
                if lost is not None:  # a first open retried is not a reopen: it keeps its seed
                    self.result.reopens += 1
            try:
                await self._open()
                return
            except RECOVERABLE as failed:
                err = failed

    def _show_while_away(self) -> None:
        """Provisional mode: while the verifier is away, top the pending block up to one block
        and show it provisionally; verified (or retracted) once a session is back. Strict mode
        only waits; accept-unverified makes nothing final without a reply here either."""
        if self.cfg.timeouts.mode != "provisional":
            return
        room = min(self.k_policy.next_k(), self.out.remaining() - 1)
        if self.session is not None:
            room = min(room, self.session.max_draft_tokens)
        if len(self.pending) < room:
            self.drafter.sync(self.committed + self.pending.token_ids)
            self.pending.extend(self.drafter.propose(room - len(self.pending), self._stop_rule()))
        while self.provisional < len(self.pending):  # one token at a time, as the observer expects
            self.provisional += 1
            self.result.provisional_tokens += 1
            self.out.show_provisional(self.pending.token_ids[: self.provisional])

    async def _close(self) -> None:
        if self.session is not None:
            try:
                await self.client.close_session(self.session.session_id, self.session_key)
            except (CloudUnavailable, SessionNotFound):
                pass  # the verifier drops idle sessions itself

    # ---- one round ----------------------------------------------------------------------

    async def run(self) -> GenerationResult:
        up0, down0 = self.client.stats.bytes_up, self.client.stats.bytes_down
        await self._connect(None)
        try:
            while not self.out.done():
                await self._round()
        finally:
            await self._close()
        return self.out.finish(self.client, up0, down0)

    def _stop_rule(self) -> StopRule | None:
        rules = [
            r for r in (self.cfg.gating.thresholds.is_hard if self.cfg.gating else None, self.cfg.stop_rule) if r is not None
        ]
        if not rules:
            return None
        return lambda s: any(rule(s) for rule in rules)

    def _draft(self) -> float:
        """Top the pending block up to k tokens; returns the drafting time in ms."""
        if self.carry is not None:  # drafted ahead during the last round and still valid
            self.pending, self.carry = self.carry, None
        else:
            self.pending = self.pending.head(self.provisional)
        assert self.session is not None
        if self.provisional > self.session.max_draft_tokens:  # shown while away, before this session's limit was known
            self.result.retracted_tokens += self.provisional - self.session.max_draft_tokens
            self.provisional = self.session.max_draft_tokens
            self.pending = self.pending.head(self.provisional)
        room = min(self.k_policy.next_k(), self.out.remaining() - 1, self.session.max_draft_tokens)
        if len(self.pending) > max(room, self.provisional):
            self.pending = self.pending.head(max(room, self.provisional))
        want = max(room - len(self.pending), 0)
        start = time.perf_counter()
        if want:
            self.drafter.sync(self.committed + self.pending.token_ids)
            block = self.drafter.propose(want, self._stop_rule())
            self.result.mc_dropout_ms += block.mc_ms
            self.pending.extend(block)
        return ms_since(start)

    def _hard_mask(self) -> tuple[list[bool], bool]:
        """Per pending token: hard by signals or by a rule; and whether any rule hit. A rule hit
        ends the block right after that token (verify now)."""
        gating = self.cfg.gating
        if gating is None or not self.pending.signals:
            return [], False
        mask = [gating.thresholds.is_hard(s) for s in self.pending.signals]
        if gating.rules is None or gating.token_text is None:
            return mask, False
        text = gating.token_text
        previous = "".join(text(t) for t in self.committed[-8:])
        for i, token in enumerate(self.pending.token_ids):
            piece = text(token)
            if gating.rules.rule_hit(token, piece, previous):
                mask[i] = True
                if i >= self.provisional:
                    self.pending = self.pending.head(i + 1)
                    return mask[: i + 1], True
            previous += piece
        return mask, False

    async def _round(self) -> None:
        # In a worker thread: the event loop stays free (other generations, the HTTP server,
        # gRPC keepalives) while the draft model runs.
        draft_ms = await asyncio.to_thread(self._draft)
        mask, rule_hit = self._hard_mask()
        hard_ratio = sum(mask) / len(mask) if mask else 0.0
        if self._commit_locally(hard_ratio, rule_hit, draft_ms):
            return
        assert self.session is not None
        base = len(self.committed) - len(self.catchup)
        # Only the scalar modes need q(y) on the wire; greedy and point drafts are points and
        # sparse drafts carry their whole support. Leaving it out keeps the uplink small.
        probs = self.pending.probs if self.cfg.session.accept_mode in SCALAR_MODES else []
        req = VerifyRequest(
            self.session.session_id,
            base,
            self.pending.token_ids,
            probs,
            committed_tokens=self.catchup,
            hard_mask=mask,
            sparse_draft=self.pending.sparse,
            want_top_k=self.drafter.filler_top_k,
        )
        up0, down0 = self.client.stats.bytes_up, self.client.stats.bytes_down
        start = time.perf_counter()
        reply = await self._verify(req)
        if reply is None:
            return
        self._apply(
            req,
            reply,
            draft_ms,
            ms_since(start),
            hard_ratio,
            self.client.stats.bytes_up - up0,
            self.client.stats.bytes_down - down0,
        )

    def _commit_locally(self, hard_ratio: float, rule_hit: bool, draft_ms: float) -> bool:
        """LOSSY (--local-commit): an easy block is final without the cloud."""
        gating = self.cfg.gating
        block = self.pending.tail(self.provisional)
        if gating is None or not gating.local_commit or self.provisional or not block.token_ids:
            return False
        if rule_hit or hard_ratio > gating.thresholds.hard_ratio:
            return False
        tokens = block.token_ids
        self.committed += tokens
        self.catchup += tokens
        self.pending = Draft()
        self.result.local_tokens += len(tokens)
        record = RoundRecord(
            round=self.result.rounds,
            k=len(tokens),
            draft_tokens=tokens,
            accepted_len=len(tokens),
            next_token=tokens[-1],
            bonus=False,
            la_over_k=1.0,
            alpha_mean=0.0,
            a_cum=self.result.accepted_tokens,
            edge_time_ms=draft_ms,
            cloud_verify_ms=0.0,
            rtt_ms=0.0,
            bytes_up=0,
            bytes_down=0,
            hard_ratio=hard_ratio,
            escalated=False,
            catchup=0,
            provisional=0,
            retracted=0,
            local=True,
        )
        self.result.round_log.append(record)
        self.out.commit(tokens, record)
        return True

    async def _verify(self, req: VerifyRequest) -> VerifyResult | None:
        """The Verify call with the soft deadline; None when the round was lost (and the
        session recovered, or the block given up in accept-unverified mode). With overlap the
        wait is spent drafting the next block."""
        call = asyncio.ensure_future(self.client.verify(req, session_key=self.session_key))
        loop = asyncio.get_running_loop()
        policy = self.cfg.timeouts
        soft = None if policy.mode == "strict" else policy.soft_deadline_s
        deadline = None if soft is None else loop.time() + soft
        self.ahead = Draft()
        while not call.done():
            if self._can_draft_ahead():
                await self._draft_ahead_one()
            else:
                await asyncio.wait({call}, timeout=None if deadline is None else max(deadline - loop.time(), 0))
            if call.done() or deadline is None or loop.time() < deadline:
                continue
            if policy.mode == "accept-unverified" and self.pending.token_ids:
                call.cancel()
                self.ahead = Draft()
                self._accept_unverified()
                return None
            if self.provisional < len(self.pending):
                self.provisional += 1
                self.result.provisional_tokens += 1
                self.out.show_provisional(self.pending.token_ids[: self.provisional])
            # Nothing left to show: wait for the reply or the call's own deadline.
            deadline = loop.time() + soft if soft and self.provisional < len(self.pending) else None
        try:
            return call.result()
        except RECOVERABLE as err:
            self.ahead = Draft()
            await self._connect(err)
            return None
        except CapacityExceeded:
            # Still full after the client's resends: accept-unverified falls back locally as on a
            # slow cloud (the block goes out again as catch-up); the other modes never make
            # unverified text final, so they give up with the verifier's answer.
            if policy.mode != "accept-unverified":
                raise
            self.ahead = Draft()
            if not self.pending.token_ids:  # a round of k = 0 (the last token): draft it here
                self.drafter.sync(self.committed)
                self.pending = self.drafter.propose(1)
            self._accept_unverified()
            return None

    def _can_draft_ahead(self) -> bool:
        # The first ahead token stands for the bonus; k more make a whole next block.
        if not self.cfg.overlap or len(self.ahead) >= self.k_policy.next_k() + 1:
            return False
        tail = (self.pending.token_ids + self.ahead.token_ids)[-1:]
        if tail and tail[0] in self.cfg.stop_token_ids:
            return False
        # The block, its bonus and the ahead tokens must fit in what is left to generate.
        return len(self.pending) + 1 + len(self.ahead) < self.out.remaining()

    async def _draft_ahead_one(self) -> None:
        """One more token after the in-flight block (in a thread: the reply can land meanwhile).
        Its first token guesses the bonus; it is kept only if the whole block passes and the
        bonus matches."""
        start = time.perf_counter()

        def step() -> Draft:
            self.drafter.sync(self.committed + self.pending.token_ids + self.ahead.token_ids)
            return self.drafter.propose(1)

        self.ahead.extend(await asyncio.to_thread(step))
        self.result.overlap_draft_ms += ms_since(start)

    def _accept_unverified(self) -> None:
        """Accept-unverified (lossy): the first pending token becomes final, counted as unverified,
        and reaches the cloud as catch-up."""
        token = self.pending.token_ids[0]
        self.committed.append(token)
        self.catchup.append(token)
        self.pending = self.pending.tail(1)
        self.result.unverified_tokens += 1
        self.out.commit([token], None)

    def _apply(
        self,
        req: VerifyRequest,
        reply: VerifyResult,
        draft_ms: float,
        rtt_ms: float,
        hard_ratio: float,
        bytes_up: int,
        bytes_down: int,
    ) -> None:
        drafts = req.draft_tokens
        m = reply.accepted_len
        shown = self.provisional  # tokens on screen, unverified, when the reply came
        retracted = max(shown - m, 0)
        if reply.target_top_k:
            recent = self.committed[-64:]  # n-gram contexts are short; no need to copy it all
            contexts = [recent + drafts[:i] for i in range(len(reply.target_top_k))]
            self.drafter.learn(contexts, reply.target_top_k)
        new = [*drafts[:m], reply.next_token]
        self.committed += new
        self.catchup = []
        signals: list[TokenSignals] = self.pending.signals
        sources = self.pending.sources
        self.pending, self.provisional = Draft(), 0
        ahead_drafted, ahead_used = self._keep_ahead(reply)
        for i, source in enumerate(sources):
            self.result.drafted_by[source] = self.result.drafted_by.get(source, 0) + 1
            if i < m:
                self.result.accepted_by[source] = self.result.accepted_by.get(source, 0) + 1
        result = self.result
        result.rounds += 1
        result.target_forward_passes += 1
        result.draft_tokens += len(drafts)
        result.accepted_tokens += m
        result.retracted_tokens += retracted
        result.hard_tokens += sum(req.hard_mask)
        result.verify_bytes_up += bytes_up
        result.verify_bytes_down += bytes_down
        self.k_policy.observe(
            RoundObservation(
                len(drafts),
                m,
                reply.metrics.alpha_mean,
                draft_ms,
                rtt_ms,
                reply.metrics.verify_ms,
                sum(s.entropy_bits for s in signals) / len(signals) if signals else 0.0,
            )
        )
        record = RoundRecord(
            round=result.rounds - 1,
            k=len(drafts),
            draft_tokens=drafts,
            accepted_len=m,
            next_token=reply.next_token,
            bonus=reply.bonus,
            la_over_k=m / len(drafts) if drafts else 0.0,
            alpha_mean=reply.metrics.alpha_mean,
            a_cum=result.accepted_tokens,
            edge_time_ms=draft_ms,
            cloud_verify_ms=reply.metrics.verify_ms,
            rtt_ms=rtt_ms,
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            hard_ratio=hard_ratio,
            escalated=True,
            catchup=len(req.committed_tokens),
            provisional=shown,
            retracted=retracted,
            sources=sources,
            ahead_drafted=ahead_drafted,
            ahead_used=ahead_used,
        )
        result.round_log.append(record)
        self.out.commit(new, record)

    def _keep_ahead(self, reply: VerifyResult) -> tuple[int, int]:
        """Keep the tokens drafted ahead when the block passed whole and the bonus is the
        token the drafter guessed; they become the next block. Returns (drafted, kept)."""
        ahead, self.ahead = self.ahead, Draft()
        kept = 0
        if ahead.token_ids and reply.bonus and ahead.token_ids[0] == reply.next_token:
            self.carry = ahead.tail(1)
            kept = len(self.carry)
        self.result.ahead_drafted += len(ahead)
        self.result.ahead_used += kept
        return len(ahead), kept
