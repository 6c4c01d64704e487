"""Drafting ahead must not bias what the cloud verifies: with overlap on, exact sparse-mode
sampling through the real loop and server still follows the target's distribution of the
3rd and 4th generated tokens (positions that blocks drafted ahead and kept reach)."""

import asyncio
import itertools

import torch

from edge.drafting.drafter import Drafter, DrafterConfig
from edge.drafting.kpolicy import FixedK
from edge.drafting.runtime_transformers import TransformersDraftLM
from edge.round.generate import speculative_generate
from shared import lm
from shared.protocol import AcceptMode, SamplingParams
from shared.sampling.verifier_torch import penalized_logits, probs_from_logits
from tests.harness import gen_config, running_verifier
from tests.tiny_models import tiny_draft, tiny_target
from tests.unit.cloud.test_sampling_exactness import _pvalue

V = 8
PROMPT = [3]
PARAMS = SamplingParams(temperature=1.5)
TRIALS = 1500


def _next_probs(model, context: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    logits = lm.forward(model, lm.new_cache(model), context)[-1:]
    return probs_from_logits(penalized_logits(logits, context, [], PARAMS, V), PARAMS)[0]


def _reference_tokens_3_4(target) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """p(t3, t4) = sum over t1, t2 of p(t1) p(t2|t1) p(t3|t1 t2) p(t4|t1 t2 t3), as [V * V]."""
    joint = torch.zeros(V, V)
    first = _next_probs(target, PROMPT)
    for t1, t2 in itertools.product(range(V), range(V)):
        prefix_p = first[t1] * _next_probs(target, PROMPT + [t1])[t2]
        third = _next_probs(target, PROMPT + [t1, t2])
        for t3 in range(V):
            joint[t3] += prefix_p * third[t3] * _next_probs(target, PROMPT + [t1, t2, t3])
    return joint.flatten()


def test_overlap_keeps_sparse_sampling_exact() -> None:
    target = tiny_target(seed=4, vocab=V)
    draft = tiny_draft(target, noise=0.6, seed=9)
    reference = _reference_tokens_3_4(target)

    async def run() -> tuple[torch.Tensor, int]:
        counts, used = torch.zeros(V * V), 0
        async with running_verifier(target) as (client, _):
            for trial in range(TRIALS):
                config = DrafterConfig(PARAMS, AcceptMode.SPARSE, V, draft_top_k=V)
                drafter = Drafter(TransformersDraftLM(draft), config, seed=10_000 + trial)
                cfg = gen_config(max_new_tokens=4, params=PARAMS, mode=AcceptMode.SPARSE, seed=trial, vocab=V, overlap=True)
                result = await speculative_generate(PROMPT, drafter, client, FixedK(1), cfg)
                counts[result.token_ids[2] * V + result.token_ids[3]] += 1
                used += result.ahead_used
        return counts, used

    counts, used = asyncio.run(run())
    assert used > 0  # blocks drafted ahead were kept and verified in some trials
    assert _pvalue(counts, reference) > 1e-3
    third = counts.view(V, V).sum(dim=1)
    assert _pvalue(third, reference.view(V, V).sum(dim=1)) > 1e-3
