"""N-gram drafting (NASD): a drafter with no model, and a hybrid with the draft model.

The store counts which token followed each context of 1..N tokens in the prompt and the
committed text, and predicts with backoff: the longest context it has seen wins. Its
"top-K filler" also adds the target's top-K candidates at each verified position (weighted
by the target's probability), so it learns continuations nobody has written yet; with
filler_top_k = 1 it is NAPD (only committed tokens update it).

Drafts are deterministic (point masses, q = 1), so the cloud verifies them exactly in point
mode (greedy: accept while equal to the argmax; sampling: accept with probability p(y)).
Drafting stops at the first position the store does not know: no filler tokens are sent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from edge.drafting.drafter import Draft, Drafter, StopRule
from edge.drafting.feedback import RoundFeedback
from edge.drafting.gating import TokenSignals
from shared.protocol import SparseDistribution

CERTAIN = TokenSignals(nll=0.0, entropy_bits=0.0, margin=1.0)


@dataclass(frozen=True)
class Prediction:
    token: int
    order: int  # context length that matched
    count: float  # weight of the predicted continuation in that context


class _Context:
    """Continuation counts of one context, with the running best kept for O(1) predict."""

    __slots__ = ("best", "best_count", "counts")

    def __init__(self) -> None:
        self.counts: dict[int, float] = {}
        self.best = -1
        self.best_count = 0.0

    def add(self, token: int, weight: float) -> None:
        count = self.counts.get(token, 0.0) + weight
        self.counts[token] = count
        if count >= self.best_count:  # ties go to the most recent continuation
            self.best, self.best_count = token, count


class NGramStore:
    """Contexts of orders 1..order. Memory is bounded by max_contexts; past it the least
    recently updated context is evicted (an LRU over contexts), so recent text wins."""

    def __init__(self, order: int = 4, max_contexts: int = 200_000) -> None:
        if order < 1:
            raise ValueError("n-gram order must be >= 1")
        self.order = order
        self.max_contexts = max_contexts
        self._contexts: OrderedDict[tuple[int, ...], _Context] = OrderedDict()

    def __len__(self) -> int:
        return len(self._contexts)

    def add(self, context: Sequence[int], token: int, weight: float = 1.0) -> None:
        """Count `token` after each suffix (1..order tokens) of `context`."""
        for n in range(1, min(self.order, len(context)) + 1):
            key = tuple(context[len(context) - n :])
            entry = self._contexts.get(key)
            if entry is None:
                entry = self._contexts[key] = _Context()
            else:
                self._contexts.move_to_end(key)
            entry.add(token, weight)
        while len(self._contexts) > self.max_contexts:
            self._contexts.popitem(last=False)

    def add_sequence(self, tokens: Sequence[int], start: int = 1) -> None:
        """Count every token from index `start` on, after the tokens before it."""
        for i in range(max(start, 1), len(tokens)):
            self.add(tokens[max(0, i - self.order) : i], tokens[i])

    def predict(self, context: Sequence[int]) -> Prediction | None:
        """The most frequent continuation of the longest known suffix of context."""
        for n in range(min(self.order, len(context)), 0, -1):
            entry = self._contexts.get(tuple(context[len(context) - n :]))
            if entry is not None:
                return Prediction(entry.best, n, entry.best_count)
        return None


class NGramDrafter:
    """A drafter with no model. It learns every token it is synced to (prompt, committed)."""

    def __init__(
        self,
        store: NGramStore,
        filler_top_k: int = 1,
        stop_token_ids: frozenset[int] = frozenset(),
        with_sparse: bool = False,
        with_signals: bool = False,
    ) -> None:
        self.store = store
        # The target's top-K asked for each round: none where one candidate (the token the
        # round committed, which sync learns) is all the filler would take.
        self.filler_top_k = filler_top_k if filler_top_k > 1 else 0
        self.stop_token_ids = stop_token_ids
        # Keep a Draft's per-token lists aligned with a model drafter's in the same session:
        # sparse entries only in SPARSE mode, gating signals only when gating reads them.
        self.with_sparse, self.with_signals = with_sparse, with_signals
        self.tokens: list[int] = []
        self._learned = 0  # tokens[:_learned] are in the store
        self.forward_passes = 0

    def sync(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        shared = 0
        while shared < min(self._learned, len(tokens)) and tokens[shared] == self.tokens[shared]:
            shared += 1
        self.tokens = tokens
        self.store.add_sequence(tokens, start=shared if shared else 1)
        self._learned = len(tokens)

    def prefill(self) -> None:
        pass  # nothing to cache: sync already learned the prompt

    def predict(self, context: Sequence[int]) -> Prediction | None:
        return self.store.predict(context)

    def propose(self, k: int, stop_after: StopRule | None = None) -> Draft:
        draft = Draft()
        context = list(self.tokens)
        while len(draft) < k:
            guess = self.store.predict(context[-self.store.order :])
            if guess is None:
                break  # unknown context: send nothing rather than a random filler
            self.append_point(draft, guess.token)
            context.append(guess.token)
            if guess.token in self.stop_token_ids:
                break
        return draft

    def append_point(self, draft: Draft, token: int) -> None:
        """Add an n-gram token: a point mass, q = 1, certain by every gating signal."""
        draft.token_ids.append(token)
        draft.probs.append(1.0)
        draft.sources.append("ngram")
        if self.with_sparse:
            draft.sparse.append(SparseDistribution([token], [1.0]))
        if self.with_signals:
            draft.signals.append(CERTAIN)

    def update(self, feedback: RoundFeedback) -> None:
        self.learn(feedback.top_k_contexts(), feedback.target_top_k)

    def learn(self, contexts: Sequence[Sequence[int]], top_k: Sequence[SparseDistribution]) -> None:
        """Top-K filler: the target's candidates at each verified position, weighted by p."""
        if self.filler_top_k <= 1:
            return
        for context, row in zip(contexts, top_k, strict=False):
            for token, prob in list(zip(row.token_ids, row.probs, strict=True))[: self.filler_top_k]:
                self.store.add(context[-self.store.order :], token, prob)


class HybridDrafter:
    """Per position: the n-gram proposal when its context order and count pass the
    thresholds, the draft model's otherwise. n-gram tokens are points (q = 1)."""

    def __init__(self, model: Drafter, ngram: NGramDrafter, min_order: int = 3, min_count: float = 1.0) -> None:
        self.model, self.ngram = model, ngram
        self.min_order, self.min_count = min_order, min_count
        self.filler_top_k = ngram.filler_top_k
        self.tokens: list[int] = []

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def sync(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.ngram.sync(tokens)
        self.model.sync(tokens)

    def prefill(self) -> None:
        self.model.prefill()

    def update(self, feedback: RoundFeedback) -> None:
        self.ngram.update(feedback)

    def propose(self, k: int, stop_after: StopRule | None = None) -> Draft:
        draft = Draft()
        while len(draft) < k:
            context = self.tokens + draft.token_ids
            guess = self.ngram.predict(context[-self.ngram.store.order :])
            if guess is not None and guess.order >= self.min_order and guess.count >= self.min_count:
                self.ngram.append_point(draft, guess.token)
            else:
                self.model.sync(context)
                step = self.model.propose(1, stop_after)
                if not step.token_ids:
                    break
                draft.extend(step)
            if draft.token_ids[-1] in self.model.config.stop_token_ids:
                break
            if stop_after is not None and draft.signals and stop_after(draft.signals[-1]):
                break
        return draft
