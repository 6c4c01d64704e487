"""The tokens of one speculative generation between rounds, and drafting the next block:
the pending tokens topped up to k, ended early at a hard token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from edge.drafting.drafter import Draft, DraftSource, StopRule
from edge.drafting.kpolicy import KPolicy
from edge.round.generation import GenerationConfig, GenerationResult, Output, ms_since


@dataclass
class RoundTokens:
    committed: list[int]  # final: prompt + generated
    catchup: list[int] = field(default_factory=list)  # final, not yet sent to the cloud
    pending: Draft = field(default_factory=Draft)  # drafted, not final
    provisional: int = 0  # the first pending tokens, shown before the cloud's verdict

    def commit_unsent(self, tokens: list[int]) -> None:
        """Final without the cloud (lossy modes): the cloud gets them as catch-up."""
        self.committed += tokens
        self.catchup += tokens

    def commit_verified(self, tokens: list[int]) -> None:
        """The cloud's verdict on a round: final, and the pending block is spent."""
        self.committed += tokens
        self.catchup = []
        self.pending, self.provisional = Draft(), 0


class BlockDrafter:
    """Drafts the pending block: up to k tokens (the k policy's, the session's limit and what
    is left to generate), stopped early by the gating thresholds or an extra stop rule."""

    def __init__(self, drafter: DraftSource, k_policy: KPolicy, cfg: GenerationConfig, tokens: RoundTokens, out: Output) -> None:
        self.drafter, self.k_policy, self.cfg, self.tokens, self.out = drafter, k_policy, cfg, tokens, out

    def room(self, max_draft_tokens: int | None) -> int:
        """Tokens the next block may hold: one token of what is left goes to the bonus."""
        room = min(self.k_policy.next_k(), self.out.remaining() - 1)
        return room if max_draft_tokens is None else min(room, max_draft_tokens)

    def top_up(self, room: int) -> Draft:
        """Draft after the pending block until it holds `room` tokens; the new tokens."""
        tokens = self.tokens
        self.drafter.sync(tokens.committed + tokens.pending.token_ids)
        block = self.drafter.propose(room - len(tokens.pending), self._stop_rule())
        tokens.pending.extend(block)
        return block

    def restart(self, carry: Draft | None) -> None:
        """The block a round starts from: the tokens drafted ahead during the last round and
        still valid, else the tokens already shown."""
        tokens = self.tokens
        tokens.pending = carry if carry is not None else tokens.pending.head(tokens.provisional)

    def fill(self, max_draft_tokens: int, result: GenerationResult) -> float:
        """Top the pending block up to k tokens; returns the drafting time in ms."""
        tokens = self.tokens
        room = self.room(max_draft_tokens)
        if len(tokens.pending) > max(room, tokens.provisional):
            tokens.pending = tokens.pending.head(max(room, tokens.provisional))
        start = time.perf_counter()
        if room > len(tokens.pending):
            result.mc_dropout_ms += self.top_up(room).mc_ms
        return ms_since(start)

    def _stop_rule(self) -> StopRule | None:
        gating = self.cfg.gating
        rules = [r for r in (gating.thresholds.is_hard if gating else None, self.cfg.stop_rule) if r is not None]
        if not rules:
            return None
        return lambda s: any(rule(s) for rule in rules)

    def hard_mask(self) -> tuple[list[bool], bool]:
        """Per pending token: hard by signals or by a rule; and whether any rule hit. A rule hit
        ends the block right after that token (verify now)."""
        gating, tokens = self.cfg.gating, self.tokens
        if gating is None or not tokens.pending.signals:
            return [], False
        mask = [gating.thresholds.is_hard(s) for s in tokens.pending.signals]
        if gating.rules is None or gating.token_text is None:
            return mask, False
        text = gating.token_text
        previous = "".join(text(t) for t in tokens.committed[-8:])
        for i, token in enumerate(tokens.pending.token_ids):
            piece = text(token)
            if gating.rules.rule_hit(token, piece, previous):
                mask[i] = True
                if i >= tokens.provisional:
                    tokens.pending = tokens.pending.head(i + 1)
                    return mask[: i + 1], True
            previous += piece
        return mask, False
