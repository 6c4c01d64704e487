"""Auto mode through the real gRPC server: Decode stretches and speculative rounds advance one
session; greedy output equals cloud_only token for token (fp32) however often the mode
switches; the first tokens come from the target; the round log, the result and the Decode
call say what produced each token."""

import asyncio
from dataclasses import replace
from itertools import accumulate

import grpc
import pytest

from edge.drafting.kpolicy import FixedK
from edge.round.generate import cloud_only_generate, speculative_generate
from edge.round.mode_switch import CLOUD_ONLY, SPECULATIVE, ModeMemory, SwitchRules
from shared.errors import InvalidRequest, PositionMismatch
from shared.pb import verifier_pb2 as pb
from shared.protocol import DecodeRequest, OpenSessionRequest, SamplingParams, SessionConfig, VerifyRequest
from tests.harness import TargetEngine, gen_config, make_drafter, random_prompt, running_verifier

PROMPTS = [random_prompt(seed, length=3 + seed % 9) for seed in range(8)]
# Switch after every round and every 1-3 token stretch: every boundary kind is crossed many times.
FLIPPING = SwitchRules(
    first_stretch_tokens=1,
    max_warmup_stretch_tokens=1,
    min_rounds=1,
    window=1,
    keep_ratio=1e9,  # speculation always "loses": back to the target after each round
    backoff_tokens=1,
    max_backoff_tokens=3,
)


@pytest.mark.parametrize("beside", [True, False], ids=["prefill-beside", "prefill-between"])
@pytest.mark.parametrize("rules", [SwitchRules(), FLIPPING], ids=["default-rules", "forced-switches"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(repetition_penalty=1.3)], ids=["plain", "rep-penalty"])
def test_auto_greedy_equals_cloud_only(
    target_engine: TargetEngine, draft_model, rules: SwitchRules, params, beside: bool
) -> None:
    async def run() -> None:
        cfg = gen_config(max_new_tokens=32, params=params)
        auto = replace(cfg, mode_switch=rules, prefill_beside=beside)
        async with running_verifier(target_engine) as (client, _):
            switched = 0
            for prompt in PROMPTS:
                reference = await cloud_only_generate(prompt, client, cfg)
                result = await speculative_generate(prompt, make_drafter(draft_model, params), client, FixedK(3), auto)
                assert result.token_ids == reference.token_ids, f"prompt {prompt}"
                assert sum(result.tokens_by_mode.values()) == len(result.token_ids)
                assert result.mode_switches[0]["to"] == CLOUD_ONLY and result.mode_switches[0]["why"] == "start"
                switched += len(result.mode_switches) - 1
                assert result.round_log[0].mode == CLOUD_ONLY  # the first token comes from the target
            if rules is FLIPPING:
                assert switched >= 8 * len(PROMPTS)  # both directions, many times per prompt

    asyncio.run(run())


def test_a_lost_probe_carries_to_the_next_generation_of_the_process(target_engine: TargetEngine, draft_model) -> None:
    """Speculation that loses (it always does here) puts the next generation on hold: it runs on
    the target from its first token, without the drafter, and its output is still cloud_only's."""
    losing = SwitchRules(min_rounds=1, window=1, keep_ratio=1e9, backoff_tokens=40, max_backoff_tokens=80)

    async def run() -> None:
        cfg = gen_config(max_new_tokens=16)
        memory = ModeMemory()
        auto = replace(cfg, mode_switch=losing, mode_memory=memory, prefill_beside=False)
        async with running_verifier(target_engine) as (client, _):
            first = await speculative_generate(PROMPTS[2], make_drafter(draft_model), client, FixedK(3), auto)
            assert "slower" in {s["why"] for s in first.mode_switches}
            assert memory.hold > 0 and memory.backoff == 80 and memory.target_rate > 0
            held = memory.hold
            second = await speculative_generate(PROMPTS[3], make_drafter(draft_model), client, FixedK(3), auto)
            reference = await cloud_only_generate(PROMPTS[3], client, cfg)
        assert second.token_ids == reference.token_ids
        assert second.tokens_by_mode == {CLOUD_ONLY: 16} and second.rounds == 0
        assert "lost its last probe" in second.mode_switches[0]["reason"] and len(second.mode_switches) == 1
        assert memory.hold == held - 16

    asyncio.run(run())


@pytest.mark.parametrize("above", [None, 1, 0], ids=["never-asks", "not-loaded", "loaded"])
def test_a_loaded_verifier_keeps_auto_mode_speculating(target_engine: TargetEngine, draft_model, above: int | None) -> None:
    """cloud-verifier --prefer-speculation-above N: while more than N sessions are open, each reply
    asks for speculation, and auto mode speculates even where its own rates say the target is
    faster (a keep ratio no speculation meets), dropping the hold a lost probe left; the next
    generation starts from that answer. The output is cloud_only's either way."""
    losing = SwitchRules(min_rounds=1, window=1, keep_ratio=1e9, backoff_tokens=40, max_backoff_tokens=80)

    async def run() -> None:
        cfg = gen_config(max_new_tokens=24)
        memory = ModeMemory(target_rate=100.0, backoff=80, hold=8)  # a probe lost before the load came
        auto = replace(cfg, mode_switch=losing, mode_memory=memory, prefill_beside=False)
        async with running_verifier(target_engine, prefer_speculation_above=above) as (client, _):
            first = await speculative_generate(PROMPTS[2], make_drafter(draft_model), client, FixedK(3), auto)
            second = await speculative_generate(PROMPTS[3], make_drafter(draft_model), client, FixedK(3), auto)
            references = [await cloud_only_generate(p, client, cfg) for p in PROMPTS[2:4]]
        assert [first.token_ids, second.token_ids] == [r.token_ids for r in references]
        reasons = {s["why"] for r in (first, second) for s in r.mode_switches}
        if above == 0:  # one open session is more than 0: loaded
            assert memory.verifier_asked and "verifier_loaded" in reasons and "slower" not in reasons, reasons
            assert first.tokens_by_mode[SPECULATIVE] > 0 and second.tokens_by_mode[SPECULATIVE] > 16
            assert second.mode_switches[0]["why"] == "start" and second.mode_switches[1]["why"] == "verifier_loaded"
            assert len(second.mode_switches) == 2  # speculation to the end
        else:
            assert not memory.verifier_asked and "verifier_loaded" not in reasons and "slower" in reasons, reasons

    asyncio.run(run())


def test_round_log_and_result_say_which_mode_made_each_token(target_engine: TargetEngine, draft_model) -> None:
    async def run() -> None:
        cfg = replace(gen_config(max_new_tokens=24), mode_switch=FLIPPING)
        async with running_verifier(target_engine) as (client, _):
            result = await speculative_generate(PROMPTS[1], make_drafter(draft_model), client, FixedK(2), cfg)
        stretch_tokens = sum(len(r.decoded) for r in result.round_log if r.mode == CLOUD_ONLY)
        spec_tokens = sum(r.accepted_len + 1 for r in result.round_log if r.mode == SPECULATIVE)
        assert result.tokens_by_mode == {CLOUD_ONLY: stretch_tokens, SPECULATIVE: len(result.token_ids) - stretch_tokens}
        assert spec_tokens >= result.tokens_by_mode[SPECULATIVE]  # the last round may pass max_new_tokens
        assert result.stretches == sum(r.mode == CLOUD_ONLY for r in result.round_log)
        reasons = [r.switch for r in result.round_log if r.switch]
        assert len(reasons) == len(result.mode_switches)  # each switch is on the record that follows it
        assert {s["why"] for s in result.mode_switches} >= {"start", "drafter_ready", "slower", "probe_speculation"}
        assert any("tok/s" in s["reason"] for s in result.mode_switches)  # the rates that decided it

    asyncio.run(run())


def test_speculation_that_measures_slower_stops_and_is_probed_again(target_engine: TargetEngine, draft_model) -> None:
    """A keep ratio no speculation meets: the target decodes in doubling stretches between probes."""

    async def run() -> None:
        rules = SwitchRules(min_rounds=2, window=2, keep_ratio=1e9, backoff_tokens=4, max_backoff_tokens=8)
        cfg = replace(gen_config(max_new_tokens=60), mode_switch=rules)
        async with running_verifier(target_engine) as (client, _):
            result = await speculative_generate(PROMPTS[2], make_drafter(draft_model), client, FixedK(2), cfg)
        stretches = [len(r.decoded) for r in result.round_log if r.mode == CLOUD_ONLY and r.switch.startswith("speculation")]
        assert stretches[:3] == [4, 8, 8]
        assert result.tokens_by_mode[CLOUD_ONLY] > result.tokens_by_mode[SPECULATIVE]

    asyncio.run(run())


# ---- the Decode call ----------------------------------------------------------------------


def test_decode_and_verify_advance_one_session(target_engine: TargetEngine) -> None:
    """Opened by a Decode call, decoded, verified with no drafts, decoded again: the tokens are
    the target's greedy continuation, positions follow, and the session's KV is held once."""

    async def run() -> None:
        prompt, config = PROMPTS[4], SessionConfig(vocab_size=96)
        async with running_verifier(target_engine) as (client, verifier):
            reference = await cloud_only_generate(prompt, client, gen_config(max_new_tokens=9))
            chunks = [c async for c in client.decode(DecodeRequest("", 0, 3, open=OpenSessionRequest(prompt, config)))]
            assert chunks[0].opened is not None and all(c.opened is None for c in chunks[1:])
            session = chunks[0].opened.session_id
            tokens = [t for c in chunks for t in c.tokens]
            # A chunk's position counts its tokens: a reader that fell behind gets several in one.
            assert [c.position for c in chunks] == list(accumulate((len(c.tokens) for c in chunks), initial=len(prompt)))[1:]
            assert len(tokens) == 3 and [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
            assert len(verifier.sessions) == 1
            reply = await client.verify(VerifyRequest(session, len(prompt) + 3, []))
            tokens.append(reply.next_token)
            more = [c async for c in client.decode(DecodeRequest(session, len(prompt) + 4, 5))]
            tokens += [t for c in more for t in c.tokens]
            assert tokens == reference.token_ids
            assert all(c.step_ms > 0 for c in chunks + more)
            assert len(verifier.sessions) == 1

    asyncio.run(run())


def test_decode_stops_at_a_stop_token_and_refuses_bad_requests(target_engine: TargetEngine) -> None:
    async def run() -> None:
        prompt, config = PROMPTS[5], SessionConfig(vocab_size=96)
        async with running_verifier(target_engine) as (client, _):
            free = await cloud_only_generate(prompt, client, gen_config(max_new_tokens=8))
            stop = free.token_ids[3]
            first = free.token_ids.index(stop)
            opening = DecodeRequest("", 0, 8, [stop], open=OpenSessionRequest(prompt, config))
            chunks = [c async for c in client.decode(opening)]
            assert [t for c in chunks for t in c.tokens] == free.token_ids[: first + 1] and chunks[-1].finished
            session = chunks[0].opened.session_id
            with pytest.raises(PositionMismatch) as wrong:
                [c async for c in client.decode(DecodeRequest(session, len(prompt), 2))]
            assert wrong.value.server_position == len(prompt) + first + 1
            for bad in (DecodeRequest(session, len(prompt) + first + 1, 0), DecodeRequest(session, 0, 2, [10**6])):
                with pytest.raises(InvalidRequest):
                    [c async for c in client.decode(bad)]

    asyncio.run(run())


def test_a_decode_call_names_its_session_or_opens_one(target_engine: TargetEngine) -> None:
    async def run() -> None:
        async with running_verifier(target_engine) as (client, _):
            stub = client._stubs[client.replicas.addresses[0]]  # raw messages a client could send
            both = pb.DecodeRequest(session_id="x", max_tokens=1)
            both.open.prompt_tokens.append(3)
            for request in (pb.DecodeRequest(max_tokens=1), both):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [c async for c in stub.Decode(request)]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "exactly one of session_id and open" in (err.value.details() or "")

    asyncio.run(run())
