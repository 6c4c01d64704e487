"""The conversation cache of `edge-agent serve`: the draft model's KV of generations that
ended, kept for the next turn of their conversation.

A chat client resends the whole conversation every turn. A drafter that begins from the last
turn's cache (Drafter(..., kv=...)) feeds only the new tokens: its first sync keeps the KV of
the longest prefix the cache shares with the prompt, as every sync does, so a turn drafts
from the KV it would have computed itself. Drafts only steer what is proposed: the text is
the target's whichever cache a drafter begins from.

- One owner per cache: `take` removes the entry it hands out, `give_back` adds one.
- Bounded by memory: an entry counts the bytes its cache holds (a llama.cpp context holds its
  whole --draft-context from the start), and the least recently handed back goes first.
- The draft window: a reused cache keeps its window's start while the prompt from there on
  and max_tokens fit the draft context; else the drafter begins a fresh window.
- The event loop alone calls it (a generation's start and end), so it takes no lock.
- Scoped by caller: an entry remembers the name of the API key whose request left it, and a
  request takes only its own caller's entries (without keys, "": the one local user). A
  response reports the draft tokens it reused, so a shared entry would tell one caller
  whether another's prompt began with a given text. The memory bound is one for all callers:
  one's entries may push out another's, which costs that one a prefill and shows no text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edge.drafting.drafter import Drafter, DraftKV, DraftSource
from edge.drafting.ngram import HybridDrafter
from shared.token_ids import shared_prefix


@dataclass(frozen=True)
class _Entry:
    caller: str  # the name of the API key whose request left it
    kv: DraftKV
    tokens: list[int]  # the conversation from its first token: those before kv.start, then kv.cached
    nbytes: int

    def reusable(self, prompt: Sequence[int], window: int, max_new_tokens: int, context: int) -> int:
        """Tokens of KV a drafter on `prompt` keeps from this entry; 0 where it may not begin
        from it (then it is not worth taking)."""
        start = self.kv.start
        keeps = min(shared_prefix(self.tokens, prompt), len(prompt) - 1) - start  # a sync keeps all but the last
        # Taken, the entry's other tokens are cropped for good: worth it only where the turn
        # keeps at least as many as it drops (a conversation's next turn keeps nearly all; a
        # new one that shares only the system prompt leaves a long conversation's entry alone).
        if keeps <= 0 or 2 * keeps < len(self.kv.cached):
            return 0
        fresh_start = max(len(prompt) - window, 0) if window else 0
        if start > fresh_start:  # the drafter would read less than its window
            return 0
        if start < fresh_start and len(prompt) - start + max_new_tokens > context:
            return 0  # a window stretched past the draft context: a fresh one fits it, as _check_room asks
        return keeps


class ConversationCache:
    """Draft caches of ended generations, at most `max_bytes` of them (least recently handed back
    evicted first)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: list[_Entry] = []  # least recently handed back first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries)

    def take(self, caller: str, prompt: Sequence[int], window: int, max_new_tokens: int, context: int) -> DraftKV | None:
        """The cache of `caller`'s whose KV a drafter on `prompt` reuses most, removed from the
        pool; None when none is worth taking (the drafter makes a fresh one). window:
        --draft-window; context: tokens a window may span (the prompt from its start and
        max_new_tokens)."""
        best, most = None, 0
        for entry in self._entries:
            if entry.caller != caller:
                continue
            keeps = entry.reusable(prompt, window, max_new_tokens, context)
            if keeps >= most and keeps > 0:  # ties: the most recent
                best, most = entry, keeps
        if best is None:
            return None
        self._entries.remove(best)
        return best.kv

    def give_back(self, caller: str, prompt: Sequence[int], kv: DraftKV) -> None:
        """Keep a drafter's cache for the next turn of `caller`'s conversation. prompt: what its
        generation began from (its tokens before kv.start are those the window skipped). A cache
        that holds nothing, is out of step with its tokens or alone exceeds the bound is dropped."""
        nbytes = kv.cache.nbytes()
        if not kv.cached or len(kv.cache) != len(kv.cached) or nbytes > self.max_bytes:
            return
        self._entries.append(_Entry(caller, kv, [*prompt[: kv.start], *kv.cached], nbytes))
        while self.nbytes > self.max_bytes:
            self._entries.pop(0)


def model_drafter(source: DraftSource) -> Drafter | None:
    """The draft model's drafter in a draft source (a hybrid's own); None for the n-gram drafter,
    which keeps no KV."""
    if isinstance(source, HybridDrafter):
        return source.model
    return source if isinstance(source, Drafter) else None
