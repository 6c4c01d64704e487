"""Generation under a grammar (shared/grammar.py), end to end through the real gRPC verifier with
tiny real models and a byte-level BPE tokenizer: greedy speculative output equals the target
alone under the same grammar, token for token, on every engine that takes grammars; sampled
output follows the target's constrained distribution; every output is valid under its schema;
forced tokens are drafted without a forward pass; bad grammars are refused alone."""

from __future__ import annotations

import asyncio

import pytest

from edge.drafting.kpolicy import FixedK
from edge.round.generate import speculative_generate
from shared.errors import InvalidRequest, SessionRefused
from shared.grammar import json_schema_grammar
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
    grammar_config,
    grammar_drafter,
)
from tests.harness import TargetEngine, gguf_lm, running_verifier
from tests.tiny_models import llama_bpe_tokenizer, save_gguf, tiny_target


@pytest.fixture(scope="module")
def bpe() -> Bpe:
    return Bpe.of(tiny_target(seed=3, vocab=len(llama_bpe_tokenizer())))


@pytest.fixture(scope="module", params=["transformers", "llama.cpp"])
def engine(request, bpe: Bpe, tmp_path_factory) -> TargetEngine:  # type: ignore[no-untyped-def]
    if request.param == "llama.cpp":
        gguf = save_gguf(bpe.target, tmp_path_factory.mktemp("grammar") / "target.gguf")
        return TargetEngine("llama.cpp", bpe.target, gguf=gguf)
    return TargetEngine("transformers", bpe.target)


@pytest.mark.parametrize("schema", SCHEMAS, ids=list(SCHEMAS))
def test_greedy_under_a_schema_equals_the_target_alone(bpe: Bpe, engine: TargetEngine, schema: str) -> None:
    asyncio.run(check_greedy_equals_the_target_alone(bpe, engine, schema))


def test_a_llamacpp_drafter_drafts_under_the_grammar(bpe: Bpe, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The llama.cpp draft runtime (numpy logits, as the laptop runs it) under the grammar."""
    grammar = bpe.vocab.compile(json_schema_grammar(SCHEMAS["nested-array"], compact=True))
    lm = gguf_lm(bpe.draft, tmp_path)

    async def run() -> None:
        async with running_verifier(TargetEngine("transformers", bpe.target), tokenizer=bpe.card) as (client, _):
            for prompt in PROMPTS[:2]:
                reference = constrained_greedy(bpe.target, prompt, grammar.start(STOP), 128)
                drafter = grammar_drafter(bpe, grammar, prompt, lm=lm)
                result = await speculative_generate(prompt, drafter, client, FixedK(4), grammar_config(bpe, grammar, 128))
                assert result.token_ids == reference
                assert result.accepted_by.get("model", 0) > 0  # the model's drafts passed too, not only forced ones

    asyncio.run(run())


def test_forced_tokens_are_drafted_without_a_forward_pass(bpe: Bpe) -> None:
    """The object's braces, quotes and key names are the only tokens the grammar allows where
    they stand: they ride in the draft (q = 1, source "grammar") and are all accepted."""
    grammar = bpe.vocab.compile(json_schema_grammar(SCHEMAS["enum-and-bounded-int"], compact=True))

    async def run() -> None:
        async with running_verifier(TargetEngine("transformers", bpe.target), tokenizer=bpe.card) as (client, _):
            drafter = grammar_drafter(bpe, grammar, PROMPTS[0])
            result = await speculative_generate(PROMPTS[0], drafter, client, FixedK(4), grammar_config(bpe, grammar, 64))
        forced = [(r, i) for r in result.round_log for i, s in enumerate(r.sources) if s == "grammar"]
        assert drafter.forced_tokens == len(forced) >= 8  # {"x":" and ","n": at least
        # A forced token is certain once the drafts before it pass: never the first one rejected.
        assert not [(r.round, i) for r, i in forced if i == r.accepted_len]
        model_drafted = sum(1 for r in result.round_log for s in r.sources if s == "model")
        assert drafter.forward_passes <= model_drafted + 1  # the prompt's pass, then one a model token, none a forced one

    asyncio.run(run())


@pytest.mark.parametrize("mode", [AcceptMode.POINT, AcceptMode.SPARSE], ids=["point", "sparse"])
def test_sampling_under_a_grammar_follows_the_constrained_target(bpe: Bpe, mode: AcceptMode) -> None:
    asyncio.run(check_sampling_follows_the_constrained_target(bpe, TargetEngine("transformers", bpe.target), mode))


def test_a_verifier_refuses_bad_grammars_alone(bpe: Bpe) -> None:
    grammar = bpe.vocab.compile(json_schema_grammar(SCHEMAS["any-of"], compact=True))

    async def run() -> None:
        async with running_verifier(TargetEngine("transformers", bpe.target), tokenizer=bpe.card) as (client, _):

            def opening(spec: GrammarSpec) -> OpenSessionRequest:
                return OpenSessionRequest(PROMPTS[0], SessionConfig(GREEDY, 0, AcceptMode.GREEDY, bpe.size, spec))

            for spec, says in [
                (GrammarSpec("start: %json{", (2,)), "grammar was refused"),
                (GrammarSpec("x" * (65 * 1024), (2,)), "1 to 65536 bytes"),
                (GrammarSpec(grammar.text, ()), "stop_token_ids"),
                (GrammarSpec(grammar.text, (9999,)), "outside"),
            ]:
                with pytest.raises(InvalidRequest, match=says):
                    await client.open_session(opening(spec))
            opened = await client.open_session(opening(GrammarSpec(grammar.text, (2,))))
            off_grammar = VerifyRequest(opened.session_id, opened.position, committed_tokens=[5], draft_tokens=[])
            with pytest.raises(InvalidRequest, match="breaks the grammar"):
                await client.verify(off_grammar)
            # the session goes on: a round at its position is served
            on_grammar = VerifyRequest(opened.session_id, opened.position, draft_tokens=[])
            assert grammar.start(STOP).allowed()[(await client.verify(on_grammar)).next_token]

        async with running_verifier(TargetEngine("transformers", bpe.target)) as (client, _):  # no tokenizer
            with pytest.raises(SessionRefused, match="no tokenizer.json"):
                await client.open_session(
                    OpenSessionRequest(
                        PROMPTS[0], SessionConfig(GREEDY, 0, AcceptMode.GREEDY, bpe.size, GrammarSpec(grammar.text, (2,)))
                    )
                )

    asyncio.run(run())
