"""Cross-session batching: rounds and Generate steps of concurrent sessions share forward
passes, and every session still gets exactly what it would get alone (greedy, fp32)."""

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from cloud.batcher import BatchLimits
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.drafting.kpolicy import FixedK
from edge.round.generate import cloud_only_generate, speculative_generate
from edge.transport.client import VerifierClient
from shared.errors import CapacityExceeded, SessionNotFound
from shared.protocol import (
    DecodeChunk,
    DecodeRequest,
    GenerateRequest,
    OpenSessionRequest,
    SessionConfig,
    VerifyRequest,
)
from tests.harness import TargetEngine, cap_kv, dropped_stretch, gen_config, make_drafter, random_prompt, serving

PROMPTS = [random_prompt(seed, length=3 + seed % 7) for seed in range(100, 108)]
NEW_TOKENS = 24


@asynccontextmanager
async def batching_verifier(
    target: TargetEngine,
    batch: BatchLimits,
    limits: VerifierLimits | None = None,
) -> AsyncIterator[tuple[VerifierClient, ServerState]]:
    state = ServerState.for_verifier(Verifier(target(), "tiny-target", limits), batch)
    async with serving(state, verify_timeout_s=30) as client:
        yield client, state


def _alone(target: TargetEngine, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """Target-only greedy on a verifier of its own: one sequence per forward pass."""
    chunks = Verifier(target(), "reference").generate(GenerateRequest(prompt, SessionConfig(vocab_size=96), n))
    return [t for chunk in chunks for t in chunk.tokens]


def _mean_batch(state: ServerState) -> float:
    registry = state.metrics.registry
    return (registry.get_sample_value("specdec_batch_size_sum") or 0.0) / (
        registry.get_sample_value("specdec_batch_size_count") or 1.0
    )


def test_concurrent_sessions_batched_equal_each_alone(target_engine: TargetEngine) -> None:
    """Four speculative edges and four cloud_only streams at once: their rounds and tokens
    are batched together, and each output equals the target alone, token for token."""
    cfg = gen_config(max_new_tokens=NEW_TOKENS)
    draft_model = target_engine.draft_model()

    async def run() -> None:
        async with batching_verifier(target_engine, BatchLimits(max_batch_size=8, max_batch_wait_ms=20)) as (client, state):
            speculative = [speculative_generate(p, make_drafter(draft_model), client, FixedK(3), cfg) for p in PROMPTS[:4]]
            cloud_only = [cloud_only_generate(p, client, cfg) for p in PROMPTS[4:]]
            results = await asyncio.gather(*speculative, *cloud_only)
            assert _mean_batch(state) > 2.0  # the steps really shared forward passes
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert result.token_ids == _alone(target_engine, prompt), f"prompt {prompt}"
        assert sum(r.accepted_tokens for r in results[:4]) > 0

    asyncio.run(run())


def test_a_lone_stream_does_not_wait_the_batch_window(target_engine: TargetEngine) -> None:
    """The batch window is for company: once the only session of the last pass is back, its
    next step runs at once. Each of a lone cloud_only stream's tokens would otherwise wait the
    whole 400 ms window (24 tokens: 9.6 s); the first pass waits it once."""
    cfg = gen_config(max_new_tokens=NEW_TOKENS)

    async def run() -> None:
        async with batching_verifier(target_engine, BatchLimits(max_batch_size=8, max_batch_wait_ms=400)) as (client, _):
            start = asyncio.get_running_loop().time()
            result = await cloud_only_generate(PROMPTS[0], client, cfg)
            elapsed = asyncio.get_running_loop().time() - start
        assert result.token_ids == _alone(target_engine, PROMPTS[0])
        assert elapsed < 0.4 * NEW_TOKENS / 3, f"{elapsed:.2f} s for {NEW_TOKENS} tokens"

    asyncio.run(run())


def test_unbatched_server_matches_batched_one(target_engine: TargetEngine, draft_model) -> None:
    """max_batch_size 1 is the unbatched verifier: same outputs, every forward pass alone."""
    cfg = gen_config(max_new_tokens=12)

    async def run() -> None:
        async with batching_verifier(target_engine, BatchLimits(max_batch_size=1)) as (client, state):
            results = await asyncio.gather(
                *[speculative_generate(p, make_drafter(draft_model), client, FixedK(3), cfg) for p in PROMPTS[:3]]
            )
            assert _mean_batch(state) == 1.0
        for prompt, result in zip(PROMPTS, results, strict=False):
            assert result.token_ids == _alone(target_engine, prompt, 12)

    asyncio.run(run())


async def _drive(
    client: VerifierClient, prompt: list[int], reference: list[int], rng: random.Random, session_id: str | None = None
) -> tuple[list[int], dict[str, int]]:
    """Verify rounds until NEW_TOKENS are committed; drafts are the reference's next tokens,
    the last one spoiled half the time. A refused round waits the server's hint and retries;
    an evicted session is reopened with its committed prefix, as the edge does."""
    tokens, events = list(prompt), {"refused": 0, "reopened": 0}
    config = SessionConfig(vocab_size=96)
    while len(tokens) - len(prompt) < NEW_TOKENS:
        done = len(tokens) - len(prompt)
        draft = reference[done : done + 3]
        if draft and rng.random() < 0.5:
            draft[-1] = (draft[-1] + 1) % 96
        try:
            if session_id is None:
                session_id = (await client.open_session(OpenSessionRequest(tokens, config))).session_id
            reply = await client.verify(VerifyRequest(session_id, len(tokens), draft))
        except CapacityExceeded as err:
            assert err.retry_after_ms > 0, "a full queue answers with a retry hint"
            events["refused"] += 1
            await asyncio.sleep(err.retry_after_ms / 1000.0)
            continue
        except SessionNotFound:
            events["reopened"] += 1
            assert events["reopened"] < 100, "eviction thrash"
            session_id = None
            continue
        tokens += [*draft[: reply.accepted_len], reply.next_token]
    return tokens[len(prompt) : len(prompt) + NEW_TOKENS], events


def test_prefills_of_sessions_opened_together_share_one_forward_pass(target_engine: TargetEngine) -> None:
    """OpenSession is a batched step too: prompts opened at once are prefilled in ONE forward
    pass instead of queueing one behind another (a one-token prompt needs none), and every
    session's KV is its prefill alone: its rounds commit the target's own tokens."""
    prompts = [*PROMPTS, [5]]
    references = [_alone(target_engine, p, NEW_TOKENS + 4) for p in prompts]

    async def run() -> None:
        async with batching_verifier(target_engine, BatchLimits(max_batch_size=16, max_batch_wait_ms=500)) as (client, state):
            assert state.verifier is not None
            config = SessionConfig(vocab_size=96)
            opened = await asyncio.gather(*[client.open_session(OpenSessionRequest(p, config)) for p in prompts])
            assert state.verifier.forward_passes == 1
            assert [o.position for o in opened] == [len(p) for p in prompts]
            outcomes = await asyncio.gather(
                *[
                    _drive(client, p, r, random.Random(i), o.session_id)
                    for i, (p, r, o) in enumerate(zip(prompts, references, opened, strict=True))
                ]
            )
        for (tokens, _), reference in zip(outcomes, references, strict=True):
            assert tokens == reference[:NEW_TOKENS]

    asyncio.run(run())


def test_past_queue_and_kv_caps_clear_errors_and_admitted_sessions_complete(target_engine: TargetEngine) -> None:
    """Refusals and evictions are clear errors and every admitted session completes. Its tokens
    equal the target's alone on transformers; on llama.cpp an evicted session reopens by
    prefilling its tokens in one pass, whose rows differ from one-token-per-pass rows by ~1e-7,
    enough to flip a near-tied greedy token of this run (docs/operations.md, "Engines"), so
    there each session's length is checked."""
    exact = target_engine.name == "transformers"
    prompts = [random_prompt(seed, length=20) for seed in range(200, 208)]
    references = [_alone(target_engine, p, NEW_TOKENS + 4) for p in prompts]
    # KV room for 120 tokens (three sessions at the end of their run); a queue of two rounds,
    # each batch waiting 100 ms for more: rounds sent together overflow the queue every time.
    batch = BatchLimits(max_batch_size=8, max_batch_wait_ms=100, max_queue=2)

    async def run() -> None:
        async with batching_verifier(target_engine, batch) as (client, state):
            assert state.verifier is not None
            cap_kv(state.verifier, 120)
            config = SessionConfig(vocab_size=96)
            opened = [await client.open_session(OpenSessionRequest(p, config)) for p in prompts]
            # Eight 20-token prompts in room for 120 tokens: the least recently used were evicted.
            with pytest.raises(SessionNotFound):
                await client.verify(VerifyRequest(opened[0].session_id, len(prompts[0]), []))
            live = range(4, 8)
            rng = random.Random(0)
            outcomes = await asyncio.gather(*[_drive(client, prompts[i], references[i], rng, opened[i].session_id) for i in live])
            # Four sessions with rounds in flight against a queue of two: some rounds were
            # refused (and resent, by the client or by _drive); sessions outgrowing the KV room
            # were evicted and reopened...
            assert sum(events["reopened"] for _, events in outcomes) > 0
            assert (state.metrics.registry.get_sample_value("specdec_rejected_requests_total", {"method": "Verify"}) or 0) > 0
            # ...and every session still produced exactly the target's tokens.
            for i, (tokens, _) in zip(live, outcomes, strict=True):
                assert len(tokens) == NEW_TOKENS, f"session {i}"
                if exact:
                    assert tokens == references[i][:NEW_TOKENS], f"session {i}"
            # The server is still up and serving.
            again = await client.open_session(OpenSessionRequest(prompts[0], config))
            assert again.position == len(prompts[0])

    asyncio.run(run())


def test_refused_round_carries_retry_hint_over_the_wire(target_engine: TargetEngine) -> None:
    """The hint travels as trailing metadata next to RESOURCE_EXHAUSTED, readable by any client."""
    from shared import wire
    from shared.pb import verifier_pb2 as pb
    from shared.pb import verifier_pb2_grpc as pb_grpc

    async def run() -> None:
        # The first round waits 500 ms for company in a queue of one: the others arrive meanwhile
        # (loopback) and find it full, however slow the machine.
        async with batching_verifier(target_engine, BatchLimits(max_batch_size=8, max_batch_wait_ms=500, max_queue=1)) as (
            client,
            _,
        ):
            opened = [await client.open_session(OpenSessionRequest(p, SessionConfig(vocab_size=96))) for p in PROMPTS[:4]]
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            calls = [stub.Verify(pb.VerifyRequest(session_id=o.session_id, base_position=o.position)) for o in opened]
            results = await asyncio.gather(*calls, return_exceptions=True)
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
            assert all(int(dict(r.trailing_metadata())[wire.RETRY_AFTER_MS_KEY]) > 0 for r in refused)
            assert any(isinstance(r, pb.VerifyResponse) for r in results)

    asyncio.run(run())


@pytest.mark.vllm
def test_generate_streams_on_vllm_read_its_own_decoding_without_a_pass_a_token(vllm_target: TargetEngine) -> None:
    """Four cloud_only streams on live vLLM requests: after each stream's first step (its
    prefill, batched) vLLM decodes the rest in its own loop and the tokens reach the streams
    as they come, with no batcher pass per token. Each equals the target alone, and a stream
    ends at its stop token."""
    expected = [_alone(vllm_target, prompt) for prompt in PROMPTS[:4]]
    stop = expected[0][9]  # the first stream ends at its tenth token, the others where it first occurs
    ends = [tokens[: tokens.index(stop) + 1] if stop in tokens else tokens for tokens in expected]

    async def run() -> None:
        async with batching_verifier(vllm_target, BatchLimits(max_batch_size=8, max_batch_wait_ms=20)) as (client, state):
            cfg = gen_config(max_new_tokens=NEW_TOKENS, stop=frozenset({stop}))
            results = await asyncio.gather(*(cloud_only_generate(p, client, cfg) for p in PROMPTS[:4]))
            passes = state.metrics.registry.get_sample_value("specdec_forward_passes_total")
        assert [r.token_ids for r in results] == ends
        assert passes is not None and passes <= 4  # the first steps only (one a token: 24 here)

    asyncio.run(run())


@pytest.mark.vllm
def test_a_stream_cancelled_mid_way_ends_its_vllm_request_and_spares_the_others(vllm_target: TargetEngine) -> None:
    """A client that drops its Generate stream after a few tokens: its live request is aborted,
    vLLM stops stepping for it, and a stream beside it still gets every token of its own."""
    expected = _alone(vllm_target, PROMPTS[1], 40)

    async def run() -> None:
        async with batching_verifier(vllm_target, BatchLimits(max_batch_size=8, max_batch_wait_ms=20)) as (client, state):
            runtime = state.verifier.engine.runtime  # type: ignore[union-attr]
            others = set(runtime._live)  # the shared vLLM's requests of other tests
            dropped = client.generate(GenerateRequest(PROMPTS[0], SessionConfig(vocab_size=96), 200))
            kept = asyncio.create_task(cloud_only_generate(PROMPTS[1], client, gen_config(max_new_tokens=40)))
            got = 0
            async for chunk in dropped:
                got += len(chunk.tokens)
                if got >= 3:
                    break
            requests = [live for request_id, live in runtime._live.items() if request_id not in others]
            assert len(requests) == 2  # both streams' live requests
            await dropped.aclose()
            result = await kept

            def ended() -> bool:
                return all(live.engine_id not in runtime.scheduler.requests for live in requests)

            for _ in range(100):  # the aborts reach vLLM's thread through the model worker
                if not runtime.busy() and not runtime._followed and ended():
                    break
                await asyncio.sleep(0.05)
            assert not runtime.busy() and not runtime._followed and ended()
            assert min(len(live.tokens) for live in requests) < len(PROMPTS[0]) + 100  # the dropped one soon
        assert result.token_ids == expected

    asyncio.run(run())


async def _stretch(client: VerifierClient, req: DecodeRequest) -> tuple[str, list[int], list[DecodeChunk]]:
    """A Decode call's session, tokens and chunks."""
    chunks = [chunk async for chunk in client.decode(req)]
    opened = chunks[0].opened
    return (opened.session_id if opened else req.session_id), [t for c in chunks for t in c.tokens], chunks


@pytest.mark.vllm
def test_decode_stretches_on_vllm_read_its_own_decoding_and_hand_the_session_on(vllm_target: TargetEngine) -> None:
    """Four Decode stretches that open their sessions: after each one's first step vLLM decodes
    the rest in its own loop, with no batcher pass per token; chunk positions follow the
    tokens. The sessions then take a Verify round and a second stretch (one ends at its stop
    token) exactly where the target alone would be."""
    expected = [_alone(vllm_target, prompt, 30) for prompt in PROMPTS[:4]]
    stop = expected[0][25]
    config = SessionConfig(vocab_size=96)

    async def run() -> None:
        async with batching_verifier(vllm_target, BatchLimits(max_batch_size=8, max_batch_wait_ms=20)) as (client, state):
            opens = [DecodeRequest("", 0, 20, open=OpenSessionRequest(p, config)) for p in PROMPTS[:4]]
            first = await asyncio.gather(*(_stretch(client, req) for req in opens))
            passes = state.metrics.registry.get_sample_value("specdec_forward_passes_total")
            assert passes is not None and passes <= 4  # the opening steps only (one a token: 80 here)
            for prompt, want, (_, tokens, chunks) in zip(PROMPTS, expected, first, strict=False):
                assert tokens == want[:20]
                ends = list(itertools.accumulate(len(c.tokens) for c in chunks))
                assert [c.position for c in chunks] == [len(prompt) + n for n in ends] and chunks[-1].finished
            for prompt, want, (session, _, _) in zip(PROMPTS, expected, first, strict=False):
                reply = await client.verify(VerifyRequest(session, len(prompt) + 20, [want[20], want[21] + 1]))
                assert (reply.accepted_len, reply.next_token) == (1, want[21])
                _, more, chunks = await _stretch(client, DecodeRequest(session, len(prompt) + 22, 8, [stop]))
                assert more == (want[22 : want.index(stop, 22) + 1] if stop in want[22:] else want[22:30])
                assert chunks[-1].position == len(prompt) + 22 + len(more)

    asyncio.run(run())


@pytest.mark.vllm
def test_a_stretch_cancelled_mid_way_leaves_its_session_where_the_client_can_resume(vllm_target: TargetEngine) -> None:
    """A client that drops a long Decode stretch after a few tokens: its request parks, the
    session holds what the call streamed up to then (the position it reports), and decoding
    from there goes on exactly."""
    prompt, stretch = PROMPTS[2], 900

    async def run() -> tuple[int, list[int]]:
        async with batching_verifier(vllm_target, BatchLimits(max_batch_size=8, max_batch_wait_ms=20)) as (client, state):
            runtime = state.verifier.engine.runtime  # type: ignore[union-attr]

            def parked() -> None:  # the dropped stretch's request parked: vLLM steps for nobody
                assert not runtime.call(runtime.stepping)  # on vLLM's thread: after the stop queued there

            return await dropped_stretch(client, prompt, stretch, parked)

    at, more = asyncio.run(run())
    assert len(prompt) + 3 <= at < len(prompt) + stretch  # cut short, at what the call had streamed
    done = at - len(prompt)
    assert more == _alone(vllm_target, prompt, done + 10)[done:]
