"""Admission control: a verifier that cannot prefill every session opened at once before the
callers' deadlines serves some and refuses the rest quickly (RESOURCE_EXHAUSTED with a retry
hint), instead of timing every session out together. Real server, client and tiny model; the
verifier is made slow per fed token, as a big model on a small CPU is."""

import asyncio
import time
from typing import Any

import pytest

from cloud.batch_step import ForwardStep
from cloud.grpc_server import create_server
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.drafting.kpolicy import FixedK
from edge.round.generate import cloud_only_generate, speculative_generate
from edge.transport.client import CapacityRetry, VerifierClient
from shared.errors import CapacityExceeded, CloudUnavailable, DeadlineExceeded, SpecDecError
from shared.protocol import OpenSessionRequest, SessionConfig, VerifyRequest
from tests.harness import TargetEngine, gen_config, make_drafter, random_prompt

MS_PER_TOKEN = 8.0  # a 48-token prefill: about 0.4 s
DEADLINE_S = 1.6  # the client's OpenSession deadline
SESSIONS = 8


class SlowVerifier(Verifier):
    """A real verifier whose forward passes take MS_PER_TOKEN per fed token longer."""

    def run_batch(self, steps: list[tuple[ForwardStep[Any], float]]) -> list[Any]:
        time.sleep(sum(step.tokens for step, _ in steps) * MS_PER_TOKEN / 1000.0)
        return super().run_batch(steps)


async def _serve(verifier: Verifier):  # type: ignore[no-untyped-def]
    state = ServerState.for_verifier(verifier)
    server, port = create_server(state, "127.0.0.1:0")
    await server.start()
    return server, state, f"127.0.0.1:{port}"


async def _one_session(address: str, draft_model, prompt: list[int]) -> tuple[str, float, Any]:  # type: ignore[no-untyped-def]
    """Open (deadline DEADLINE_S, no resends) and generate; (outcome, seconds to the open's answer, detail)."""
    client = VerifierClient(address, verify_timeout_s=30, open_timeout_s=DEADLINE_S, capacity_retry=CapacityRetry(max_retries=0))
    started = time.perf_counter()
    try:
        result = await speculative_generate(prompt, make_drafter(draft_model), client, FixedK(3), gen_config(12))
        return "served", time.perf_counter() - started, result.token_ids
    except CapacityExceeded as err:
        return "refused", time.perf_counter() - started, err.retry_after_ms
    except SpecDecError as err:
        return err.status, time.perf_counter() - started, str(err)
    finally:
        await client.close()


def test_sessions_opened_at_once_are_admitted_or_refused_in_time(target_engine: TargetEngine, draft_model) -> None:
    prompts = [random_prompt(100 + i, length=48) for i in range(SESSIONS)]

    async def run() -> None:
        # The second wave sends the first one's prompts: without prefix reuse, so that both
        # waves prefill all of them and the second meets an admission that knows the cost.
        server, state, address = await _serve(SlowVerifier(target_engine(), "tiny", VerifierLimits(reuse_prefixes=False)))
        try:
            first = await asyncio.gather(*(_one_session(address, draft_model, p) for p in prompts))
            # Once the verifier knows its prefill speed, a second wave is refused at the door.
            second = await asyncio.gather(*(_one_session(address, draft_model, p) for p in prompts))
            reference_client = VerifierClient(address, verify_timeout_s=60)
            references = [await cloud_only_generate(p, reference_client, gen_config(12)) for p in prompts]
            await reference_client.close()
        finally:
            await server.stop(None)
        for wave in (first, second):
            outcomes = [outcome for outcome, _, _ in wave]
            assert set(outcomes) <= {"served", "refused"}, wave  # never DEADLINE_EXCEEDED or UNAVAILABLE
            assert 1 <= outcomes.count("served") < SESSIONS and "refused" in outcomes
            for (outcome, seconds, detail), reference in zip(wave, references, strict=True):
                if outcome == "served":
                    assert detail == reference.token_ids  # admitted sessions complete, lossless
                else:
                    assert detail > 0  # a retry hint
                    assert seconds < DEADLINE_S  # answered before the caller gave up
        # The second wave's refusals come at once, not after waiting in the queue.
        assert max(seconds for outcome, seconds, _ in second if outcome == "refused") < 0.5
        assert state.metrics.registry.get_sample_value("specdec_admission_refusals_total") >= 2

    asyncio.run(run())


def test_a_call_past_its_deadline_is_deadline_exceeded_not_unavailable(target_engine: TargetEngine) -> None:
    async def run() -> None:
        server, _, address = await _serve(SlowVerifier(target_engine(), "tiny"))
        client = VerifierClient(address, verify_timeout_s=30)
        try:
            opened = await client.open_session(OpenSessionRequest(random_prompt(5), SessionConfig(vocab_size=96)))
            # 40 catch-up tokens and one draft: about 0.35 s of work against a 50 ms deadline
            block = VerifyRequest(opened.session_id, opened.position, [5], committed_tokens=random_prompt(6, length=40))
            with pytest.raises(DeadlineExceeded) as caught:
                await client.verify(block, timeout_s=0.05)
            assert caught.value.status == "DEADLINE_EXCEEDED"
            assert isinstance(caught.value, CloudUnavailable)  # the edge recovers from it as from an outage
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(run())
