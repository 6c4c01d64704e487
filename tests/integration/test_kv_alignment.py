"""After many rounds both caches hold exactly the committed prefix: lengths, and values equal
to a fresh prefill of that prefix."""

import asyncio

import torch
from transformers import DynamicCache, PreTrainedModel

from edge.drafting.kpolicy import LaRatioK
from edge.round.generate import speculative_generate
from shared import lm
from shared.protocol import OpenSessionRequest, SessionConfig, VerifyRequest
from tests.harness import gen_config, make_drafter, random_prompt, running_verifier


def _assert_cache_is_prefill_of(model: PreTrainedModel, cache: DynamicCache, tokens: list[int]) -> None:
    assert cache.get_seq_length() == len(tokens)
    fresh = lm.new_cache(model)
    lm.forward(model, fresh, tokens)
    for got, want in zip(cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)


def test_both_caches_hold_the_committed_prefix(target_model, draft_model) -> None:
    async def run() -> None:
        async with running_verifier(target_model) as (client, verifier):
            drafter = make_drafter(draft_model)
            prompt = random_prompt(3)
            cfg = gen_config(max_new_tokens=60)
            # Keep the session open: generate through the loop, then inspect before closing.
            result = await speculative_generate(prompt, drafter, client, LaRatioK(), cfg)
            committed = prompt + result.token_ids
            assert result.rounds > 5
            # The drafter synced to the committed sequence: its cache holds a prefix of it, short by
            # the correction token, or also by the last draft when the round ended in a bonus.
            cached = len(drafter.cache)
            assert len(committed) - 2 <= cached <= len(committed) - 1
            _assert_cache_is_prefill_of(draft_model, drafter.cache.kv, committed[:cached])
            # The verifier's session was closed; replay the same rounds on a fresh session instead.
            opened = verifier.open_session(OpenSessionRequest(prompt, SessionConfig(vocab_size=96)))
            session = verifier.sessions.get(opened.session_id)
            position = len(prompt)
            for record in result.round_log:
                reply = verifier.verify(VerifyRequest(opened.session_id, position, record.draft_tokens))
                assert (reply.accepted_len, reply.next_token) == (record.accepted_len, record.next_token)
                position = reply.new_base_position
            # The last round may have run past max_new_tokens; compare to what the server committed.
            assert session.tokens[: len(committed)] == committed
            _assert_cache_is_prefill_of(target_model, session.cache, session.tokens[:-1])

    asyncio.run(run())


def test_drafter_sync_keeps_only_the_valid_prefix(draft_model) -> None:
    drafter = make_drafter(draft_model)
    tokens = random_prompt(5, length=10)
    drafter.sync(tokens)
    draft = drafter.propose(5)
    assert len(drafter.cache) == len(tokens) + len(draft) - 1
    # The cloud accepted two drafts and corrected the third.
    committed = tokens + draft.token_ids[:2] + [(draft.token_ids[2] + 1) % 96]
    drafter.sync(committed)
    assert len(drafter.cache) == len(tokens) + 2
    _assert_cache_is_prefill_of(draft_model, drafter.cache.kv, committed[: len(tokens) + 2])
