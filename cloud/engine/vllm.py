"""The vLLM engine (`--engine vllm`): vLLM owns the KV as paged, prefix-cached blocks and batches every request of a
step itself; a session is ONE live vLLM request for its whole life, parked between its steps, whose tokens held ahead
serve its next steps (docs/architecture.md, "Live requests"; what each call becomes and why: docs/operations.md,
"The vLLM engine")."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from cloud.engine import EngineName, KVPlan, KVRequest, PromptChunk, SessionKV, SessionStep, StepOutcome, TokenSink
from cloud.engine.vllm_runtime import MAX_STALLED_STEPS, STALLED_RETRY_MS, LiveRequest, TopRow, VllmRuntime
from cloud.grammars import SessionGrammars
from cloud.rejection_sampler import RoundOutcome
from shared import lm
from shared.errors import CapacityExceeded, ConfigError, SessionRefused, VerifierFault
from shared.grammar import Constraint
from shared.protocol import SessionConfig, SparseDistribution
from shared.token_ids import shared_prefix

VLLM_MAX_TOKEN_LIST = 1024  # vLLM's engine core refuses (and dies of) a longer allowed_token_ids
VLLM_MAX_BANNED = 128  # single-token bad words vLLM masks per request (VLLM_MAX_NUM_BAD_WORDS)
LIVE_SEED_STRIDE = 7_919  # a session's request starting at position p samples with seed + p * this


class BannedSpan(list[list[int]]):
    """Single-token bad words that are one span of ids, [start, end): the rows past a session's vocabulary, masked
    with one write for a run of requests (vllm_patches._mask_banned_spans; the cost: docs/operations.md)."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__([token] for token in range(start, end))
        self.span = (start, end)


def limit_vocab(params: Any, vocab: int, width: int) -> None:
    """Keep vLLM's sampling of `params` inside a session's vocabulary: the padding rows banned when few, else the
    vocabulary listed when short; ValueError when neither fits (docs/architecture.md, "Live requests")."""
    if vocab >= width:
        return
    if width - vocab <= VLLM_MAX_BANNED:
        # vLLM fills this from `bad_words` text only when some is given; ids need no tokenizer.
        params._bad_words_token_ids = BannedSpan(vocab, width)
    elif vocab <= VLLM_MAX_TOKEN_LIST:
        params.allowed_token_ids = list(range(vocab))
    else:
        raise ValueError(f"a vocabulary of {vocab} in {width} rows cannot be given to vLLM's sampler")


@dataclass(frozen=True)
class LiveStep:
    """A session step as the live request takes it (what crosses to the engine process): the
    session takes `fed` as given after its tokens, then `drafts` are verified, each a point
    (q = 1) or, with `draft_q`, drawn from the edge's q over it. A step that `reads` yields
    the accepted drafts and one more token, and with `top_k` the top-k row each was drawn
    or verified from; the rest is SessionStep's."""

    kv: Any  # the session's VllmKV (its id on the way to the engine process)
    fed: list[int]
    drafts: list[int]
    reads: bool = True
    ahead: int = 1
    stops: frozenset[int] = frozenset()
    known: int = 0
    draft_q: Sequence[SparseDistribution] = ()
    top_k: bool = False
    chunk: int = 0

    @classmethod
    def of(cls, step: SessionStep) -> LiveStep:
        reads = step.rule is not None
        draft_q = step.rule.sparse_draft if step.rule is not None else ()
        top_k = step.top_k > 0
        return cls(step.kv, step.fed, step.drafts, reads, step.ahead, step.stops, step.known, draft_q, top_k, step.chunk)


@dataclass(frozen=True)
class LiveYield:
    """What a live step that reads yields: its tokens, and the top-k rows it asked for."""

    tokens: list[int]
    rows: list[TopRow] = field(default_factory=list)


class LiveEngine(ABC):
    """An engine whose sessions are live vLLM requests: VllmEngine, or the same in a child
    process (cloud/engine/vllm_process.py)."""

    name: EngineName = "vllm"
    caches_prefixes = True  # vLLM's prefix cache, salted by each session's scope
    decodes_ahead = True
    applies_grammars = True  # its scheduler masks every row (cloud/engine/vllm_scheduler.py)

    @abstractmethod
    def run_live(self, steps: Sequence[LiveStep]) -> list[LiveYield | PromptChunk | Exception]: ...

    @abstractmethod
    def crop(self, kv: SessionKV, length: int) -> None: ...

    def run_steps(self, steps: Sequence[SessionStep]) -> list[StepOutcome | PromptChunk | None | Exception]:
        """Session steps as live requests' steps: each one's tokens become its outcome, and its
        KV is cropped to the drafts it accepted."""
        lengths = [step.kv.get_seq_length() for step in steps]
        produced = self.run_live([LiveStep.of(step) for step in steps])
        outcomes: list[StepOutcome | PromptChunk | None | Exception] = []
        for step, yielded, length in zip(steps, produced, lengths, strict=True):
            if isinstance(yielded, (Exception, PromptChunk)):
                outcomes.append(yielded)
            elif step.rule is None:
                outcomes.append(None)  # it reads nothing
            elif not yielded.tokens:
                outcomes.append(VerifierFault("vLLM yielded no token for a step that reads"))
            else:
                outcomes.append(_live_outcome(step, yielded, step.rule.vocab))
                self.crop(step.kv, length + step.grows_by + len(yielded.tokens) - 1)
        return outcomes


def _live_outcome(step: SessionStep, yielded: LiveYield, vocab: int) -> StepOutcome:
    """A step's tokens as its outcome (each draft's acceptance as the 1 or 0 it was: vLLM
    reports no p/q), with the top-k rows it asked for."""
    drafts, accepted = len(step.drafts), len(yielded.tokens) - 1
    passed = [1.0] * accepted + [0.0] * (drafts - accepted)
    top_k = [_wire_row(row, step.top_k, vocab) for row in yielded.rows] if step.top_k else []
    return StepOutcome(RoundOutcome(accepted, yielded.tokens[-1], accepted == drafts, passed), top_k)


def _wire_row(row: TopRow, k: int, vocab: int) -> SparseDistribution:
    """A row's k most likely ids of the session's vocabulary (past it vLLM banned them: 0), as
    many as the reference sends: min(k, vocab), the place of ids with no probability taken by
    the lowest ids of none."""
    pairs = [(t, p) for t, p in zip(row.token_ids, row.probs, strict=True) if t < vocab][:k]
    held = {t for t, _ in pairs}
    spare = (t for t in range(vocab) if t not in held)
    pairs += [(next(spare), 0.0) for _ in range(min(k, vocab) - len(pairs))]
    return SparseDistribution([t for t, _ in pairs], [p for _, p in pairs])


@dataclass
class VllmKV:
    """One session as vLLM serves it: its tokens (those whose KV a step computed), the salt
    that keeps its cached blocks its scope's (its own, or its API key's sessions'), and its
    live request once it has one."""

    salt: str = field(default_factory=lambda: uuid.uuid4().hex)
    tokens: list[int] = field(default_factory=list)
    released: bool = False
    params: Any = None  # the session's vllm.SamplingParams (start_session)
    seed: int = 0
    live: LiveRequest | None = None
    top_k: bool = False  # its requests return each sampled row's top-k (a round asked for it)
    grammar: Constraint | None = None  # its place in its grammar (None: free text)
    generated: int = 0  # of its prompt, the last tokens made under its grammar
    grammar_start: int | None = None  # where its tokens enter the grammar: set by its first step, its prompt's

    def get_seq_length(self) -> int:
        return len(self.tokens)


@dataclass
class _PendingStep:
    """A live step on its way: the tokens its session takes as given, and once decided, the
    tokens it yields (or what failed it)."""

    step: LiveStep
    kv: VllmKV
    base: list[int]
    tokens: list[int] | None = None
    error: Exception | None = None
    stepped: bool = False  # vLLM ran a step since the work began
    computed: int | None = None  # of a prompt vLLM computed a chunk of: the tokens it computed

    def kept(self) -> list[int]:
        """The session's tokens once the step is decided: the tokens it took as given (or those
        vLLM computed of them) and its drafts (the rejected ones cropped after)."""
        if self.computed is not None:
            return self.base[: self.computed]
        return self.base[: len(self.base) - self.step.known] + self.step.drafts

    def yielded(self) -> LiveYield | PromptChunk | Exception:
        if self.tokens is None:
            assert self.error is not None  # decided
            return self.error
        if self.computed is not None:  # of the tokens it fed, those computed before the step stopped
            return PromptChunk(self.computed - self.held)
        live = self.kv.live
        if not self.step.top_k or not self.tokens or live is None:
            return LiveYield(self.tokens)
        for position in [p for p in live.top if p < len(self.base)]:  # the session is past them
            del live.top[position]
        rows = [live.top.get(len(self.base) + i) for i in range(len(self.tokens))]
        if any(row is None for row in rows):
            return VerifierFault("vLLM returned no top-k for a token of the step")
        return LiveYield(self.tokens, rows)  # type: ignore[arg-type]  # checked: every row is there

    @property
    def held(self) -> int:
        """The session's tokens before the ones the step feeds."""
        return len(self.base) - len(self.step.fed)

    @property
    def decided(self) -> bool:
        return self.tokens is not None or self.error is not None


class VllmEngine(LiveEngine):
    """A model served by a VllmRuntime. Several engines may share one runtime (tests do): only
    the engine that owns it stops it on close."""

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
        self.grammars = SessionGrammars(_tokenizer_json(Path(config.model)), self.logits_width)
        self.grammars.warm_up()

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
        return VllmKV(salt=scope) if scope else VllmKV()

    def cached_tokens(self, kv: SessionKV) -> int:
        live = _own(kv).live
        return live.cached if live is not None else 0

    def free(self, kv: SessionKV) -> None:
        """Its request ends behind the step running, not waited for (as each call that only
        tells vLLM's thread something: a stream's steps do not wait for another's end)."""
        kv = _own(kv)
        kv.released, kv.tokens = True, []
        if kv.live is not None:
            self.runtime.soon(partial(self.runtime.end_live, kv.live))

    def freed(self, kv: SessionKV) -> bool:
        return _own(kv).released

    def crop(self, kv: SessionKV, length: int) -> None:
        del _own(kv).tokens[length:]

    # ---- live sessions ----------------------------------------------------------------------

    def check_session(self, config: SessionConfig, vocab: int) -> None:
        self._sampling(config, vocab)

    def start_session(self, kv: SessionKV, config: SessionConfig, vocab: int) -> None:
        own = _own(kv)
        own.params, own.seed = self._sampling(config, vocab), config.seed
        if config.grammar is not None:  # its place follows each request's tokens (LiveScheduler)
            own.grammar, own.generated = self.grammars.start(config.grammar, []), config.grammar.generated

    def _sampling(self, config: SessionConfig, vocab: int) -> Any:
        """vLLM's sampling of a session; SessionRefused for one it cannot verify exactly (an
        approximate accept mode, settings or a vocabulary vLLM refuses), which is never
        verified by another rule."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

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
                output_kind=RequestOutputKind.DELTA,  # each output carries the step's new tokens only
            )
            limit_vocab(params, vocab, self.logits_width)
        except (VLLMValidationError, ValueError) as err:
            raise SessionRefused(f"the vllm engine cannot sample this session: {str(err)[:200]}") from err
        return params

    def run_live(self, steps: Sequence[LiveStep]) -> list[LiveYield | PromptChunk | Exception]:
        """Each step advanced as far as the tokens its request holds decide it; vLLM steps while
        any is undecided. A session's tokens grow by the step's fed tokens and drafts (the
        rejected ones are cropped after: run_steps)."""
        works = [_PendingStep(step, kv, kv.tokens + step.fed) for step in steps for kv in [_own(step.kv)]]
        yielded = self.runtime.call(self._decide, works)
        for work in works:
            if work.tokens is not None:
                work.kv.tokens = work.kept()
        return yielded

    def follow(self, kv: SessionKV, position: int, sink: TokenSink) -> bool:
        """Queued on vLLM's thread behind the step running, not waited for: the streams whose
        first tokens a batch gave start following at once, not one step of the others apart
        (what it decodes meanwhile is read from `position`)."""
        live = _own(kv).live
        if live is None:
            return False
        self.runtime.soon(partial(self.runtime.follow, live, position, sink))
        return True

    def unfollow(self, kv: SessionKV) -> None:
        live = _own(kv).live
        if live is not None:  # before the session's next step, which queues behind it
            self.runtime.soon(partial(self.runtime.stop_following, live))

    def extend(self, kv: SessionKV, tokens: list[int]) -> None:
        _own(kv).tokens.extend(tokens)

    def own_steps(self) -> tuple[int, float]:
        return self.runtime.steps, self.runtime.step_seconds

    def _decide(self, works: list[_PendingStep]) -> list[LiveYield | PromptChunk | Exception]:
        """On vLLM's thread: advance every work, and step vLLM while any is undecided; what
        each yields. vLLM's scheduler cuts a long prompt into the works' chunks."""
        self.runtime.scheduler.prefill_chunk = max((work.step.chunk for work in works), default=0)
        self._decide_all(works)
        for work in works:  # read here, so that cached_tokens never waits for vLLM's thread
            live = work.kv.live
            if live is not None and not live.cached:
                live.cached = self.runtime.cached(live)
        return [work.yielded() for work in works]

    def _decide_all(self, works: list[_PendingStep]) -> None:
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
            for work in undecided:
                work.stepped = True
            stalled = 0 if self._progress(undecided) != before else stalled + 1
            if stalled >= MAX_STALLED_STEPS:
                self._give_up(undecided)
                return

    def _settle(self, works: list[_PendingStep]) -> None:
        """Under asynchronous scheduling: the outputs still to come of the works' parked
        requests (a prefill's token, the step a stream took past its stop) come in first, so
        that the rounds among the works are woken together and share one step."""
        runtime = self.runtime
        for _ in range(MAX_STALLED_STEPS):  # a step or two: as many as vLLM keeps in flight
            if not any(w.kv.live is not None and runtime.settling(w.kv.live) for w in works if not w.decided):
                return
            runtime.step()

    def _progress(self, works: list[_PendingStep]) -> list[tuple[int, int]]:
        """How far the works' requests got: their tokens, and the tokens vLLM computed of them."""
        return [(len(w.kv.live.tokens), self.runtime.computed(w.kv.live)) for w in works if w.kv.live is not None]

    def _give_up(self, works: list[_PendingStep]) -> None:
        """Steps vLLM cannot schedule (its KV blocks are held by parked sessions): their
        requests end, and their sessions get new ones on their next step."""
        for work in works:
            if work.kv.live is not None:
                self.runtime.end_live(work.kv.live)
                work.kv.live = None
            work.error = CapacityExceeded("vLLM has no KV blocks free for the session's step", STALLED_RETRY_MS)

    def _advance(self, work: _PendingStep) -> None:
        """Decide the step from the tokens its request holds past the session's, or have vLLM
        make more: start the request (or a new one, when the session's tokens left it), put
        the drafts on it, or let it decode ahead."""
        kv, step, runtime = work.kv, work.step, self.runtime
        if len(step.drafts) > runtime.options.max_draft_tokens:
            work.error = VerifierFault(f"vLLM verifies at most {runtime.options.max_draft_tokens} drafts a step")
            return
        live = kv.live
        asks_rows = step.top_k and not kv.top_k  # its request returns no rows: a new one that does
        if live is None or live.tokens[: len(work.base)] != work.base or asks_rows:
            kv.top_k = kv.top_k or step.top_k
            if live is not None:
                runtime.end_live(live)
            if len(work.base) > runtime.max_context_tokens:
                work.error = VerifierFault("the session's tokens fill the context")
                return
            kv.live = runtime.start_live(work.base, kv.salt, self._seeded(kv, len(work.base)), *self._grammar(kv, work.base))
            return
        if self._prefilling(work, live):
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

    def _prefilling(self, work: _PendingStep, live: LiveRequest) -> bool:
        """Whether vLLM is still computing the prompt the step feeds; once a step of vLLM computed some of it, the
        step stops there (docs/architecture.md, "Live requests")."""
        prompt = min(live.prompt, len(work.base) - work.step.known)
        computed = self.runtime.computed(live)
        if live.ended or computed >= prompt:
            return False
        if work.stepped and computed > work.held:
            work.tokens, work.computed = [], computed
        return True

    def _decode_on(self, live: LiveRequest, step: LiveStep, held: list[int]) -> None:
        """After a step without drafts read the first of the tokens vLLM `held` past the session:
        let a parked request decode the tokens its session reads next (a stretch, a stream, up
        to a stop token) in the steps to come."""
        more = step.ahead - len(held)
        if step.drafts or more <= 0 or live.ended or step.stops.intersection(held) or not self.runtime.parked(live):
            return
        self.runtime.wake(live, [], more, step.stops)

    def _grammar(self, kv: VllmKV, base: list[int]) -> tuple[Constraint | None, int]:
        """The session's grammar for a request of its tokens `base`, and where they enter it: its
        first request's tokens are its prompt, whose last `generated` are the grammar's first."""
        if kv.grammar is None:
            return None, 0
        if kv.grammar_start is None:
            kv.grammar_start = len(base) - kv.generated
        return kv.grammar, kv.grammar_start

    def _seeded(self, kv: VllmKV, position: int) -> Any:
        """The session's sampling for a request starting at `position`: seeded from its seed
        and the position, so its requests draw independently."""
        params = kv.params.clone()
        if kv.top_k:
            params.logprobs = self.runtime.options.max_top_k
        if params.temperature > 0:
            params.seed = (kv.seed + LIVE_SEED_STRIDE * position) % (1 << 63)
        return params


def _tokenizer_json(folder: Path) -> str:
    """The model folder's tokenizer.json, which the verifier's grammars read too ("": none)."""
    path = folder / "tokenizer.json"
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def _own(kv: SessionKV) -> VllmKV:
    if not isinstance(kv, VllmKV):
        raise TypeError(f"the vLLM engine holds no {type(kv).__name__}")
    return kv
