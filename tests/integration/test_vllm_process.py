"""The vLLM engine in a process of its own (`--vllm-engine-process`, cloud/engine/vllm_process.py):
the verifier's sessions, rounds, streams and stretches go over its pipes to a VllmEngine in the
child, and every answer is what the engine in the verifier's own process gives (greedy, fp32,
the tiny vLLM target). A child that dies fails the calls after it and the streams that follow
it, and the engine says why."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud.batcher import BatchLimits
from cloud.engine.vllm_process import ProcessEngine
from cloud.engine.vllm_runtime import VllmOptions
from cloud.state import ServerState
from cloud.verifier import Verifier
from edge.drafting.kpolicy import FixedK
from edge.round.generate import cloud_only_generate, speculative_generate
from edge.transport.client import VerifierClient
from shared.errors import SpecDecError
from shared.hardware import usable_cores
from shared.protocol import (
    AcceptMode,
    DecodeRequest,
    GenerateRequest,
    OpenSessionRequest,
    SamplingParams,
    SessionConfig,
    VerifyRequest,
)
from tests.harness import VLLM_CONTEXT, TargetEngine, dropped_stretch, gen_config, make_drafter, random_prompt, serving

pytestmark = pytest.mark.vllm

PROMPTS = [random_prompt(seed, length=4 + seed % 5) for seed in range(300, 306)]
BATCH = BatchLimits(max_batch_size=8, max_batch_wait_ms=20)


def _process_engine(folder: Path, cpu_threads: int = 0) -> ProcessEngine:
    options = VllmOptions(
        str(folder), "float32", VLLM_CONTEXT, max_sessions=32, max_kv_bytes=64 << 20, enforce_eager=True, cpu_threads=cpu_threads
    )
    return ProcessEngine(options)


@pytest.fixture(scope="module")
def engine(vllm_target: TargetEngine) -> Iterator[ProcessEngine]:
    assert vllm_target.folder is not None
    engine = _process_engine(vllm_target.folder)
    yield engine
    engine.close()
    assert engine._process.exitcode == 0  # the child stopped cleanly


def _state(engine: ProcessEngine) -> ServerState:
    return ServerState.for_verifier(Verifier(engine, "tiny-target"), BATCH)


def test_sessions_streams_and_stretches_in_the_engine_process_equal_the_target(
    engine: ProcessEngine, vllm_target: TargetEngine
) -> None:
    """Three speculative sessions, three Generate streams and a Decode stretch at once, then a
    round and a second stretch on the stretch's session: every token is the target's greedy
    one, and the streams and the stretch take no pass per token."""
    expected = [vllm_target.greedy_continuation(p, 30) for p in PROMPTS]
    cfg = gen_config(max_new_tokens=20)
    draft = vllm_target.draft_model()

    async def run() -> None:
        async with serving(_state(engine), verify_timeout_s=30) as client:
            speculative = [speculative_generate(p, make_drafter(draft), client, FixedK(3), cfg) for p in PROMPTS[:3]]
            streams = [cloud_only_generate(p, client, cfg) for p in PROMPTS[3:5]]
            opening = DecodeRequest("", 0, 20, open=OpenSessionRequest(PROMPTS[5], SessionConfig(vocab_size=96)))
            results = await asyncio.gather(*speculative, *streams, _chunks(client.decode(opening)))
            for result, want in zip(results[:5], expected, strict=False):
                assert result.token_ids == want[:20]
            chunks = results[5]
            assert [t for c in chunks for t in c.tokens] == expected[5][:20] and chunks[-1].position == len(PROMPTS[5]) + 20
            session, want = chunks[0].opened.session_id, expected[5]
            reply = await client.verify(VerifyRequest(session, len(PROMPTS[5]) + 20, [want[20], want[21] + 1]))
            assert (reply.accepted_len, reply.next_token) == (1, want[21])
            more = await _chunks(client.decode(DecodeRequest(session, len(PROMPTS[5]) + 22, 8)))
            assert [t for c in more for t in c.tokens] == want[22:30]

    asyncio.run(run())


async def _chunks(stream):  # type: ignore[no-untyped-def]
    return [chunk async for chunk in stream]


def test_a_dropped_stretch_in_the_engine_process_leaves_its_session_where_the_client_resumes(
    engine: ProcessEngine, vllm_target: TargetEngine
) -> None:
    """A long stretch dropped after a few tokens: its session holds what the call streamed, and
    a stretch from there goes on exactly (the crops and lengths the verifier keeps of the
    child's sessions stay right)."""
    prompt = PROMPTS[0]

    async def run() -> tuple[int, list[int]]:
        async with serving(_state(engine), verify_timeout_s=30) as client:
            return await dropped_stretch(client, prompt, 400)

    at, more = asyncio.run(run())
    done = at - len(prompt)
    assert 3 <= done < 400
    assert more == vllm_target.greedy_continuation(prompt, done + 10)[done:]


def test_a_sampling_session_draws_in_the_engine_process_what_it_draws_in_the_verifier_s(
    engine: ProcessEngine, vllm_target: TargetEngine
) -> None:
    """Point-mode sampling with a seed and top-k: a Generate stream and a round draw the same
    tokens with vLLM in the child as with vLLM in the verifier's own process (the session's
    sampling settings and seed reach the child's vLLM)."""
    sampling = SamplingParams(temperature=1.3, top_k=20)
    config = SessionConfig(sampling=sampling, seed=7, accept_mode=AcceptMode.POINT, vocab_size=96)

    def draws(verifier: Verifier) -> list[int]:
        tokens = [t for chunk in verifier.generate(GenerateRequest(PROMPTS[3], config, 24)) for t in chunk.tokens]
        opened = verifier.open_session(OpenSessionRequest(PROMPTS[4], config))
        reply = verifier.verify(VerifyRequest(opened.session_id, opened.position, tokens[:3]))
        verifier.close_session(opened.session_id)
        return [*tokens, reply.accepted_len, reply.next_token]

    assert draws(Verifier(engine, "child")) == draws(Verifier(vllm_target(), "in-process"))


def test_vllm_runs_its_cpu_kernels_on_the_threads_it_is_given(engine: ProcessEngine, vllm_target: TargetEngine) -> None:
    """--threads on a CPU: vLLM's model in the child runs on that many threads (and decodes the
    target's tokens on them); by default, on every core the process may use."""
    assert vllm_target.folder is not None
    one = _process_engine(vllm_target.folder, cpu_threads=1)
    try:
        assert one.describe()["threads"] == "1"
        config = SessionConfig(vocab_size=96)
        chunks = Verifier(one, "one-thread").generate(GenerateRequest(PROMPTS[0], config, 8))
        tokens = [t for chunk in chunks for t in chunk.tokens]
        assert tokens == vllm_target.greedy_continuation(PROMPTS[0], 8)
    finally:
        one.close()
    assert engine.describe()["threads"] == str(usable_cores())  # the module's engine: no --threads


def test_a_dead_engine_process_fails_the_calls_after_it_and_says_why(vllm_target: TargetEngine) -> None:
    """The child killed while a stream follows its session: the stream fails instead of waiting,
    the next round fails with INTERNAL, and the engine's failure names the process's end (what
    the verifier's watch stops the server on)."""
    assert vllm_target.folder is not None
    engine = _process_engine(vllm_target.folder)

    async def run() -> None:
        async with serving(_state(engine), verify_timeout_s=30) as client:
            opened = await client.open_session(OpenSessionRequest(PROMPTS[1], SessionConfig(vocab_size=96)))
            stream = client.generate(GenerateRequest(PROMPTS[2], SessionConfig(vocab_size=96), 900))
            async for _ in stream:
                os.kill(engine._process.pid, signal.SIGKILL)  # type: ignore[arg-type]
                break
            with pytest.raises(SpecDecError, match="INTERNAL: vLLM's engine process ended"):
                async for _ in stream:
                    pass
            with pytest.raises(SpecDecError, match="INTERNAL: vLLM's engine process ended"):
                await client.verify(VerifyRequest(opened.session_id, opened.position, [3, 4]))

    try:
        asyncio.run(run())
        assert (engine.failure() or "").startswith("vLLM's engine process ended")
    finally:
        engine.close()


def test_the_engine_process_reports_vllms_prefix_cache_hits_within_a_client_only(engine: ProcessEngine) -> None:
    """A client's next session over its last one's prompt: the blocks vLLM's cache served, by
    vLLM's own count (whole 16-token blocks), come back through the engine process; another
    client's session over the same prompt computes every token."""
    prompt = random_prompt(310, length=40)
    config = SessionConfig(vocab_size=96)

    async def reused(client: VerifierClient, tokens: list[int]) -> int:
        opened = await client.open_session(OpenSessionRequest(tokens, config))
        await client.close_session(opened.session_id)
        return opened.reused_tokens

    async def run() -> None:
        async with serving(_state(engine), verify_timeout_s=30) as client:
            other = VerifierClient(client.target)
            try:
                assert await reused(client, prompt) == 0
                assert await reused(other, prompt + [5]) == 0
                assert await reused(client, prompt + [6]) == 32
            finally:
                await other.close()

    asyncio.run(run())
