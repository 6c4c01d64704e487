"""The verifier with --kv-layout slots: batched rounds equal each session alone (greedy fp32)
over joins, leaves, evictions and crops; a failed pass touches no session; the KV accounting is
the pool's allocation."""

import asyncio
import random

import pytest

from cloud.batch_step import ForwardStep
from cloud.batcher import BatchLimits
from cloud.engine.kv_slots import SlotKV
from cloud.engine.transformers import TransformersEngine
from cloud.sessions import SessionLimits
from cloud.verifier import Verifier, VerifierLimits
from edge.drafting.kpolicy import FixedK
from edge.round.generate import cloud_only_generate, speculative_generate
from shared.errors import SessionNotFound
from shared.protocol import OpenSessionRequest, SessionConfig, VerifyRequest
from tests.harness import TargetEngine, gen_config, make_drafter, random_prompt
from tests.integration.test_batching import PROMPTS, _alone, _mean_batch, batching_verifier

CONFIG = SessionConfig(vocab_size=96)


def _slots(model, max_sessions: int = 8, slot_tokens: int = 128) -> Verifier:  # type: ignore[no-untyped-def]
    return Verifier(
        TransformersEngine(model),
        "tiny-target",
        VerifierLimits(kv_layout="slots", kv_slot_tokens=slot_tokens, sessions=SessionLimits(max_sessions=max_sessions)),
    )


def _check_accounting(verifier: Verifier) -> None:
    assert isinstance(verifier.engine, TransformersEngine)
    pool = verifier.engine.pool
    assert pool is not None
    assert pool.nbytes == sum(t.numel() * t.element_size() for t in (*pool.keys, *pool.values))
    assert verifier.limits.sessions.max_kv_bytes == pool.nbytes  # the cap is what was allocated
    holders = len(verifier.sessions) + len(verifier.sessions.prefixes)  # kept prefixes hold their slots
    assert verifier.sessions.kv_bytes() == holders * pool.slot_bytes
    assert pool.free_slots == pool.slots - holders
    held = [s.cache for s in verifier.sessions] + [kept.kv for kept in verifier.sessions.prefixes.entries()]
    assert all(isinstance(kv, SlotKV) and not kv.released for kv in held)
    assert len({kv.slot for kv in held if isinstance(kv, SlotKV)}) == len(held)  # no slot shared


def test_slots_server_batched_equals_each_alone(target_model, draft_model) -> None:
    """Four speculative edges and four cloud_only streams at once on a slots verifier, prompts
    prefilled in chunks of 4 tokens beside the other sessions' rounds."""
    cfg = gen_config(max_new_tokens=24)
    limits = VerifierLimits(kv_layout="slots", kv_slot_tokens=96, sessions=SessionLimits(max_sessions=8))
    target = TargetEngine("transformers", target_model)  # slot KV is the transformers engine's

    async def run() -> None:
        async with batching_verifier(
            target, BatchLimits(max_batch_size=8, max_batch_wait_ms=20, max_prefill_chunk=4), limits
        ) as (client, state):
            speculative = [speculative_generate(p, make_drafter(draft_model), client, FixedK(3), cfg) for p in PROMPTS[:4]]
            cloud_only = [cloud_only_generate(p, client, cfg) for p in PROMPTS[4:]]
            results = await asyncio.gather(*speculative, *cloud_only)
            assert _mean_batch(state) > 2.0
            _check_accounting(state.verifier)
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert result.token_ids == _alone(target, prompt, 24), f"prompt {prompt}"

    asyncio.run(run())


def _round(verifier: Verifier, session_id: str, tokens: list[int], draft: list[int]) -> ForwardStep:  # type: ignore[type-arg]
    return verifier.begin_verify(VerifyRequest(session_id, len(tokens), draft))


def test_rounds_over_joins_leaves_and_evictions_equal_each_alone(target_model) -> None:
    """Random batched rounds on a 3-slot verifier; a 4th session evicts the least recent, whose
    slot the newcomer takes. Each round's reply equals a packed verifier's round run alone."""
    rng = random.Random(3)
    slots, alone = _slots(target_model, max_sessions=3), Verifier(TransformersEngine(target_model), "reference")
    live: dict[str, tuple[str, list[int]]] = {}  # slots id -> (reference id, committed tokens)
    evicted = 0
    for step in range(40):
        if not live or (rng.random() < 0.25):
            prompt = random_prompt(step, length=rng.randint(2, 20))
            before = set(live)
            sid = slots.open_session(OpenSessionRequest(prompt, CONFIG)).session_id
            live[sid] = (alone.open_session(OpenSessionRequest(prompt, CONFIG)).session_id, list(prompt))
            for gone in before - {s.session_id for s in slots.sessions}:  # evicted: the least recently used
                with pytest.raises(SessionNotFound):
                    slots.begin_verify(VerifyRequest(gone, len(live[gone][1]), []))
                alone.close_session(live.pop(gone)[0])
                evicted += 1
        batch = rng.sample(sorted(live), rng.randint(1, len(live)))
        drafts = [[rng.randrange(96) for _ in range(rng.randint(0, 4))] for _ in batch]
        got = slots.run_batch([(_round(slots, sid, live[sid][1], d), 0.0) for sid, d in zip(batch, drafts, strict=True)])
        for sid, draft, reply in zip(batch, drafts, got, strict=True):
            ref_id, tokens = live[sid]
            want = alone.verify(VerifyRequest(ref_id, len(tokens), draft))
            assert (reply.accepted_len, reply.next_token, reply.new_base_position) == (
                want.accepted_len,
                want.next_token,
                want.new_base_position,
            )
            tokens += [*draft[: reply.accepted_len], reply.next_token]
            assert slots.sessions.get(sid).cache.get_seq_length() == len(tokens) - 1  # the rejected tail cropped
        if rng.random() < 0.15 and len(live) > 1:
            sid = rng.choice(sorted(live))
            slots.close_session(sid)
            alone.close_session(live.pop(sid)[0])
        _check_accounting(slots)
    assert evicted > 0


class _NoWork:
    def rule(self) -> None:
        return None

    def finish(self, *_: object) -> None:
        return None

    def undo(self) -> None:
        pass


def test_a_failed_pass_touches_no_session(target_model) -> None:
    slots, alone = _slots(target_model, max_sessions=4), Verifier(TransformersEngine(target_model), "reference")
    prompts = [random_prompt(seed, length=5 + seed) for seed in range(3)]
    ids = [slots.open_session(OpenSessionRequest(p, CONFIG)).session_id for p in prompts]
    refs = [alone.open_session(OpenSessionRequest(p, CONFIG)).session_id for p in prompts]
    lengths = [slots.sessions.get(sid).cache.get_seq_length() for sid in ids]
    victim = slots.sessions.get(ids[1])
    broken = ForwardStep(victim.cache, [10_000], work=_NoWork())  # an id past the embedding
    steps = [(_round(slots, ids[0], prompts[0], [7, 8]), 0.0), (broken, 0.0), (_round(slots, ids[2], prompts[2], [9]), 0.0)]
    with pytest.raises(IndexError):
        slots.run_batch(steps)
    assert [slots.sessions.get(sid).cache.get_seq_length() for sid in ids] == lengths
    for sid, ref, prompt in zip(ids, refs, prompts, strict=True):  # every session goes on as if nothing happened
        got = slots.verify(VerifyRequest(sid, len(prompt), [3, 4, 5]))
        want = alone.verify(VerifyRequest(ref, len(prompt), [3, 4, 5]))
        assert (got.accepted_len, got.next_token) == (want.accepted_len, want.next_token)
    _check_accounting(slots)


def test_a_session_longer_than_its_slot_is_refused(target_model) -> None:
    slots = _slots(target_model, max_sessions=2, slot_tokens=16)
    assert slots.limits.max_context_tokens == 16
    with pytest.raises(Exception, match="limit 16"):
        slots.open_session(OpenSessionRequest(random_prompt(1, length=17), CONFIG))
    _check_accounting(slots)
