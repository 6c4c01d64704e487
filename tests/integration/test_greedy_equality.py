"""Greedy speculative output equals target-only greedy output, token for token (fp32),
through the real gRPC server."""

import asyncio

import pytest
import torch

from edge.drafting.kpolicy import CostK, EgagK, FixedK, KPolicy, LaRatioK
from edge.round.generate import cloud_only_generate, speculative_generate
from shared.protocol import SamplingParams
from tests.harness import TargetEngine, gen_config, make_drafter, random_prompt, running_verifier

PROMPTS = [random_prompt(seed, length=3 + seed % 9) for seed in range(20)]
# The llama.cpp engine runs the policy x sampling x runtime grid on fewer prompts (CI time): the
# same check per prompt, and the transformers run covers the rest of the prompts.
LLAMACPP_PROMPTS = 5


def _policy(name: str) -> KPolicy:
    policies: dict[str, KPolicy] = {"la-ratio": LaRatioK(), "egag": EgagK(1, 12), "cost": CostK(1, 12)}
    return policies[name] if name in policies else FixedK(int(name))


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(repetition_penalty=1.3)], ids=["plain", "repetition-penalty"]
)
@pytest.mark.parametrize("policy", ["1", "3", "8", "la-ratio", "egag", "cost"])
def test_speculative_equals_target_only(target_engine: TargetEngine, draft_lm, policy: str, params: SamplingParams) -> None:
    async def run() -> None:
        cfg = gen_config(max_new_tokens=32, params=params)
        async with running_verifier(target_engine) as (client, _):
            accepted = drafted = 0
            for prompt in PROMPTS if target_engine.name == "transformers" else PROMPTS[:LLAMACPP_PROMPTS]:
                reference = await cloud_only_generate(prompt, client, cfg)
                drafter = make_drafter(draft_lm, params, signals=policy == "egag")
                result = await speculative_generate(prompt, drafter, client, _policy(policy), cfg)
                assert result.token_ids == reference.token_ids, f"prompt {prompt}"
                for r in result.round_log:  # greedy: the drafts on an accepted prefix are 1s and one 0
                    reached = min(r.accepted_len + 1, r.k)
                    assert r.alpha_prefix == (pytest.approx(r.accepted_len / reached) if r.k else None), r
                accepted += result.accepted_tokens
                drafted += result.draft_tokens
            # The pair agrees often enough that the accept path, not only corrections, was exercised.
            assert 0 < accepted < drafted

    asyncio.run(run())


def test_identical_draft_accepts_everything(target_engine: TargetEngine) -> None:
    async def run() -> None:
        cfg = gen_config(max_new_tokens=30)
        async with running_verifier(target_engine) as (client, _):
            result = await speculative_generate(PROMPTS[0], make_drafter(target_engine.as_draft()), client, FixedK(4), cfg)
            reference = await cloud_only_generate(PROMPTS[0], client, cfg)
        assert result.token_ids == reference.token_ids
        assert result.accepted_tokens == result.draft_tokens
        assert all(r.bonus for r in result.round_log)
        assert result.rounds == 6  # 5 tokens per round

    asyncio.run(run())


def test_stop_token_ends_generation(target_engine: TargetEngine, draft_model) -> None:
    async def run() -> None:
        async with running_verifier(target_engine) as (client, _):
            free = await cloud_only_generate(PROMPTS[3], client, gen_config(max_new_tokens=20))
            stop = frozenset({free.token_ids[5]})
            cfg = gen_config(max_new_tokens=20, stop=stop)
            reference = await cloud_only_generate(PROMPTS[3], client, cfg)
            result = await speculative_generate(PROMPTS[3], make_drafter(draft_model, stop=stop), client, FixedK(4), cfg)
        assert result.token_ids == reference.token_ids
        assert result.finish_reason == reference.finish_reason == "stop"
        assert result.token_ids[-1] in stop and len(result.token_ids) <= 6

    asyncio.run(run())


def test_padded_target_vocabulary_is_masked(target_engine: TargetEngine, draft_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A target whose logits are wider than the shared vocabulary (padded embedding rows)
    must never emit the padding ids, and speculative still equals target-only."""
    padded = target_engine.tiny_target(vocab=104)
    with torch.no_grad():
        padded.lm_head.weight[96:] = padded.lm_head.weight[:8] * 3  # padding rows that would win

    async def run() -> None:
        cfg = gen_config(max_new_tokens=24, vocab=96)
        async with running_verifier(target_engine.of(padded, tmp_path)) as (client, _):
            for prompt in PROMPTS[:5]:
                reference = await cloud_only_generate(prompt, client, cfg)
                result = await speculative_generate(prompt, make_drafter(draft_model), client, FixedK(3), cfg)
                assert result.token_ids == reference.token_ids
                assert max(reference.token_ids) < 96

    asyncio.run(run())


REPETITIVE = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, random_prompt(77, length=12) * 2]


@pytest.mark.parametrize("kind", ["ngram", "ngram-filler", "hybrid"])
def test_ngram_and_hybrid_drafts_equal_target_only(target_engine: TargetEngine, draft_model, kind: str) -> None:
    from edge.drafting.ngram import HybridDrafter, NGramDrafter, NGramStore

    def drafter():  # type: ignore[no-untyped-def]
        ngram = NGramDrafter(NGramStore(order=3), filler_top_k=4 if kind == "ngram-filler" else 1)
        return HybridDrafter(make_drafter(draft_model), ngram, min_order=2, min_count=1.0) if kind == "hybrid" else ngram

    async def run() -> None:
        cfg = gen_config(max_new_tokens=30)
        async with running_verifier(target_engine) as (client, _):
            by_source: dict[str, int] = {}
            for prompt in REPETITIVE + PROMPTS[:6]:
                reference = await cloud_only_generate(prompt, client, cfg)
                result = await speculative_generate(prompt, drafter(), client, FixedK(5), cfg)
                assert result.token_ids == reference.token_ids, f"prompt {prompt}"
                for source, n in result.accepted_by.items():
                    by_source[source] = by_source.get(source, 0) + n
            assert by_source.get("ngram", 0) > 0
            if kind == "hybrid":
                assert by_source.get("model", 0) > 0

    asyncio.run(run())
