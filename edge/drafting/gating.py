"""Hard-token gating: per drafted token, how unsure is the draft model?

Signals (all from the draft's processed distribution q at that position):
- nll: -ln q(y) of the drafted token;
- entropy_bits: H(q) in bits;
- margin: q(top1) - q(top2);
- mc_var: variance of q(y) over several dropout passes of the last hidden state
  (MC dropout; costs extra lm_head passes, reported as mc_ms).
A token is hard when any signal crosses its threshold. Rules on the token's text
(numbers, dates, amounts, named entities, rare words) always escalate.

Using the signals only to decide how much to draft (end the block at a hard token) is
lossless; committing a block without the cloud (--local-commit) is lossy and counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from shared.sampling import edge_numpy


@dataclass(frozen=True)
class TokenSignals:
    nll: float
    entropy_bits: float
    margin: float
    mc_var: float = 0.0


@dataclass(frozen=True)
class GatingThresholds:
    entropy_bits: float = 2.5  # T_H
    margin: float = 0.2  # T_margin: hard when the top-2 are closer than this
    nll: float = 2.0  # T_nll: `calibrate` sets it to the 80th percentile of a calibration run
    mc_var: float = 0.02  # T_var
    hard_ratio: float = 0.3  # R_hard: a block above it escalates

    def is_hard(self, s: TokenSignals) -> bool:
        return s.entropy_bits > self.entropy_bits or s.margin < self.margin or s.nll > self.nll or s.mc_var > self.mc_var


def token_signals(q: np.ndarray, token: int) -> TokenSignals:
    """Signals of drafted `token` under the draft distribution q [V]."""
    return TokenSignals(edge_numpy.nll(q, token), edge_numpy.entropy_bits(q), edge_numpy.top2_margin(q))


# ---- rules that always escalate -------------------------------------------------------

_DIGIT = re.compile(r"\d")
_AMOUNT = re.compile(r"[$€£¥%]")
_MONTHS = re.compile(r"\b(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\b", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z]+")


@dataclass
class EscalationRules:
    """Token-text rules: numbers, dates, amounts, named entities, rare words.

    Rare: an alphabetic piece of 4+ letters seen fewer than `rare_below` times in the
    token-frequency table (built from the Spec-Bench prompts the project ships)."""

    counts: dict[int, int] = field(default_factory=dict)
    rare_below: int = 1

    def rule_hit(self, token: int, text: str, previous_text: str) -> str | None:
        if _DIGIT.search(text):
            return "number"
        if _AMOUNT.search(text):
            return "amount"
        if _MONTHS.search(text.strip()) and text.strip()[:1].isupper():
            return "date"
        word = text.strip()
        # A capitalised word that does not start a sentence: a likely named entity.
        if (
            word[:1].isupper()
            and _WORD.fullmatch(word)
            and text.startswith(" ")
            and not previous_text.rstrip().endswith((".", "!", "?", ":", "\n"))
            and previous_text.strip()
        ):
            return "entity"
        if self.counts and len(word) >= 4 and word.isalpha() and self.counts.get(token, 0) < self.rare_below:
            return "rare"
        return None


def token_frequencies(token_streams: Iterable[Sequence[int]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for stream in token_streams:
        for token in stream:
            counts[token] = counts.get(token, 0) + 1
    return counts


def save_gating_config(path: Path, thresholds: GatingThresholds, counts: dict[int, int]) -> None:
    data = {"thresholds": asdict(thresholds), "token_counts": {str(k): v for k, v in sorted(counts.items())}}
    path.write_text(json.dumps(data) + "\n")


def load_gating_config(path: Path) -> tuple[GatingThresholds, dict[int, int]]:
    """Thresholds and the token-frequency table written by edge-calibrate."""
    data = json.loads(path.read_text())
    fields = GatingThresholds.__dataclass_fields__
    thresholds = GatingThresholds(**{k: float(v) for k, v in data.get("thresholds", {}).items() if k in fields})
    counts = {int(k): int(v) for k, v in data.get("token_counts", {}).items()}
    return thresholds, counts
