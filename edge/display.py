"""Terminal output: text streamed as it is committed, or each round in colour (--show-steps)."""

from __future__ import annotations

import sys
from typing import TextIO

from transformers import PreTrainedTokenizerBase

from edge.generate import GenerationResult, RoundRecord

GREEN, RED, YELLOW, CYAN, DIM, RESET = "\033[32m", "\033[31;9m", "\033[33m", "\033[36m", "\033[2m", "\033[0m"


class TextStream:
    """Decodes the whole generation each time and writes only the new suffix, so tokens that
    split a UTF-8 character print correctly once complete."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, out: TextIO = sys.stdout) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.token_ids: list[int] = []
        self.printed = ""

    def __call__(self, new: list[int], record: RoundRecord | None) -> None:
        self.token_ids.extend(new)
        text = str(self.tokenizer.decode(self.token_ids, skip_special_tokens=True))
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text


class StepPrinter:
    """One line per round: accepted drafts green, rejected drafts red, then the correction
    (yellow) or bonus (cyan) token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, out: TextIO = sys.stdout) -> None:
        self.tokenizer = tokenizer
        self.out = out

    def _piece(self, token: int) -> str:
        return repr(self.tokenizer.decode([token]))[1:-1]

    def __call__(self, new: list[int], record: RoundRecord | None) -> None:
        if record is None:
            self.out.write("".join(self._piece(t) for t in new))
            return
        accepted = record.draft_tokens[: record.accepted_len]
        rejected = record.draft_tokens[record.accepted_len:]
        parts = [f"{DIM}[{record.round:3d} k={record.k:2d} {record.rtt_ms:6.1f}ms]{RESET} "]
        parts += [GREEN + "".join(self._piece(t) for t in accepted) + RESET]
        if rejected:
            parts += [RED + "".join(self._piece(t) for t in rejected) + RESET]
        parts += [(CYAN if record.bonus else YELLOW) + self._piece(record.next_token) + RESET, "\n"]
        self.out.write("".join(parts))
        self.out.flush()


def format_stats(result: GenerationResult, mode: str) -> str:
    n = max(len(result.token_ids), 1)
    tokens_per_s = len(result.token_ids) / result.elapsed_s if result.elapsed_s else 0.0
    line = (f"[{mode}] {len(result.token_ids)} tokens in {result.elapsed_s:.2f}s ({tokens_per_s:.1f} tok/s), "
            f"ttft {result.ttft_s * 1000:.0f} ms, target passes/token {result.target_forward_passes / n:.2f}")
    if result.rounds:
        tau = len(result.token_ids) / result.rounds
        rate = result.accepted_tokens / max(result.draft_tokens, 1)
        line += (f", rounds {result.rounds}, tau {tau:.2f}, accepted {result.accepted_tokens}/"
                 f"{result.draft_tokens} ({rate:.0%}), bytes up/down {result.bytes_up}/{result.bytes_down}")
    return line
