"""The vLLM engine: the target in vLLM (`--engine vllm`), which owns the KV as paged,
prefix-cached blocks and batches every request of a step itself.

A session is ONE live vLLM request for its whole life (the scheduler in
cloud/engine/vllm_scheduler.py); a session step (cloud/engine/__init__.py) is a step of it. Its prefill is the request's prompt; a
Verify round puts the edge's drafts on it as speculative tokens for one step, verified by
vLLM's rejection sampler: greedy drafts by the argmax, point drafts as q = 1, sparse drafts
with the edge's distribution over each handed to the sampler as its draft probabilities. A
Generate stream or a Decode stretch is vLLM decoding it on its own. Between its steps the
request is parked: it keeps its KV and costs no step. The tokens a request holds past the
session's own (a stretch decoded ahead, the token its prefill sampled) are read by the
session's next steps: a draft that equals the token vLLM sampled there is accepted without a
step, the first that differs is corrected by it. Whatever the accept mode, this is exact: the
token at that position is the target's own draw (a sparse draft is accepted there with
probability p(y) where the sampler's rule gives min(1, p(y)/q(y)): a lower acceptance, at one
position after a prefill). A session whose tokens no longer extend its request's (a round
that caught up on tokens of its own) gets a new request; its salted prefix-cache blocks serve
the whole blocks of it. A session vLLM cannot verify exactly (an approximate accept mode, a
vocabulary narrower than the model's that vLLM cannot mask) is refused when it opens.

Rows of logits (the target's top-k a round asks for, `want_top_k`) come from requests of their
own after the round's live step, processed by the session's rule as the reference accept
processes them: one request per row, for the session's tokens up to it,
under its cache salt (vLLM's prefix cache serves the whole blocks it already holds), asking
for the raw logit of every token of the row it samples: the model's own logits, at the price
of one request (a full sort of the vocabulary and its transfer) per row.

vLLM itself is started and run by a VllmRuntime (cloud/engine/vllm_runtime.py), on a thread of
its own, in the verifier's process or a child of it (`--vllm-engine-process`,
cloud/engine/vllm_process.py).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from cloud.engine import EngineName, KVPlan, KVRequest, SessionKV, SessionStep, StepOutcome, TokenSink
from cloud.engine.vllm_runtime import MAX_STALLED_STEPS, STALLED_RETRY_MS, LiveRequest, VllmRuntime
from cloud.rejection_sampler import RejectionSampler, RoundOutcome, top_k_rows
from shared import lm
from shared.errors import CapacityExceeded, ConfigError, SessionRefused, VerifierFault
from shared.protocol import SessionConfig, SparseDistribution
from shared.token_ids import shared_prefix

log = logging.getLogger("cloud-verifier")
VLLM_MAX_TOKEN_LIST = 1024  # vLLM's engine core refuses (and dies of) a longer allowed_token_ids
VLLM_MAX_BANNED = 128  # single-token bad words vLLM masks per request (VLLM_MAX_NUM_BAD_WORDS)
LIVE_SEED_STRIDE = 7_919  # a session's request starting at position p samples with seed + p * this


class BannedSpan(list[list[int]]):
    """Single-token bad words that are one span of ids, [start, end): a session's vocabulary
    narrower than the model's rows (a draft's 151,936 tokens on a target padded to 152,064).
    vLLM masks bad words one word and one row at a time, a tensor write each (128 words on the
    17 rows of a padded step: 2,176 writes a request a step); a span is masked with one write
    for all the rows of a run of requests (cloud/engine/vllm_scheduler.py)."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__([token] for token in range(start, end))
        self.span = (start, end)


def limit_vocab(params: Any, vocab: int, width: int) -> None:
    """Keep vLLM's sampling of `params` inside a session's vocabulary (a draft's 151,936
    tokens on a target whose rows are padded to 152,064, say): the padding rows banned as
    single-token bad words when they are few, else the vocabulary listed when it is short.
    These are the masks vLLM's rejection sampler applies (a logit bias it ignores under
    speculative decoding). A session that fits neither raises ValueError (it keeps the
    forward pass), as vLLM checks the lists only inside its engine core."""
    if vocab >= width:
        return
    if width - vocab <= VLLM_MAX_BANNED:
        # vLLM fills this from `bad_words` text only when some is given; ids need no tokenizer.
        params._bad_words_token_ids = BannedSpan(vocab, width)
    elif vocab <= VLLM_MAX_TOKEN_LIST:
        params.allowed_token_ids = list(range(vocab))
    else:
        raise ValueError(f"a vocabulary of {vocab} in {width} rows cannot be given to vLLM's sampler")


def _delta() -> Any:
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.DELTA  # each output carries the step's new tokens only


@dataclass(frozen=True)
class LiveStep:
    """A session step as the live request takes it (what crosses to the engine process): the
    session takes `fed` as given after its tokens, then `drafts` are verified, each a point
    (q = 1) or, with `draft_q`, drawn from the edge's q over it. A step that `reads` yields
    the accepted drafts and one more token; the rest is SessionStep's."""

    kv: Any  # the session's VllmKV (its id on the way to the engine process)
    fed: list[int]
    drafts: list[int]
    reads: bool = True
    ahead: int = 1
    stops: frozenset[int] = frozenset()
    known: int = 0
    draft_q: Sequence[SparseDistribution] = ()

    @classmethod
    def of(cls, step: SessionStep) -> LiveStep:
        rule = step.rule
        draft_q = rule.sparse_draft if rule is not None else ()
        return cls(step.kv, step.fed, step.drafts, rule is not None, step.ahead, step.stops, step.known, draft_q)


class LiveRuns(Protocol):
    """An engine whose sessions are live requests: VllmEngine, or the same in a child process."""

    def run_live(self, steps: Sequence[LiveStep]) -> list[list[int] | Exception]: ...

    def rows(self, kv: SessionKV, length: int, block: list[int], keep: int) -> torch.Tensor: ...

    def crop(self, kv: SessionKV, length: int) -> None: ...


def steps_as_live(engine: LiveRuns, steps: Sequence[SessionStep]) -> list[StepOutcome | None | Exception]:
    """Session steps as live requests' steps: each one's tokens become its outcome, and its KV
    is cropped to the drafts it accepted."""
    lengths = [step.kv.get_seq_length() for step in steps]
    produced = engine.run_live([LiveStep.of(step) for step in steps])
    outcomes: list[StepOutcome | None | Exception] = []
    for step, tokens, length in zip(steps, produced, lengths, strict=True):
        try:
            if isinstance(tokens, Exception):
                raise tokens
            outcomes.append(_live_outcome(engine, step, tokens, length))
        except Exception as err:  # this step alone fails
            outcomes.append(err)
    return outcomes


def _live_outcome(engine: LiveRuns, step: SessionStep, tokens: list[int], length: int) -> StepOutcome | None:
    """A step's tokens as its outcome (each draft's acceptance as the 1 or 0 it was: vLLM
    reports no p/q); a step that reads nothing has none."""
    if step.rule is None:
        return None
    drafts, accepted = len(step.drafts), len(tokens) - 1
    top_k = _top_k(engine, step, length, accepted) if step.top_k else []
    engine.crop(step.kv, length + step.grows_by + accepted)
    passed = torch.tensor([1.0] * accepted + [0.0] * (drafts - accepted))
    return StepOutcome(RoundOutcome(accepted, tokens[-1], accepted == drafts, passed), top_k)


def _top_k(engine: LiveRuns, step: SessionStep, length: int, accepted: int) -> list[SparseDistribution]:
    """The top-k rows a step asked for: its rows from requests of their own, processed by its
    rule as the reference accept would process them."""
    assert step.rule is not None  # only a step that reads asks
    rows = engine.rows(step.kv, length, step.fed[: step.grows_by] + step.drafts, len(step.drafts) + 1)
    [probs] = RejectionSampler().distributions([step.rule.with_logits(rows)])
    if isinstance(probs, Exception):
        raise probs
    return top_k_rows(probs[: accepted + 1], step.top_k)


@dataclass
class VllmKV:
    """One session as vLLM serves it: its tokens (those whose KV a step computed), the salt
    that keeps its cached blocks its scope's (its own, or its API key's sessions'), and its
    live request once it has one."""

    salt: str = field(default_factory=lambda: uuid.uuid4().hex)
    tokens: list[int] = field(default_factory=list)
    released: bool = False
    params: Any = None  # the session's vllm.SamplingParams (make_live)
    seed: int = 0
    live: LiveRequest | None = None

    def get_seq_length(self) -> int:
        return len(self.tokens)


@dataclass
class _LiveWork:
    """A live step on its way: the tokens its session takes as given, and once decided, the
    tokens it yields (or what failed it)."""

    step: LiveStep
    kv: VllmKV
    base: list[int]
    tokens: list[int] | None = None
    error: Exception | None = None

    @property
    def decided(self) -> bool:
        return self.tokens is not None or self.error is not None


class VllmEngine:
    """A model served by a VllmRuntime. Several engines may share one runtime (tests do): only
    the engine that owns it stops it on close."""

    name: EngineName = "vllm"
    caches_prefixes = True  # its prefix cache, salted by each session's scope
    decodes_ahead = True

    def __init__(self, runtime: VllmRuntime, owns_runtime: bool = True) -> None:
        config = runtime.llm.model_config
        self.runtime = runtime
        self.owns_runtime = owns_runtime
        self.logits_width = int(config.get_vocab_size())
        width = torch.empty(0, dtype=config.dtype).element_size()
        layers, heads = config.get_total_num_hidden_layers(), config.get_total_num_kv_heads()
        self.kv_bytes_per_token = int(layers * 2 * heads * config.get_head_size() * width)
        self.parameters = lm.safetensors_parameters(Path(config.model))  # vLLM does not report it
        self.dtype = str(config.dtype).removeprefix("torch.")

    def plan_kv(self, request: KVRequest) -> KVPlan:
        """vLLM holds the KV (sized when it started): the context it serves, and the KV it
        allocated, or the cap asked where smaller. A vLLM that sized its own KV (no bytes given:
        what a GPU had left) sets the cap alone; the default cap is sized for a CPU."""
        if request.layout != "packed":
            raise ConfigError("--engine vllm keeps its own KV: --kv-layout slots is for the transformers engine")
        context = min(request.max_context_tokens, self.runtime.max_context_tokens)
        held = self.kv_bytes_held()
        # Each live session holds whole blocks and room for a round's drafts past its tokens.
        slack = request.max_sessions * (self.runtime.block_size + self.runtime.options.max_draft_tokens + 1)
        usable = max(held - slack * self.kv_bytes_per_token, held // 2)
        return KVPlan(context, min(request.max_kv_bytes, usable) if self.runtime.options.max_kv_bytes else usable)

    def kv_bytes_held(self) -> int:
        return self.runtime.kv_tokens() * self.kv_bytes_per_token

    def kv_tokens(self) -> int:
        """The tokens of KV vLLM allocated."""
        return self.runtime.kv_tokens()

    def failure(self) -> str | None:
        return self.runtime.failure()

    def describe(self) -> dict[str, str]:
        import vllm

        facts = {"engine": self.name, "dtype": self.dtype, "device": self.runtime.device, "vllm": vllm.__version__}
        facts["scheduling"] = "asynchronous" if self.runtime.llm.vllm_config.scheduler_config.async_scheduling else "synchronous"
        if self.runtime.device == "cpu":
            facts["threads"] = str(self.runtime.cpu_threads)
        return facts

    def close(self) -> None:
        if self.owns_runtime:
            self.runtime.close()

    # ---- a session's KV -----------------------------------------------------------------

    def new_kv(self, scope: str = "") -> VllmKV:
        """A session whose cached blocks are its scope's (its API key's sessions share them), or
        its own alone."""
        return VllmKV(salt=scope) if scope else VllmKV()

    def free(self, kv: SessionKV) -> None:
        kv = _own(kv)
        kv.released = True
        kv.tokens = []
        if kv.live is not None:
            self.runtime.call(self.runtime.end_live, kv.live)

    def freed(self, kv: SessionKV) -> bool:
        return _own(kv).released

    def crop(self, kv: SessionKV, length: int) -> None:
        del _own(kv).tokens[length:]

    # ---- live sessions ----------------------------------------------------------------------

    def check_session(self, config: SessionConfig, vocab: int) -> None:
        self._sampling(config, vocab)

    def start_session(self, kv: SessionKV, config: SessionConfig, vocab: int) -> None:
        """Every session is live: vLLM's rejection sampler verifies its rounds exactly (greedy,
        point drafts as q = 1, sparse drafts with the edge's q as its draft probabilities)."""
        own = _own(kv)
        own.params, own.seed = self._sampling(config, vocab), config.seed

    def _sampling(self, config: SessionConfig, vocab: int) -> Any:
        """vLLM's sampling of a session; SessionRefused for one it cannot verify exactly (an
        approximate accept mode, settings or a vocabulary vLLM refuses), which is never
        verified by another rule."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError

        if not config.accept_mode.exact:
            raise SessionRefused(
                f"the vllm engine verifies only exact accept modes (greedy, point, sparse), not "
                f"{config.accept_mode.value}: use --accept-mode sparse or point"
            )
        sampling = config.sampling
        try:
            params = SamplingParams(
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                repetition_penalty=sampling.repetition_penalty,
                ignore_eos=True,  # a session ends when the edge closes it
                detokenize=False,
                output_kind=_delta(),
            )
            limit_vocab(params, vocab, self.logits_width)
        except (VLLMValidationError, ValueError) as err:
            raise SessionRefused(f"the vllm engine cannot sample this session: {str(err)[:200]}") from err
        return params

    def run_steps(self, steps: Sequence[SessionStep]) -> list[StepOutcome | None | Exception]:
        return steps_as_live(self, steps)

    def run_live(self, steps: Sequence[LiveStep]) -> list[list[int] | Exception]:
        """Each step advanced as far as the tokens its request holds decide it; vLLM steps while
        any is undecided. A session's tokens grow by the step's fed tokens and drafts (its
        rounds crop the rejected ones, as after a forward pass)."""
        works = [_LiveWork(step, kv, kv.tokens + step.fed) for step in steps for kv in [_own(step.kv)]]
        self.runtime.call(self._decide, works)
        for work in works:
            if work.tokens is not None:
                work.kv.tokens = work.base[: len(work.base) - work.step.known] + work.step.drafts
        return [w.tokens if w.tokens is not None else w.error for w in works]  # type: ignore[misc]

    def follow(self, kv: SessionKV, position: int, sink: TokenSink) -> bool:
        live = _own(kv).live
        if live is None:
            return False
        self.runtime.call(self.runtime.follow, live, position, sink)
        return True

    def unfollow(self, kv: SessionKV) -> None:
        live = _own(kv).live
        if live is not None:
            self.runtime.call(self.runtime.stop_following, live)

    def extend(self, kv: SessionKV, tokens: list[int]) -> None:
        _own(kv).tokens.extend(tokens)

    def own_steps(self) -> tuple[int, float]:
        return self.runtime.steps_taken()

    def rows(self, kv: SessionKV, length: int, block: list[int], keep: int) -> torch.Tensor:
        """Full rows from requests of their own under the session's cache salt (its whole
        blocks served by vLLM's prefix cache): what a round asking for the target's top-k reads."""
        own = _own(kv)
        scratch = VllmKV(salt=own.salt, tokens=own.tokens[:length])
        return self.forward([scratch], [block], [keep])[0]

    def _decide(self, works: list[_LiveWork]) -> None:
        """On vLLM's thread: advance every work, and step vLLM while any is undecided."""
        stalled = 0
        while True:
            self._settle(works)
            for work in works:
                if not work.decided:
                    self._advance(work)
            undecided = [w for w in works if not w.decided]
            if not undecided:
                return
            if not self.runtime.busy():
                for work in undecided:
                    work.error = VerifierFault("vLLM ended the session's request before its step's tokens")
                return
            before = self._progress(undecided)
            self.runtime.step()
            stalled = 0 if self._progress(undecided) != before else stalled + 1
            if stalled >= MAX_STALLED_STEPS:
                self._give_up(undecided)
                return

    def _settle(self, works: list[_LiveWork]) -> None:
        """Under asynchronous scheduling: the outputs still to come of the works' parked
        requests (a prefill's token, the step a stream took past its stop) come in first, so
        that the rounds among the works are woken together and share one step."""
        runtime = self.runtime
        for _ in range(MAX_STALLED_STEPS):  # a step or two: as many as vLLM keeps in flight
            if not any(w.kv.live is not None and runtime.settling(w.kv.live) for w in works if not w.decided):
                return
            runtime.step()

    def _progress(self, works: list[_LiveWork]) -> list[tuple[int, int]]:
        """How far the works' requests got: their tokens, and the tokens vLLM computed of them."""
        return [(len(w.kv.live.tokens), self.runtime.computed(w.kv.live)) for w in works if w.kv.live is not None]

    def _give_up(self, works: list[_LiveWork]) -> None:
        """Steps vLLM cannot schedule (its KV blocks are held by parked sessions): their
        requests end, and their sessions get new ones on their next step."""
        for work in works:
            if work.kv.live is not None:
                self.runtime.end_live(work.kv.live)
                work.kv.live = None
            work.error = CapacityExceeded("vLLM has no KV blocks free for the session's step", STALLED_RETRY_MS)

    def _advance(self, work: _LiveWork) -> None:
        """Decide the step from the tokens its request holds past the session's, or have vLLM
        make more: start the request (or a new one, when the session's tokens left it), put
        the drafts on it, or let it decode ahead."""
        kv, step, runtime = work.kv, work.step, self.runtime
        if len(step.drafts) > runtime.options.max_draft_tokens:
            work.error = VerifierFault(f"vLLM verifies at most {runtime.options.max_draft_tokens} drafts a step")
            return
        live = kv.live
        if live is None or live.tokens[: len(work.base)] != work.base:
            if live is not None:
                runtime.end_live(live)
            if len(work.base) > runtime.max_context_tokens:
                work.error = VerifierFault("the session's tokens fill the context")
                return
            kv.live = runtime.start_live(work.base, kv.salt, self._seeded(kv, len(work.base)))
            return
        if not step.reads:
            work.tokens = []
            return
        ahead = live.tokens[len(work.base) :]
        matched = shared_prefix(step.drafts, ahead)
        if matched < len(ahead):  # a draft differs from what vLLM sampled there, or all pass and it holds the next
            work.tokens = [*step.drafts[:matched], ahead[matched]]
            self._decode_on(live, step, ahead[matched:])
            return
        drafts, draft_q = step.drafts[matched:], step.draft_q[matched:]
        if live.ended:
            work.error = VerifierFault("vLLM ended the session's request at the context's end")
        elif runtime.parked(live):
            runtime.wake(live, drafts, 1 if drafts else max(step.ahead, 1), step.stops, draft_q)
        elif drafts and runtime.park(live):  # decoding on its own: the drafts go on it from its next step
            runtime.wake(live, drafts, 1, step.stops, draft_q)

    def _decode_on(self, live: LiveRequest, step: LiveStep, held: list[int]) -> None:
        """After a step without drafts read the first of the tokens vLLM `held` past the session:
        let a parked request decode the tokens its session reads next (a stretch, a stream, up
        to a stop token) in the steps to come."""
        more = step.ahead - len(held)
        if step.drafts or more <= 0 or live.ended or step.stops.intersection(held) or not self.runtime.parked(live):
            return
        self.runtime.wake(live, [], more, step.stops)

    def _seeded(self, kv: VllmKV, position: int) -> Any:
        """The session's sampling for a request starting at `position`: seeded from its seed
        and the position, so its requests draw independently."""
        params = kv.params.clone()
        if params.temperature > 0:
            params.seed = (kv.seed + LIVE_SEED_STRIDE * position) % (1 << 63)
        return params

    # ---- rows of logits: full rows, one request per row ------------------------------------

    def forward(
        self,
        kvs: Sequence[SessionKV],
        blocks: Sequence[Sequence[int]],
        keeps: Sequence[int],
    ) -> list[torch.Tensor]:
        """Every block's rows as requests in flight together: per block its last keeps[i] rows
        [keep, V] (all rows when 0). A session's tokens
        grow only when the whole pass succeeded. (Sessions run live: this serves `rows`.)"""
        caches = [_own(kv) for kv in kvs]
        steps = [(kv.tokens + list(block), keep or len(block)) for kv, block, keep in zip(caches, blocks, keeps, strict=True)]
        requests = [
            (prompt, kv.salt, params) for kv, step in zip(caches, steps, strict=True) for prompt, params in _requests(*step)
        ]
        outputs = iter(self.runtime.run(requests))
        rows = [self._rows(keep, [next(outputs) for _ in range(keep)]) for _, keep in steps]
        for kv, (tokens, _) in zip(caches, steps, strict=True):
            kv.tokens = tokens
        return rows

    def _rows(self, keep: int, outputs: list[Any]) -> torch.Tensor:
        rows = torch.full((keep, self.logits_width), float("-inf"), dtype=torch.float32)
        for row, output in zip(rows, outputs, strict=True):
            _fill(row, output.outputs[0].logprobs)
        return rows


def _requests(tokens: list[int], keep: int) -> list[tuple[list[int], Any]]:
    """One request per kept row, ending at that row, asking for every token's raw logit of the
    row it samples."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, flat_logprobs=True, logprobs=-1)
    return [(tokens[: i + 1], params) for i in range(len(tokens) - keep, len(tokens))]


def _fill(row: torch.Tensor, flat: Any) -> None:
    """Write a FlatLogprobs row's (token, raw logit) pairs into a row."""
    start, end = flat.start_indices[0], flat.end_indices[0]
    ids, values = flat.token_ids[start:end], flat.logprobs[start:end]
    if not ids:
        raise VerifierFault("vLLM returned an empty row of logits")
    row[torch.tensor(ids)] = torch.tensor(values, dtype=torch.float32)


def _own(kv: SessionKV) -> VllmKV:
    if not isinstance(kv, VllmKV):
        raise TypeError(f"the vLLM engine holds no {type(kv).__name__}")
    return kv
