"""What a round yields and costs, estimated as the k policy's model means each input
(edge/drafting/kpolicy.py, CostK):

- acceptance: the probability that a draft is accepted given that every draft before it was.
  Only the positions verified on an accepted prefix tell it: the accepted drafts and the first
  rejected one. A position after the first rejection is verified on a wrong prefix and says
  nothing about this parameter (in greedy mode it matches far less often), so it is left out.
  The estimate is the censored count, accepted / (accepted + one per rejected round), with the
  cloud's min(1, p/q) of each such position in place of its 0/1 outcome where the cloud reports
  it (`alpha_prefix`: the same expectation, less noise when sampling). Acceptance belongs to
  the text more than to the machine: each generation keeps its own (`Acceptance`), starting
  from the process's figure with the weight of a couple of rounds, so a predictable text after
  a hard one drafts long blocks from its first rounds;
- the draft time per token: drafting time over the tokens drafted in it (a block topped up from
  tokens drafted ahead counts only the tokens drafted for it);
- the verify time as a function of the rows in the target's pass (the last committed token, any
  catch-up and the drafts): fixed + per-row, a weighted least-squares line over the rounds seen,
  its slope shrunk towards flat while the rounds seen hold too few distinct sizes to tell (a
  policy that believes the pass flat drafts longer, and so measures the slope if there is one);
- the network's share of a round: the call's wall time less the cloud's.

Every sum is discounted by `decay` per round, so the estimates follow a verifier whose load or a
text whose predictability changes, while about 1 / (1 - decay) rounds weigh in at a time. A small
prior (the starting figures, about a round's weight) fills in until rounds arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge.drafting.feedback import RoundFeedback


@dataclass(frozen=True)
class CostPrior:
    """Starting figures, until measured rounds outweigh them."""

    acceptance: float = 0.7
    draft_ms_per_token: float = 50.0
    verify_ms: float = 150.0
    net_ms: float = 1.0
    weight: float = 1.0  # in rounds (acceptance: in verified positions, times 4)
    generation_weight: float = 8.0  # verified positions a generation's acceptance gives the process's figure


@dataclass(frozen=True)
class PlannedCosts:
    """Figures the policy plans with in place of the measured ones (None: measured), e.g. a
    GPU verifier's flat pass while a CPU verifier does the checking, or a laptop's drafting
    speed while a slower machine drafts."""

    verify_ms: float | None = None  # the pass, whatever its size
    network_ms: float | None = None  # each round's time on the network
    draft_ms_per_token: float | None = None  # drafting one token


@dataclass
class _Line:
    """A discounted weighted least-squares line y = fixed + slope * x, its slope shrunk towards
    0 by `ridge` (in units of the x-spread's weight) while x has barely varied."""

    ridge: float = 0.1
    w: float = 0.0
    wx: float = 0.0
    wy: float = 0.0
    wxx: float = 0.0
    wxy: float = 0.0

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        self.w += weight
        self.wx += weight * x
        self.wy += weight * y
        self.wxx += weight * x * x
        self.wxy += weight * x * y

    def decay(self, factor: float) -> None:
        self.w *= factor
        self.wx *= factor
        self.wy *= factor
        self.wxx *= factor
        self.wxy *= factor

    def fit(self) -> tuple[float, float]:
        """(fixed, slope), both at least 0."""
        if self.w <= 0:
            return 0.0, 0.0
        mean_x, mean_y = self.wx / self.w, self.wy / self.w
        sxx = self.wxx - self.w * mean_x * mean_x
        sxy = self.wxy - self.w * mean_x * mean_y
        slope = max(sxy / (max(sxx, 0.0) + self.ridge), 0.0)
        fixed = mean_y - slope * mean_x
        if fixed < 0:  # the line through the origin instead
            return 0.0, max(self.wxy / self.wxx, 0.0) if self.wxx > 0 else 0.0
        return fixed, slope


@dataclass
class DiscountedRatio:
    """sum(numerators) / sum(denominators), both discounted by `decay` at each addition, starting
    from `value_prior` with `weight` (in the denominator's units)."""

    value_prior: float
    weight: float
    decay: float
    _numerator: float = 0.0
    _denominator: float = 0.0

    def __post_init__(self) -> None:
        self._numerator, self._denominator = self.value_prior * self.weight, self.weight

    @property
    def value(self) -> float:
        return self._numerator / self._denominator

    def add(self, numerator: float, denominator: float) -> None:
        self._numerator = self.decay * self._numerator + numerator
        self._denominator = self.decay * self._denominator + denominator


class Acceptance(DiscountedRatio):
    """The censored count of acceptance given an accepted prefix, over verified positions."""

    def add_round(self, feedback: RoundFeedback) -> None:
        reached = min(feedback.accepted_len + 1, feedback.k)  # positions verified on an accepted prefix
        # The cloud's min(1, p/q) of those positions where it sent them, else their 0/1 outcomes.
        accepted = feedback.accepted_len if feedback.alpha_prefix is None else feedback.alpha_prefix * reached
        self.add(accepted, reached)


@dataclass
class RoundCosts:
    """The running estimates; `update` takes one verified round. One edge process keeps one
    (EdgeContext owns it), so a generation starts from what the last ones measured."""

    decay: float = 0.98
    prior: CostPrior = field(default_factory=CostPrior)
    planned: PlannedCosts = field(default_factory=PlannedCosts)
    _acceptance: Acceptance = field(init=False)
    _draft_ms: DiscountedRatio = field(init=False)  # per token drafted
    _net_ms: DiscountedRatio = field(init=False)  # per round
    _verify: _Line = field(default_factory=_Line)

    def __post_init__(self) -> None:
        p = self.prior
        self._acceptance = Acceptance(p.acceptance, 4 * p.weight, self.decay)
        self._draft_ms = DiscountedRatio(p.draft_ms_per_token, p.weight, self.decay)
        self._net_ms = DiscountedRatio(p.net_ms, p.weight, self.decay)

    # ---- the estimates ------------------------------------------------------------------

    @property
    def acceptance(self) -> float:
        """P(a draft is accepted | every draft before it was), over the process's rounds."""
        return self._acceptance.value

    def generation_acceptance(self) -> Acceptance:
        """A new generation's own acceptance, starting from the process's figure."""
        return Acceptance(self.acceptance, self.prior.generation_weight, self.decay)

    @property
    def draft_ms_per_token(self) -> float:
        if self.planned.draft_ms_per_token is not None:
            return self.planned.draft_ms_per_token
        return self._draft_ms.value

    @property
    def net_ms(self) -> float:
        if self.planned.network_ms is not None:
            return self.planned.network_ms
        return self._net_ms.value

    def verify_ms(self, rows: int) -> float:
        """The cloud's time for a round whose pass holds `rows` rows (drafts + 1, plus catch-up)."""
        fixed, per_row = self.verify_line()
        return fixed + per_row * rows

    def verify_line(self) -> tuple[float, float]:
        """(fixed ms, ms per row) of the verify time; the prior, flat, before any round."""
        if self.planned.verify_ms is not None:
            return self.planned.verify_ms, 0.0
        return self._verify.fit() if self._verify.w > 0 else (self.prior.verify_ms, 0.0)

    # ---- learning -----------------------------------------------------------------------

    def update(self, feedback: RoundFeedback) -> None:
        if feedback.k <= 0:
            return
        self._acceptance.add_round(feedback)
        drafted = feedback.k if feedback.drafted is None else feedback.drafted
        self._draft_ms.add(feedback.draft_ms if drafted > 0 else 0.0, drafted)
        self._net_ms.add(max(feedback.rtt_ms - feedback.verify_ms, 0.0), 1)
        self._verify.decay(self.decay)
        self._verify.add(feedback.k + 1 + feedback.catchup, feedback.verify_ms)
