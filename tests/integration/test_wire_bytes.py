"""The bytes a generation reports are those of its own calls, also when other generations share
its client (edge-agent serve runs every request over one client)."""

import asyncio

from cloud.verifier import VerifierLimits
from edge.drafting.kpolicy import FixedK
from edge.round.generate import GenerationResult, TimeoutPolicy, cloud_only_generate, speculative_generate
from tests.harness import gen_config, make_drafter, random_prompt, running_verifier


def _bytes(result: GenerationResult) -> tuple[int, int, int, int]:
    return result.bytes_up, result.bytes_down, result.verify_bytes_up, result.verify_bytes_down


def test_generations_sharing_a_client_count_only_their_own_bytes(target_model, draft_model) -> None:
    prompts = [random_prompt(seed, length=6) for seed in (11, 12, 13)]

    async def speculative(client, prompt: list[int]) -> GenerationResult:  # type: ignore[no-untyped-def]
        cfg = gen_config(max_new_tokens=16, timeouts=TimeoutPolicy(soft_deadline_s=30))  # no round shaped by timing
        return await speculative_generate(prompt, make_drafter(draft_model), client, FixedK(3), cfg)

    async def run() -> None:
        # No prefix reuse: a reused prompt's open replies with its count (other bytes than alone)
        async with running_verifier(target_model, VerifierLimits(reuse_prefixes=False)) as (client, _):
            alone = [await speculative(client, prompt) for prompt in prompts]
            together = await asyncio.gather(*(speculative(client, prompt) for prompt in prompts))
            cloud_alone = await cloud_only_generate(prompts[0], client, gen_config(max_new_tokens=16))
            cloud_together, _ = await asyncio.gather(
                cloud_only_generate(prompts[0], client, gen_config(max_new_tokens=16)), speculative(client, prompts[1])
            )
        for solo, shared in zip(alone, together, strict=True):
            assert shared.token_ids == solo.token_ids and _bytes(shared) == _bytes(solo)
            # Every round's Verify, and besides them the OpenSession and CloseSession calls.
            assert sum(r.bytes_up for r in solo.round_log) == solo.verify_bytes_up < solo.bytes_up
            assert sum(r.bytes_down for r in solo.round_log) == solo.verify_bytes_down < solo.bytes_down
        assert _bytes(cloud_together) == _bytes(cloud_alone) and cloud_alone.bytes_up > 0 and cloud_alone.bytes_down > 0

    asyncio.run(run())
