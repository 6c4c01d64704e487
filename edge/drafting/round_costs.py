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
  a hard one drafts long blocks from its first rounds. The process also keeps how a block's
  first draft fares against the drafts after it (`DepthProfile`), a factor on the text's figure
  for each;
- the drafting time against the tokens drafted in a round: fixed + per token (`CostLine`). The
  fixed part is real: before its first draft the drafter takes in the tokens the cloud just
  committed (one forward pass of its own), so a round of 8 drafts costs less than four rounds
  of 2 per token, and a per-token average taken at short blocks makes long ones look dear. A
  block topped up from tokens drafted ahead counts only the tokens drafted for it;
- the verify time as a function of the rows in the target's pass (the last committed token, any
  catch-up and the drafts): fixed + per-row (`CostLine`);
- the network's share of a round: the call's wall time less the cloud's (`Level`).

The verify line and the network's share are timings of a shared machine and link, and they go
wrong in ways the rest does not: a round slowed by another job, a CPU hog for a minute, an RTT
that steps. Left to a plain discounted least-squares line, two slow early rounds at two sizes
teach a steep slope; every later round then drafts k = 1, no round measures another size, and
the slope stays (the best k of a line through its own stale points is the smallest). So:

- Forgetting by rounds and by time (`Forgetting`): a round's weight falls by `decay` per round
  since it and halves every `half_life_s` seconds since it, read from the clock RoundCosts is
  given (a test's own), so a process that ran few rounds for minutes forgets old ones too.
- Robust to outliers: the line is refitted with Tukey's biweight (a round more than about five
  robust scales off the line does not count), starting from the line of the last rounds where
  they hold two sizes, so a stale slow round at a size not drafted since cannot hold the line
  by leverage against fresh ones; the network's share is a weighted median, so one slow round
  moves neither much.
- A level shift is forgotten at once: when four rounds in a row fall on the same side of the
  estimate by more than four robust scales each, the rounds before them are dropped (`Samples`).
  One slow round is an outlier; four are the machine now.
- The fixed part cannot go negative, and the fit never falls back to a line through the origin:
  that line says an empty pass is free, which no verifier does (it reads its weights for one row
  as for ten), and it makes the fewest rows look best. Where the data would put the fixed part
  below a tenth of the pass at their centre, the slope is cut and the line pivots on that centre,
  which keeps its prediction at the sizes actually seen.
- The slope's ridge is a share of the data's own weight (rows², `LineFit.ridge`), so whatever
  the memory, rounds of one size read as a flat pass and a few stale points cannot pin a slope.
  Drafting is shrunk the other way (`LineFit.toward`): rounds of one size read as a cost per
  token with no fixed part, and only rounds of different sizes show a fixed part.
- Exploration (`Exploration`): after some rounds in a row at one size a round drafts one token
  more or fewer than the best k, and sooner while the weight at other sizes is under a tenth of
  the whole (the slope rests on old rounds, or on none). A probe that disagrees with the stale
  points starts the robust fit, they drop out of it, and the best k moves.

Exploration and these costs belong to the endpoint and the process, not to a generation: one
RoundCosts lives as long as the process (EdgeContext), so a serve process of short requests
explores and forgets as a long generation would. A small prior (the starting figures) fills in
until rounds arrive.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from edge.drafting.feedback import RoundFeedback

Array = npt.NDArray[np.float64]


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


@dataclass(frozen=True)
class Forgetting:
    """How fast a measured round stops counting: by `per_round` for each round since it and by
    half every `half_life_s` seconds since it, so a process that runs few rounds for minutes
    forgets as surely as a busy one."""

    per_round: float = 0.98
    half_life_s: float = 60.0

    def weights(self, rounds_ago: Array, seconds_ago: Array) -> Array:
        return np.power(self.per_round, rounds_ago) * np.exp2(-np.maximum(seconds_ago, 0.0) / self.half_life_s)

    def window(self) -> int:
        """Rounds after which a round weighs under 1% (at most 2000: a long memory is sampled)."""
        if self.per_round >= 1.0:
            return 2000
        return int(min(math.log(0.01) / math.log(self.per_round), 2000)) + 1


def weighted_median(values: Array, weights: Array) -> float:
    order = np.argsort(values)
    seen = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(seen, seen[-1] / 2)])


def robust_scale(residuals: Array, weights: Array, floor: float) -> float:
    """The residuals' spread as a normal's standard deviation, from their weighted median size."""
    return max(1.4826 * weighted_median(np.abs(residuals), weights), floor)


@dataclass
class Samples:
    """The recent measurements (x, y) of one cost, weighted by `forgetting` relative to the
    newest. A level shift is forgotten at once: when the last `shift_run` measurements all fell
    on the same side of what the older ones predicted, by more than `shift_at` robust scales
    each, the older ones are dropped."""

    forgetting: Forgetting
    shift_run: int = 4
    shift_at: float = 4.0
    # (x, y, round, clock seconds) rows, the live ones [_start, _end): twice the window, so that
    # moving the live rows to the front is needed once per window's additions, not every one
    _rows: Array = field(init=False)
    _start: int = field(default=0, init=False)
    _end: int = field(default=0, init=False)
    _surprises: deque[float] = field(init=False)  # the last rounds' residuals in robust scales
    _points: tuple[Array, Array, Array] | None = field(default=None, init=False)  # of the rows as they are

    def __post_init__(self) -> None:
        self._window = self.forgetting.window()
        self._rows = np.empty((2 * self._window, 4))
        self._surprises = deque(maxlen=self.shift_run)

    def __len__(self) -> int:
        return self._end - self._start

    def add(self, x: float, y: float, round_no: int, t: float, surprise: float) -> None:
        """`surprise`: how far y lies from what the owner estimated before it, in scales."""
        if self._end == len(self._rows):
            live = self._rows[self._start : self._end].copy()
            self._rows[: len(live)] = live
            self._start, self._end = 0, len(live)
        self._rows[self._end] = (x, y, round_no, t)
        self._end += 1
        self._start = max(self._start, self._end - self._window)
        self._points = None
        run = self._surprises
        run.append(surprise)
        if len(run) == self.shift_run and (min(run) > self.shift_at or max(run) < -self.shift_at):
            self._start = max(self._start, self._end - self.shift_run)
            run.clear()

    def points(self) -> tuple[Array, Array, Array]:
        """(xs, ys, weights), read again only after an addition (the policy asks every k)."""
        if self._points is None:
            xs, ys, rounds, times = self._rows[self._start : self._end].T.copy()
            self._points = xs, ys, self.forgetting.weights(rounds[-1] - rounds, times[-1] - times)
        return self._points


@dataclass(frozen=True)
class LineFit:
    """How a cost line is fitted: shrunk by `ridge` (a share of the data's own weight, so stale
    points weigh in it no more than fresh ones) towards `toward` where its sizes cannot tell
    (the verify pass: "flat", its slope shrunk, in rows²; drafting: "proportional", its fixed
    part shrunk), a fixed part of at least `floor` of the cost at the sizes seen, and rounds
    far off the line weighted down to nothing (Tukey's biweight, zero beyond `reject` robust
    scales) over `iterations` refits that start from the last `recent` rounds' own line where
    those hold two sizes: where old rounds and recent ones disagree, the recent ones decide."""

    toward: Literal["flat", "proportional"] = "flat"
    ridge: float = 0.002
    floor: float = 0.1
    reject: float = 4.685
    iterations: int = 5
    recent: int = 16
    measured_share: float = 0.1  # of the weight at other sizes than the last, for a measured slope
    noise: float = 0.01  # the smallest scale, a share of the mean pass: timings are never exact


@dataclass(frozen=True)
class Line:
    fixed: float
    slope: float
    scale: float  # of the residuals, robust

    def at(self, x: Array | float) -> Array | float:
        return self.fixed + self.slope * x


def fit_line(xs: Array, ys: Array, ws: Array, how: LineFit) -> Line:
    """y = fixed + slope * x, robust to rounds far off the rest."""
    tail = slice(-how.recent, None)
    recent_sizes = len(np.unique(xs[tail])) > 1
    line = _least_squares(xs[tail], ys[tail], ws[tail], how) if recent_sizes else _least_squares(xs, ys, ws, how)
    floor = max(how.noise * float(np.average(ys, weights=ws)), 0.01)  # ms: a pass timed at 0 has no spread
    for _ in range(how.iterations):
        residuals = ys - line.at(xs)
        scale = robust_scale(residuals, ws, floor)
        biweight = np.clip(1.0 - (residuals / (how.reject * scale)) ** 2, 0.0, None) ** 2
        line = _least_squares(xs, ys, ws * biweight, how)
    return Line(line.fixed, line.slope, robust_scale(ys - line.at(xs), ws, floor))


def _least_squares(xs: Array, ys: Array, ws: Array, how: LineFit) -> Line:
    if how.toward == "proportional":
        return _least_squares_proportional(xs, ys, ws, how)
    total = float(ws.sum())
    mean_x, mean_y = float(ws @ xs) / total, float(ws @ ys) / total
    sxx = float(ws @ (xs - mean_x) ** 2)
    sxy = float(ws @ ((xs - mean_x) * (ys - mean_y)))
    slope = max(sxy / (sxx + how.ridge * total), 0.0)
    # A pass costs something at any size: the line pivots on the data's centre rather than
    # reach a fixed part below the floor (through the origin, the fewest rows would look best).
    if mean_x > 0:
        slope = min(slope, (1.0 - how.floor) * mean_y / mean_x)
    return Line(mean_y - slope * mean_x, slope, 0.0)


def _least_squares_proportional(xs: Array, ys: Array, ws: Array, how: LineFit) -> Line:
    """Weighted least squares with the fixed part shrunk to zero: a cost per unit unless the
    sizes show a fixed part; neither part negative."""
    sw, sx, sy = float(ws.sum()), float(ws @ xs), float(ws @ ys)
    sxx, sxy = float(ws @ (xs * xs)), float(ws @ (xs * ys))
    penalty = how.ridge * sw
    det = (sw + penalty) * sxx - sx * sx
    if det <= 0 or sxx <= 0:
        return Line(max(sy / sw, 0.0), 0.0, 0.0)
    fixed = (sy * sxx - sx * sxy) / det
    slope = ((sw + penalty) * sxy - sx * sy) / det
    if fixed < 0:  # through the origin
        return Line(0.0, max(sxy / sxx, 0.0), 0.0)
    if slope < 0:  # a level
        return Line(sy / sw, 0.0, 0.0)
    return Line(fixed, slope, 0.0)


# Drafting's line: a cost per token unless rounds of different sizes show a fixed part; no floor
# under the fixed part (an edge that drafts nothing spends nothing).
DRAFT_FIT = LineFit(toward="proportional", ridge=0.002, floor=0.0)


@dataclass
class CostLine:
    """A cost against a round's size (the verify pass's rows, the tokens drafted), fitted on
    the recent rounds."""

    forgetting: Forgetting
    how: LineFit = field(default_factory=LineFit)
    _samples: Samples = field(init=False)
    _fit: Line | None = field(default=None, init=False)  # of the samples as they are

    def __post_init__(self) -> None:
        self._samples = Samples(self.forgetting)

    def fit(self) -> Line | None:
        """None before any round."""
        if self._fit is None and len(self._samples):
            self._fit = fit_line(*self._samples.points(), self.how)
        return self._fit

    def unsure(self) -> bool:
        """Whether the recent rounds hold too little weight at sizes other than the last one's
        for the line to be measured now (what it rests on is then old, or nothing)."""
        if not len(self._samples):
            return False
        xs, _, ws = self._samples.points()
        return float(ws[xs != xs[-1]].sum()) < self.how.measured_share * float(ws.sum())

    def add(self, size: int, ms: float, round_no: int, t: float) -> None:
        line = self.fit()
        surprise = 0.0 if line is None else (ms - float(line.at(size))) / line.scale
        self._samples.add(size, ms, round_no, t, surprise)
        self._fit = None


@dataclass
class Level:
    """A cost that does not depend on the round's size (the network's share of a round): the
    weighted median of the recent rounds, which a spike does not move and a step does."""

    forgetting: Forgetting
    noise_ms: float = 1.0  # the smallest scale: a millisecond's jitter is no shift
    _samples: Samples = field(init=False)
    _value: float | None = field(default=None, init=False)  # of the samples as they are

    def __post_init__(self) -> None:
        self._samples = Samples(self.forgetting)

    def value(self) -> float | None:
        if self._value is None and len(self._samples):
            _, ys, ws = self._samples.points()
            self._value = weighted_median(ys, ws)
        return self._value

    def add(self, ms: float, round_no: int, t: float) -> None:
        surprise = 0.0
        if len(self._samples):
            _, ys, ws = self._samples.points()
            level = weighted_median(ys, ws)
            surprise = (ms - level) / robust_scale(ys - level, ws, max(self.noise_ms, 0.05 * level))
        self._samples.add(0.0, ms, round_no, t, surprise)
        self._value = None


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
class DepthProfile:
    """How acceptance differs between a block's first draft and the drafts after it, as factors
    on the pooled figure: P(accepted | every draft before it was) at depth 0, and at any depth
    after, each over the censored pooled ratio. The first draft follows the cloud's correction,
    a turn the draft model did not see coming; a draft after an accepted one continues a stretch
    it has been matching. In greedy decoding on the packaged pair the first passes 0.71 of the
    time and the later ones 0.77 to 0.91, so one pooled figure, learned where blocks are short,
    prices a long block low. Two figures and no more: each depth's own would be noise at the
    depths few blocks reach. Both are discounted censored counts (the positions verified on an
    accepted prefix); the later figure is pulled towards the first by `pull` positions, so a
    process that drafts k = 1 reads them alike."""

    decay: float
    pull: float = 8.0
    _first: Array = field(init=False)  # (passed, reached) at depth 0
    _later: Array = field(init=False)  # (passed, reached) at depths 1 and on

    def __post_init__(self) -> None:
        self._first, self._later = np.zeros(2), np.zeros(2)

    def add_round(self, feedback: RoundFeedback) -> None:
        reached = min(feedback.accepted_len + 1, feedback.k)
        self._first *= self.decay
        self._later *= self.decay
        if reached > 0:
            self._first += (min(feedback.accepted_len, 1), 1.0)
            self._later += (max(min(feedback.accepted_len, reached) - 1, 0), reached - 1)

    def factors(self, count: int) -> Array:
        """The first `count` depths' acceptance over the pooled one (1 throughout before any
        round)."""
        factors = np.ones(count)
        passed, reached = self._first + self._later
        if passed <= 0 or reached <= 0:
            return factors
        pooled = passed / reached
        first = self._first[0] / self._first[1]
        later = (self._later[0] + self.pull * first) / (self._later[1] + self.pull)
        factors[0], factors[1:] = first / pooled, later / pooled
        return factors


@dataclass
class Exploration:
    """When a round drafts a size other than the best k, so that the verify line's slope stays
    measured. After `every` rounds in a row at one size (the policy's cadence) it drafts one
    token more or fewer (alternately). While the line cannot tell its slope from recent rounds (`CostLine.unsure`)
    it does so after `unsure_every` rounds: a slope measured at one size and a long-gone other
    is no measure at all, and at k = 1 no round measures another size unless one is asked for.
    The counts live with the costs, not with a generation: a process answering many short
    requests explores as one answering a long one."""

    unsure_every: int = 8
    _same: int = 0  # rounds in a row at one size, since the last probe
    _rows: int = -1  # the last round's
    _probes: int = 0

    def k(self, best: int, k_min: int, k_max: int, every: int, unsure: bool) -> int:
        """The k to draft this round, given the best by the estimates."""
        if unsure:
            every = min(self.unsure_every, every)
        if every <= 0 or self._same < every - 1:
            return best
        step = 1 if self._probes % 2 == 0 else -1
        if not k_min <= best + step <= k_max:
            step = -step
        return min(max(best + step, k_min), k_max)

    def note(self, rows: int, probe: bool) -> None:
        """A verified round: its rows, and whether it was a probe."""
        if probe:
            self._same, self._probes = 0, self._probes + 1
        else:
            self._same = self._same + 1 if rows == self._rows else 1
        self._rows = rows


@dataclass
class RoundCosts:
    """The running estimates; `update` takes one verified round. The verify line and the
    network's share are the endpoint's (the --cloud target), the draft time the process's, and
    acceptance here the process's figure that each generation's own starts from. An edge
    process talks to one endpoint, so EdgeContext keeps one RoundCosts for its life and every
    generation (a batch's prompts, `edge-agent serve`'s requests) plans and explores with it."""

    decay: float = 0.98
    prior: CostPrior = field(default_factory=CostPrior)
    planned: PlannedCosts = field(default_factory=PlannedCosts)
    half_life_s: float = 60.0
    clock: Callable[[], float] = time.monotonic  # seconds; a test passes its own
    exploration: Exploration = field(default_factory=Exploration)
    _acceptance: Acceptance = field(init=False)
    _depths: DepthProfile = field(init=False)
    _draft: CostLine = field(init=False)  # ms against tokens drafted
    _net: Level = field(init=False)  # ms per round
    _verify: CostLine = field(init=False)  # ms against the pass's rows
    _rounds: int = 0

    def __post_init__(self) -> None:
        p = self.prior
        forgetting = Forgetting(self.decay, self.half_life_s)
        self._acceptance = Acceptance(p.acceptance, 4 * p.weight, self.decay)
        self._depths = DepthProfile(self.decay)
        self._draft = CostLine(forgetting, DRAFT_FIT)
        self._net = Level(forgetting)
        self._verify = CostLine(forgetting)

    @property
    def rounds(self) -> int:
        """Verified rounds measured so far (by every generation that shares these costs)."""
        return self._rounds

    # ---- the estimates ------------------------------------------------------------------

    @property
    def acceptance(self) -> float:
        """P(a draft is accepted | every draft before it was), over the process's rounds."""
        return self._acceptance.value

    def depth_factors(self, count: int) -> Array:
        """Acceptance at each of the first `count` depths of a block over the pooled figure
        (DepthProfile)."""
        return self._depths.factors(count)

    def generation_acceptance(self) -> Acceptance:
        """A new generation's own acceptance, starting from the process's figure."""
        return Acceptance(self.acceptance, self.prior.generation_weight, self.decay)

    def draft_ms(self, tokens: int) -> float:
        """Drafting `tokens` tokens in one round (the drafter first takes in what the cloud
        committed)."""
        if tokens <= 0:
            return 0.0
        if self.planned.draft_ms_per_token is not None:
            return self.planned.draft_ms_per_token * tokens
        line = self._draft.fit()
        return self.prior.draft_ms_per_token * tokens if line is None else max(float(line.at(tokens)), 0.0)

    @property
    def net_ms(self) -> float:
        if self.planned.network_ms is not None:
            return self.planned.network_ms
        level = self._net.value()
        return self.prior.net_ms if level is None else level

    def verify_ms(self, rows: int) -> float:
        """The cloud's time for a round whose pass holds `rows` rows (drafts + 1, plus catch-up)."""
        fixed, per_row = self.verify_line()
        return fixed + per_row * rows

    def verify_line(self) -> tuple[float, float]:
        """(fixed ms, ms per row) of the verify time; the prior, flat, before any round."""
        if self.planned.verify_ms is not None:
            return self.planned.verify_ms, 0.0
        line = self._verify.fit()
        return (self.prior.verify_ms, 0.0) if line is None else (line.fixed, line.slope)

    def explore(self, best: int, k_min: int, k_max: int, every: int) -> int:
        """The k to draft next round: `best`, or a probe of another size after `every` rounds
        in a row at one size, sooner while the slope is not measured (Exploration)."""
        unsure = self.planned.verify_ms is None and self._verify.unsure()
        return self.exploration.k(best, k_min, k_max, every, unsure)

    # ---- learning -----------------------------------------------------------------------

    def update(self, feedback: RoundFeedback, probe: bool = False) -> None:
        """One verified round; `probe`: its k was an exploring one, not the best."""
        if feedback.k <= 0:
            return
        now, rows = self.clock(), feedback.k + 1 + feedback.catchup
        self._rounds += 1
        self._acceptance.add_round(feedback)
        self._depths.add_round(feedback)
        drafted = feedback.k if feedback.drafted is None else feedback.drafted
        if drafted > 0:
            self._draft.add(drafted, feedback.draft_ms, self._rounds, now)
        self._net.add(max(feedback.rtt_ms - feedback.verify_ms, 0.0), self._rounds, now)
        self._verify.add(rows, feedback.verify_ms, self._rounds, now)
        self.exploration.note(rows, probe)
