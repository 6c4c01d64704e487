"""Session steps on an engine that runs forward passes (transformers, llama.cpp): ONE forward pass, ONE batched
accept, then each KV cropped to what its step accepted (docs/architecture.md, "Engines and session steps")."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import replace

import torch

from cloud.engine import PromptChunk, SessionKV, SessionStep, StepOutcome, TokenSink
from cloud.rejection_sampler import AcceptedRound, RejectionSampler, top_k_rows
from shared.errors import VerifierFault
from shared.protocol import SessionConfig


class ForwardEngine(ABC):
    """The Engine a forward pass makes: subclasses own the model, its KV and `forward`."""

    caches_prefixes = False  # the verifier keeps closed sessions' KV (cloud/prefix_cache.py)
    decodes_ahead = False
    applies_grammars = False  # the rejection sampler masks with the rounds' grammar rows
    sampler = RejectionSampler()  # stateless: every session's randomness is its own generator

    def cached_tokens(self, kv: SessionKV) -> int:
        return 0  # every fed token is computed: kept prefixes are the verifier's

    @abstractmethod
    def forward(self, kvs: Sequence[SessionKV], blocks: Sequence[Sequence[int]], keeps: Sequence[int]) -> list[torch.Tensor]:
        """ONE pass: each block after its KV (which gains the block's KV); per block its last
        keeps[i] rows of logits [keep, logits_width] (all rows when 0), float32 on the CPU. A
        pass that raises leaves every KV as it was."""

    @abstractmethod
    def crop(self, kv: SessionKV, length: int) -> None: ...

    def run_steps(self, steps: Sequence[SessionStep]) -> list[StepOutcome | PromptChunk | None | Exception]:
        chunked = [bool(step.chunk) and step.grows_by > step.chunk for step in steps]
        steps = [_chunked(step) for step in steps]
        lengths = [step.kv.get_seq_length() for step in steps]
        computed = [i for i, step in enumerate(steps) if step.grows_by + len(step.drafts) > 0]
        blocks = [steps[i].fed[: steps[i].grows_by] + steps[i].drafts for i in computed]
        keeps = [len(steps[i].drafts) + 1 for i in computed]
        passed = self.forward([steps[i].kv for i in computed], blocks, keeps) if computed else []
        rows = dict(zip(computed, passed, strict=True))
        outcomes = self._accept(steps, rows)
        for step, length, outcome in zip(steps, lengths, outcomes, strict=True):
            kept = length + step.grows_by + (outcome.round.accepted_len if isinstance(outcome, StepOutcome) else 0)
            self.crop(step.kv, length if isinstance(outcome, Exception) else kept)
        return [
            PromptChunk(step.grows_by) if cut and outcome is None else outcome
            for step, cut, outcome in zip(steps, chunked, outcomes, strict=True)
        ]

    def _accept(
        self, steps: Sequence[SessionStep], rows: dict[int, torch.Tensor]
    ) -> list[StepOutcome | PromptChunk | None | Exception]:
        """The batched accept over the steps that read; a step whose accept fails fails alone."""
        reading = [i for i, step in enumerate(steps) if step.rule is not None and i in rows]
        rounds = [steps[i].rule.with_logits(rows[i], steps[i].drafts) for i in reading]  # type: ignore[union-attr]  # reading: a rule
        outcomes: list[StepOutcome | PromptChunk | None | Exception] = [None] * len(steps)
        for i, step in enumerate(steps):
            if step.rule is not None and i not in rows:
                outcomes[i] = VerifierFault("a step that reads fed no tokens")
        for i, accepted in zip(reading, self.sampler.accept_rounds(rounds), strict=True):
            outcomes[i] = accepted if isinstance(accepted, Exception) else _outcome(accepted, steps[i].top_k)
        return outcomes

    def check_session(self, config: SessionConfig, vocab: int) -> None:
        return None  # the reference rule verifies every accept mode as it is defined

    def start_session(self, kv: SessionKV, config: SessionConfig, vocab: int) -> None:
        return None  # each step carries its session's rule

    def follow(self, kv: SessionKV, position: int, sink: TokenSink) -> bool:
        return False

    def unfollow(self, kv: SessionKV) -> None:
        return None

    def extend(self, kv: SessionKV, tokens: list[int]) -> None:
        raise VerifierFault("a forward-pass engine decodes nothing on its own to extend a session by")

    def own_steps(self) -> tuple[int, float]:
        return 0, 0.0

    def failure(self) -> str | None:
        return None  # in-process: a failure raises from its pass

    def close(self) -> None:
        return None  # the model and its KV go with the engine (llama.cpp's context: freed with it)


def _chunked(step: SessionStep) -> SessionStep:
    """A step with more new tokens than its chunk: the chunk alone, which reads nothing (the
    rest, at least one token, comes in a later step with the drafts)."""
    if not step.chunk or step.grows_by <= step.chunk:
        return step
    return replace(step, fed=step.fed[: step.chunk], drafts=[], rule=None, known=0)


def _outcome(accepted: AcceptedRound, top_k: int) -> StepOutcome | Exception:
    try:
        return StepOutcome(accepted.outcome, top_k_rows(accepted.probs[: accepted.outcome.accepted_len + 1], top_k))
    except Exception as err:  # this step alone fails
        return err
