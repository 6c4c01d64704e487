"""What Describe answers about the model a verifier serves: its name and size, its tokenizer as
block digests (shared/tokenizer_card.py) with one run of tokens on request, and the cost of one
decode step, measured once at load. A client checks its draft against it before its first
session (edge/pair_check.py)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from cloud.engine import Engine, SessionStep, StepOutcome
from cloud.rejection_sampler import RoundRule
from shared.errors import InvalidRequest, VerifierFault
from shared.protocol import ModelDescription, SessionConfig
from shared.tokenizer_card import BLOCK, TokenizerCard

WARMUP_TOKENS = 8
TIMED_STEPS = 3


@dataclass
class ModelCard:
    model_id: str
    parameters: int
    logits_width: int
    tokenizer: TokenizerCard | None = None
    decode_step_ms: float = 0.0

    def __post_init__(self) -> None:
        self._digests = self.tokenizer.digests() if self.tokenizer else []  # computed once: a call only reads them

    def describe(self, tokens_from: int = 0, tokens_count: int = 0, chat_template: bool = False) -> ModelDescription:
        """The description; with tokens_count, the tokens [tokens_from, tokens_from + count) too;
        with chat_template, the template's text."""
        tokens = self._tokens(tokens_from, tokens_count)
        t = self.tokenizer
        return ModelDescription(
            model_id=self.model_id,
            parameters=self.parameters,
            logits_width=self.logits_width,
            has_tokenizer=t is not None,
            tokenizer_size=len(t.tokens) if t else 0,
            block_size=BLOCK if t else 0,
            block_digests=tuple(self._digests),
            special_tokens=t.specials if t else (),
            chat_template_sha256=t.template_digest() if t else b"",
            decode_step_ms=round(self.decode_step_ms, 3),
            tokens=tokens,
            chat_template=(t.chat_template or "") if t and chat_template else "",
        )

    def _tokens(self, start: int, count: int) -> tuple[str, ...]:
        if count == 0:
            return ()
        if self.tokenizer is None:
            raise InvalidRequest("this verifier has no tokenizer to list (it serves token ids only)")
        size = len(self.tokenizer.tokens)
        if count > BLOCK:
            raise InvalidRequest(f"tokens_count is at most {BLOCK}")
        if start >= size:
            raise InvalidRequest(f"tokens_from must be below the tokenizer's size {size}")
        return self.tokenizer.tokens[start : start + count]


def measure_decode_step(engine: Engine) -> float:
    """Milliseconds of one decode step of one session on this engine: a short prompt and its
    first token, then the median of a few greedy single-token steps (the first steps of a model
    are slower: this warms it too), each feeding the token the last one drew. Runs on the engine
    directly, before the verifier serves, and frees its KV."""
    kv = engine.new_kv()
    config = SessionConfig()
    try:
        engine.start_session(kv, config, engine.logits_width)
        tokens = fed = [0] * WARMUP_TOKENS
        times = []
        for _ in range(TIMED_STEPS + 1):
            start = time.perf_counter()
            rule = RoundRule.next_token(config, engine.logits_width, tokens, torch.Generator())
            [outcome] = engine.run_steps([SessionStep(kv, fed, rule=rule)])
            if isinstance(outcome, Exception):
                raise outcome
            if not isinstance(outcome, StepOutcome):
                raise VerifierFault("a decode step read no token")
            times.append((time.perf_counter() - start) * 1000.0)
            tokens = [*tokens, outcome.round.next_token]
            fed = tokens[-1:]
        return statistics.median(times[1:])  # the first fed the prompt
    finally:
        engine.free(kv)
