"""One speculative generation on the edge: SpeculativeRun, the one owner of its tokens
(RoundTokens), its counters (GenerationResult) and its round records.

A round: draft a block (`_draft`), send it with one Verify (`_verify`), commit the cloud's
verdict (`_apply`): the accepted prefix plus the recovered/bonus token. Then one RoundFeedback
goes to each part that adapts, through the same `update` call: the drafter, the k policy and
overlap. The parts around the core return decisions and values; only this module changes the
tokens and the counters:
- edge/round/blocks.py: how many tokens a block holds (edge/drafting/kpolicy.py), where drafting
  stops early and which tokens are hard (gating, edge/drafting/gating.py);
- edge/round/provisional.py: when a Verify slower than the soft deadline shows the next pending
  token (provisional: shown, not final; retracted if the cloud rejects it);
- edge/round/overlap.py: drafting the next block while the Verify is in flight;
- edge/round/recovery.py: the verifier session; a lost call or session is reopened here on the
  committed prefix within the reconnect window (generation.Reconnecting), showing the pending
  block meanwhile in provisional mode;
- edge/experimental/: the lossy commits without the cloud (--local-commit; --accept-unverified
  once the soft deadline passes or a full verifier's resends run out; the other modes stop
  with the error), consulted only when their flags are on.
Drafting runs in a worker thread and the Verify call as a task, so the event loop stays free
(other generations, the HTTP server, gRPC keepalives) while the draft model runs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field, replace

from edge.drafting.drafter import Draft, DraftSource
from edge.drafting.feedback import Learner, RoundFeedback
from edge.drafting.kpolicy import KPolicy
from edge.experimental.accept_unverified import AcceptUnverified
from edge.experimental.local_commit import LocalCommit, local_record
from edge.round.blocks import BlockDrafting
from edge.round.generation import (
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
from edge.round.mode_switch import CLOUD_ONLY, ModeSwitch
from edge.round.overlap import DraftAhead
from edge.round.provisional import SoftDeadline, shows_while_away
from edge.round.recovery import VerifierSession
from edge.round.warmup import DrafterWarmup
from edge.transport.client import VerifierClient
from shared.errors import CapacityExceeded, SpecDecError
from shared.protocol import DecodeRequest, OpenSessionRequest, VerifyRequest, VerifyResult, WireBytes

NGRAM_CONTEXT = 64  # committed tokens the feedback carries: n-gram contexts are short


@dataclass
class RoundTokens:
    committed: list[int]  # final: prompt + generated
    catchup: list[int] = field(default_factory=list)  # final, not yet sent to the cloud
    pending: Draft = field(default_factory=Draft)  # drafted, not final
    provisional: int = 0  # the first pending tokens, shown before the cloud's verdict

    def commit_unsent(self, tokens: list[int], rest: Draft) -> None:
        """Final without the cloud (lossy modes): the cloud gets them as catch-up; `rest` stays pending."""
        self.committed += tokens
        self.catchup += tokens
        self.pending = rest

    def commit_verified(self, tokens: list[int]) -> None:
        """The cloud's verdict on a round: final, and the pending block is spent."""
        self.committed += tokens
        self.catchup = []
        self.pending, self.provisional = Draft(), 0


@dataclass(frozen=True)
class SentBlock:
    """A block on its way to the cloud: the request, and what the round's record needs of it."""

    req: VerifyRequest
    draft: Draft  # the pending block as sent (sources, signals)
    draft_ms: float
    drafted: int  # tokens drafted in draft_ms (the block may start from tokens drafted earlier)
    hard_ratio: float
    sent_at: float  # perf_counter when the Verify call started


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
        self.drafter, self.client, self.k_policy, self.cfg = drafter, client, k_policy, cfg
        self.result = GenerationResult()
        self.out = Output(cfg, self.result, observer)
        self.tokens = RoundTokens(list(prompt))
        self.prompt_len = len(prompt)
        self.blocks = BlockDrafting(drafter, k_policy, cfg)
        self.session = VerifierSession(client, drafter)
        self.overlap = DraftAhead(cfg.overlap, drafter, k_policy, cfg.stop_token_ids)
        self.learners: tuple[Learner, ...] = (drafter, k_policy, self.overlap)
        self.local_commit = LocalCommit.when_on(cfg.gating)
        self.unverified = AcceptUnverified.when_on(cfg.timeouts)
        self.switch = ModeSwitch(cfg.mode_switch, cfg.mode_memory) if cfg.mode_switch is not None else None
        self.warmup = DrafterWarmup(drafter, beside=cfg.prefill_beside)
        self._outage: Reconnecting | None = None  # a lost Decode stretch's, until a chunk comes
        self._switch_reason = ""  # for the next record: why the mode changed before it

    async def run(self) -> GenerationResult:
        if self.switch is None:
            await self._connect(None)
        try:
            while not self.out.done():
                await (self._round() if self.switch is None else self._next_in_auto_mode(self.switch))
        finally:
            if self.switch is not None:
                self.switch.remember()
            await self.warmup.settle()
            self.result.count_wire(await self.session.close())
        return self.out.finish()

    async def _next_in_auto_mode(self, switch: ModeSwitch) -> None:
        """Auto mode: a Decode stretch or a speculative round, as the measured rates say."""
        generated = len(self.result.token_ids)
        if switch.mode == CLOUD_ONLY and generated and not switch.holding:
            await self.warmup.catch_up(self.tokens.committed)  # prefilling between stretches: now
        plan = switch.plan(self.warmup.ready(), generated)
        if plan.reason:
            self.result.mode_switches.append(asdict(switch.switches[-1]))
            self._switch_reason = plan.reason
        if plan.mode == CLOUD_ONLY:
            await self._stretch(min(plan.tokens, self.out.remaining()), switch)
            return
        await self.warmup.settle()
        start = time.perf_counter()
        if not self.session.live:  # lost during a stretch: reopened here, as a round needs it
            await self._connect(None)
        await self._round()
        switch.round_done(len(self.result.token_ids) - generated, time.perf_counter() - start)

    # ---- the verifier session -----------------------------------------------------------

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
            committed = self.tokens.committed
            try:
                config = reopened_config(self.cfg.session, self.result.reopens, len(committed) - self.prompt_len)
                opened = await self.session.open(committed, config)
            except RECOVERABLE as failed:
                self.result.count_wire(failed.wire)
                err = failed
                continue
            self.result.count_wire(opened.wire)
            self.tokens.catchup = []
            self.result.target_forward_passes += 1 if len(committed) > 1 else 0
            return

    # ---- the target's own decoding (auto mode) ---------------------------------------

    async def _stretch(self, max_tokens: int, switch: ModeSwitch) -> None:
        """A Decode stretch: the target's own tokens on the session (opened by the call when
        there is none), final as they stream in; the drafter follows them in the background.
        A recoverable loss waits as a lost round does; the next stretch reopens."""
        self.overlap.drop()
        req, sent_at = self._decode_request(max_tokens), time.perf_counter()
        if not switch.holding:  # beside: the prompt's prefill starts with the verifier's
            self.warmup.follow(self.tokens.committed)
        decoded: list[int] = []
        gaps: list[float] = []
        traffic, server_ms, last, first_step_s = WireBytes(), 0.0, 0.0, 0.0
        try:
            async for chunk in self.session.decode(req):
                now = time.perf_counter()
                if decoded:  # a chunk of several tokens (the client read slower than they came): its gap shared
                    gaps += [(now - last) / max(len(chunk.tokens), 1)] * len(chunk.tokens)
                elif chunk.opened is None:  # an opening chunk's step is the prompt's prefill: no decoding rate
                    first_step_s = chunk.step_ms / 1000.0
                last, traffic, server_ms = now, traffic + chunk.wire, server_ms + chunk.step_ms
                switch.verifier_asks(chunk.prefer_speculation)
                self._outage = None
                if chunk.opened is not None:  # its prefill was a pass too, as OpenSession's is
                    self.session.adopt(chunk.opened)
                    self.result.target_forward_passes += 1 if req.open and len(req.open.prompt_tokens) > 1 else 0
                self._commit_decoded(chunk.tokens, decoded)
        except RECOVERABLE as err:
            self.result.count_wire(traffic + err.wire)
            await self._decode_lost(err, req)
            return
        finally:
            switch.stretch_done(first_step_s, gaps, tokens=len(decoded))
        self.result.count_wire(traffic)
        self._record_stretch(req, decoded, ms_since(sent_at), server_ms, traffic)

    def _decode_request(self, max_tokens: int) -> DecodeRequest:
        tokens, stops = self.tokens, sorted(self.cfg.stop_token_ids)
        if self.session.live:
            base = len(tokens.committed) - len(tokens.catchup)
            return DecodeRequest(self.session.current().session_id, base, max_tokens, stops, tokens.catchup)
        config = reopened_config(self.cfg.session, self.result.reopens, len(tokens.committed) - self.prompt_len)
        return DecodeRequest("", 0, max_tokens, stops, open=OpenSessionRequest(list(tokens.committed), config))

    def _commit_decoded(self, new: list[int], decoded: list[int]) -> None:
        """Tokens of a stretch are final on arrival: shown, and followed by the drafter."""
        self.tokens.commit_verified(new)
        decoded += new
        self.result.target_forward_passes += len(new)
        self.out.commit(new, None, CLOUD_ONLY)
        self.warmup.follow(self.tokens.committed)

    async def _decode_lost(self, err: SpecDecError, req: DecodeRequest) -> None:
        """The session is lost or out of step: wait as the reconnect window says; the next
        stretch opens a new one on the committed prefix (a reopen once one had opened)."""
        if self.session.live or (req.open is None and self.session.session is not None):
            self.result.reopens += 1
        self.session.lose()
        self._outage = self._outage or Reconnecting(self.cfg.timeouts)
        await self._outage.wait(err)

    def _record_stretch(
        self, req: DecodeRequest, decoded: list[int], rtt_ms: float, server_ms: float, traffic: WireBytes
    ) -> None:
        result = self.result
        result.stretches += 1
        record = RoundRecord(
            round=result.rounds + result.stretches - 1,
            k=0,
            draft_tokens=[],
            accepted_len=0,
            next_token=decoded[-1] if decoded else -1,
            bonus=False,
            la_over_k=0.0,
            alpha_mean=0.0,
            a_cum=result.accepted_tokens,
            edge_time_ms=0.0,
            cloud_verify_ms=server_ms,
            rtt_ms=rtt_ms,
            bytes_up=traffic.up,
            bytes_down=traffic.down,
            hard_ratio=0.0,
            escalated=True,
            catchup=len(req.committed_tokens),
            provisional=0,
            retracted=0,
            mode=CLOUD_ONLY,
            decoded=decoded,
            switch=self._take_switch_reason(),
        )
        result.round_log.append(record)

    def _take_switch_reason(self) -> str:
        reason, self._switch_reason = self._switch_reason, ""
        return reason

    # ---- drafting a block ---------------------------------------------------------------

    def _draft(self) -> tuple[float, int]:
        """Top the pending block up to k tokens (in a worker thread); the drafting time in ms and
        the tokens drafted in it. The block starts from the tokens drafted ahead during the last
        round and still valid, else from the tokens already shown."""
        tokens, limit = self.tokens, self.session.current().max_draft_tokens
        carry = self.overlap.take_carry()
        tokens.pending = carry if carry is not None else tokens.pending.head(tokens.provisional)
        self._fit_shown(limit)
        room = self.blocks.room(self.out.remaining(), limit)
        if len(tokens.pending) > max(room, tokens.provisional):
            tokens.pending = tokens.pending.head(max(room, tokens.provisional))
        start, drafted = time.perf_counter(), 0
        if room > len(tokens.pending):
            block = self._top_up(room)
            self.result.mc_dropout_ms += block.mc_ms
            drafted = len(block)
        return ms_since(start), drafted

    def _top_up(self, room: int) -> Draft:
        """Draft after the pending block until it holds `room` tokens; the new tokens."""
        tokens = self.tokens
        block = self.blocks.draft(tokens.committed + tokens.pending.token_ids, room - len(tokens.pending))
        tokens.pending.extend(block)
        return block

    def _fit_shown(self, max_draft_tokens: int) -> None:
        """Tokens shown while away, before this session's limit was known, past that limit
        are retracted."""
        tokens = self.tokens
        if tokens.provisional > max_draft_tokens:
            self.result.retracted_tokens += tokens.provisional - max_draft_tokens
            tokens.provisional = max_draft_tokens
            tokens.pending = tokens.pending.head(tokens.provisional)

    def _hard_mask(self) -> tuple[list[bool], bool]:
        """The pending block's hard mask, and whether a rule ended the block (verify now)."""
        tokens = self.tokens
        mask, end = self.blocks.hard_mask(tokens.pending, tokens.committed, tokens.provisional)
        if end is not None:
            tokens.pending = tokens.pending.head(end)
        return mask, end is not None

    # ---- showing pending tokens ---------------------------------------------------------

    def _more_to_show(self) -> bool:
        return self.tokens.provisional < len(self.tokens.pending)

    def _show_one(self) -> None:
        """One more pending token on screen, unverified (none left: nothing happens). One per
        call: the observer, and the edge's metrics, count one token per call."""
        tokens = self.tokens
        if self._more_to_show():
            tokens.provisional += 1
            self.result.provisional_tokens += 1
            self.out.show_provisional(tokens.pending.token_ids[: tokens.provisional])

    def _show_while_away(self) -> None:
        """Provisional mode: while the verifier is away, top the pending block up to one block
        and show it; verified (or retracted) once a session is back."""
        if not shows_while_away(self.cfg.timeouts):
            return
        room = self.blocks.room(self.out.remaining(), self.session.max_draft_tokens())
        if len(self.tokens.pending) < room:
            self._top_up(room)
        while self._more_to_show():
            self._show_one()

    # ---- one round ----------------------------------------------------------------------

    async def _round(self) -> None:
        draft_ms, drafted = await asyncio.to_thread(self._draft)
        mask, rule_hit = self._hard_mask()
        hard_ratio = sum(mask) / len(mask) if mask else 0.0
        if self.local_commit is not None and self._commit_locally(hard_ratio, rule_hit, draft_ms):
            return
        tokens = self.tokens
        # q(y) goes on the wire only where the verifier reads it: a smaller uplink.
        probs = tokens.pending.probs if self.cfg.session.accept_mode.reads_draft_probs else []
        req = VerifyRequest(
            self.session.current().session_id,
            len(tokens.committed) - len(tokens.catchup),
            tokens.pending.token_ids,
            probs,
            committed_tokens=tokens.catchup,
            hard_mask=mask,
            sparse_draft=tokens.pending.sparse,
            want_top_k=self.drafter.filler_top_k,
        )
        sent = SentBlock(req, tokens.pending, draft_ms, drafted, hard_ratio, time.perf_counter())
        replied = await self._verify(req)
        if replied is not None:
            self._apply(sent, *replied)

    async def _verify(self, req: VerifyRequest) -> tuple[VerifyResult, float] | None:
        """The Verify call with the soft deadline: its reply and when it came (perf_counter);
        None when the round was lost (and the session recovered, or the block given up in
        accept-unverified mode). With overlap the wait is spent drafting the next block, and
        the reply is read once the token being drafted is done."""
        call = asyncio.ensure_future(self._timed_verify(req))
        deadline = SoftDeadline(self.cfg.timeouts)
        tokens = self.tokens
        self.overlap.drop()
        while not call.done():
            if self.overlap.can_draft(tokens.pending.token_ids, self.out.remaining()):
                self.result.overlap_draft_ms += await self.overlap.draft_one(tokens.committed + tokens.pending.token_ids)
            else:
                await asyncio.wait({call}, timeout=deadline.left_s())
            if call.done() or not deadline.passed():
                continue
            if self.unverified is not None and self.unverified.gives_up(tokens.pending):
                call.cancel()
                self.overlap.drop()
                self._accept_unverified(self.unverified)
                return None
            self._show_one()
            deadline.rearm(self._more_to_show())
        return await self._reply(call)

    async def _timed_verify(self, req: VerifyRequest) -> tuple[VerifyResult, float]:
        reply = await self.session.verify(req)
        return reply, time.perf_counter()

    async def _reply(self, call: asyncio.Future[tuple[VerifyResult, float]]) -> tuple[VerifyResult, float] | None:
        """The finished call's reply and when it came, or None once its failure was dealt with."""
        try:
            replied = call.result()
        except SpecDecError as err:
            self.result.count_wire(err.wire)  # a failed call's bytes count too
            await self._failed(err)
            return None
        self.result.count_wire(replied[0].wire)
        return replied

    async def _failed(self, err: SpecDecError) -> None:
        """Deal with a failed Verify: reopen after a recoverable loss; when a full verifier still
        refuses the block after the client's resends, accept-unverified falls back locally as on
        a slow cloud (the block goes out again as catch-up); the other modes never make
        unverified text final, so they give up with the verifier's answer."""
        if isinstance(err, RECOVERABLE):
            self.overlap.drop()
            await self._connect(err)
            return
        if not isinstance(err, CapacityExceeded) or self.unverified is None:
            raise err
        self.overlap.drop()
        if not self.tokens.pending.token_ids:  # a round of k = 0 (the last token): draft it here
            self.drafter.sync(self.tokens.committed)
            self.tokens.pending = self.drafter.propose(1)
        self._accept_unverified(self.unverified)

    def _apply(self, sent: SentBlock, reply: VerifyResult, replied_at: float) -> None:
        """Commit the cloud's verdict (the accepted prefix and the recovered or bonus token),
        tell every learner, count the round and record it."""
        rtt_ms, traffic = 1000.0 * (replied_at - sent.sent_at), reply.wire
        drafts, accepted = sent.req.draft_tokens, reply.accepted_len
        shown = self.tokens.provisional  # on screen, unverified, when the reply came
        feedback = _feedback(sent, reply, rtt_ms, self.tokens.committed[-NGRAM_CONTEXT:])
        new = [*drafts[:accepted], reply.next_token]
        self.tokens.commit_verified(new)
        if self.switch is not None:
            self.switch.verifier_asks(reply.prefer_speculation)
        ahead_drafted = self.overlap.drafted()
        for learner in self.learners:
            learner.update(feedback)
        ahead = (ahead_drafted, self.overlap.carried())
        retracted = max(shown - accepted, 0)
        self._count_verified(sent, accepted, retracted, traffic, ahead)
        record = _verified_record(sent, reply, self.result, shown=shown, rtt_ms=rtt_ms, traffic=traffic, ahead=ahead)
        record = replace(record, switch=self._take_switch_reason()) if self._switch_reason else record
        self.result.round_log.append(record)
        self.out.commit(new, record)

    def _count_verified(self, sent: SentBlock, accepted: int, retracted: int, traffic: WireBytes, ahead: tuple[int, int]) -> None:
        result = self.result
        for i, source in enumerate(sent.draft.sources):
            result.drafted_by[source] = result.drafted_by.get(source, 0) + 1
            if i < accepted:
                result.accepted_by[source] = result.accepted_by.get(source, 0) + 1
        result.rounds += 1
        result.target_forward_passes += 1
        result.draft_tokens += len(sent.req.draft_tokens)
        result.accepted_tokens += accepted
        result.retracted_tokens += retracted
        result.hard_tokens += sum(sent.req.hard_mask)
        result.verify_bytes_up += traffic.up
        result.verify_bytes_down += traffic.down
        result.ahead_drafted += ahead[0]
        result.ahead_used += ahead[1]

    # ---- lossy commits (edge/experimental/, only when their flags are on) ------------------

    def _commit_locally(self, hard_ratio: float, rule_hit: bool, draft_ms: float) -> bool:
        """--local-commit: an easy block is final without the cloud; whether it was."""
        assert self.local_commit is not None
        tokens = self.tokens
        block = self.local_commit.easy_block(tokens.pending, tokens.provisional, hard_ratio, rule_hit)
        if not block:
            return False
        tokens.commit_unsent(block, Draft())
        self.result.local_tokens += len(block)
        record = local_record(self.result.rounds, block, self.result.accepted_tokens, draft_ms, hard_ratio)
        self.result.round_log.append(record)
        self.out.commit(block, record)
        return True

    def _accept_unverified(self, policy: AcceptUnverified) -> None:
        """--accept-unverified: the first pending token becomes final, counted as unverified,
        and reaches the cloud as catch-up."""
        final, rest = policy.final_token(self.tokens.pending)
        self.tokens.commit_unsent(final, rest)
        self.result.unverified_tokens += len(final)
        self.out.commit(final, None)


def _feedback(sent: SentBlock, reply: VerifyResult, rtt_ms: float, context: list[int]) -> RoundFeedback:
    """What the round tells the drafter, the k policy and overlap."""
    signals = sent.draft.signals
    return RoundFeedback(
        k=len(sent.req.draft_tokens),
        accepted_len=reply.accepted_len,
        alpha_mean=reply.metrics.alpha_mean,
        draft_ms=sent.draft_ms,
        rtt_ms=rtt_ms,
        verify_ms=reply.metrics.verify_ms,
        alpha_prefix=reply.metrics.alpha_prefix,
        drafted=sent.drafted,
        catchup=len(sent.req.committed_tokens),
        mean_entropy_bits=sum(s.entropy_bits for s in signals) / len(signals) if signals else 0.0,
        next_token=reply.next_token,
        bonus=reply.bonus,
        context=context,
        draft_tokens=sent.req.draft_tokens,
        target_top_k=reply.target_top_k,
    )


def _verified_record(
    sent: SentBlock,
    reply: VerifyResult,
    result: GenerationResult,
    *,
    shown: int,
    rtt_ms: float,
    traffic: WireBytes,
    ahead: tuple[int, int],
) -> RoundRecord:
    """The record of a round the cloud answered (counted already): `shown` of the block was on
    screen when the reply came, `ahead` is (drafted, kept) by overlap meanwhile."""
    drafts, accepted = sent.req.draft_tokens, reply.accepted_len
    return RoundRecord(
        round=result.rounds - 1,
        k=len(drafts),
        draft_tokens=drafts,
        accepted_len=accepted,
        next_token=reply.next_token,
        bonus=reply.bonus,
        la_over_k=accepted / len(drafts) if drafts else 0.0,
        alpha_mean=reply.metrics.alpha_mean,
        a_cum=result.accepted_tokens,
        edge_time_ms=sent.draft_ms,
        cloud_verify_ms=reply.metrics.verify_ms,
        rtt_ms=rtt_ms,
        bytes_up=traffic.up,
        bytes_down=traffic.down,
        hard_ratio=sent.hard_ratio,
        escalated=True,
        catchup=len(sent.req.committed_tokens),
        provisional=shown,
        retracted=max(shown - accepted, 0),
        sources=sent.draft.sources,
        ahead_drafted=ahead[0],
        ahead_used=ahead[1],
        alpha_prefix=reply.metrics.alpha_prefix,
    )
