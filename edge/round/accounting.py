"""What a generation counts: per round (the round record, the k policy's observation, the
Verify call's bytes) and in all (the result's totals)."""

from __future__ import annotations

import time

from edge.drafting.drafter import Draft
from edge.drafting.kpolicy import KPolicy, RoundObservation
from edge.round.generation import GenerationResult, RoundRecord, ms_since
from shared.protocol import VerifyRequest, VerifyResult, WireBytes


class RoundAccounting:
    def __init__(self, result: GenerationResult, k_policy: KPolicy) -> None:
        self.result, self.k_policy = result, k_policy
        self.sent_at = 0.0

    def sending(self) -> None:
        """A Verify call starts: its round's time counts from here."""
        self.sent_at = time.perf_counter()

    def verified(
        self,
        req: VerifyRequest,
        reply: VerifyResult,
        block: Draft,
        *,
        shown: int,
        draft_ms: float,
        hard_ratio: float,
        ahead: tuple[int, int],
    ) -> RoundRecord:
        """A round the cloud answered: `block` was sent, `shown` of it was on screen when the
        reply came, `ahead` is (drafted, kept) by overlap meanwhile."""
        rtt_ms, traffic = ms_since(self.sent_at), reply.wire
        drafts, accepted = req.draft_tokens, reply.accepted_len
        retracted = max(shown - accepted, 0)
        self._count(req, accepted, retracted, block, traffic)
        self._observe(req, reply, block, draft_ms, rtt_ms)
        result = self.result
        record = RoundRecord(
            round=result.rounds - 1,
            k=len(drafts),
            draft_tokens=drafts,
            accepted_len=accepted,
            next_token=reply.next_token,
            bonus=reply.bonus,
            la_over_k=accepted / len(drafts) if drafts else 0.0,
            alpha_mean=reply.metrics.alpha_mean,
            a_cum=result.accepted_tokens,
            edge_time_ms=draft_ms,
            cloud_verify_ms=reply.metrics.verify_ms,
            rtt_ms=rtt_ms,
            bytes_up=traffic.up,
            bytes_down=traffic.down,
            hard_ratio=hard_ratio,
            escalated=True,
            catchup=len(req.committed_tokens),
            provisional=shown,
            retracted=retracted,
            sources=block.sources,
            ahead_drafted=ahead[0],
            ahead_used=ahead[1],
        )
        result.round_log.append(record)
        return record

    def _observe(self, req: VerifyRequest, reply: VerifyResult, block: Draft, draft_ms: float, rtt_ms: float) -> None:
        """What the k policy learns from the round."""
        signals = block.signals
        observation = RoundObservation(
            k=len(req.draft_tokens),
            accepted_len=reply.accepted_len,
            alpha_mean=reply.metrics.alpha_mean,
            draft_ms=draft_ms,
            rtt_ms=rtt_ms,
            verify_ms=reply.metrics.verify_ms,
            mean_entropy_bits=sum(s.entropy_bits for s in signals) / len(signals) if signals else 0.0,
        )
        self.k_policy.observe(observation)

    def _count(self, req: VerifyRequest, accepted: int, retracted: int, block: Draft, traffic: WireBytes) -> None:
        result = self.result
        for i, source in enumerate(block.sources):
            result.drafted_by[source] = result.drafted_by.get(source, 0) + 1
            if i < accepted:
                result.accepted_by[source] = result.accepted_by.get(source, 0) + 1
        result.rounds += 1
        result.target_forward_passes += 1
        result.draft_tokens += len(req.draft_tokens)
        result.accepted_tokens += accepted
        result.retracted_tokens += retracted
        result.hard_tokens += sum(req.hard_mask)
        result.verify_bytes_up += traffic.up
        result.verify_bytes_down += traffic.down

    def local(self, tokens: list[int], draft_ms: float, hard_ratio: float) -> RoundRecord:
        """A block committed without the cloud (--local-commit, lossy)."""
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
        return record
