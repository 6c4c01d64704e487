"""MC-dropout gating signals (--mc-passes N with --gating; transformers draft runtime only):
the variance of q(y) over N dropout masks on the draft model's last hidden state, one extra
LM-head pass each. A research signal: it costs drafting time (counted as mc_dropout_ms) and
feeds the mc_var threshold of hard-token gating. The drafter asks for it only when N > 0.

torch is imported inside the one function that needs it, so a llama.cpp or n-gram edge that
imports the drafter never loads it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from edge.drafting.gating import TokenSignals

if TYPE_CHECKING:
    import torch


class DropoutCache(Protocol):
    """A draft cache that can run the dropout passes on its last hidden state."""

    def mc_dropout_variance(self, token: int, passes: int, dropout_p: float) -> float: ...


def with_mc_variance(
    signals: TokenSignals, cache: DropoutCache, token: int, passes: int, dropout_p: float
) -> tuple[TokenSignals, float]:
    """`signals` with the drafted token's MC-dropout variance, and the time it took in ms."""
    start = time.perf_counter()
    var = cache.mc_dropout_variance(token, passes, dropout_p)
    ms = (time.perf_counter() - start) * 1000.0
    return TokenSignals(signals.nll, signals.entropy_bits, signals.margin, var), ms


def mc_dropout_variance(
    hidden: torch.Tensor, lm_head: torch.nn.Module, token: int, passes: int, p: float, generator: torch.Generator
) -> float:
    """Variance of softmax(lm_head(dropout(h)))[token] over `passes` dropout masks; hidden [H]."""
    import torch

    keep = torch.rand(passes, hidden.shape[-1], generator=generator) >= p  # [passes, H]
    dropped = hidden.float()[None] * keep / (1.0 - p)
    with torch.inference_mode():
        logits = lm_head(dropped.to(hidden.dtype)).float()  # [passes, V]
    return float(logits.softmax(dim=-1)[:, token].var())
