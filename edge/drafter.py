"""The edge's draft model with its own KV cache: propose k tokens, then sync to what the
cloud committed (the cache is cropped to the longest prefix still valid)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from shared import lm
from shared.protocol import SparseDistribution
from shared.sampling import SamplingParams, penalized_logits, probs_from_logits, truncate_top_k
from shared.speculative import AcceptMode, sample_token


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # q(y) of each drafted token
    sparse: list[SparseDistribution] = field(default_factory=list)  # SPARSE mode only

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class DrafterConfig:
    sampling: SamplingParams
    accept_mode: AcceptMode
    vocab_size: int  # ids >= this are never drafted (padded embedding rows)
    draft_top_k: int = 16  # support size sent in SPARSE mode
    stop_token_ids: frozenset[int] = frozenset()


class Drafter:
    def __init__(self, model: PreTrainedModel, config: DrafterConfig, seed: int) -> None:
        self.model = model
        self.config = config
        self.generator = torch.Generator().manual_seed(seed)  # one per session, never reseeded
        self.cache = lm.new_cache(model)
        self.tokens: list[int] = []  # committed tokens
        self._cached: list[int] = []  # the tokens whose KV the cache holds, in order
        self.forward_passes = 0

    def sync(self, committed: Sequence[int]) -> None:
        """Adopt the committed sequence; keep the cached KV of its longest shared prefix."""
        self.tokens = list(committed)
        keep = 0
        limit = min(len(self._cached), len(self.tokens) - 1)
        while keep < limit and self._cached[keep] == self.tokens[keep]:
            keep += 1
        lm.crop(self.cache, keep)
        del self._cached[keep:]

    def _feed(self, token_ids: list[int]) -> torch.Tensor:  # [V] logits after the last fed token
        logits = lm.forward(self.model, self.cache, token_ids)
        self._cached.extend(token_ids)
        self.forward_passes += 1
        return logits[-1:]

    def propose(self, k: int) -> Draft:
        """Draft up to k tokens after the committed sequence (fewer if a stop token is drafted)."""
        draft = Draft()
        if k <= 0:
            return draft
        logits = self._feed(self.tokens[len(self._cached):])
        while True:
            self._pick(logits, draft)
            if len(draft) == k or draft.token_ids[-1] in self.config.stop_token_ids:
                return draft
            logits = self._feed(draft.token_ids[-1:])

    def _pick(self, logits: torch.Tensor, draft: Draft) -> None:
        cfg = self.config
        context = self.tokens + draft.token_ids
        penalized = penalized_logits(logits, context, [], cfg.sampling, cfg.vocab_size)[0]  # [V]
        if cfg.accept_mode in (AcceptMode.GREEDY, AcceptMode.POINT):
            token = int(penalized.argmax())
            # q sent for information (gating, logs); the cloud treats these drafts as points.
            draft.token_ids.append(token)
            draft.probs.append(float(penalized.softmax(dim=-1)[token]))
            return
        q = probs_from_logits(penalized[None], cfg.sampling)[0]
        if cfg.accept_mode is AcceptMode.SPARSE:
            q = truncate_top_k(q[None], cfg.draft_top_k)[0]
            support = q.nonzero()[:, 0]
            draft.sparse.append(SparseDistribution(support.tolist(), q[support].tolist()))
        token = sample_token(q, self.generator)
        draft.token_ids.append(token)
        draft.probs.append(float(q[token]))
