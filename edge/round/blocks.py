"""Drafting one block, as the round loop asks for it: how many tokens it may hold (the k
policy's k, the session's limit, what is left to generate), where drafting stops early (a hard
token under gating, EGAG's entropy cap) and which of its tokens are hard. Everything here
returns values; the round loop (edge/round/session.py) owns the tokens they go into."""

from __future__ import annotations

from collections.abc import Sequence

from edge.drafting.drafter import Draft, DraftSource, StopRule
from edge.drafting.kpolicy import KPolicy
from edge.round.generation import GenerationConfig


class BlockDrafting:
    def __init__(self, drafter: DraftSource, k_policy: KPolicy, cfg: GenerationConfig) -> None:
        self.drafter, self.k_policy, self.cfg = drafter, k_policy, cfg

    def room(self, remaining: int, max_draft_tokens: int | None) -> int:
        """Tokens the next block may hold: one token of what is left goes to the bonus."""
        room = min(self.k_policy.next_k(), remaining - 1)
        return room if max_draft_tokens is None else min(room, max_draft_tokens)

    def draft(self, context: list[int], n: int) -> Draft:
        """Up to n tokens after `context`, stopped early by the gating thresholds or the extra rule."""
        self.drafter.sync(context)
        return self.drafter.propose(n, self._stop_rule())

    def _stop_rule(self) -> StopRule | None:
        gating = self.cfg.gating
        rules = [r for r in (gating.thresholds.is_hard if gating else None, self.cfg.stop_rule) if r is not None]
        if not rules:
            return None
        return lambda s: any(rule(s) for rule in rules)

    def hard_mask(self, pending: Draft, committed: Sequence[int], shown: int) -> tuple[list[bool], int | None]:
        """Per pending token: hard by its signals or by a rule on its text; and where the block
        ends when a rule hits a token not yet on screen (right after it: verify now), else None."""
        gating = self.cfg.gating
        if gating is None or not pending.signals:
            return [], None
        mask = [gating.thresholds.is_hard(s) for s in pending.signals]
        if gating.rules is None or gating.token_text is None:
            return mask, None
        text = gating.token_text
        previous = "".join(text(t) for t in committed[-8:])
        for i, token in enumerate(pending.token_ids):
            piece = text(token)
            if gating.rules.rule_hit(token, piece, previous):
                mask[i] = True
                if i >= shown:
                    return mask[: i + 1], i + 1
            previous += piece
        return mask, None
