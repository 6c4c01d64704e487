"""A chat's next turn starts from the KV its last turn left (a kept prefix, or vLLM's prefix
cache under the key's salt): through the real gRPC server, every later turn's tokens equal the
target's own greedy tokens for the whole conversation (fp32), by every way a session opens
(OpenSession, a Decode call that opens it, a Generate stream); keys never share a prefix; a
prefix that is gone costs only a prefill."""

import asyncio

from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.drafting.kpolicy import FixedK
from edge.round.generate import cloud_only_generate, speculative_generate
from shared.api_keys import Caller
from shared.protocol import DecodeRequest, OpenSessionRequest, OpenSessionResult, SessionConfig
from tests.harness import TargetEngine, engine_of, gen_config, make_drafter, random_prompt, running_verifier
from tests.ops import metric_samples

CONFIG = SessionConfig(vocab_size=96)
TURN = 12  # new tokens a turn


def _user_turn(seed: int) -> list[int]:
    return random_prompt(100 + seed, length=5)


async def _decode_opening(client, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """A Decode stretch that opens its session (auto mode's start), then its close."""
    tokens, session = [], ""
    async for chunk in client.decode(DecodeRequest("", 0, n, open=OpenSessionRequest(prompt, CONFIG))):
        session = chunk.opened.session_id if chunk.opened is not None else session
        tokens += chunk.tokens
    await client.close_session(session)
    return tokens


def test_each_turn_equals_the_target_alone(target_engine: TargetEngine, draft_lm) -> None:
    """Four turns of one conversation, each opened another way, on one verifier: each turn's
    tokens are the target's greedy continuation of the whole history."""
    cfg = gen_config(max_new_tokens=TURN)

    async def run() -> None:
        async with running_verifier(target_engine) as (client, verifier):
            history = random_prompt(7, length=20)
            for turn in range(4):
                if turn == 0 or turn == 2:
                    drafter = make_drafter(draft_lm)
                    reply = (await speculative_generate(history, drafter, client, FixedK(3), cfg)).token_ids
                elif turn == 1:
                    reply = (await cloud_only_generate(history, client, cfg)).token_ids
                else:
                    reply = await _decode_opening(client, history, TURN)
                assert reply == target_engine.greedy_continuation(history, TURN), f"turn {turn}"
                history = history + reply + _user_turn(turn)
            reused, prefilled, _, _ = verifier.sessions.prefix_totals()
            if not verifier.engine.caches_prefixes:  # vLLM reuses inside its own prefix cache
                assert reused > prefilled  # three turns of four started from the last turn's KV

    asyncio.run(run())


def test_reuse_off_keeps_nothing(target_model) -> None:
    cfg = gen_config(max_new_tokens=TURN)

    async def run() -> None:
        limits = VerifierLimits(reuse_prefixes=False)
        async with running_verifier(TargetEngine("transformers", target_model), limits) as (client, verifier):
            history = random_prompt(8, length=20)
            reply = (await cloud_only_generate(history, client, cfg)).token_ids
            await cloud_only_generate(history + reply + _user_turn(0), client, cfg)
            assert len(verifier.sessions.prefixes) == 0
            assert verifier.sessions.prefix_totals()[0] == 0

    asyncio.run(run())


def _open(verifier: Verifier, prompt: list[int], owner: str, reuse_token: str = "") -> OpenSessionResult:
    step = verifier.begin_open(OpenSessionRequest(prompt, CONFIG, reuse_token), owner=owner)
    [opened] = verifier.run_batch([(step, 0.0)])
    assert isinstance(opened, OpenSessionResult)
    return opened


def _opened(verifier: Verifier, prompt: list[int], owner: str) -> str:
    return _open(verifier, prompt, owner).session_id


def test_a_prefix_never_crosses_api_keys(forward_pass_engine: TargetEngine) -> None:
    verifier = Verifier(engine_of(forward_pass_engine), "tiny-target")
    prompt = random_prompt(9, length=30)
    alice = _open(verifier, prompt, "alice")
    verifier.close_session(alice.session_id, "alice")
    assert len(verifier.sessions.prefixes) == 1
    bob = _open(verifier, prompt + [5], "bob", alice.reuse_token)  # the same tokens, another key: alice's token names nothing
    verifier.close_session(bob.session_id, "bob")
    assert bob.reused_tokens == 0 and verifier.sessions.prefix_totals()[0] == 0  # bob prefilled everything
    assert [kept.owner for kept in verifier.sessions.prefixes.entries()] == ["alice", "bob"]
    again = _open(verifier, prompt + [5, 6], "alice", alice.reuse_token)
    assert again.reused_tokens == len(prompt) - 1  # alice's own, not bob's longer one
    assert verifier.sessions.get(again.session_id, "alice").cache.get_seq_length() == len(prompt) + 1
    state = ServerState.for_verifier(verifier)  # what /v1/stats shows each key: its own reuse only
    assert state.prefix_reuse(Caller("bob", sees_all=False))["reused_tokens"] == 0
    assert state.prefix_reuse(Caller("bob", sees_all=False))["kept_prefixes"] == 1
    assert state.prefix_reuse(Caller("alice", sees_all=False))["reused_tokens"] == len(prompt) - 1
    assert state.prefix_reuse(Caller("alice", sees_all=False))["kept_prefixes"] == 0


def test_a_prefix_that_is_gone_costs_a_prefill(forward_pass_engine: TargetEngine) -> None:
    """Evicted for room (or a restarted verifier: nothing kept), the next turn prefills it all
    and still equals the target alone."""
    cfg = gen_config(max_new_tokens=TURN)

    async def run() -> None:
        async with running_verifier(forward_pass_engine) as (client, verifier):
            history = random_prompt(10, length=20)
            reply = (await cloud_only_generate(history, client, cfg)).token_ids
            for _ in range(100):  # the stream's end reaches the model worker just after its last chunk
                if len(verifier.sessions.prefixes):
                    break
                await asyncio.sleep(0.01)
            assert len(verifier.sessions.prefixes) == 1
            await verifier_worker(verifier)  # the room another session needs takes it
            history = history + reply + _user_turn(1)
            again = (await cloud_only_generate(history, client, cfg)).token_ids
            assert again == forward_pass_engine.greedy_continuation(history, TURN)
            assert verifier.sessions.prefix_totals()[0] == 0

    async def verifier_worker(verifier: Verifier) -> None:
        [kept] = verifier.sessions.prefixes.entries()  # the room its own client's next session needs
        cap_tokens = verifier.limits.sessions.max_kv_bytes // verifier.sessions.kv_bytes_per_token
        verifier.sessions.reserve(cap_tokens, scope=kept.scope)
        assert len(verifier.sessions.prefixes) == 0

    asyncio.run(run())


def test_metrics_show_reuse(target_model) -> None:
    verifier = Verifier(engine_of(target_model), "tiny-target")
    state = ServerState.for_verifier(verifier)
    prompt = random_prompt(11, length=30)
    first = _open(verifier, prompt, "")
    verifier.close_session(first.session_id, "")
    samples = metric_samples(_scraped(state))
    assert samples[("specdec_prefix_cache_entries", frozenset())] == 1
    assert samples[("specdec_prefix_cache_bytes", frozenset())] == 29 * verifier.sessions.kv_bytes_per_token
    _open(verifier, prompt + [3, 4], "", first.reuse_token)
    samples = metric_samples(_scraped(state))
    assert samples[("specdec_prefix_reused_tokens_total", frozenset())] == 29
    assert samples[("specdec_prefix_prefilled_tokens_total", frozenset())] == 30 + 3
    assert samples[("specdec_prefix_cache_entries", frozenset())] == 0


def _scraped(state: ServerState) -> str:
    state.sessions()  # what a scrape of /metrics runs first
    return state.metrics.exposition().decode()


def test_slots_reuse_equals_the_target_alone(target_model) -> None:
    cfg = gen_config(max_new_tokens=TURN)
    target = TargetEngine("transformers", target_model)

    async def run() -> None:
        limits = VerifierLimits(kv_layout="slots", kv_slot_tokens=128)
        async with running_verifier(target, limits) as (client, verifier):
            history = random_prompt(12, length=20)
            for turn in range(3):
                reply = (await cloud_only_generate(history, client, cfg)).token_ids
                assert reply == target.greedy_continuation(history, TURN), f"turn {turn}"
                history = history + reply + _user_turn(turn)
            assert verifier.sessions.prefix_totals()[0] > 0

    asyncio.run(run())
