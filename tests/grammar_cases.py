"""Generation under a grammar, as every engine's tests check it: tiny real models on a byte-level
BPE tokenizer, three JSON schemas, the target alone under a grammar as the greedy reference, and
the target's constrained distribution over a small grammar's outputs as the sampling reference
(tests/integration/test_grammar.py, test_vllm_grammar.py)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, replace

import jsonschema
import torch
from scipy.stats import chisquare
from transformers import PreTrainedModel

from edge.drafting.drafter import Drafter, DrafterConfig, DraftGrammar, DraftLM
from edge.drafting.kpolicy import CostK, FixedK
from edge.drafting.runtime_transformers import TransformersDraftLM
from edge.round.generate import GenerationConfig, cloud_only_generate, speculative_generate
from edge.round.mode_switch import ModeMemory, SwitchRules
from shared import lm
from shared.grammar import Constraint, Grammar, GrammarVocab, json_schema_grammar, masked
from shared.protocol import AcceptMode, GrammarSpec, SamplingParams, SessionConfig
from shared.sampling.verifier_torch import probs_from_logits
from shared.tokenizer_card import TokenizerCard
from tests.harness import TargetEngine, running_verifier
from tests.tiny_models import llama_bpe_tokenizer, tiny_draft

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
ENUM = {"enum": ["a", "ab", "abcd", "cd", "b"]}  # a small grammar: its outputs can be listed
TRIALS = 600


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

    @classmethod
    def of(cls, target: PreTrainedModel) -> Bpe:
        """`target` (of llama_bpe_tokenizer()'s vocabulary) and a perturbed draft of it."""
        tokenizer = llama_bpe_tokenizer()
        source = tokenizer.backend_tokenizer.to_str()
        card = TokenizerCard.of(tokenizer.backend_tokenizer, None, source)
        return cls(target, tiny_draft(target, noise=0.3), card, GrammarVocab(source, len(tokenizer)), tokenizer.decode)


def grammar_config(  # type: ignore[no-untyped-def]
    bpe: Bpe, grammar: Grammar, max_new: int, params: SamplingParams = GREEDY, mode=AcceptMode.GREEDY, seed=0
) -> GenerationConfig:
    session = SessionConfig(params, seed, mode, bpe.size, GrammarSpec(grammar.text, tuple(STOP)))
    return GenerationConfig(session, max_new, STOP)


def grammar_drafter(  # type: ignore[no-untyped-def]
    bpe: Bpe, grammar: Grammar, prompt: list[int], params=GREEDY, mode=AcceptMode.GREEDY, seed=1, lm: DraftLM | None = None
) -> Drafter:
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


def valid(bpe: Bpe, tokens: list[int], schema: dict) -> None:  # type: ignore[type-arg]
    assert tokens[-1] in STOP, "the generation ran out of tokens before its grammar ended"
    jsonschema.validate(json.loads(bpe.decode(tokens[:-1])), schema)  # type: ignore[operator]


async def check_greedy_equals_the_target_alone(bpe: Bpe, engine: TargetEngine, schema: str) -> None:
    """cloud_only, speculative and auto-mode greedy output under the schema equal the target
    alone under it, token for token, for every prompt and k policy."""
    grammar = bpe.vocab.compile(json_schema_grammar(SCHEMAS[schema], compact=True))
    async with running_verifier(engine, tokenizer=bpe.card) as (client, _):
        for prompt in PROMPTS:
            reference = constrained_greedy(bpe.target, prompt, grammar.start(STOP), 128)
            valid(bpe, reference, SCHEMAS[schema])
            cfg = grammar_config(bpe, grammar, 128)
            alone = await cloud_only_generate(prompt, client, cfg)
            assert alone.token_ids == reference, f"cloud_only, prompt {prompt}"
            for policy in (FixedK(3), FixedK(8), CostK(1, 12)):
                result = await speculative_generate(prompt, grammar_drafter(bpe, grammar, prompt), client, policy, cfg)
                assert result.token_ids == reference, f"{type(policy).__name__}, prompt {prompt}"
            # auto mode: the target alone first, then a probe of speculation, whose drafter
            # first syncs after tokens the grammar already took
            auto = replace(cfg, mode_switch=SwitchRules(), mode_memory=ModeMemory())
            result = await speculative_generate(prompt, grammar_drafter(bpe, grammar, prompt), client, CostK(1, 12), auto)
            assert result.token_ids == reference, f"auto, prompt {prompt}"
            if len(reference) > SwitchRules().first_stretch_tokens:
                assert {"cloud_only", "speculative"} <= set(result.tokens_by_mode), result.tokens_by_mode


def enum_paths(bpe: Bpe, prompt: list[int], constraint: Constraint, params: SamplingParams) -> dict[tuple[int, ...], float]:
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


async def check_sampling_follows_the_constrained_target(bpe: Bpe, engine: TargetEngine, mode: AcceptMode) -> None:
    """TRIALS speculative generations under ENUM, each its own seed: only outputs the grammar
    allows, in the frequencies the target's constrained distribution gives them (chi-square)."""
    params = SamplingParams(temperature=1.0)
    grammar = bpe.vocab.compile(json_schema_grammar(ENUM, compact=True))
    prompt = PROMPTS[1]
    expected = enum_paths(bpe, prompt, grammar.start(STOP), params)
    assert abs(sum(expected.values()) - 1.0) < 1e-4
    seen: Counter[tuple[int, ...]] = Counter()
    async with running_verifier(engine, tokenizer=bpe.card) as (client, _):
        for trial in range(TRIALS):
            cfg = grammar_config(bpe, grammar, 16, params, mode, seed=trial)
            draft_params = params if mode is AcceptMode.SPARSE else GREEDY
            drafter = grammar_drafter(bpe, grammar, prompt, draft_params, mode, seed=10_000 + trial)
            result = await speculative_generate(prompt, drafter, client, FixedK(3), cfg)
            seen[tuple(result.token_ids)] += 1
    assert set(seen) <= set(expected), "an output the grammar does not allow"
    big = [path for path, p in expected.items() if p * TRIALS >= 5]
    observed = [seen[path] for path in big] + [TRIALS - sum(seen[path] for path in big)]
    wanted = [expected[path] * TRIALS for path in big] + [TRIALS * (1 - sum(expected[path] for path in big))]
    observed, wanted = (observed, wanted) if wanted[-1] >= 1e-9 else (observed[:-1], wanted[:-1])
    assert len(big) >= 3, "the target's constrained distribution is spread over several outputs"
    assert chisquare(observed, wanted).pvalue > 1e-3, (observed, wanted)
