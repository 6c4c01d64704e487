"""The edge's draft model with its own KV cache: propose k tokens, then sync to what the
cloud committed (the cache is cropped to the longest prefix still valid).

The model itself runs in a *draft runtime* (`DraftLM`): llama.cpp on a GGUF file
(edge/drafting/runtime_llamacpp.py) or transformers (edge/drafting/runtime_transformers.py). Everything
else here is numpy, so a llama.cpp or n-gram edge never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edge.drafting.feedback import RoundFeedback
from edge.drafting.gating import TokenSignals, token_signals
from edge.experimental.mc_dropout import with_mc_variance
from shared.errors import ConfigError
from shared.grammar import Constraint, masked
from shared.protocol import AcceptMode, SamplingParams, SparseDistribution
from shared.sampling import edge_numpy
from shared.token_ids import shared_prefix


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # q(y) of each drafted token; on the wire only in scalar/shortcut mode
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
    mc_passes: int = 0  # MC-dropout passes per token (0 = off; edge/experimental/mc_dropout.py)
    mc_dropout_p: float = 0.1
    # The model drafts from the last `window` tokens of the prompt on (0 = all of it): a long
    # prompt's prefill then costs the drafter a window's, not the prompt's. Drafts only steer
    # what is proposed; the verifier judges them on the whole context.
    window: int = 0


StopRule = Callable[[TokenSignals], bool]


class DraftSource(Protocol):
    """What the round loop needs from a drafter (model, n-gram or hybrid)."""

    filler_top_k: int  # ask the cloud for the target's top-K per verified position (0 = no)

    def sync(self, tokens: Sequence[int]) -> None: ...

    def prefill(self) -> None: ...

    def propose(self, k: int, stop_after: StopRule | None = None) -> Draft: ...

    def update(self, feedback: RoundFeedback) -> None: ...  # after each verified round


class DraftCache(Protocol):
    """One session's KV cache in a draft runtime. Its length is the number of tokens fed."""

    def __len__(self) -> int: ...

    def feed(self, token_ids: Sequence[int]) -> np.ndarray: ...  # [V_model] float32 logits after the last

    def crop(self, length: int) -> None: ...  # keep the first `length` tokens' KV

    def mc_dropout_variance(self, token: int, passes: int, dropout_p: float) -> float: ...

    def nbytes(self) -> int: ...  # the memory the cache holds


@dataclass
class DraftKV:
    """A draft cache and what it holds: the KV of `cached`, the sequence's tokens from `start`
    (the draft window's start) on. What a drafter hands on when its generation ends, and what
    another can begin from (edge/drafting/conversations.py)."""

    cache: DraftCache
    cached: list[int]
    start: int


class DraftLM(Protocol):
    """A loaded draft model: weights shared by every session, one cache per session."""

    runtime: str  # "llama.cpp" | "transformers"
    logits_width: int  # the model's vocabulary rows (may exceed the tokenizer's)
    parameters: int  # the model's parameter count (the pair check's size ratio)

    def new_cache(self, seed: int) -> DraftCache: ...  # seed: the runtime's own randomness (MC dropout)


@dataclass(frozen=True)
class DraftGrammar:
    """A generation's grammar as its drafter follows it: its place in the grammar, and where the
    generation's own tokens begin in the sequences the drafter is synced to (the prompt's end:
    a drafter may first be synced after the target alone made some, as in auto mode)."""

    constraint: Constraint
    prompt_len: int


def _point(token: int, vocab: int) -> np.ndarray:  # [vocab] all mass on one token
    q = np.zeros(vocab, dtype=np.float32)
    q[token] = 1.0
    return q


class Drafter:
    filler_top_k = 0  # a model drafter learns nothing from the target's top-K

    def __init__(
        self, lm: DraftLM, config: DrafterConfig, seed: int, kv: DraftKV | None = None, grammar: DraftGrammar | None = None
    ) -> None:
        """kv: another drafter's cache to begin from (its window's start kept); the first sync
        keeps the KV of the longest prefix it shares with the tokens, as every sync does.
        grammar: what the generation must follow: the model drafts under it (its q is the
        masked, renormalised distribution it draws from, the one the verifier's test needs),
        and a token the grammar forces is drafted without a forward pass (q = 1)."""
        if config.mc_passes > 0 and lm.runtime != "transformers":
            raise ConfigError("MC-dropout signals need --draft-runtime transformers (they read hidden states)")
        if config.mc_passes > 0 and kv is not None:  # its dropout masks come from the cache's seeded generator
            raise ConfigError("MC-dropout signals need a cache of their own seed: a drafter with them begins afresh")
        self.lm = lm
        self.config = config
        self.rng = np.random.Generator(np.random.PCG64(seed))  # one per session, never reseeded
        self.cache = lm.new_cache(seed + 1) if kv is None else kv.cache  # seed: dropout masks, drafts reproducible
        self.tokens: list[int] = []  # the sequence drafts continue from (from `start` on)
        self.start: int | None = None if kv is None else kv.start  # where the window begins, fixed by the first sync
        self.cached: list[int] = [] if kv is None else list(kv.cached)  # the tokens whose KV the cache holds, in order
        self.forward_passes = 0
        self.reused_tokens = 0  # prompt tokens whose KV came with `kv` (counted by the first sync)
        self.prefilled_tokens = 0  # prompt tokens whose KV this drafter computed
        self._prompt_end: int | None = None  # the first sync's tokens (the prompt) in `tokens`
        self.grammar = None if grammar is None else grammar.constraint
        self.prompt_len = 0 if grammar is None else grammar.prompt_len
        self.generated: list[int] = []  # the generation's own tokens, as the last sync gave them
        self.forced_tokens = 0  # drafted because the grammar allowed nothing else

    def sync(self, tokens: Sequence[int]) -> None:
        """Continue from `tokens` (from the window's start on); keep the cached KV of its
        longest shared prefix."""
        if self.start is None:
            self.start = max(len(tokens) - self.config.window, 0) if self.config.window else 0
        self.tokens = list(tokens[self.start :])
        self.generated = list(tokens[self.prompt_len :]) if self.grammar is not None else []
        keep = max(min(shared_prefix(self.cached, self.tokens), len(self.tokens) - 1), 0)  # the last is fed
        self.cache.crop(keep)
        del self.cached[keep:]
        if self._prompt_end is None:  # the first sync is on the prompt
            self._prompt_end, self.reused_tokens = len(self.tokens), keep

    def kv(self) -> DraftKV | None:
        """The cache and what it holds, to hand on once this drafter is done (None before
        its first sync: it holds nothing)."""
        if self.start is None:
            return None
        return DraftKV(self.cache, list(self.cached), self.start)

    def update(self, feedback: RoundFeedback) -> None:
        pass  # the model's drafts follow from the committed tokens it is synced to

    def prefill(self) -> None:
        """Cache all but the last token now (e.g. while the cloud prefills the same prompt)."""
        if len(self.cached) < len(self.tokens) - 1:
            self._feed(self.tokens[len(self.cached) : -1])

    def _feed(self, token_ids: list[int]) -> np.ndarray:  # [V_model] logits after the last fed token
        logits = self.cache.feed(token_ids)
        prompt_end = self._prompt_end or 0
        self.prefilled_tokens += max(min(len(self.cached) + len(token_ids), prompt_end) - len(self.cached), 0)
        self.cached.extend(token_ids)
        self.forward_passes += 1
        return logits

    def propose(self, k: int, stop_after: StopRule | None = None) -> Draft:
        """Draft up to k tokens; stop early after a stop token or a token `stop_after` flags."""
        draft = Draft()
        if k <= 0:
            return draft
        if self.grammar is None:
            return self._draft(draft, k, stop_after)
        self.grammar.sync(self.generated)
        committed = len(self.grammar.consumed)
        try:
            return self._draft(draft, k, stop_after)
        finally:
            self.grammar.pop(len(self.grammar.consumed) - committed)  # the drafts are not committed yet

    def _draft(self, draft: Draft, k: int, stop_after: StopRule | None) -> Draft:
        while True:
            if not self._forced(draft):
                self._pick(self._feed(self._unfed(draft)), draft)
            if len(draft) == k or draft.token_ids[-1] in self.config.stop_token_ids:
                return draft
            if stop_after is not None and draft.signals and stop_after(draft.signals[-1]):
                return draft

    def _unfed(self, draft: Draft) -> list[int]:
        """The tokens before the next draft whose KV the cache lacks (the last committed one,
        drafts, forced tokens)."""
        return (self.tokens + draft.token_ids)[len(self.cached) :]

    def _forced(self, draft: Draft) -> bool:
        """Draft the token the grammar forces next, if it forces one: no forward pass, q = 1."""
        if self.grammar is None:
            return False
        token = self.grammar.forced()
        if token is None:
            return False
        self.grammar.push(token)
        draft.token_ids.append(token)
        draft.probs.append(1.0)
        draft.sources.append("grammar")
        if self.config.accept_mode is AcceptMode.SPARSE:
            draft.sparse.append(SparseDistribution([token], [1.0]))
        if self.config.signals:
            draft.signals.append(token_signals(_point(token, self.config.vocab_size), token))
        self.forced_tokens += 1
        return True

    def _pick(self, logits: np.ndarray, draft: Draft) -> None:
        cfg = self.config
        penalized = edge_numpy.penalized_logits(logits, self.tokens + draft.token_ids, cfg.sampling, cfg.vocab_size)  # [V]
        if self.grammar is not None:
            penalized = masked(penalized, self.grammar.mask_rows([])[0])
        if cfg.accept_mode in (AcceptMode.GREEDY, AcceptMode.POINT):
            # Deterministic drafts; q (at temperature 1) is sent for gating and logs only.
            q = edge_numpy.softmax(penalized)
            token = int(penalized.argmax())
        else:
            q = edge_numpy.probs_from_logits(penalized, cfg.sampling)
            if cfg.accept_mode is AcceptMode.SPARSE:
                q = edge_numpy.truncate_top_k(q, cfg.draft_top_k)
                support = np.flatnonzero(q)
                draft.sparse.append(SparseDistribution(support.tolist(), q[support].tolist()))
            token = edge_numpy.sample_token(q, self.rng)
        if self.grammar is not None:
            self.grammar.push(token)  # a stop id is not consumed (the generation ends with it)
        draft.token_ids.append(token)
        draft.probs.append(float(q[token]))
        draft.sources.append("model")
        if cfg.signals:
            draft.signals.append(self._signals(q, token, draft))

    def _signals(self, q: np.ndarray, token: int, draft: Draft) -> TokenSignals:
        signals = token_signals(q, token)
        if self.config.mc_passes <= 0:
            return signals
        signals, ms = with_mc_variance(signals, self.cache, token, self.config.mc_passes, self.config.mc_dropout_p)
        draft.mc_ms += ms
        return signals
