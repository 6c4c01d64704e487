"""vLLM's scheduler with live sessions: a session is one vLLM request for its whole life, parked between its pieces of
work and woken for each, its grammar masked by the scheduler (docs/architecture.md, "Live requests"). vLLM's internal
API: the model runner's side, and the vLLM versions both are tested on, are in vllm_patches.py."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

import numpy as np
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import remove_all
from vllm.v1.request import Request, RequestStatus

from shared.grammar import Constraint, GrammarRefused

LIVE_PREFIX = "live-"  # the ids of live requests (the others are plain vLLM requests)
# Set on a request when vLLM first schedules it: the prompt tokens its prefix cache served
CACHED_TOKENS = "specedge_cached_tokens"

# The edge's distribution over one draft: (token ids, their probabilities), the rest 0.
DraftDistribution = tuple[list[int], list[float]]


@dataclass
class LiveWork:
    """What a woken live request runs for: until it holds `until` tokens or samples a stop."""

    until: int
    stops: frozenset[int] = field(default_factory=frozenset)


@dataclass
class LiveGrammar:
    """A live request's grammar: its session's place in it (moved to the request's tokens before
    each step), and the position of the request's tokens where the grammar starts."""

    constraint: Constraint
    start: int


class LiveScheduler(Scheduler):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's scheduler, with live requests parked between their pieces of work."""

    running: list[Request]  # vLLM's: the requests it schedules
    max_num_scheduled_tokens: int  # vLLM's: the tokens a step may schedule

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parked: dict[str, Request] = {}  # not scheduled, nothing in flight: ready for work
        self.settling: dict[str, Request] = {}  # not scheduled, a step's outputs still to come
        self.work: dict[str, LiveWork] = {}
        self.draft_q: dict[str, list[DraftDistribution]] = {}  # a woken round's sparse drafts' distributions
        self.grammars: dict[str, LiveGrammar] = {}  # the live requests under a grammar
        self.pad_limit = 0  # the most tokens a step padded to 1 + K a request may have (0: no pads)
        self.steps = 0  # steps scheduled that run the model

    @property
    def prefill_chunk(self) -> int:
        """The most tokens of a prompt one step computes (0: a whole prompt, as the step's token
        budget allows): a long prompt takes several steps, shared with other requests."""
        return int(self.scheduler_config.long_prefill_token_threshold)

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int) -> None:
        # vLLM pads a new request with one token left to compute (its prompt's blocks cached) to
        # 1 + K tokens and expects that step whole: a chunk is never shorter.
        self.scheduler_config.long_prefill_token_threshold = max(tokens, 1 + self.num_spec_tokens) if tokens else 0

    # ---- what the verifier calls ------------------------------------------------------------

    def wake(
        self,
        request_id: str,
        drafts: list[int],
        tokens: int,
        stops: Iterable[int] = (),
        draft_q: list[DraftDistribution] | None = None,
    ) -> None:
        """Run a parked live request for `tokens` more tokens (1: one step, whatever it accepts),
        with `drafts` as its speculative tokens for the first step and `draft_q` the edge's
        distribution over each (None: point drafts, q = 1)."""
        request = self.parked.pop(request_id)  # KeyError: it is not parked
        request.spec_token_ids = list(drafts)
        # Until the step that schedules the drafts takes them: under asynchronous scheduling the
        # request parks while that step is scheduled (AsyncLiveScheduler._update_after_schedule).
        if draft_q:
            self.draft_q[request_id] = draft_q
        else:
            self.draft_q.pop(request_id, None)
        self.work[request_id] = LiveWork(request.num_tokens + tokens, frozenset(stops))
        self.running.append(request)

    def park(self, request_id: str) -> bool:
        """Stop a live request decoding on its own (between two steps); whether it is parked
        now (one that waits to be scheduled, computes its prompt, or was preempted, parks after
        its next token)."""
        request = self.requests.get(request_id)
        if request_id in self.parked or request_id in self.settling:
            return request_id in self.parked
        if request is None or request.status != RequestStatus.RUNNING or request not in self.running or _prefilling(request):
            work = self.work.get(request_id)
            if request is not None and work is not None:
                work.until = min(work.until, _due(request) + 1)
            return False
        self.running = remove_all(self.running, {request})
        self._park(request)
        return request_id in self.parked

    def constrain(self, request_id: str, constraint: Constraint, start: int) -> None:
        """Mask every row of the request's steps with `constraint`'s grammar, which its tokens
        enter at `start`, from its next step on."""
        self.grammars[request_id] = LiveGrammar(constraint, start)

    # ---- vLLM's scheduler, for live requests --------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id.startswith(LIVE_PREFIX):  # its prefill samples one token, then it parks
            self.work[request.request_id] = LiveWork(request.num_tokens + 1)
        super().add_request(request)

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """Drafts come from the edge (wake), never from a proposer."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._pad_own_decoding()
        budget = self.max_num_scheduled_tokens
        if self.prefill_chunk and sum(self.get_request_counts()) == 1:
            # vLLM 0.27 on lets a request alone in a step compute its whole prompt past
            # long_prefill_token_threshold; a round arriving meanwhile would wait for all of it.
            self.max_num_scheduled_tokens = min(budget, self.prefill_chunk)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = budget
        self.steps += output.total_num_scheduled_tokens > 0
        output.edge_draft_q = self._scheduled_draft_q(output.scheduled_spec_decode_tokens)
        for new in output.scheduled_new_reqs:  # first scheduled: what it computed so far came from the prefix cache
            request = self.requests.get(new.req_id)
            if request is not None and not hasattr(request, CACHED_TOKENS):
                setattr(request, CACHED_TOKENS, int(new.num_computed_tokens))
        return output

    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        """The masks of a scheduled step's live requests under a grammar, for the model runner
        to apply to their logits: 1 + drafts rows each (a prompt's chunk that samples nothing
        has none). Every request here is live: vLLM's own structured outputs have none."""
        scheduled = scheduler_output.num_scheduled_tokens
        ids = [rid for rid in scheduled if rid in self.grammars and not self.requests[rid].is_prefill_chunk]
        if not ids:
            return super().get_grammar_bitmask(scheduler_output)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        rows = [_grammar_rows(self.requests[rid], self.grammars[rid], drafts.get(rid, ())) for rid in ids]
        # vLLM 0.32's GrammarOutput also says how many drafts each mask covers, for its V2 model
        # runner only: the edge's drafts run on the V1 runner (the custom_class proposer).
        return GrammarOutput(ids, np.concatenate(rows))

    def _scheduled_draft_q(self, scheduled: dict[str, list[int]]) -> dict[str, list[DraftDistribution]]:
        """The distributions of the sparse drafts this step verifies (as many as vLLM scheduled
        of each round's drafts); a round's go with its one step."""
        return {rid: self.draft_q.pop(rid)[: len(drafts)] for rid, drafts in scheduled.items() if rid in self.draft_q}

    def _pad_own_decoding(self) -> None:
        """K pads (its last token, repeated) on each request decoding on its own, when that makes the step a uniform
        batch that fits pad_limit, vLLM's full CUDA graph (docs/architecture.md, "Live requests")."""
        k = self.num_spec_tokens
        if not self.pad_limit or not k or self.get_request_counts()[1] or len(self.running) * (1 + k) > self.pad_limit:
            return
        own = []
        for request in self.running:
            if request.num_computed_tokens != request.num_tokens - 1:  # a prefill, or a pass's request
                return
            if request.spec_token_ids:
                if len(request.spec_token_ids) != k:  # a round of fewer drafts: no uniform batch
                    return
            elif request.request_id in self.work:
                own.append(request)
            else:
                return
        for request in own:
            request.spec_token_ids = [request.all_token_ids[-1]] * k

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        before = {rid: self.requests[rid].num_tokens for rid in scheduler_output.num_scheduled_tokens if rid in self.work}
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        done = set()
        for request_id, length in before.items():
            work = self.work.get(request_id)
            request = self.requests.get(request_id)
            if work is None or request is None or request.status != RequestStatus.RUNNING:
                continue
            new = request.all_token_ids[length:]  # one token, or more where drafts (pads) passed
            if request.num_tokens >= work.until or work.stops.intersection(new):
                done.add(request)
        self._park_all(done)
        self._settle()
        return outputs

    def _park_all(self, requests: set[Request]) -> None:
        if requests:
            self.running = remove_all(self.running, requests)
            for request in requests:
                self._park(request)

    def _park(self, request: Request) -> None:
        parked = self.settling if request.num_output_placeholders else self.parked
        parked[request.request_id] = request
        request.spec_token_ids = []
        self.work.pop(request.request_id, None)

    def _settle(self) -> None:
        """Settling requests whose last outputs came back are parked (those vLLM ended go)."""
        for request_id, request in list(self.settling.items()):
            if request.is_finished():
                del self.settling[request_id]
            elif not request.num_output_placeholders:
                self.parked[request_id] = self.settling.pop(request_id)

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        ids = (request_ids,) if isinstance(request_ids, str) else list(request_ids if request_ids is not None else self.requests)
        for request_id in ids:
            self.work.pop(request_id, None)
            self.draft_q.pop(request_id, None)
            self.grammars.pop(request_id, None)
            parked = self.parked.pop(request_id, None) or self.settling.pop(request_id, None)
            if parked is not None:  # finished from the running list, as vLLM expects
                self.running.append(parked)
        return super().finish_requests(ids, finished_status)  # type: ignore[no-any-return]


class AsyncLiveScheduler(LiveScheduler, AsyncScheduler):  # type: ignore[misc]  # vLLM is untyped here
    """The live scheduler under vLLM's asynchronous scheduling: it schedules a step while the
    one before it runs on the GPU."""

    def wake(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        super().wake(request_id, *args, **kwargs)
        # Its next step sends the model runner all its tokens, as for a request that was not in
        # the step before, and the runner takes it as new (NoDrafts): the tokens it holds on
        # the device may be those of a round that verified drafts.
        self.prev_step_scheduled_req_ids.discard(request_id)

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        """After vLLM's own bookkeeping of a step: the scheduled requests drop vLLM's draft placeholders, and those
        whose work it completes, or under a grammar, park now (docs/architecture.md, "Live requests")."""
        super()._update_after_schedule(scheduler_output)
        done = set()
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[request_id]
            if not request.num_output_placeholders:  # a prefill chunk: no token sampled
                continue
            request.spec_token_ids = []
            work = self.work.get(request_id)
            if work is not None and (_due(request) >= work.until or request_id in self.grammars):
                done.add(request)
        self._park_all(done)


def _grammar_rows(request: Request, grammar: LiveGrammar, drafts: Sequence[int]) -> np.ndarray:  # [1 + drafts, words] int32
    """Row i allows what the grammar allows after the request's tokens and drafts[:i]; past a padding draft of vLLM's
    or a stop id, everything (docs/architecture.md, "Live requests")."""
    constraint = grammar.constraint
    rows = np.full((1 + len(drafts), constraint.vocab.words), -1, dtype=np.int32)
    valid = list(takewhile(lambda token: token >= 0, drafts))
    try:
        constraint.sync(request.all_token_ids[grammar.start :])
    except GrammarRefused:
        return rows
    rows[: 1 + len(valid)] = constraint.mask_rows(valid)
    return rows


def _prefilling(request: Request) -> bool:
    return bool(request.num_computed_tokens < request.num_prompt_tokens)


def _due(request: Request) -> int:
    """The tokens a request will hold once its scheduled steps' outputs are in."""
    return int(request.num_tokens + request.num_output_placeholders)
