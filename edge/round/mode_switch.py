"""Auto mode: whether the next tokens come from speculative rounds or from the target's own
decoding (a Decode stretch on the same session), decided from measured rates.

The round loop (edge/round/session.py) asks `plan()` at every boundary (after a round, at the
end of a stretch) and reports what each produced (`stretch_done`, `round_done`); this module
only keeps the rates and returns decisions. The rule, as docs/edge.md explains:

- A generation starts on the target: its first tokens stream as in cloud_only while the
  drafter prefills the prompt beside them. The first stretch is two tokens (the first comes with
  the prompt's prefill, the gap to the second is the target's decoding rate); stretches then
  double (4, 8, 16) while the drafter is still prefilling, so a short prompt speculates from
  its third token on.
- Once the drafter is ready, speculation is probed for `min_rounds` rounds.
- Speculation is kept while its rate over the last `window` rounds (committed tokens over the
  rounds' wall time, drafting included) is at least `keep_ratio` of the target's streaming rate
  (tokens over the gaps between a stretch's chunks). Below that, the target decodes a stretch
  of `backoff_tokens`, then speculation is probed again; each probe that loses doubles the
  stretch (up to `max_backoff_tokens`), a probe that wins resets it.
- Speculation is never judged without the target's rate: when no stretch has measured it yet
  (a stretch cut short, a lost call), the target decodes `reprobe_target_tokens` to measure it.
- What a generation learned carries to the next one of the same edge process (ModeMemory, owned
  by the edge's context): the target's rate, the backoff, and the target's tokens still due
  before the next probe. A generation that starts while speculation is on hold decodes on the
  target from its first token and skips the drafter's prefill until the hold is spent, so a
  machine where speculation does not pay costs one probe per backoff, not one per generation.
- While speculation wins, the target's rate is re-measured now and then (a stretch of
  `reprobe_target_tokens` after `reprobe_after_tokens` speculative tokens, that interval doubling
  each time): rates change with the verifier's load and with the text.
- A loaded verifier (cloud-verifier --prefer-speculation-above) asks for speculation with each
  Verify reply and Decode chunk. While it asks, the generation speculates as soon as the drafter
  is ready (at the end of the stretch under way), whatever the rates say: a hold after a lost
  probe is dropped, and speculation is neither judged slower nor interrupted to re-measure the
  target. The next generation starts from the verifier's last answer. One GPU then serves more
  sessions, each drafting on its own edge, at a pace the user may find a little slower than the
  target's own decoding on an idle GPU.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

Mode = Literal["speculative", "cloud_only"]
SPECULATIVE: Mode = "speculative"
CLOUD_ONLY: Mode = "cloud_only"


@dataclass(frozen=True)
class SwitchRules:
    first_stretch_tokens: int = 2  # the first stretch: the first token as fast as cloud_only's, and the target's rate
    max_warmup_stretch_tokens: int = 16  # stretches while the drafter prefills double up to this
    min_rounds: int = 3  # rounds a probe of speculation runs before it is judged
    window: int = 4  # rounds the speculative rate is measured over
    keep_ratio: float = 0.95  # speculation stays while at least this fraction of the target's rate
    backoff_tokens: int = 16  # the target's stretch after speculation lost
    max_backoff_tokens: int = 256
    reprobe_after_tokens: int = 64  # speculative tokens before the target's rate is measured again
    reprobe_target_tokens: int = 4


@dataclass
class ModeMemory:
    """What auto mode carries from one generation to the next in an edge process. The edge's
    context owns it; a generation reads it when it starts (ModeSwitch) and writes it back when it
    ends (ModeSwitch.remember). Concurrent generations each start from the last one written."""

    target_rate: float = 0.0  # tokens/s of the target's own decoding (0: not measured)
    backoff: int = 0  # the stretch after the next lost probe (0: the rules' first)
    hold: int = 0  # the target's tokens still due before speculation is probed again
    verifier_asked: bool = False  # the verifier's last reply asked for speculation (it is loaded)


@dataclass(frozen=True)
class Plan:
    """What comes next: speculative rounds, or a Decode stretch of `tokens` tokens."""

    mode: Mode
    tokens: int = 0
    reason: str = ""  # why the mode changed here (empty: it did not)


@dataclass(frozen=True)
class Switch:
    at_token: int  # generated tokens before the switch
    to: Mode
    why: str  # start | drafter_ready | slower | probe_speculation | probe_target | verifier_loaded (a metric label)
    reason: str  # the same in words, with the rates that decided it


class ModeSwitch:
    """The decisions of one generation in auto mode; see the module docstring for the rule."""

    def __init__(self, rules: SwitchRules | None = None, memory: ModeMemory | None = None) -> None:
        self.rules = rules or SwitchRules()
        self.memory = memory
        self.mode: Mode = CLOUD_ONLY
        self.target_rate = memory.target_rate if memory else 0.0  # tokens/s of the target's own decoding, streamed
        self._rounds: deque[tuple[int, float]] = deque(maxlen=self.rules.window)  # (tokens, seconds)
        self._stretch = self.rules.first_stretch_tokens
        self._probing = False  # speculation runs as a probe after a loss or at the start
        self._backoff = (memory.backoff if memory else 0) or self.rules.backoff_tokens
        self._hold = memory.hold if memory else 0  # the target's tokens due before the next probe
        self._spec_tokens = 0  # since speculation last started
        self._reprobe_after = self.rules.reprobe_after_tokens
        self._asked = False  # the verifier's last word: it is loaded and asks for speculation
        if memory is not None:
            self.verifier_asks(memory.verifier_asked)
        self.switches: list[Switch] = []

    @property
    def speculative_rate(self) -> float:
        """Tokens/s over the last rounds (0 before any)."""
        seconds = sum(s for _, s in self._rounds)
        return sum(t for t, _ in self._rounds) / seconds if seconds > 0 else 0.0

    def plan(self, drafter_ready: bool, generated: int) -> Plan:
        """What to run next, `generated` tokens into the generation."""
        if self.mode == CLOUD_ONLY:
            return self._after_stretch(drafter_ready, generated)
        return self._after_round(generated)

    @property
    def holding(self) -> bool:
        """Whether speculation is on hold after a lost probe (the drafter is not needed yet)."""
        return self._hold > 0

    def stretch_done(self, first_step_s: float, gaps_s: list[float], tokens: int | None = None) -> None:
        """A Decode stretch of `tokens` tokens (default: one per gap, plus the first) ended: its
        first token took `first_step_s` of server time (the round trip left out; 0 when that
        step was the prompt's prefill too, so it does not count), the next ones came `gaps_s`
        apart."""
        self._hold = max(0, self._hold - (len(gaps_s) + 1 if tokens is None else tokens))
        seconds = first_step_s + sum(gaps_s)
        steps = len(gaps_s) + (1 if first_step_s > 0 else 0)
        if seconds > 0 and steps:
            rate = steps / seconds
            self.target_rate = rate if not self.target_rate else 0.5 * self.target_rate + 0.5 * rate

    def verifier_asks(self, prefer_speculation: bool) -> None:
        """What the verifier's last reply or chunk said: whether it is loaded and asks edges to
        speculate."""
        self._asked = prefer_speculation
        if prefer_speculation:
            self._hold = 0

    def round_done(self, tokens: int, seconds: float) -> None:
        """A speculative round committed `tokens` in `seconds` of wall time, drafting included."""
        self._rounds.append((tokens, seconds))
        self._spec_tokens += tokens

    def remember(self) -> None:
        """The generation ended: what it measured is where the next one starts."""
        if self.memory is not None:
            self.memory.target_rate, self.memory.backoff, self.memory.hold = self.target_rate, self._backoff, self._hold
            self.memory.verifier_asked = self._asked

    # ---- the two boundaries -------------------------------------------------------------

    def _after_stretch(self, drafter_ready: bool, generated: int) -> Plan:
        if self._hold and not self.switches:  # an earlier generation's probe lost: no drafter yet
            reason = f"speculation lost its last probe: the target decodes {self._hold} more tokens first"
            return self._switch(CLOUD_ONLY, generated, ("start", reason), self._hold)
        if self._hold:
            return Plan(CLOUD_ONLY, self._hold)
        if not self.switches:  # the start: the first tokens come from the target, at once
            reason = "the first tokens stream while the drafter prefills"
            return self._switch(CLOUD_ONLY, generated, ("start", reason), self._warmup_stretch())
        if not drafter_ready:
            return Plan(CLOUD_ONLY, self._warmup_stretch())
        if self._asked:
            reason = "the verifier is loaded and asks edges to speculate"
            return self._switch(SPECULATIVE, generated, ("verifier_loaded", reason))
        self._probing = True
        if self.speculative_rate:
            return self._switch(SPECULATIVE, generated, ("probe_speculation", "probing speculation again"))
        return self._switch(SPECULATIVE, generated, ("drafter_ready", "the drafter has prefilled the prompt"))

    def _warmup_stretch(self) -> int:
        stretch = self._stretch
        self._stretch = min(2 * self._stretch, self.rules.max_warmup_stretch_tokens)
        return stretch

    def _after_round(self, generated: int) -> Plan:
        rules = self.rules
        if self._asked or len(self._rounds) < min(rules.min_rounds, rules.window):
            return Plan(SPECULATIVE)
        if not self.target_rate:
            reason = "measuring the target's decoding rate, unknown so far"
            return self._switch(CLOUD_ONLY, generated, ("probe_target", reason), rules.reprobe_target_tokens)
        spec, target = self.speculative_rate, self.target_rate
        if spec < rules.keep_ratio * target:
            stretch = self._hold = self._backoff
            self._backoff = min(2 * self._backoff, rules.max_backoff_tokens)
            reason = f"speculation {spec:.2f} tok/s < {rules.keep_ratio:g} x target {target:.2f} tok/s"
            return self._switch(CLOUD_ONLY, generated, ("slower", reason), stretch)
        if self._probing:  # a probe that wins: the next loss starts the backoff afresh
            self._probing, self._backoff = False, rules.backoff_tokens
        if self._spec_tokens >= self._reprobe_after:
            self._reprobe_after *= 2
            reason = f"measuring the target again after {self._spec_tokens} speculative tokens"
            return self._switch(CLOUD_ONLY, generated, ("probe_target", reason), rules.reprobe_target_tokens)
        return Plan(SPECULATIVE)

    def _switch(self, to: Mode, generated: int, why: tuple[str, str], tokens: int = 0) -> Plan:
        self.mode = to
        self.switches.append(Switch(generated, to, *why))
        if to == SPECULATIVE:  # a fresh measurement of speculation
            self._spec_tokens = 0
            self._rounds.clear()
        return Plan(to, tokens, why[1])
