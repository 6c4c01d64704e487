"""What a generation is configured with and what it yields, shared by the round loop
(edge/round/session.py), the baselines (edge/round/generate.py) and everything that reads their results:
timeouts and reconnecting, gating, the round record, the result, the observer, and the
output cut at a stop token or max_new_tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol

from edge.drafting.drafter import StopRule
from edge.drafting.gating import EscalationRules, GatingThresholds
from edge.round.mode_switch import ModeMemory, SwitchRules
from edge.transport.backoff import Reconnecting as Reconnecting  # re-exported: the round loop reconnects with it
from shared.errors import CloudUnavailable, PositionMismatch, SessionNotFound
from shared.protocol import REOPEN_SEED_STRIDE, SessionConfig, WireBytes

TimeoutMode = Literal["provisional", "strict", "accept-unverified"]
# Errors after which the edge reopens a session on its committed prefix (within the window).
RECOVERABLE = (CloudUnavailable, SessionNotFound, PositionMismatch)


@dataclass(frozen=True)
class TimeoutPolicy:
    soft_deadline_s: float = 0.4  # then a pending token becomes provisional (or unverified)
    mode: TimeoutMode = "provisional"
    # A verifier restart (model load included) takes tens of seconds to minutes: the edge
    # rides it out rather than counting attempts. 0: the first failure is final.
    reconnect_window_s: float = 300.0
    backoff_s: float = 0.1  # first reconnect delay, doubled per attempt, with jitter x0.5-1.5
    max_backoff_s: float = 2.0  # the doubling stops here: a verifier back is found within seconds


@dataclass(frozen=True)
class Gating:
    thresholds: GatingThresholds
    rules: EscalationRules | None = None
    token_text: Callable[[int], str] | None = None  # rules read the token's text
    local_commit: bool = False  # LOSSY: commit easy blocks without the cloud


@dataclass(frozen=True)
class GenerationConfig:
    session: SessionConfig
    max_new_tokens: int = 128
    stop_token_ids: frozenset[int] = frozenset()
    timeouts: TimeoutPolicy = TimeoutPolicy()
    gating: Gating | None = None
    stop_rule: StopRule | None = None  # extra early stop for a block (e.g. EGAG's entropy cap)
    overlap: bool = False  # draft the next block while Verify is in flight
    # auto mode: switch between speculation and the target's own decoding on measured rates
    # (edge/round/mode_switch.py); None pins speculation
    mode_switch: SwitchRules | None = None
    mode_memory: ModeMemory | None = None  # where the last generation left auto mode (the context's)
    # auto mode: the drafter prefills beside the target's tokens, or between stretches (where
    # the two share this machine's cores: edge/round/warmup.py)
    prefill_beside: bool = True


@dataclass(frozen=True)
class RoundRecord:
    round: int
    k: int
    draft_tokens: list[int]
    accepted_len: int
    next_token: int
    bonus: bool
    la_over_k: float
    alpha_mean: float
    a_cum: int  # accepted draft tokens so far
    edge_time_ms: float  # drafting
    cloud_verify_ms: float  # server-side time of the round
    rtt_ms: float  # wall time of the Verify call
    bytes_up: int
    bytes_down: int
    hard_ratio: float
    escalated: bool  # the block went to the cloud (always, unless committed locally)
    catchup: int  # locally committed tokens sent ahead of the draft
    provisional: int  # tokens shown provisionally while this round was in flight
    retracted: int  # of those, rejected by the cloud
    local: bool = False  # committed without the cloud (lossy)
    sources: list[str] = field(default_factory=list)  # drafter of each draft token: model / ngram
    ahead_drafted: int = 0  # overlap: tokens drafted while this round was in flight
    ahead_used: int = 0  # of those, kept as the next block (all accepted and the bonus matched)
    mode: str = "speculative"  # cloud_only: a Decode stretch of the target's own tokens (`decoded`)
    decoded: list[int] = field(default_factory=list)
    switch: str = ""  # why auto mode changed to this record's mode here (empty: it did not)
    # the cloud's mean min(1, p/q) over the drafts verified on an accepted prefix (alpha_mean is
    # over all the drafts, those after the first rejection included); None: not reported
    alpha_prefix: float | None = None


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)  # generated tokens only, final
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forward_passes: int = 0
    elapsed_s: float = 0.0
    ttft_s: float = 0.0
    bytes_up: int = 0  # all requests, prompt upload included
    bytes_down: int = 0
    verify_bytes_up: int = 0  # Verify requests only: the per-round uplink
    verify_bytes_down: int = 0
    finish_reason: str = "length"
    provisional_tokens: int = 0
    retracted_tokens: int = 0
    unverified_tokens: int = 0  # final without verification (accept-unverified)
    local_tokens: int = 0  # committed by --local-commit (lossy)
    hard_tokens: int = 0
    mc_dropout_ms: float = 0.0  # drafting time spent on MC-dropout passes (gating cost)
    ahead_drafted: int = 0  # overlap: tokens drafted while a Verify was in flight
    ahead_used: int = 0  # of those, kept (the rest was thrown away)
    overlap_draft_ms: float = 0.0  # drafting time hidden behind Verify calls
    reopens: int = 0
    stretches: int = 0  # Decode stretches (auto mode)
    tokens_by_mode: dict[str, int] = field(default_factory=dict)  # generated tokens: speculative / cloud_only
    mode_switches: list[dict[str, Any]] = field(default_factory=list)  # auto mode: {at_token, to, reason}
    drafted_by: dict[str, int] = field(default_factory=dict)  # draft tokens per drafter (model / ngram / grammar: forced)
    accepted_by: dict[str, int] = field(default_factory=dict)
    round_log: list[RoundRecord] = field(default_factory=list)

    def verified_speculative_tokens(self) -> int:
        """Tokens speculative rounds committed through the cloud (tau counts these per round)."""
        return self.tokens_by_mode.get("speculative", 0) - self.local_tokens - self.unverified_tokens

    def count_wire(self, wire: WireBytes) -> None:
        """The bytes of one call to the verifier (edge/transport/client.py sets them on its
        replies and errors)."""
        self.bytes_up += wire.up
        self.bytes_down += wire.down

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        del out["round_log"]
        return out


class Observer(Protocol):
    def committed(self, tokens: list[int], record: RoundRecord | None) -> None: ...

    def provisional(self, tokens: list[int]) -> None:
        """The pending tokens now on screen, unverified: one more than at the last call of
        this round (the edge's metrics count one token per call)."""


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


class Output:
    """Final tokens, cut after a stop token or at max_new_tokens, and their timing."""

    def __init__(self, cfg: GenerationConfig, result: GenerationResult, observer: Observer | None) -> None:
        self.cfg, self.result, self.observer = cfg, result, observer
        self.start = time.perf_counter()

    def done(self) -> bool:
        return self.result.finish_reason == "stop" or len(self.result.token_ids) >= self.cfg.max_new_tokens

    def remaining(self) -> int:
        return self.cfg.max_new_tokens - len(self.result.token_ids)

    def commit(self, new: list[int], record: RoundRecord | None, mode: str = "speculative") -> None:
        """`new` tokens are final (those past a stop token or max_new_tokens are dropped),
        produced by `mode`."""
        result = self.result
        if not result.token_ids and new:
            result.ttft_s = time.perf_counter() - self.start
        kept: list[int] = []
        for token in new:
            if self.done():
                break
            result.token_ids.append(token)
            kept.append(token)
            result.tokens_by_mode[mode] = result.tokens_by_mode.get(mode, 0) + 1
            if token in self.cfg.stop_token_ids:
                result.finish_reason = "stop"
        if self.observer:
            self.observer.committed(kept, record)

    def show_provisional(self, tokens: list[int]) -> None:
        if self.observer:
            self.observer.provisional(tokens[: self.remaining()])

    def finish(self) -> GenerationResult:
        """The result, timed."""
        self.result.elapsed_s = time.perf_counter() - self.start
        return self.result


def reopened_config(session: SessionConfig, reopens: int, generated: int = 0) -> SessionConfig:
    """The session's config with a fresh seed per reopen: a reopened session draws new
    randomness rather than replaying the first one's. `generated`: the tokens at the end of its
    prompt the generation made (its grammar, if any, has consumed them)."""
    seed = session.seed + REOPEN_SEED_STRIDE * reopens
    grammar = None if session.grammar is None else replace(session.grammar, generated=generated)
    return replace(session, seed=seed, grammar=grammar)
