"""One client cannot take the verifier from the others: Generate streams count against the
session and KV caps, long prompts are prefilled in chunks between other sessions' rounds,
and each API key has its own sessions, limits and a fair share of every forward pass."""

import asyncio

import grpc
import pytest

from cloud.batcher import BatchLimits, ForwardBatcher
from cloud.quotas import KeyLimits
from cloud.sessions import SessionLimits
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from shared.errors import CapacityExceeded, SessionNotFound
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from shared.protocol import GenerateRequest, OpenSessionRequest, SessionConfig, VerifyRequest
from tests.harness import TargetEngine, random_prompt, serving

CONFIG = SessionConfig(vocab_size=96)


def _alone(target: TargetEngine, prompt: list[int], n: int) -> list[int]:
    chunks = Verifier(target(), "reference").generate(GenerateRequest(prompt, CONFIG, n))
    return [t for chunk in chunks for t in chunk.tokens]


def _state(target: TargetEngine, batch: BatchLimits | None = None, limits: VerifierLimits | None = None) -> ServerState:
    return ServerState.for_verifier(Verifier(target(), "tiny-target", limits), batch or BatchLimits())


async def _generate(stub: pb_grpc.VerifierStub, prompt: list[int], n: int) -> list[int]:
    request = pb.GenerateRequest(prompt_tokens=prompt, max_new_tokens=n, vocab_size=96)
    return [t async for chunk in stub.Generate(request) for t in chunk.tokens]


def test_generate_streams_count_against_the_kv_cap(target_engine: TargetEngine) -> None:
    """With room for two streams' KV, four concurrent streams: two are served to the end,
    two are refused with RESOURCE_EXHAUSTED, and once they end the KV is free again."""
    prompt, n = random_prompt(1, length=20), 30

    async def run() -> None:
        state = _state(target_engine)
        verifier = state.verifier
        assert verifier is not None
        per_token = verifier.sessions.kv_bytes_per_token
        verifier.sessions.limits = SessionLimits(max_kv_bytes=per_token * 2 * (len(prompt) + n))
        async with serving(state) as client:
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            results = await asyncio.gather(*(_generate(stub, prompt, n) for _ in range(4)), return_exceptions=True)
            served = [r for r in results if isinstance(r, list)]
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert len(served) == 2 and len(refused) == 2, results
            assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
            assert served[0] == served[1] == _alone(target_engine, prompt, n)
            await asyncio.sleep(0.1)  # the streams' ends reach the model worker
            store = verifier.sessions
            # What stays is kept prefixes (the KV a stream's client's next turn would start
            # from), each client's own; they give way to their own client's need first, and a
            # client holding no more than its share keeps its own.
            assert len(store) == 0 and store.kv_bytes() == store.prefixes.nbytes()
            if verifier.engine.caches_prefixes:
                assert store.kv_bytes() == 0  # vLLM keeps them in its own cache
                return
            first, second = store.prefixes.entries()
            assert first.scope != second.scope  # two clients: two scopes
            store.reserve(len(prompt) + n, scope=first.scope)
            assert store.prefixes.entries() == [second]

    asyncio.run(run())


def test_generate_streams_count_against_the_session_cap(target_engine: TargetEngine) -> None:
    async def run() -> None:
        state = _state(target_engine, limits=VerifierLimits(sessions=SessionLimits(max_sessions=1)))
        async with serving(state) as client:
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            stream = stub.Generate(pb.GenerateRequest(prompt_tokens=random_prompt(2), max_new_tokens=40, vocab_size=96))
            await stream.read()  # the stream holds the only session
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=random_prompt(3), vocab_size=96))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            stream.cancel()
            await asyncio.sleep(0.1)
            opened = await stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=random_prompt(3), vocab_size=96))
            assert opened.session_id

    asyncio.run(run())


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_gives_the_same_tokens(target_engine: TargetEngine, chunk: int) -> None:
    """Sessions and streams whose prompts are fed over several passes (chunks of 7 or 16
    tokens, with other sessions' rounds between) produce exactly the unchunked tokens."""
    prompts = [random_prompt(seed, length=length) for seed, length in ((10, 50), (11, 9), (12, 33))]

    async def run() -> None:
        async with serving(_state(target_engine, BatchLimits(max_prefill_chunk=chunk))) as client:
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            streams = await asyncio.gather(*(_generate(stub, p, 12) for p in prompts))
            assert streams == [_alone(target_engine, p, 12) for p in prompts]
            for prompt, expected in zip(prompts, streams, strict=True):
                opened = await client.open_session(OpenSessionRequest(prompt, CONFIG))
                # k = 0 rounds: each returns the target's next greedy token after the prefix.
                tokens = []
                for _ in range(4):
                    base = len(prompt) + len(tokens)
                    reply = await client.verify(VerifyRequest(opened.session_id, base, []))
                    tokens.append(reply.next_token)
                assert tokens == expected[:4]

    asyncio.run(run())


@pytest.mark.parametrize(("chunk", "overtaken"), [(16, True), (0, False)])
def test_a_long_prompt_does_not_hold_up_other_rounds(target_engine: TargetEngine, chunk: int, overtaken: bool) -> None:
    """A round sent while a 600-token prompt is being prefilled is answered before that
    prefill ends when prompts go in chunks; fed whole, the prompt's one pass holds it."""

    async def run() -> None:
        async with serving(_state(target_engine, BatchLimits(max_prefill_chunk=chunk))) as client:
            small = await client.open_session(OpenSessionRequest(random_prompt(4), CONFIG))
            long_open = asyncio.ensure_future(client.open_session(OpenSessionRequest(random_prompt(5, length=600), CONFIG)))
            await asyncio.sleep(0.005)  # the long prefill is queued first
            await client.verify(VerifyRequest(small.session_id, 8, []))
            assert long_open.done() is not overtaken
            assert (await long_open).position == 600

    asyncio.run(run())


def test_a_prefill_cut_off_between_chunks_leaves_no_session(target_engine: TargetEngine) -> None:
    async def run() -> None:
        state = _state(target_engine, BatchLimits(max_prefill_chunk=8))
        async with serving(state) as client:
            stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(client.target))
            call = stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=random_prompt(6, length=800), vocab_size=96))
            await asyncio.sleep(0.05)  # a few chunks in
            call.cancel()
            await asyncio.sleep(0.3)
            assert state.verifier is not None and len(state.verifier.sessions) == 0

    asyncio.run(run())


# ---- keys: the batcher and the store, driven directly (the gRPC side is in test_api_keys) ----


def test_a_session_is_invisible_to_other_keys(target_engine: TargetEngine) -> None:
    verifier = Verifier(target_engine(), "tiny-target")
    opened = verifier.begin_open(OpenSessionRequest(random_prompt(7), CONFIG), owner="alice")
    verifier._run_alone(opened, 0.0)
    session_id = next(iter(verifier.sessions)).session_id
    for key in ("bob", ""):
        with pytest.raises(SessionNotFound) as err:
            verifier.begin_verify(VerifyRequest(session_id, 8, []), key)
        assert session_id not in str(err.value)
        with pytest.raises(SessionNotFound):
            verifier.close_session(session_id, key)
    assert verifier.close_session(session_id, "alice").position == 8


def test_a_key_at_its_session_cap_is_refused_and_others_are_not(target_engine: TargetEngine) -> None:
    limits = VerifierLimits(sessions=SessionLimits(per_key=KeyLimits(max_sessions=2)))
    verifier = Verifier(target_engine(), "tiny-target", limits)

    def open_for(key: str) -> str:
        verifier._run_alone(verifier.begin_open(OpenSessionRequest(random_prompt(8), CONFIG), owner=key), 0.0)
        return list(verifier.sessions)[-1].session_id

    alice = [open_for("alice"), open_for("alice")]
    with pytest.raises(CapacityExceeded) as err:
        open_for("alice")  # refused: none of alice's live sessions is evicted for it
    assert "'alice'" in str(err.value) and err.value.retry_after_ms > 0
    bob = open_for("bob")
    assert {s.session_id for s in verifier.sessions} == {*alice, bob}
    verifier.close_session(alice[0], "alice")
    open_for("alice")  # room again


def test_a_key_over_its_kv_cap_loses_its_own_idle_session_only(target_engine: TargetEngine) -> None:
    per_token = Verifier(target_engine(), "x").sessions.kv_bytes_per_token
    limits = VerifierLimits(sessions=SessionLimits(per_key=KeyLimits(max_kv_bytes=per_token * 20)))
    verifier = Verifier(target_engine(), "tiny-target", limits)

    def open_for(key: str) -> str:
        verifier._run_alone(verifier.begin_open(OpenSessionRequest(random_prompt(8), CONFIG), owner=key), 0.0)
        return list(verifier.sessions)[-1].session_id

    bob = open_for("bob")
    first, second = open_for("alice"), open_for("alice")  # 2 x 8 tokens of alice's 20
    verifier.sessions.busy[second] += 1  # a round of it in flight
    third = open_for("alice")  # alice's least recently used idle session goes, not bob's
    assert {s.session_id for s in verifier.sessions} == {bob, second, third}
    assert first not in {s.session_id for s in verifier.sessions}


def test_a_key_over_its_kv_cap_is_refused_while_others_are_served(target_engine: TargetEngine) -> None:
    per_token = Verifier(target_engine(), "x").sessions.kv_bytes_per_token
    limits = VerifierLimits(sessions=SessionLimits(per_key=KeyLimits(max_kv_bytes=per_token * 30)))
    verifier = Verifier(target_engine(), "tiny-target", limits)
    with pytest.raises(CapacityExceeded):
        verifier.begin_open(OpenSessionRequest(random_prompt(9, length=40), CONFIG), owner="alice")
    for key in ("alice", "bob"):
        verifier._run_alone(verifier.begin_open(OpenSessionRequest(random_prompt(9, length=20), CONFIG), owner=key), 0.0)
    assert len(verifier.sessions) == 2


def _step_owner_order(target: TargetEngine, batch: BatchLimits, submissions: list[tuple[str, str]]) -> list[list[str]]:
    """Submit one k=0 round per (key, session name) at once; the keys of each forward pass."""

    async def run() -> list[list[str]]:
        state = _state(target, batch)
        assert state.verifier is not None and state.batcher is not None
        verifier, batcher = state.verifier, state.batcher
        ids = {}
        for key, name in submissions:
            verifier._run_alone(verifier.begin_open(OpenSessionRequest(random_prompt(1), CONFIG), owner=key), 0.0)
            ids[name] = list(verifier.sessions)[-1].session_id
        # On the model worker, in order: each step's key as its batch begins it, then the pass.
        events: list[str] = []
        run_batch = verifier.run_batch

        def recording(steps):  # type: ignore[no-untyped-def]
            events.append("|")
            return run_batch(steps)

        verifier.run_batch = recording  # type: ignore[method-assign]  # observe, not change, the passes

        def begin(key: str, name: str):  # type: ignore[no-untyped-def]
            events.append(key)
            return verifier.begin_verify(VerifyRequest(ids[name], 8, []), key)

        async def round_of(key: str, name: str) -> None:
            await batcher.submit(ids[name], 1, lambda: begin(key, name), key=key)

        await asyncio.gather(*(round_of(key, name) for key, name in submissions))
        state.worker.shutdown()
        return [p.split() for p in " ".join(events).split("|")[:-1]]

    return asyncio.run(run())


def test_every_key_gets_into_the_next_pass(target_engine: TargetEngine) -> None:
    """Eight rounds of a heavy key queued ahead of one of a light key, four steps a pass:
    the light key's round runs in the first pass, not after the heavy key's eight."""
    submissions = [("heavy", f"h{i}") for i in range(8)] + [("light", "l0")]
    passes = _step_owner_order(target_engine, BatchLimits(max_batch_size=4, max_batch_wait_ms=50), submissions)
    assert "light" in passes[0], passes
    assert sum(len(p) for p in passes) == 9


def test_a_key_over_its_queue_limit_is_refused_and_others_are_not(target_engine: TargetEngine) -> None:
    async def run() -> None:
        limits = BatchLimits(max_batch_wait_ms=200, per_key=KeyLimits(max_queued=2))
        state = _state(target_engine, limits)
        assert state.batcher is not None
        batcher: ForwardBatcher = state.batcher
        verifier = state.verifier
        assert verifier is not None

        def opening(key: str):  # type: ignore[no-untyped-def]
            return batcher.submit(
                key, 8, lambda: verifier.begin_open(OpenSessionRequest(random_prompt(2), CONFIG), owner=key), key=key
            )

        heavy = [asyncio.ensure_future(opening("heavy")) for _ in range(3)]
        light = asyncio.ensure_future(opening("light"))
        results = await asyncio.gather(*heavy, light, return_exceptions=True)
        refused = [r for r in results if isinstance(r, CapacityExceeded)]
        assert len(refused) == 1 and "'heavy'" in str(refused[0]) and refused[0].retry_after_ms > 0
        assert not isinstance(results[-1], BaseException)
        state.worker.shutdown()

    asyncio.run(run())


def test_a_full_queue_still_takes_a_key_below_its_share(target_engine: TargetEngine) -> None:
    async def run() -> None:
        state = _state(target_engine, BatchLimits(max_queue=4, max_batch_wait_ms=200))
        assert state.batcher is not None and state.verifier is not None
        batcher, verifier = state.batcher, state.verifier

        def opening(key: str, n: int):  # type: ignore[no-untyped-def]
            request = OpenSessionRequest(random_prompt(n), CONFIG)
            return batcher.submit(f"{key}{n}", 8, lambda: verifier.begin_open(request, owner=key), key=key)

        heavy = [asyncio.ensure_future(opening("heavy", n)) for n in range(5)]
        await asyncio.sleep(0)  # four queue, the fifth finds the queue full of heavy's steps
        light = asyncio.ensure_future(opening("light", 9))
        results = await asyncio.gather(*heavy, light, return_exceptions=True)
        assert [isinstance(r, CapacityExceeded) for r in results] == [False] * 4 + [True, False]
        state.worker.shutdown()

    asyncio.run(run())
