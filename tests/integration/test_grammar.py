"""Generation under a grammar (shared/grammar.py), end to end through the real gRPC verifier with
tiny real models and a byte-level BPE tokenizer: greedy speculative output equals the target
alone under the same grammar, token for token, on every engine that takes grammars; sampled
output follows the target's constrained distribution; every output is valid under its schema;
forced tokens are drafted without a forward pass; bad grammars are refused alone."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, replace

import jsonschema
import pytest
import torch
from scipy.stats import chisquare
from transformers import PreTrainedModel

from edge.drafting.drafter import Drafter, DrafterConfig, DraftGrammar
from edge.drafting.kpolicy import CostK, FixedK
from edge.drafting.runtime_transformers import TransformersDraftLM
from edge.round.generate import GenerationConfig, cloud_only_generate, speculative_generate
from edge.round.mode_switch import ModeMemory, SwitchRules
from shared import lm
from shared.errors import InvalidRequest, SessionRefused
from shared.grammar import Constraint, Grammar, GrammarVocab, json_schema_grammar, masked
from shared.protocol import AcceptMode, GrammarSpec, OpenSessionRequest, SamplingParams, SessionConfig, VerifyRequest
from shared.sampling.verifier_torch import probs_from_logits
from shared.tokenizer_card import TokenizerCard
from tests.harness import TargetEngine, gguf_lm, running_verifier
from tests.tiny_models import llama_bpe_tokenizer, save_gguf, tiny_draft, tiny_target

STOP = frozenset({2})  # </s>
GREEDY = SamplingParams()
SCHEMAS = {
    "enum-and-bounded-int": {
        "type": "object",
        "properties": {"x": {"enum": ["ab", "cd", "abcd"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "n"],
        "additionalProperties": False,
    },
    "nested-array": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"k": {"type": "boolean"}, "s": {"type": "string", "maxLength": 2}},
                    "required": ["k", "s"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "any-of": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"enum": ["a", "b"]},
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        ]
    },
}
PROMPTS = [[5, 40, 77], [120, 9, 200, 31], [260, 7]]


@dataclass(frozen=True)
class Bpe:
    """A tiny pair on a byte-level BPE tokenizer grammars can read."""

    target: PreTrainedModel
    draft: PreTrainedModel
    card: TokenizerCard
    vocab: GrammarVocab
    decode: object

    @property
    def size(self) -> int:
        return self.vocab.width


@pytest.fixture(scope="module")
def bpe() -> Bpe:
    tokenizer = llama_bpe_tokenizer()
    source = tokenizer.backend_tokenizer.to_str()
    size = len(tokenizer)
    target = tiny_target(seed=3, vocab=size)
    card = TokenizerCard.of(tokenizer.backend_tokenizer, None, source)
    return Bpe(target, tiny_draft(target, noise=0.3), card, GrammarVocab(source, size), tokenizer.decode)


@pytest.fixture(scope="module", params=["transformers", "llama.cpp"])
def engine(request, bpe: Bpe, tmp_path_factory) -> TargetEngine:  # type: ignore[no-untyped-def]
    if request.param == "llama.cpp":
        gguf = save_gguf(bpe.target, tmp_path_factory.mktemp("grammar") / "target.gguf")
        return TargetEngine("llama.cpp", bpe.target, gguf=gguf)
    return TargetEngine("transformers", bpe.target)


def _config(bpe: Bpe, grammar: Grammar, max_new: int, params: SamplingParams = GREEDY, mode=AcceptMode.GREEDY, seed=0):  # type: ignore[no-untyped-def]
    session = SessionConfig(params, seed, mode, bpe.size, GrammarSpec(grammar.text, tuple(STOP)))
    return GenerationConfig(session, max_new, STOP)


def _drafter(bpe: Bpe, grammar: Grammar, prompt: list[int], params=GREEDY, mode=AcceptMode.GREEDY, seed=1, lm=None) -> Drafter:  # type: ignore[no-untyped-def]
    config = DrafterConfig(params, mode, bpe.size, draft_top_k=8, stop_token_ids=STOP)
    return Drafter(lm or TransformersDraftLM(bpe.draft), config, seed, grammar=DraftGrammar(grammar.start(STOP), len(prompt)))


def constrained_greedy(model: PreTrainedModel, prompt: list[int], constraint: Constraint, n: int) -> list[int]:
    """The target alone under the grammar, computed here: argmax of the masked logits, a step a token."""
    cache, feed, out = lm.new_cache(model), list(prompt), []
    for _ in range(n):
        logits = lm.forward(model, cache, feed)[-1].numpy()
        token = int(masked(logits, constraint.mask_rows([])[0]).argmax())
        out.append(token)
        if token in STOP:
            break
        constraint.sync(out)
        feed = [token]
    return out


def _valid(bpe: Bpe, tokens: list[int], schema: dict) -> None:  # type: ignore[type-arg]
    assert tokens[-1] in STOP, "the generation ran out of tokens before its grammar ended"
    jsonschema.validate(json.loads(bpe.decode(tokens[:-1])), schema)  # type: ignore[operator]


@pytest.mark.parametrize("schema", SCHEMAS, ids=list(SCHEMAS))
def test_greedy_under_a_schema_equals_the_target_alone(bpe: Bpe, engine: TargetEngine, schema: str) -> None:
    grammar = bpe.vocab.compile(json_schema_grammar(SCHEMAS[schema]))

    async def run() -> None:
        async with running_verifier(engine, tokenizer=bpe.card) as (client, _):
            for prompt in PROMPTS:
                reference = constrained_greedy(bpe.target, prompt, grammar.start(STOP), 128)
                _valid(bpe, reference, SCHEMAS[schema])
                cfg = _config(bpe, grammar, 128)
                alone = await cloud_only_generate(prompt, client, cfg)
                assert alone.token_ids == reference, f"cloud_only, prompt {prompt}"
                for policy in (FixedK(3), FixedK(8), CostK(1, 12)):
                    result = await speculative_generate(prompt, _drafter(bpe, grammar, prompt), client, policy, cfg)
                    assert result.token_ids == reference, f"{type(policy).__name__}, prompt {prompt}"
                # auto mode: the target alone first, then a probe of speculation, whose drafter
                # first syncs after tokens the grammar already took
                auto = replace(cfg, mode_switch=SwitchRules(), mode_memory=ModeMemory())
                result = await speculative_generate(prompt, _drafter(bpe, grammar, prompt), client, CostK(1, 12), auto)
                assert result.token_ids == reference, f"auto, prompt {prompt}"
                if len(reference) > SwitchRules().first_stretch_tokens:
                    assert {"cloud_only", "speculative"} <= set(result.tokens_by_mode), result.tokens_by_mode

    asyncio.run(run())


def test_a_llamacpp_drafter_drafts_under_the_grammar(bpe: Bpe, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The llama.cpp draft runtime (numpy logits, as the laptop runs it) under the grammar."""
    grammar = bpe.vocab.compile(json_schema_grammar(SCHEMAS["nested-array"]))
    lm = gguf_lm(bpe.draft, tmp_path)

    async def run() -> None:
        async with running_verifier(TargetEngine("transformers", bpe.target), tokenizer=bpe.card) as (client, _):
            for prompt in PROMPTS[:2]:
                reference = constrained_greedy(bpe.target, prompt, grammar.start(STOP), 128)
                drafter = _drafter(bpe, grammar, prompt, lm=lm)
                result = await speculative_generate(prompt, drafter, client, FixedK(4), _config(bpe, grammar, 128))
                assert result.token_ids == reference
                assert result.accepted_by.get("model", 0) > 0  # the model's drafts passed too, not only forced ones

    asyncio.run(run())


def test_forced_tokens_are_drafted_without_a_forward_pass(bpe: Bpe) -> None:
    """The object's braces, quotes and key names are the only tokens the grammar allows where
    they stand: they ride in the draft (q = 1, source "grammar") and are all accepted."""
    grammar = bpe.vocab.compile(json_schema_grammar(SCHEMAS["enum-and-bounded-int"]))

    async def run() -> None:
        async with running_verifier(TargetEngine("transformers", bpe.target), tokenizer=bpe.card) as (client, _):
            drafter = _drafter(bpe, grammar, PROMPTS[0])
            result = await speculative_generate(PROMPTS[0], drafter, client, FixedK(4), _config(bpe, grammar, 64))
        forced = [(r, i) for r in result.round_log for i, s in enumerate(r.sources) if s == "grammar"]
        assert drafter.forced_tokens == len(forced) >= 8  # {"x":" and ","n": at least
        # A forced token is certain once the drafts before it pass: never the first one rejected.
        assert not [(r.round, i) for r, i in forced if i == r.accepted_len]
        model_drafted = sum(1 for r in result.round_log for s in r.sources if s == "model")
        assert drafter.forward_passes <= model_drafted + 1  # the prompt's pass, then one a model token, none a forced one

    asyncio.run(run())


ENUM = {"enum": ["a", "ab", "abcd", "cd", "b"]}
TRIALS = 600


def _paths(bpe: Bpe, prompt: list[int], constraint: Constraint, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Every token sequence the grammar allows after `prompt` (to its stop id), with the
    target's probability of it under the grammar: the product of masked, processed rows."""
    out: dict[tuple[int, ...], float] = {}

    def walk(tokens: list[int], prob: float) -> None:
        constraint.sync(tokens)
        logits = lm.forward(bpe.target, lm.new_cache(bpe.target), prompt + tokens)[-1:]
        allowed = torch.from_numpy(masked(logits[0].numpy(), constraint.mask_rows([])[0]))[None]
        probs = probs_from_logits(allowed, params)[0]
        for token in torch.nonzero(probs).flatten().tolist():
            if token in STOP:
                out[tuple(tokens + [token])] = prob * float(probs[token])
            else:
                walk(tokens + [token], prob * float(probs[token]))

    walk([], 1.0)
    return out


@pytest.mark.parametrize("mode", [AcceptMode.POINT, AcceptMode.SPARSE], ids=["point", "sparse"])
def test_sampling_under_a_grammar_follows_the_constrained_target(bpe: Bpe, mode: AcceptMode) -> None:
    params = SamplingParams(temperature=1.0)
    grammar = bpe.vocab.compile(json_schema_grammar(ENUM))
    prompt = PROMPTS[1]
    expected = _paths(bpe, prompt, grammar.start(STOP), params)
    assert abs(sum(expected.values()) - 1.0) < 1e-4

    async def run() -> Counter[tuple[int, ...]]:
        seen: Counter[tuple[int, ...]] = Counter()
        async with running_verifier(TargetEngine("transformers", bpe.target), tokenizer=bpe.card) as (client, _):
            for trial in range(TRIALS):
                cfg = _config(bpe, grammar, 16, params, mode, seed=trial)
                drafter = _drafter(
                    bpe, grammar, prompt, params if mode is AcceptMode.SPARSE else GREEDY, mode, seed=10_000 + trial
                )
                result = await speculative_generate(prompt, drafter, client, FixedK(3), cfg)
                seen[tuple(result.token_ids)] += 1
        return seen

    seen = asyncio.run(run())
    assert set(seen) <= set(expected), "an output the grammar does not allow"
    big = [path for path, p in expected.items() if p * TRIALS >= 5]
    observed = [seen[path] for path in big] + [TRIALS - sum(seen[path] for path in big)]
    wanted = [expected[path] * TRIALS for path in big] + [TRIALS * (1 - sum(expected[path] for path in big))]
    observed, wanted = (observed, wanted) if wanted[-1] >= 1e-9 else (observed[:-1], wanted[:-1])
    assert len(big) >= 3, "the target's constrained distribution is spread over several outputs"
    assert chisquare(observed, wanted).pvalue > 1e-3, (observed, wanted)


def test_a_verifier_refuses_bad_grammars_alone(bpe: Bpe) -> None:
    grammar = bpe.vocab.compile(json_schema_grammar(SCHEMAS["any-of"]))

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
