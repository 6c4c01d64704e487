"""The two measurements of the fleet benchmark, as the edge makes its calls (edge.transport.client,
edge.round.generate): Verify latency through the proxy against straight to the replica, paired; and
concurrent speculative sessions through the proxy while one replica is SIGKILLed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bench.fleet_parts import Replica
from bench.fleet_report import percentiles
from bench.tiny_models import VOCAB
from edge.drafting.drafter import Drafter, DrafterConfig
from edge.drafting.kpolicy import FixedK
from edge.drafting.runtime_transformers import TransformersDraftLM
from edge.round.generate import cloud_only_generate, speculative_generate
from edge.round.generation import GenerationConfig, GenerationResult, RoundRecord, TimeoutPolicy
from edge.transport.client import VerifierClient
from edge.transport.replicas import new_session_key
from shared.protocol import AcceptMode, OpenSessionRequest, SamplingParams, SessionConfig, VerifyRequest

GREEDY = SessionConfig(SamplingParams(), 0, AcceptMode.GREEDY, VOCAB)
ROUNDS_PER_SESSION = 40  # then a fresh session pair: the tiny model's context stays short


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Paired:
    """One session through the proxy and one straight to the replica that holds it."""

    def __init__(self, proxy: VerifierClient, direct: dict[str, VerifierClient], replicas: list[Replica]) -> None:
        self.proxy, self.direct, self.replicas = proxy, direct, replicas

    async def open(self, seed: int) -> list[tuple[VerifierClient, str, str, int]]:
        """[(client, session key, session id, position)] for the proxy path, then the direct one."""
        before = [r.counters()["opens"] for r in self.replicas]
        key = new_session_key()
        via_proxy = await self.proxy.open_session(OpenSessionRequest(_prompt(seed, 8), GREEDY), session_key=key)
        grew = [r for r, b in zip(self.replicas, before, strict=True) if r.counters()["opens"] > b]
        assert len(grew) == 1, "the proxy's OpenSession reached no replica, or several"
        direct, direct_key = self.direct[grew[0].address], new_session_key()
        straight = await direct.open_session(OpenSessionRequest(_prompt(seed, 8), GREEDY), session_key=direct_key)
        return [
            (self.proxy, key, via_proxy.session_id, via_proxy.position),
            (direct, direct_key, straight.session_id, straight.position),
        ]


async def _timed_verify(client: VerifierClient, key: str, session: str, position: int, drafts: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    reply = await client.verify(VerifyRequest(session, position, drafts), session_key=key)
    return (time.perf_counter() - start) * 1000.0, reply.new_base_position


async def proxy_overhead(proxy_address: str, replicas: list[Replica], pairs: int) -> dict[str, Any]:
    """Verify wall time through the proxy and direct, `pairs` times each, interleaved."""
    proxy = VerifierClient(proxy_address)
    direct = {r.address: VerifierClient(r.address) for r in replicas}
    paired, times = _Paired(proxy, direct, replicas), {"proxy": list[float](), "direct": list[float]()}
    try:
        for block in range((pairs + ROUNDS_PER_SESSION - 1) // ROUNDS_PER_SESSION):
            sessions = await paired.open(block)
            for r in range(min(ROUNDS_PER_SESSION, pairs - block * ROUNDS_PER_SESSION)):
                for path in (0, 1) if r % 2 == 0 else (1, 0):  # which goes first alternates
                    client, key, session, position = sessions[path]
                    ms, position = await _timed_verify(client, key, session, position, _prompt(block * 1000 + r, 4))
                    sessions[path] = (client, key, session, position)
                    times["proxy" if path == 0 else "direct"].append(ms)
            for client, key, session, _ in sessions:
                await client.close_session(session, session_key=key)
    finally:
        for client in [proxy, *direct.values()]:
            await client.close()
    added = [p - d for p, d in zip(times["proxy"], times["direct"], strict=True)]
    return {
        "pairs": len(added),
        "proxy_ms": percentiles(times["proxy"]),
        "direct_ms": percentiles(times["direct"]),
        "added_ms": percentiles(added),  # per pair: proxy minus direct
    }


class _CommitTimes:
    """When each round of one session committed (time.perf_counter())."""

    def __init__(self) -> None:
        self.times = [time.perf_counter()]

    def committed(self, tokens: list[int], record: RoundRecord | None) -> None:
        self.times.append(time.perf_counter())

    def provisional(self, tokens: list[int]) -> None:
        pass

    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1000.0 for a, b in zip(self.times, self.times[1:], strict=False)]


async def _kill_busiest(replicas: list[Replica], rounds: float) -> tuple[Replica, float]:
    """Once some replica has served `rounds` rounds of this run, SIGKILL it: it and the time."""
    before = [r.counters()["rounds"] for r in replicas]
    while True:
        served = [(await asyncio.to_thread(r.counters))["rounds"] - b for r, b in zip(replicas, before, strict=True)]
        if max(served) >= rounds:
            victim = replicas[served.index(max(served))]
            victim.kill()
            return victim, time.time()
        await asyncio.sleep(0.05)


def _drafter(model: Any) -> Drafter:
    return Drafter(TransformersDraftLM(model), DrafterConfig(SamplingParams(), AcceptMode.GREEDY, VOCAB, draft_top_k=8), 1)


async def _references(address: str, prompts: list[list[int]], cfg: GenerationConfig) -> list[list[int]]:
    client = VerifierClient(address, verify_timeout_s=30)
    try:
        return [(await cloud_only_generate(p, client, cfg)).token_ids for p in prompts]
    finally:
        await client.close()


async def failover(
    proxy_address: str, replicas: list[Replica], draft_dir: Path, sessions: int, max_new_tokens: int, kill_after: int
) -> dict[str, Any]:
    """`sessions` concurrent speculative generations through the proxy; the busiest replica is
    SIGKILLed after `kill_after` rounds. Each session's time between commits tells the stall."""
    model = AutoModelForCausalLM.from_pretrained(draft_dir).float().eval()
    prompts = [_prompt(100 + i, 4 + i) for i in range(sessions)]
    cfg = GenerationConfig(GREEDY, max_new_tokens, timeouts=TimeoutPolicy(reconnect_window_s=60))
    references = await _references(replicas[0].address, prompts, cfg)
    client = VerifierClient(proxy_address, verify_timeout_s=30)
    observers = [_CommitTimes() for _ in prompts]
    killer = asyncio.create_task(_kill_busiest(replicas, kill_after))
    started_unix_s = time.time()
    try:
        results = await asyncio.gather(
            *(
                speculative_generate(p, _drafter(model), client, FixedK(4), cfg, o)
                for p, o in zip(prompts, observers, strict=True)
            ),
            return_exceptions=True,
        )
    finally:
        await client.close()
    if not killer.done():
        killer.cancel()
        raise RuntimeError("every session ended before the kill: lower --kill-after-rounds or raise --max-new-tokens")
    victim, kill_unix_s = killer.result()
    return _summary(results, references, observers, max_new_tokens) | {
        "killed_replica": replicas.index(victim),
        "kill_after_rounds": kill_after,
        "started_unix_s": started_unix_s,
        "kill_unix_s": kill_unix_s,
    }


def _summary(
    results: list[GenerationResult | BaseException], references: list[list[int]], observers: list[_CommitTimes], n: int
) -> dict[str, Any]:
    done = [(r, ref, o) for r, ref, o in zip(results, references, observers, strict=True) if isinstance(r, GenerationResult)]
    hit = [(r, o) for r, _, o in done if r.reopens > 0]
    spared = [(r, o) for r, _, o in done if r.reopens == 0]
    usual = [gap for _, o in spared for gap in o.gaps_ms()]
    usual_p50 = percentiles(usual)["p50"] or 0.0
    stalls = [max(o.gaps_ms()) for _, o in hit]
    return {
        "sessions": len(results),
        "completed": sum(1 for r, _, _ in done if len(r.token_ids) == n),
        "equal_to_cloud_only": sum(1 for r, ref, _ in done if r.token_ids == ref),
        "errors": [f"{type(r).__name__}: {r}" for r in results if not isinstance(r, GenerationResult)],
        "reopens": sum(r.reopens for r, _, _ in done),
        "sessions_reopened": len(hit),
        "round_gap_ms_unaffected": percentiles(usual) | {"max": round(max(usual), 1) if usual else None},
        "stall_ms_affected": [round(s, 1) for s in stalls],
        "extra_ms_affected": percentiles([s - usual_p50 for s in stalls]),  # the stalled gap minus a usual one
        "wall_s_affected": percentiles([r.elapsed_s for r, _ in hit]),
        "wall_s_unaffected": percentiles([r.elapsed_s for r, _ in spared]),
    }
