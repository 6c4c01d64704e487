"""Switching modes must not bias sampling: in auto mode with a switch forced after every round
and every one-token stretch, exact sampling (sparse and point) through the real loop and server
still follows the target's joint distribution of the 2nd and 3rd generated tokens, which
speculative rounds and Decode stretches take turns to produce."""

import asyncio
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from bench.tiny_models import random_llama
from edge.drafting.drafter import Drafter, DrafterConfig
from edge.drafting.kpolicy import FixedK
from edge.drafting.runtime_transformers import TransformersDraftLM
from edge.round.generate import speculative_generate
from edge.round.mode_switch import CLOUD_ONLY, SPECULATIVE, SwitchRules
from shared.protocol import AcceptMode
from tests.harness import TargetEngine, gen_config, running_verifier
from tests.integration.test_overlap_sampling import PARAMS, PROMPT, V, _next_probs
from tests.tiny_models import save_model, tiny_draft, tiny_target
from tests.unit.cloud.test_sampling_exactness import _pvalue

TRIALS = 1200
# Every round "loses" (keep_ratio out of reach) and every stretch is one token: the modes alternate.
ALTERNATE = SwitchRules(
    first_stretch_tokens=1,
    max_warmup_stretch_tokens=1,
    min_rounds=1,
    window=1,
    keep_ratio=1e9,
    backoff_tokens=1,
    max_backoff_tokens=1,
)


def _reference_tokens_2_3(target) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """p(t2, t3) = sum over t1 of p(t1) p(t2|t1) p(t3|t1 t2), as [V * V]."""
    joint = torch.zeros(V, V)
    first = _next_probs(target, PROMPT)
    for t1, t2 in itertools.product(range(V), range(V)):
        joint[t2] += first[t1] * _next_probs(target, PROMPT + [t1])[t2] * _next_probs(target, PROMPT + [t1, t2])
    return joint.flatten()


def _counts_across_switches(
    target, draft, mode: AcceptMode, served: PreTrainedModel | TargetEngine
) -> tuple[torch.Tensor, dict[str, int]]:  # type: ignore[no-untyped-def]
    async def run() -> tuple[torch.Tensor, dict[str, int]]:
        counts, by_mode = torch.zeros(V * V), {SPECULATIVE: 0, CLOUD_ONLY: 0}
        async with running_verifier(served) as (client, _):
            for trial in range(TRIALS):
                drafter = Drafter(TransformersDraftLM(draft), DrafterConfig(PARAMS, mode, V, draft_top_k=V), seed=10_000 + trial)
                cfg = gen_config(max_new_tokens=3, params=PARAMS, mode=mode, seed=trial, vocab=V)
                result = await speculative_generate(PROMPT, drafter, client, FixedK(1), replace(cfg, mode_switch=ALTERNATE))
                counts[result.token_ids[1] * V + result.token_ids[2]] += 1
                for name, tokens in result.tokens_by_mode.items():
                    by_mode[name] += tokens
        return counts, by_mode

    return asyncio.run(run())


def _assert_follows(counts: torch.Tensor, by_mode: dict[str, int], reference: torch.Tensor) -> None:
    # Both modes produced a good share of the tokens measured.
    assert min(by_mode.values()) > TRIALS // 2
    assert _pvalue(counts, reference) > 1e-3
    assert _pvalue(counts.view(V, V).sum(dim=0), reference.view(V, V).sum(dim=0)) > 1e-3


@pytest.mark.parametrize("mode", [AcceptMode.SPARSE, AcceptMode.POINT])
def test_exact_sampling_stays_exact_across_forced_switches(mode: AcceptMode) -> None:
    target = tiny_target(seed=4, vocab=V)
    draft = tiny_draft(target, noise=0.6, seed=9)
    _assert_follows(*_counts_across_switches(target, draft, mode, target), _reference_tokens_2_3(target))


@pytest.mark.vllm
def test_exact_sampling_stays_exact_across_forced_switches_on_vllm(tmp_path: Path) -> None:
    """The same on the vLLM engine, where each Decode stretch is one request vLLM samples on its
    own (seeded by the session's seed and the stretch's position) and each round's sparse drafts
    are verified by vLLM's rejection sampler with the edge's q."""
    target = random_llama(4, vocab=V, hidden=128, mlp=256, layers=2, heads=2, kv_heads=1)  # a shape vLLM's CPU attention runs
    draft = tiny_draft(target, noise=0.6, seed=9)
    served = TargetEngine("vllm", target, folder=save_model(target, tmp_path / "target"))
    _assert_follows(*_counts_across_switches(target, draft, AcceptMode.SPARSE, served), _reference_tokens_2_3(target))
