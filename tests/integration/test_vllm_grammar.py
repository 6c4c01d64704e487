"""Generation under a grammar on the vLLM engine (tests/grammar_cases.py): vLLM masks every row
it samples or verifies for a grammar session's live request (its drafts' and its bonus row), so
greedy speculative output and cloud_only equal the target alone under the grammar token for
token, synchronous and asynchronous; sampled output follows the target's constrained
distribution; drafts the grammar refuses are rejected at their own rows; a session that gets a
new request midway, or opens midway, goes on under its grammar where it was. On the tiny vLLM
target over the BPE tokenizer, its folder holding that tokenizer (the engine's grammars read it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cloud.engine.vllm import VllmKV
from cloud.engine.vllm_process import ProcessEngine
from cloud.engine.vllm_runtime import VllmOptions
from cloud.verifier import Verifier
from shared.grammar import Grammar, json_schema_grammar
from shared.protocol import AcceptMode, GrammarSpec, OpenSessionRequest, SessionConfig, VerifyRequest
from tests.grammar_cases import (
    GREEDY,
    PROMPTS,
    SCHEMAS,
    STOP,
    Bpe,
    check_greedy_equals_the_target_alone,
    check_sampling_follows_the_constrained_target,
    constrained_greedy,
)
from tests.harness import VLLM_CONTEXT, TargetEngine, padded_steps
from tests.ops import greedy_continuation
from tests.tiny_models import llama_bpe_tokenizer, tiny_vllm_target

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def bpe() -> Bpe:
    return Bpe.of(tiny_vllm_target(seed=3, vocab=len(llama_bpe_tokenizer())))


@pytest.fixture(scope="module")
def folder(bpe: Bpe, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm-grammar") / "target"
    bpe.target.save_pretrained(path)
    llama_bpe_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request: pytest.FixtureRequest, bpe: Bpe, folder: Path) -> TargetEngine:
    return TargetEngine("vllm", bpe.target, folder=folder, async_scheduling=request.param)


@pytest.mark.parametrize("schema", SCHEMAS, ids=list(SCHEMAS))
def test_greedy_under_a_schema_equals_the_target_alone(bpe: Bpe, engine: TargetEngine, schema: str) -> None:
    asyncio.run(check_greedy_equals_the_target_alone(bpe, engine, schema))


def test_sampling_under_a_grammar_follows_the_constrained_target(bpe: Bpe, engine: TargetEngine) -> None:
    """Point drafts on synchronous scheduling, sparse ones on asynchronous: each mode and each
    scheduling once (the masks do not depend on the mode; the chi-square tests take 10 s each)."""
    mode = AcceptMode.SPARSE if engine.async_scheduling else AcceptMode.POINT
    asyncio.run(check_sampling_follows_the_constrained_target(bpe, engine, mode))


def _grammar(bpe: Bpe, schema: str) -> Grammar:
    return bpe.vocab.compile(json_schema_grammar(SCHEMAS[schema], compact=True))


def _open(verifier: Verifier, bpe: Bpe, prompt: list[int], grammar: Grammar, generated: int = 0) -> tuple[str, int]:
    spec = GrammarSpec(grammar.text, tuple(STOP), generated)
    opened = verifier.open_session(OpenSessionRequest(prompt, SessionConfig(GREEDY, 0, AcceptMode.GREEDY, bpe.size, spec)))
    return opened.session_id, opened.position


def _live(verifier: Verifier, session_id: str) -> object:
    kv = verifier.sessions.get(session_id).cache
    assert isinstance(kv, VllmKV)
    return kv.live


def test_drafts_the_grammar_refuses_are_rejected_at_their_own_rows(bpe: Bpe, engine: TargetEngine) -> None:
    """Rounds drafting two of the target's tokens under the grammar, then its own free greedy
    tokens: a free draft the grammar refuses is rejected at its own row (however likely the
    target finds it) and corrected by the target's token under the grammar, so the session's
    tokens are the target alone under the grammar."""
    grammar = _grammar(bpe, "enum-and-bounded-int")
    prompt = PROMPTS[0]
    reference = constrained_greedy(bpe.target, prompt, grammar.start(STOP), 64)
    verifier = Verifier(engine(), "tiny", tokenizer=bpe.card)
    session_id, position = _open(verifier, bpe, prompt, grammar)
    tokens: list[int] = []
    refused = 0
    while len(tokens) < len(reference) and not STOP.intersection(tokens):
        head = reference[len(tokens) : len(tokens) + 2]
        drafts = head + greedy_continuation(bpe.target, prompt + tokens + head, 3)
        result = verifier.verify(VerifyRequest(session_id, position, drafts))
        refused += len(head) <= result.accepted_len < len(drafts)  # the target's argmax: only its grammar refuses it
        tokens += [*drafts[: result.accepted_len], result.next_token]
        position = result.new_base_position
    assert tokens[: len(reference)] == reference
    assert refused >= 2, "the target's free tokens leave the grammar"


def test_a_session_restarted_or_opened_midway_goes_on_under_its_grammar(bpe: Bpe, engine: TargetEngine) -> None:
    """A round catching up on tokens of the edge's own starts the session's new vLLM request,
    whose prompt holds tokens its grammar already read: its rows follow the grammar from where
    the session is. A session opened midway (its prompt's last tokens generated under the
    grammar) goes on the same way."""
    grammar = _grammar(bpe, "nested-array")
    prompt = PROMPTS[1]
    reference = constrained_greedy(bpe.target, prompt, grammar.start(STOP), 40)
    verifier = Verifier(engine(), "tiny", tokenizer=bpe.card)
    session_id, position = _open(verifier, bpe, prompt, grammar)
    first = verifier.verify(VerifyRequest(session_id, position, []))
    assert first.next_token == reference[0]
    request = _live(verifier, session_id)
    caught_up = VerifyRequest(session_id, first.new_base_position, [], committed_tokens=reference[1:6])
    result = verifier.verify(caught_up)
    assert result.next_token == reference[6] and _live(verifier, session_id) is not request
    result = verifier.verify(VerifyRequest(session_id, result.new_base_position, reference[7:10]))
    assert (result.accepted_len, result.next_token) == (3, reference[10])

    session_id, position = _open(verifier, bpe, prompt + reference[:12], grammar, generated=12)
    for i in range(12, 16):  # its own tokens, a step each
        result = verifier.verify(VerifyRequest(session_id, position, []))
        assert result.next_token == reference[i]
        position = result.new_base_position
    result = verifier.verify(VerifyRequest(session_id, position, reference[16:20]))
    assert (result.accepted_len, result.next_token) == (4, reference[20])


def test_a_new_request_cached_but_for_its_last_token_stays_under_the_grammar(bpe: Bpe, engine: TargetEngine) -> None:
    """A round asking for the target's top-k gets the session a new request (one that returns
    rows), whose prompt's whole blocks are cached but for its last token: vLLM 0.32 runs that
    step with placeholder drafts (-1), whose rows the grammar leaves open; the token its first
    row gives is the target's under the grammar."""
    grammar = _grammar(bpe, "nested-array")
    prompt = [(7 * i) % 250 + 3 for i in range(28)]  # with 5 tokens more, one whole block of 32 computed
    reference = constrained_greedy(bpe.target, prompt, grammar.start(STOP), 12)
    verifier = Verifier(engine(), "tiny", tokenizer=bpe.card)
    session_id, position = _open(verifier, bpe, prompt, grammar)
    tokens: list[int] = []
    for top_k in [0] * 5 + [4, 0]:
        result = verifier.verify(VerifyRequest(session_id, position, [], want_top_k=top_k))
        tokens.append(result.next_token)
        position = result.new_base_position
    assert tokens == reference[: len(tokens)]


def test_steps_padded_to_k_drafts_stay_under_the_grammar(bpe: Bpe, folder: Path) -> None:
    """Steps padded to K drafts (a GPU's full CUDA graphs): a grammar session's pads are drafts
    masked at their rows like the edge's, so its tokens, a step each, are the target's alone
    under the grammar, and the steps ran with pads."""
    grammar = _grammar(bpe, "nested-array")
    verifier = Verifier(TargetEngine("vllm", bpe.target, folder=folder)(), "tiny", tokenizer=bpe.card)
    with padded_steps(verifier.engine) as padded:
        for prompt in PROMPTS:
            reference = constrained_greedy(bpe.target, prompt, grammar.start(STOP), 64)
            session_id, position = _open(verifier, bpe, prompt, grammar)
            tokens: list[int] = []
            while not STOP.intersection(tokens) and len(tokens) < len(reference):
                result = verifier.verify(VerifyRequest(session_id, position, []))
                tokens.append(result.next_token)
                position = result.new_base_position
            assert tokens == reference
    assert sum(padded) > 0


def test_grammar_sessions_in_the_engine_process_equal_the_target_alone(bpe: Bpe, folder: Path) -> None:
    """--vllm-engine-process: the child keeps each session's place in its grammar itself (only
    the session's config crosses), and its rounds give the target's tokens under the grammar."""
    grammar = _grammar(bpe, "any-of")
    options = VllmOptions(str(folder), "float32", VLLM_CONTEXT, max_sessions=4, max_kv_bytes=64 << 20, enforce_eager=True)
    engine = ProcessEngine(options)
    try:
        verifier = Verifier(engine, "tiny", tokenizer=bpe.card)
        for prompt in PROMPTS:
            reference = constrained_greedy(bpe.target, prompt, grammar.start(STOP), 32)
            session_id, position = _open(verifier, bpe, prompt, grammar)
            tokens: list[int] = []
            while not STOP.intersection(tokens) and len(tokens) < len(reference):
                drafts = reference[len(tokens) : len(tokens) + 2]
                result = verifier.verify(VerifyRequest(session_id, position, drafts))
                tokens += [*drafts[: result.accepted_len], result.next_token]
                position = result.new_base_position
            assert tokens[: len(reference)] == reference  # past the stop id, the grammar says nothing
    finally:
        engine.close()
