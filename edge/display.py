"""Terminal output: text streamed as it is committed, or each round in colour (--show-steps)."""

from __future__ import annotations

import sys
from typing import TextIO

from edge.round.generate import GenerationResult, RoundRecord
from edge.tokenizer import EdgeTokenizer

GREEN, RED, YELLOW, CYAN, MAGENTA = "\033[32m", "\033[31;9m", "\033[33m", "\033[36m", "\033[35m"
DIM, RESET = "\033[2m", "\033[0m"


class TextStream:
    """Final text as it is committed, provisional text dimmed after it.

    The whole generation is decoded each time and only the new suffix written, so tokens
    that split a UTF-8 character print correctly once complete. Provisional text is drawn
    after a saved cursor position and erased (restore + clear) when the cloud answers, so a
    retracted token disappears from the screen."""

    SAVE, RESTORE_CLEAR = "\0337", "\0338\033[J"

    def __init__(self, tokenizer: EdgeTokenizer, out: TextIO = sys.stdout) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.token_ids: list[int] = []
        self.printed = ""
        self.showing_provisional = False

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _clear_provisional(self) -> None:
        if self.showing_provisional:
            self.out.write(self.RESTORE_CLEAR)
            self.showing_provisional = False

    def committed(self, tokens: list[int], record: RoundRecord | None) -> None:
        self._clear_provisional()
        self.token_ids.extend(tokens)
        text = self._decode(self.token_ids)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return
        self.out.write(text[len(self.printed) :])
        self.out.flush()
        self.printed = text

    def provisional(self, tokens: list[int]) -> None:
        self._clear_provisional()
        extra = self._decode(self.token_ids + tokens)[len(self.printed) :]
        self.out.write(self.SAVE + DIM + extra + RESET)
        self.out.flush()
        self.showing_provisional = True


class StepPrinter:
    """One line per round: accepted drafts green, rejected drafts red, then the correction
    (yellow) or bonus (cyan) token."""

    def __init__(self, tokenizer: EdgeTokenizer, out: TextIO = sys.stdout) -> None:
        self.tokenizer = tokenizer
        self.out = out

    def _piece(self, token: int) -> str:
        return repr(self.tokenizer.decode([token]))[1:-1]

    def provisional(self, tokens: list[int]) -> None:
        self.out.write(f"{DIM}[provisional: {''.join(self._piece(t) for t in tokens)}]{RESET}\n")

    def committed(self, new: list[int], record: RoundRecord | None) -> None:
        if record is None:
            self.out.write("".join(self._piece(t) for t in new))
            return
        if record.local:
            self.out.write(
                f"{DIM}[{record.round:3d} local k={record.k:2d}]{RESET} {MAGENTA}"
                + "".join(self._piece(t) for t in new)
                + f"{RESET}\n"
            )
            return
        accepted = record.draft_tokens[: record.accepted_len]
        rejected = record.draft_tokens[record.accepted_len :]
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
    line = (
        f"[{mode}] {len(result.token_ids)} tokens in {result.elapsed_s:.2f}s ({tokens_per_s:.1f} tok/s), "
        f"ttft {result.ttft_s * 1000:.0f} ms, target passes/token {result.target_forward_passes / n:.2f}"
    )
    if result.rounds:
        tau = result.verified_speculative_tokens() / result.rounds
        rate = result.accepted_tokens / max(result.draft_tokens, 1)
        line += (
            f", rounds {result.rounds}, tau {tau:.2f}, accepted {result.accepted_tokens}/"
            f"{result.draft_tokens} ({rate:.0%}), bytes up/down {result.bytes_up}/{result.bytes_down}"
        )
    extras = {
        "provisional": result.provisional_tokens,
        "retracted": result.retracted_tokens,
        "UNVERIFIED": result.unverified_tokens,
        "LOCAL (lossy)": result.local_tokens,
        "hard": result.hard_tokens,
        "reopens": result.reopens,
    }
    line += "".join(f", {name} {value}" for name, value in extras.items() if value)
    if result.mode_switches:
        by_mode = "/".join(f"{result.tokens_by_mode.get(m, 0)}" for m in ("speculative", "cloud_only"))
        line += f", tokens speculative/cloud_only {by_mode}, mode switches {len(result.mode_switches) - 1}"
    return line
