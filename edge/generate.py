"""The edge's round loop (speculative) and the two baselines (cloud_only, edge_only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from edge.client import VerifierClient
from edge.drafter import Drafter
from edge.kpolicy import KPolicy
from shared.protocol import GenerateRequest, OpenSessionRequest, SessionConfig, VerifyRequest


@dataclass(frozen=True)
class GenerationConfig:
    session: SessionConfig
    max_new_tokens: int = 128
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class RoundRecord:
    round: int
    k: int
    draft_tokens: list[int]
    accepted_len: int
    next_token: int
    bonus: bool
    draft_ms: float  # edge time spent drafting
    rtt_ms: float  # wall time of the Verify call
    verify_ms: float  # server-side time of the round
    alpha_mean: float


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forward_passes: int = 0
    elapsed_s: float = 0.0
    ttft_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    finish_reason: str = "length"
    round_log: list[RoundRecord] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        del out["round_log"]
        return out


OnCommit = Callable[[list[int], RoundRecord | None], None]


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _append(result: GenerationResult, new: list[int], cfg: GenerationConfig, start: float) -> list[int]:
    """Add newly committed tokens, cut after a stop token or at max_new_tokens; returns what was kept."""
    if not result.token_ids and new:
        result.ttft_s = time.perf_counter() - start
    kept: list[int] = []
    for token in new:
        if len(result.token_ids) >= cfg.max_new_tokens:
            break
        result.token_ids.append(token)
        kept.append(token)
        if token in cfg.stop_token_ids:
            result.finish_reason = "stop"
            break
    return kept


def _done(result: GenerationResult, cfg: GenerationConfig) -> bool:
    return result.finish_reason == "stop" or len(result.token_ids) >= cfg.max_new_tokens


async def speculative_generate(prompt: list[int], drafter: Drafter, client: VerifierClient, k_policy: KPolicy,
                               cfg: GenerationConfig, on_commit: OnCommit | None = None) -> GenerationResult:
    """Draft k tokens, verify them in one cloud round, commit accepted + one, repeat."""
    start = time.perf_counter()
    up0, down0 = client.stats.bytes_up, client.stats.bytes_down
    result = GenerationResult()
    session = await client.open_session(OpenSessionRequest(prompt, cfg.session))
    result.target_forward_passes = 1 if len(prompt) > 1 else 0
    committed = list(prompt)
    drafter.sync(committed)
    try:
        while not _done(result, cfg):
            remaining = cfg.max_new_tokens - len(result.token_ids)
            k = max(0, min(k_policy.next_k(), remaining - 1, session.max_draft_tokens))
            t0 = time.perf_counter()
            draft = drafter.propose(k)
            draft_ms = _ms(t0)
            req = VerifyRequest(session.session_id, len(committed), draft.token_ids, draft.probs,
                                sparse_draft=draft.sparse)
            t1 = time.perf_counter()
            reply = await client.verify(req)
            rtt_ms = _ms(t1)
            new = [*draft.token_ids[: reply.accepted_len], reply.next_token]
            committed.extend(new)
            drafter.sync(committed)
            k_policy.observe(len(draft), reply.accepted_len)
            record = RoundRecord(result.rounds, len(draft), draft.token_ids, reply.accepted_len,
                                 reply.next_token, reply.bonus, draft_ms, rtt_ms,
                                 reply.metrics.verify_ms, reply.metrics.alpha_mean)
            result.rounds += 1
            result.target_forward_passes += 1
            result.draft_tokens += len(draft)
            result.accepted_tokens += reply.accepted_len
            result.round_log.append(record)
            kept = _append(result, new, cfg, start)
            if on_commit:
                on_commit(kept, record)
    finally:
        await client.close_session(session.session_id)
    result.elapsed_s = time.perf_counter() - start
    result.bytes_up = client.stats.bytes_up - up0
    result.bytes_down = client.stats.bytes_down - down0
    return result


async def cloud_only_generate(prompt: list[int], client: VerifierClient, cfg: GenerationConfig,
                              on_commit: OnCommit | None = None) -> GenerationResult:
    """Target alone through the verifier's Generate stream."""
    start = time.perf_counter()
    up0, down0 = client.stats.bytes_up, client.stats.bytes_down
    result = GenerationResult()
    req = GenerateRequest(prompt, cfg.session, cfg.max_new_tokens, sorted(cfg.stop_token_ids))
    async for chunk in client.generate(req):
        result.target_forward_passes += 1
        kept = _append(result, chunk.tokens, cfg, start)
        if on_commit:
            on_commit(kept, None)
    result.elapsed_s = time.perf_counter() - start
    result.bytes_up = client.stats.bytes_up - up0
    result.bytes_down = client.stats.bytes_down - down0
    return result


def edge_only_generate(prompt: list[int], drafter: Drafter, cfg: GenerationConfig,
                       on_commit: OnCommit | None = None) -> GenerationResult:
    """The draft model alone: one token per step, committed at once."""
    start = time.perf_counter()
    result = GenerationResult()
    committed = list(prompt)
    drafter.sync(committed)
    while not _done(result, cfg):
        draft = drafter.propose(1)
        committed.extend(draft.token_ids)
        drafter.sync(committed)
        kept = _append(result, draft.token_ids, cfg, start)
        if on_commit:
            on_commit(kept, None)
    result.elapsed_s = time.perf_counter() - start
    return result
