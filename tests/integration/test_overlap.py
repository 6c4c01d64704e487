"""Overlapped rounds: the edge drafts the next block while Verify is in flight. Output stays
the target's; with a slow link most drafting leaves the critical path."""

import asyncio
import time

import pytest
from transformers import LlamaForCausalLM

from bench.tiny_models import random_llama
from edge.drafting.kpolicy import FixedK, KPolicy, LaRatioK
from edge.round.generate import GenerationResult, TimeoutPolicy, cloud_only_generate, speculative_generate
from edge.transport.client import VerifierClient
from tests.harness import gen_config, make_drafter, random_prompt, running_verifier
from tools.netproxy import FaultProxy, LinkConditions

PROMPTS = [random_prompt(seed, length=4 + seed % 5) for seed in range(12)]


@pytest.mark.parametrize("policy", ["1", "3", "8", "la-ratio"])
def test_overlap_keeps_greedy_output_exact(target_model, draft_lm, policy: str) -> None:
    def k_policy() -> KPolicy:
        return LaRatioK() if policy == "la-ratio" else FixedK(int(policy))

    async def run() -> None:
        cfg = gen_config(max_new_tokens=30, overlap=True)
        async with running_verifier(target_model) as (client, _):
            for prompt in PROMPTS:
                reference = await cloud_only_generate(prompt, client, gen_config(max_new_tokens=30))
                result = await speculative_generate(prompt, make_drafter(draft_lm), client, k_policy(), cfg)
                assert result.token_ids == reference.token_ids, f"prompt {prompt}"

    asyncio.run(run())


def _medium_model() -> LlamaForCausalLM:
    """Large enough that drafting 12 tokens takes a good part of a 200 ms round trip."""
    return random_llama(3, vocab=96, hidden=1024, mlp=4096, layers=4, heads=8, kv_heads=4)


async def _timed(model, proxy_rtt_ms: float, overlap: bool) -> tuple[GenerationResult, float]:  # type: ignore[no-untyped-def]
    async with running_verifier(model) as (direct, _):
        proxy = FaultProxy("127.0.0.1", int(direct.target.rsplit(":", 1)[1]), LinkConditions(rtt_ms=proxy_rtt_ms))
        await proxy.start()
        client = VerifierClient(proxy.address, verify_timeout_s=30)
        try:
            cfg = gen_config(max_new_tokens=60, overlap=overlap, timeouts=TimeoutPolicy(mode="strict"))
            start = time.perf_counter()
            # The draft is the target itself: every block passes, so drafted-ahead work is kept.
            result = await speculative_generate(random_prompt(1), make_drafter(model), client, FixedK(12), cfg)
            return result, time.perf_counter() - start
        finally:
            await client.close()
            await proxy.close()


def test_overlap_hides_drafting_behind_a_slow_link() -> None:
    model = _medium_model()

    async def run() -> None:
        sequential, sequential_s = await _timed(model, 200.0, overlap=False)
        overlapped, overlapped_s = await _timed(model, 200.0, overlap=True)
        assert overlapped.token_ids == sequential.token_ids
        assert overlapped.ahead_used > 0 and sequential.ahead_drafted == 0
        draft_s = sum(r.edge_time_ms for r in sequential.round_log) / 1000
        waited_s = sum(r.edge_time_ms for r in overlapped.round_log) / 1000
        hidden_s = overlapped.overlap_draft_ms / 1000
        # Drafting is a large share of the sequential run, and overlap moves most of it off the
        # critical path: it happens while Verify is in flight. Wall time only has to improve;
        # by how much depends on how the two processes share this machine's cores.
        assert draft_s > 0.2 * sequential_s
        assert waited_s < 0.5 * draft_s and hidden_s > waited_s, (waited_s, hidden_s, draft_s)
        assert overlapped_s < sequential_s, (overlapped_s, sequential_s)

    asyncio.run(run())
