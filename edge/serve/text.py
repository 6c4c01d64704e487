"""Verified token ids in, text out, for a served request: decoded incrementally, never a
broken UTF-8 character, stop strings honoured across chunk boundaries.

Decoding follows TGI's window: the new text is decode(ids[prefix:]) minus
decode(ids[prefix:read]), so each push decodes a few tokens rather than the whole answer,
and a token that ends mid-character (the decode ends in U+FFFD) waits for the next one.
Text that could be the start of a stop string is held back until it is not; the stop
string itself is never released.
"""

from __future__ import annotations

from collections.abc import Sequence

from edge.tokenizer import EdgeTokenizer

REPLACEMENT = "\ufffd"  # what a decode shows for an incomplete UTF-8 sequence


class TextStreamer:
    def __init__(self, tokenizer: EdgeTokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []  # every committed token
        self.text = ""  # decoded text of ids[:read]
        self.released = 0  # characters of text handed out
        self.prefix, self.read = 0, 0  # the decode window: ids[prefix:read] is already in text
        self.stopped = False  # a stop string was found: nothing more is released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, tokens: Sequence[int]) -> str:
        """Commit tokens; returns the text that is now safe to show (may be empty)."""
        self.ids += tokens
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: the rest of the text, held-back characters included. The
        whole answer is decoded once more, so what was released plus this equals the one-shot
        decode of every token."""
        if self.stopped:
            return ""
        whole = self._decode(self.ids)
        if whole.startswith(self.text[: self.released]):
            self.text = whole
        self.prefix = self.read = len(self.ids)
        return self._release(final=True)

    def released_text(self) -> str:
        return self.text[: self.released]

    def preview(self, provisional: Sequence[int]) -> str:
        """The text after what was released if `provisional` tokens were final: held-back text,
        pending characters and the provisional tokens, cut before any stop string."""
        if self.stopped:
            return ""
        base = self._decode(self.ids[self.prefix : self.read])
        extended = self._decode(self.ids[self.prefix :] + list(provisional))
        tail = extended[len(base) :] if extended.startswith(base) else ""
        text = (self.text[self.released :] + tail).rstrip(REPLACEMENT)
        cut = self._first_stop(text, 0)
        return text if cut is None else text[:cut]

    def _first_stop(self, text: str, start: int) -> int | None:
        found = [at for s in self.stop if (at := text.find(s, start)) >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Characters at the end of text that could begin a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text) - self.released), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        # Released text never holds the start of a stop string, so one can only begin here.
        cut = self._first_stop(self.text, self.released)
        if cut is not None:
            self.stopped = True
            end = cut
        else:
            end = len(self.text) - (0 if final else self._held_back())
        out = self.text[self.released : end]
        self.released = max(self.released, end)
        return out
