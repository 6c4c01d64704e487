"""The edge's draft model with its own KV cache: propose k tokens, then sync to what the
cloud committed (the cache is cropped to the longest prefix still valid)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from edge.gating import TokenSignals, mc_dropout_variance, token_signals
from shared import lm
from shared.protocol import SparseDistribution, TopK
from shared.sampling import SamplingParams, penalized_logits, probs_from_logits, truncate_top_k
from shared.speculative import AcceptMode, sample_token


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # q(y) of each drafted token
    sparse: list[SparseDistribution] = field(default_factory=list)  # SPARSE mode only
    signals: list[TokenSignals] = field(default_factory=list)  # when DrafterConfig.signals
    sources: list[str] = field(default_factory=list)  # who proposed each token: "model" or "ngram"
    mc_ms: float = 0.0  # time spent on MC-dropout passes

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, n: int) -> Draft:
        """The first n drafted tokens with their distributions."""
        return Draft(self.token_ids[:n], self.probs[:n], self.sparse[:n], self.signals[:n], self.sources[:n])

    def tail(self, n: int) -> Draft:
        """Everything after the first n tokens."""
        return Draft(self.token_ids[n:], self.probs[n:], self.sparse[n:], self.signals[n:], self.sources[n:])

    def extend(self, other: Draft) -> None:
        self.token_ids += other.token_ids
        self.probs += other.probs
        self.sparse += other.sparse
        self.signals += other.signals
        self.sources += other.sources
        self.mc_ms += other.mc_ms


@dataclass(frozen=True)
class DrafterConfig:
    sampling: SamplingParams
    accept_mode: AcceptMode
    vocab_size: int  # ids >= this are never drafted (padded embedding rows)
    draft_top_k: int = 16  # support size sent in SPARSE mode
    stop_token_ids: frozenset[int] = frozenset()
    signals: bool = False  # compute gating signals per drafted token
    mc_passes: int = 0  # MC-dropout passes per token (0 = off)
    mc_dropout_p: float = 0.1


StopRule = Callable[[TokenSignals], bool]


class DraftSource(Protocol):
    """What the round loop needs from a drafter (model, n-gram or hybrid)."""

    filler_top_k: int  # ask the cloud for the target's top-K per verified position (0 = no)

    def sync(self, tokens: Sequence[int]) -> None: ...

    def prefill(self) -> None: ...

    def propose(self, k: int, stop_after: StopRule | None = None) -> Draft: ...

    def learn(self, contexts: Sequence[Sequence[int]], top_k: Sequence[TopK]) -> None: ...


class Drafter:
    filler_top_k = 0  # a model drafter learns nothing from the target's top-K

    def __init__(self, model: PreTrainedModel, config: DrafterConfig, seed: int) -> None:
        self.model = model
        self.config = config
        self.generator = torch.Generator().manual_seed(seed)  # one per session, never reseeded
        self.mc_generator = torch.Generator().manual_seed(seed + 1)  # dropout masks: drafts stay reproducible
        self.cache = lm.new_cache(model)
        self.tokens: list[int] = []  # the sequence drafts continue from
        self._cached: list[int] = []  # the tokens whose KV the cache holds, in order
        self._hidden: torch.Tensor | None = None
        self.forward_passes = 0

    def sync(self, tokens: Sequence[int]) -> None:
        """Continue from `tokens`; keep the cached KV of its longest shared prefix."""
        self.tokens = list(tokens)
        keep = 0
        limit = min(len(self._cached), len(self.tokens) - 1)
        while keep < limit and self._cached[keep] == self.tokens[keep]:
            keep += 1
        lm.crop(self.cache, keep)
        del self._cached[keep:]

    def learn(self, contexts: Sequence[Sequence[int]], top_k: Sequence[TopK]) -> None:
        pass

    def prefill(self) -> None:
        """Cache all but the last token now (e.g. while the cloud prefills the same prompt)."""
        if len(self._cached) < len(self.tokens) - 1:
            self._feed(self.tokens[len(self._cached):-1])

    def _feed(self, token_ids: list[int]) -> torch.Tensor:  # [1, V] logits after the last fed token
        logits, self._hidden = lm.forward_with_hidden(self.model, self.cache, token_ids, keep=1,
                                                      hidden=self.config.mc_passes > 0)
        self._cached.extend(token_ids)
        self.forward_passes += 1
        return logits[-1:]

    def propose(self, k: int, stop_after: StopRule | None = None) -> Draft:
        """Draft up to k tokens; stop early after a stop token or a token `stop_after` flags."""
        draft = Draft()
        if k <= 0:
            return draft
        logits = self._feed(self.tokens[len(self._cached):])
        while True:
            self._pick(logits, draft)
            if len(draft) == k or draft.token_ids[-1] in self.config.stop_token_ids:
                return draft
            if stop_after is not None and draft.signals and stop_after(draft.signals[-1]):
                return draft
            logits = self._feed(draft.token_ids[-1:])

    def _pick(self, logits: torch.Tensor, draft: Draft) -> None:
        cfg = self.config
        context = self.tokens + draft.token_ids
        penalized = penalized_logits(logits, context, [], cfg.sampling, cfg.vocab_size)[0]  # [V]
        if cfg.accept_mode in (AcceptMode.GREEDY, AcceptMode.POINT):
            # Deterministic drafts; q (at temperature 1) is sent for gating and logs only.
            q = penalized.softmax(dim=-1)
            token = int(penalized.argmax())
        else:
            q = probs_from_logits(penalized[None], cfg.sampling)[0]
            if cfg.accept_mode is AcceptMode.SPARSE:
                q = truncate_top_k(q[None], cfg.draft_top_k)[0]
                support = q.nonzero()[:, 0]
                draft.sparse.append(SparseDistribution(support.tolist(), q[support].tolist()))
            token = sample_token(q, self.generator)
        draft.token_ids.append(token)
        draft.probs.append(float(q[token]))
        draft.sources.append("model")
        if cfg.signals:
            draft.signals.append(self._signals(q, token, draft))

    def _signals(self, q: torch.Tensor, token: int, draft: Draft) -> TokenSignals:
        signals = token_signals(q, token)
        if self.config.mc_passes <= 0 or self._hidden is None:
            return signals
        start = time.perf_counter()
        var = mc_dropout_variance(self._hidden, self.model.get_output_embeddings(), token,
                                  self.config.mc_passes, self.config.mc_dropout_p, self.mc_generator)
        draft.mc_ms += (time.perf_counter() - start) * 1000.0
        return TokenSignals(signals.nll, signals.entropy_bits, signals.margin, var)
