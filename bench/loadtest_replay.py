"""Replay of one recorded session against a live verifier.

Speculative: the session's recorded Verify requests are sent in order, each after the edge's
recorded think-time (the gap between the previous reply and this request in the recording),
with base_position taken from the live server's last reply, so a replay stays valid even where
a reply differs from the recording. Replies that differ (accepted_len, next token) are counted:
replay fidelity. Recorded reopens are replayed as reopens (on the recorded prefix while the
replay has matched the recording, else on the replay's own committed tokens); a NOT_FOUND or
position mismatch met live is answered like the edge does: reopen on the committed prefix.

Resized sessions (Azure lengths or caps): the prompt is the tiled one of the plan, and the
recorded draft blocks are cycled until the planned output length is generated; the last blocks
are cut so the output ends exactly there. Replies are not compared then.

cloud_only: one Generate with the same prompt and max_new_tokens = the planned output length
(no stop tokens, so both modes produce the same number of tokens).

auto: Decode stretches until the verifier asks for speculation (a verifier started with
--prefer-speculation-above N, once it holds more than N sessions), then the recorded rounds from
the next round boundary (AutoReplay).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from bench.loadtest_arrivals import PlannedSession
from edge.trace import Event, OpenEvent, SessionTrace, VerifyEvent
from edge.transport.client import VerifierClient
from shared.errors import PositionMismatch, SessionNotFound, SpecDecError
from shared.protocol import (
    REOPEN_SEED_STRIDE,
    AcceptMode,
    DecodeRequest,
    GenerateRequest,
    OpenSessionRequest,
    SessionConfig,
    VerifyRequest,
    VerifyResult,
)

MAX_LIVE_REOPENS = 4  # per session, for NOT_FOUND / position mismatch met during the replay


@dataclass(frozen=True)
class RoundSample:
    t_s: float  # reply time, seconds since the load test began
    latency_ms: float  # Verify round trip (cloud_only: time between two Generate chunks)
    tokens: int  # tokens the round produced: accepted drafts + the recovered/bonus token
    queue_ms: float | None  # server-reported queue time (Verify only)


@dataclass(frozen=True)
class Delivery:
    """Tokens a session's user sees at once, and the time since the session's previous ones
    (edge think-time included: the inter-token latency as the user sees it)."""

    gap_ms: float
    tokens: int
    t_s: float  # when they came, seconds since the load test began
    session: int = 0  # the session's index in the load test


class LoadClock:
    """Seconds since the load test began, and what every session reports into. `t0` (the event
    loop's monotonic time) lets processes of one load share one start."""

    def __init__(self, t0: float | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time() if t0 is None else t0
        self.rounds: list[RoundSample] = []
        self.open_changes: list[tuple[float, int]] = []  # (t, +1 / -1): sessions in flight
        self.errors_by_code: Counter[str] = Counter()
        self.deliveries: list[Delivery] = []  # after each session's first tokens (those are its TTFT)
        self._last_delivery: dict[int, float] = {}  # session index -> when it last got tokens

    def now(self) -> float:
        return self.loop.time() - self.t0

    def deliver(self, session: int, tokens: int) -> None:
        now = self.now()
        if (last := self._last_delivery.get(session)) is not None:
            self.deliveries.append(Delivery((now - last) * 1000.0, tokens, now, session))
        self._last_delivery[session] = now


@dataclass
class SessionOutcome:
    index: int
    trace: str
    mode: str
    arrival_s: float
    prompt_tokens: int
    output_target: int
    resized: bool
    start_s: float = 0.0
    end_s: float = 0.0
    ttft_ms: float | None = None
    rounds: int = 0
    verified_tokens: int = 0  # tokens produced by the verifier's replies (catch-up excluded)
    output_tokens: int = 0
    reopens: int = 0
    rounds_compared: int = 0
    accepted_len_mismatches: int = 0
    next_token_mismatches: int = 0
    rounds_differing: int = 0  # compared rounds whose reply differed in either
    output_equal: bool | None = None  # None: not comparable (resized, or sampled cloud_only)
    capacity_rejections: int = 0
    error: str | None = None  # the status code that ended the session early
    opened: bool = False  # the verifier took the session (OpenSession answered, or the stream's first token)
    errors: dict[str, int] = field(default_factory=dict)  # every error answer met, recovered or not

    @property
    def ended_by(self) -> str | None:
        """Where and how the session ended early: "open RESOURCE_EXHAUSTED", "round DEADLINE_EXCEEDED"."""
        return None if self.error is None else f"{'round' if self.opened else 'open'} {self.error}"

    def note_error(self, clock: LoadClock, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        clock.errors_by_code[code] += 1


def _session_config(trace: SessionTrace, seed: int) -> SessionConfig:
    h = trace.header
    return SessionConfig(h.sampling, seed, AcceptMode(h.accept_mode), h.vocab_size)


def think_gaps(events: list[Event]) -> dict[int, float]:
    """Per event (by position): the recorded time between the previous reply and its send."""
    gaps, last_reply = {}, 0.0
    for i, event in enumerate(events):
        gaps[i] = max(event.t - last_reply, 0.0)
        if event.error is None:
            last_reply = event.t_reply
    return gaps


def final_output(generated: list[int], trace: SessionTrace) -> list[int]:
    """The edge's cut (edge/round/generation.py Output): up to the first stop token, at most max_new_tokens."""
    out: list[int] = []
    for token in generated[: trace.header.max_new_tokens]:
        out.append(token)
        if token in trace.header.stop_token_ids:
            break
    return out


def _cut(req: VerifyRequest, catchup: int, k: int) -> VerifyRequest:
    return VerifyRequest(
        "",
        req.base_position,
        req.draft_tokens[:k],
        req.draft_probs[:k],
        req.committed_tokens[:catchup],
        req.hard_mask[:k],
        req.sparse_draft[:k],
        req.want_top_k,
    )


class SpeculativeReplay:
    def __init__(self, plan: PlannedSession, client: VerifierClient, clock: LoadClock, think_scale: float) -> None:
        self.plan, self.client, self.clock, self.think_scale = plan, client, clock, think_scale
        self.trace = plan.trace
        self.out = SessionOutcome(
            plan.index, self.trace.name, "speculative", plan.arrival_s, len(plan.prompt_tokens), plan.output_target, plan.resized
        )
        self.committed = list(plan.prompt_tokens)
        self.session_id, self.position, self.max_draft = "", 0, 0
        self.faithful = not plan.resized  # replies matched the recording so far

    def generated(self) -> list[int]:
        return self.committed[len(self.plan.prompt_tokens) :]

    async def _open(self, tokens: list[int], seed: int) -> None:
        if self.session_id:
            try:
                await self.client.close_session(self.session_id)
            except SpecDecError:
                pass  # evicted already, or gone with a restart
        reply = await self.client.open_session(OpenSessionRequest(tokens, _session_config(self.trace, seed)))
        self.session_id, self.position, self.max_draft = reply.session_id, reply.position, reply.max_draft_tokens
        self.committed = list(tokens)
        self.out.opened = True

    def _steps(self) -> Iterator[tuple[Event, float]]:
        """(event, think-time) pairs to replay: the recording in order, or its replied Verify
        blocks cycled without end (resized: the caller stops at the planned length)."""
        events = self.trace.events
        gaps = think_gaps(events)
        first_open = next((i for i, e in enumerate(events) if isinstance(e, OpenEvent) and e.error is None), -1)
        replayable = [
            (e, gaps[i])
            for i, e in enumerate(events)
            if e.error is None and i != first_open and isinstance(e, VerifyEvent | OpenEvent)
        ]
        if not self.plan.resized:
            yield from replayable
            return
        blocks = [(e, gap) for e, gap in replayable if isinstance(e, VerifyEvent)]
        if blocks:
            yield from itertools.cycle(blocks)

    def _request(self, recorded: VerifyRequest) -> VerifyRequest:
        if not self.plan.resized:
            return _cut(recorded, len(recorded.committed_tokens), min(len(recorded.draft_tokens), self.max_draft))
        room = self.plan.output_target - len(self.generated()) - 1  # one token always comes back
        catchup = min(len(recorded.committed_tokens), max(room, 0))
        return _cut(recorded, catchup, min(len(recorded.draft_tokens), max(room - catchup, 0), self.max_draft))

    async def _verify(self, recorded: VerifyRequest) -> tuple[VerifyRequest, VerifyResult]:
        """One round; a lost session is reopened on the committed prefix and the block resent."""
        while True:
            cut = self._request(recorded)
            req = VerifyRequest(
                self.session_id,
                self.position,
                cut.draft_tokens,
                cut.draft_probs,
                cut.committed_tokens,
                cut.hard_mask,
                cut.sparse_draft,
                cut.want_top_k,
            )
            sent = self.clock.now()
            try:
                reply = await self.client.verify(req)
            except (SessionNotFound, PositionMismatch) as err:
                if self.out.reopens >= MAX_LIVE_REOPENS:
                    raise  # ends the session: counted once, where that is handled
                self.out.note_error(self.clock, err.status)
                self.out.reopens += 1
                await self._open(self.committed, self.trace.header.seed + REOPEN_SEED_STRIDE * (10 + self.out.reopens))
                continue
            now = self.clock.now()
            self.clock.rounds.append(RoundSample(now, (now - sent) * 1000.0, reply.accepted_len + 1, reply.metrics.queue_ms))
            self.clock.deliver(self.out.index, reply.accepted_len + 1)
            if self.out.ttft_ms is None:
                self.out.ttft_ms = (now - self.out.start_s) * 1000.0
            return req, reply

    def _compare(self, recorded: VerifyEvent, reply: VerifyResult) -> None:
        if self.plan.resized:
            return
        self.out.rounds_compared += 1
        if reply.accepted_len != recorded.accepted_len:
            self.out.accepted_len_mismatches += 1
        if reply.next_token != recorded.next_token:
            self.out.next_token_mismatches += 1
        if reply.accepted_len != recorded.accepted_len or reply.next_token != recorded.next_token:
            self.out.rounds_differing += 1
            self.faithful = False

    def _first_seed(self) -> int:
        """The seed the recorded session opened with."""
        first = self.trace.first_open()
        return first.seed if first else self.trace.header.seed

    async def run(self) -> SessionOutcome:
        await self._open(self.plan.prompt_tokens, self._first_seed())
        await self._play(self._steps())
        return await self._finish()

    async def _play(self, steps: Iterator[tuple[Event, float]]) -> None:
        for event, gap in steps:
            if self.plan.resized and len(self.generated()) >= self.plan.output_target:
                break
            if gap * self.think_scale > 0:
                await asyncio.sleep(gap * self.think_scale)  # the edge's drafting time
            if isinstance(event, OpenEvent):  # a reopen in the recording
                prefix = event.prefix_tokens if self.faithful else self.generated()
                self.out.reopens += 1
                await self._open(self.plan.prompt_tokens + prefix, event.seed)
                continue
            assert isinstance(event, VerifyEvent)
            req, reply = await self._verify(event.request)
            self._compare(event, reply)
            self.committed += [*req.committed_tokens, *req.draft_tokens[: reply.accepted_len], reply.next_token]
            self.position = reply.new_base_position
            self.out.rounds += 1
            self.out.verified_tokens += reply.accepted_len + 1

    async def _finish(self) -> SessionOutcome:
        try:
            await self.client.close_session(self.session_id)
        except SpecDecError:
            pass  # evicted meanwhile: nothing to free
        if self.plan.resized:
            self.out.output_tokens = min(len(self.generated()), self.plan.output_target)
        else:
            output = final_output(self.generated(), self.trace)
            self.out.output_tokens = len(output)
            self.out.output_equal = output == self.trace.end.output_tokens
        return self.out


class AutoReplay(SpeculativeReplay):
    """A session in auto mode on a fast verifier, as far as the verifier's word decides it: the
    target decodes (Decode stretches of 2, then 16, doubling up to 64 tokens, as auto mode's
    backoff grows) until a chunk says the verifier is loaded and asks for speculation; then the
    session speculates from the next recorded round boundary to its end (the stretch in flight
    decodes up to that boundary first). The edge's own probes of speculation on an idle
    verifier (a few rounds, lost to the target's faster decoding) are left out."""

    STRETCHES = (2, 16, 32, 64)

    def __init__(self, plan: PlannedSession, client: VerifierClient, clock: LoadClock, think_scale: float) -> None:
        super().__init__(plan, client, clock, think_scale)
        self.out.mode = "auto"
        self.asked = False

    async def run(self) -> SessionOutcome:
        stretches = itertools.chain(self.STRETCHES, itertools.repeat(self.STRETCHES[-1]))
        while not self.asked and (room := self.plan.output_target - len(self.generated())) > 0:
            await self._decode(min(next(stretches), room))
        if self.asked:
            to_boundary, rest = _from_boundary(self._steps(), len(self.generated()))
            if to_boundary:
                await self._decode(to_boundary)
            await self._play(rest)
        return await self._finish()

    async def _decode(self, max_tokens: int) -> None:
        if self.session_id:
            req = DecodeRequest(self.session_id, self.position, max_tokens)
        else:
            config = _session_config(self.trace, self._first_seed())
            req = DecodeRequest("", 0, max_tokens, open=OpenSessionRequest(list(self.plan.prompt_tokens), config))
        last = self.clock.now()
        async for chunk in self.client.decode(req):
            now = self.clock.now()
            if chunk.opened is not None:
                self.session_id, self.max_draft = chunk.opened.session_id, chunk.opened.max_draft_tokens
                self.out.opened = True
            if chunk.tokens:
                if self.out.ttft_ms is None:
                    self.out.ttft_ms = (now - self.out.start_s) * 1000.0
                else:
                    self.clock.rounds.append(RoundSample(now, (now - last) * 1000.0, len(chunk.tokens), None))
                self.clock.deliver(self.out.index, len(chunk.tokens))
                self.committed += chunk.tokens
                self.out.rounds += len(chunk.tokens)
                self.out.verified_tokens += len(chunk.tokens)
                last = now
            self.position = chunk.position
            self.asked = chunk.prefer_speculation

    async def _finish(self) -> SessionOutcome:
        out = await super()._finish()
        if not self.trace.header.sampling.greedy:
            out.output_equal = None  # the target's own sampling draws another text than the recorded rounds
        return out


def _from_boundary(steps: Iterator[tuple[Event, float]], decoded: int) -> tuple[int, Iterator[tuple[Event, float]]]:
    """(tokens to decode up to the first recorded round that starts at or after `decoded` tokens,
    the steps from that round on). Recorded reopens before it are dropped: the decoded part had none."""
    offset = 0
    for event, gap in steps:
        if not isinstance(event, VerifyEvent):
            continue
        start, offset = offset, offset + event.accepted_len + 1
        if start >= decoded:
            return start - decoded, itertools.chain([(event, gap)], steps)
    return 0, iter(())


async def replay_cloud_only(plan: PlannedSession, client: VerifierClient, clock: LoadClock) -> SessionOutcome:
    trace = plan.trace
    out = SessionOutcome(
        plan.index, trace.name, "cloud_only", plan.arrival_s, len(plan.prompt_tokens), plan.output_target, plan.resized
    )
    out.start_s = clock.now()
    req = GenerateRequest(plan.prompt_tokens, _session_config(trace, trace.header.seed), plan.output_target, [])
    tokens: list[int] = []
    last = out.start_s
    async for chunk in client.generate(req):
        now = clock.now()
        if out.ttft_ms is None:
            out.ttft_ms = (now - out.start_s) * 1000.0  # prefill + first step: not a step latency
            out.opened = True
        else:
            clock.rounds.append(RoundSample(now, (now - last) * 1000.0, len(chunk.tokens), None))
        last = now
        clock.deliver(out.index, len(chunk.tokens))
        tokens += chunk.tokens
        out.rounds += 1
    out.verified_tokens = out.output_tokens = len(tokens)
    if not plan.resized and trace.header.sampling.greedy:
        out.output_equal = final_output(tokens, trace) == trace.end.output_tokens
    return out


async def replay(plan: PlannedSession, client: VerifierClient, clock: LoadClock, mode: str, think_scale: float) -> SessionOutcome:
    """One session, start to end; an error answer that ends it is kept in the outcome."""
    clock.open_changes.append((clock.now(), +1))
    start = clock.now()
    replays = {"speculative": SpeculativeReplay, "auto": AutoReplay}
    speculative = replays[mode](plan, client, clock, think_scale) if mode in replays else None
    try:
        if speculative is not None:
            speculative.out.start_s = start
            outcome = await speculative.run()
        else:
            outcome = await replay_cloud_only(plan, client, clock)
    except SpecDecError as err:
        outcome = (
            speculative.out
            if speculative is not None
            else SessionOutcome(
                plan.index, plan.trace.name, mode, plan.arrival_s, len(plan.prompt_tokens), plan.output_target, plan.resized
            )
        )
        outcome.start_s = start
        outcome.error = err.status
        outcome.note_error(clock, err.status)
    finally:
        clock.open_changes.append((clock.now(), -1))
    outcome.end_s = clock.now()
    outcome.capacity_rejections = client.stats.capacity_rejections
    return outcome
