"""The target model and its sessions: prefill once, one forward pass per Verify round.

Methods are synchronous and not thread-safe; cloud/grpc_server.py runs them on one
model worker so rounds never interleave on a cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar

import torch
from transformers import PreTrainedModel

from cloud.sessions import Session, SessionLimits, SessionStore
from shared import lm
from shared.errors import ConfigError, InvalidRequest, PositionMismatch, SessionNotFound, SpecDecError, VerifierFault
from shared.kv_slots import SlotKV, SlotPool
from shared.protocol import (
    AcceptMode,
    CloseSessionResult,
    GenerateChunk,
    GenerateRequest,
    OpenSessionRequest,
    OpenSessionResult,
    RoundMetrics,
    SessionConfig,
    TopK,
    VerifyRequest,
    VerifyResult,
)
from shared.sampling import penalized_logits, probs_from_logits
from shared.speculative import RoundOutcome, accept, dense_draft, sample_token

log = logging.getLogger("cloud-verifier")
# Temperature and repetition penalty divide or multiply logits: inside this range every
# logit stays finite in fp32 (|logit| <= 1e2 -> at most 1e8), outside it softmax meets inf.
SAMPLING_RANGE = (1e-3, 1e3)


@dataclass(frozen=True)
class VerifierLimits:
    max_draft_tokens: int = 16  # k limit per round
    max_catchup_tokens: int = 64
    max_context_tokens: int = 32768
    max_top_k: int = 16  # cap on want_top_k
    max_new_tokens: int = 4096  # Generate
    sessions: SessionLimits = SessionLimits()
    # packed: each session its own DynamicCache, concatenated for every batched pass (the
    # reference); slots: KV in place in a pool allocated at start (shared/kv_slots.py)
    kv_layout: Literal["packed", "slots"] = "packed"
    # slots: positions per session (its context limit); the pool holds min(max_sessions,
    # max_kv_bytes / slot bytes) slots
    kv_slot_tokens: int = 4096


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


class Verifier:
    def __init__(
        self, model: PreTrainedModel, model_id: str, limits: VerifierLimits | None = None, dtype_reason: str = ""
    ) -> None:
        self.model = model
        self.model_id = model_id
        self.dtype_reason = dtype_reason  # why the model runs in its dtype (`--dtype auto`), for /healthz
        self.limits = limits or VerifierLimits()
        self.model_vocab = lm.logits_width(model)
        per_token = lm.kv_bytes_per_token(model)
        self.pool = self._slot_pool(per_token) if self.limits.kv_layout == "slots" else None
        self.sessions = SessionStore(self.limits.sessions, per_token, slot_bytes=self.pool.slot_bytes if self.pool else 0)
        self.forward_passes = 0

    def _slot_pool(self, kv_bytes_per_token: int) -> SlotPool:
        """The slot pool, and limits that match it: a session's context fits its slot, and the
        KV cap is the pool's size, so a free slot exists whenever the store admits a session."""
        slot_tokens = min(self.limits.kv_slot_tokens, self.limits.max_context_tokens)
        sessions = self.limits.sessions
        slots = min(sessions.max_sessions, sessions.max_kv_bytes // (slot_tokens * kv_bytes_per_token))
        if slots < 1:
            raise ConfigError(
                f"a KV slot of {slot_tokens} tokens needs {slot_tokens * kv_bytes_per_token} bytes, "
                f"over --max-kv-bytes {sessions.max_kv_bytes}"
            )
        pool = SlotPool(self.model, slots, slot_tokens)
        self.limits = replace(self.limits, max_context_tokens=slot_tokens, sessions=replace(sessions, max_kv_bytes=pool.nbytes))
        return pool

    # ---- validation -------------------------------------------------------------------

    def _vocab(self, config: SessionConfig) -> int:
        if config.vocab_size > self.model_vocab:
            raise InvalidRequest(f"vocab_size {config.vocab_size} exceeds the model's {self.model_vocab}")
        return config.vocab_size or self.model_vocab

    def _check_config(self, config: SessionConfig) -> int:
        """Only settings that sample finitely: outside these ranges logits overflow to inf and
        the probabilities to NaN."""
        s = config.sampling
        low, high = SAMPLING_RANGE
        if not (s.temperature == 0 or low <= s.temperature <= high):
            raise InvalidRequest(f"temperature must be 0 (greedy) or in [{low:g}, {high:g}]")
        if not low <= s.repetition_penalty <= high:
            raise InvalidRequest(f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off)")
        if not 0 < s.top_p <= 1:
            raise InvalidRequest("top_p must be in (0, 1] (1 = off)")
        if s.top_k < 0:
            raise InvalidRequest("top_k must be >= 0 (0 = off)")
        return self._vocab(config)

    def _check_ids(self, what: str, ids: list[int], vocab: int) -> None:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"{what} has ids outside [0, {vocab}): {bad[:5]}")

    def _check_prompt(self, prompt: list[int], vocab: int) -> None:
        if not prompt:
            raise InvalidRequest("prompt_tokens is empty")
        if len(prompt) > self.limits.max_context_tokens:
            raise InvalidRequest(f"prompt has {len(prompt)} tokens, limit {self.limits.max_context_tokens}")
        self._check_ids("prompt_tokens", prompt, vocab)

    def _check_verify(self, req: VerifyRequest, session: Session) -> None:
        if req.base_position != len(session.tokens):
            raise PositionMismatch(
                f"base_position {req.base_position} != server position {len(session.tokens)}", len(session.tokens)
            )
        vocab = self._vocab(session.config)
        k = len(req.draft_tokens)
        if k > self.limits.max_draft_tokens:
            raise InvalidRequest(f"{k} draft tokens, limit {self.limits.max_draft_tokens}")
        if len(req.committed_tokens) > self.limits.max_catchup_tokens:
            raise InvalidRequest(f"{len(req.committed_tokens)} catch-up tokens, limit {self.limits.max_catchup_tokens}")
        if len(session.tokens) + len(req.committed_tokens) + k + 1 > self.limits.max_context_tokens:
            raise InvalidRequest(f"the round would pass the context limit {self.limits.max_context_tokens}")
        self._check_ids("draft_tokens", req.draft_tokens, vocab)
        self._check_ids("committed_tokens", req.committed_tokens, vocab)
        if req.draft_probs and len(req.draft_probs) != k:
            raise InvalidRequest(f"{len(req.draft_probs)} draft_probs for {k} draft tokens")
        if any(not 0.0 < q <= 1.0 for q in req.draft_probs):
            raise InvalidRequest("draft_probs must lie in (0, 1]")
        if req.want_top_k > self.limits.max_top_k:
            raise InvalidRequest(f"want_top_k {req.want_top_k}, limit {self.limits.max_top_k}")
        self._check_mode_inputs(req, session.config.accept_mode, vocab)

    def _check_mode_inputs(self, req: VerifyRequest, mode: AcceptMode, vocab: int) -> None:
        k = len(req.draft_tokens)
        if mode in (AcceptMode.SCALAR, AcceptMode.SHORTCUT) and len(req.draft_probs) != k:
            raise InvalidRequest(f"{mode.value} mode needs draft_probs for every draft token")
        if mode is not AcceptMode.SPARSE:
            if req.sparse_draft:
                raise InvalidRequest(f"sparse_draft sent to a {mode.value}-mode session")
            return
        if len(req.sparse_draft) != k:
            raise InvalidRequest(f"sparse mode needs one sparse_draft per draft token, got {len(req.sparse_draft)} for {k}")
        for i, (dist, token) in enumerate(zip(req.sparse_draft, req.draft_tokens, strict=True)):
            self._check_ids(f"sparse_draft[{i}]", dist.token_ids, vocab)
            if len(dist.probs) != len(dist.token_ids) or len(set(dist.token_ids)) != len(dist.token_ids):
                raise InvalidRequest(f"sparse_draft[{i}] needs unique ids and one prob each")
            if any(not 0.0 <= q <= 1.0 for q in dist.probs) or abs(sum(dist.probs) - 1.0) > 1e-3:
                raise InvalidRequest(f"sparse_draft[{i}] probs must lie in [0, 1] and sum to 1")
            support = dict(zip(dist.token_ids, dist.probs, strict=True))
            if support.get(token, 0.0) <= 0.0:
                raise InvalidRequest(f"draft token {i} has no probability in its sparse_draft")

    # ---- sessions ---------------------------------------------------------------------

    def open_session(self, req: OpenSessionRequest) -> OpenSessionResult:
        """Prefill on its own: begin, one forward pass, finish."""
        return self._run_alone(self.begin_open(req), 0.0)

    def begin_open(
        self, req: OpenSessionRequest, session_id: str | None = None, owner: str = ""
    ) -> ForwardStep[OpenSessionResult]:
        """Validate a new session and hold its KV; its prefill is a forward step like a round's,
        so it can share a forward pass with other sessions' rounds and prefills instead of
        making them queue behind it. The session is stored at once, so the KV cap counts it
        while its prefill waits; its id reaches the client only after the prefill. The
        caller may choose the id (to hold the session while its prefill runs in chunks)."""
        vocab = self._check_config(req.config)
        self._check_prompt(req.prompt_tokens, vocab)
        start = time.perf_counter()
        session = self.new_session(session_id or self.sessions.new_id(), req.config, req.prompt_tokens, owner)

        def finish(logits: torch.Tensor, forward_ms: float, queue_ms: float) -> OpenSessionResult:
            return OpenSessionResult(
                session.session_id, len(session.tokens), self.limits.max_draft_tokens, vocab, _ms_since(start), self.model_id
            )

        # The cache holds the KV of tokens[:-1]: the last prompt token is the first round's first row.
        return ForwardStep(session.cache, req.prompt_tokens[:-1], 1, finish, lambda: self.sessions.discard(session.session_id))

    def new_session(self, session_id: str, config: SessionConfig, prompt: list[int], owner: str, planned: int = 0) -> Session:
        """A session stored with room for its prompt's KV (or `planned` positions), counted
        against the caps from now on."""
        self.sessions.reserve(max(len(prompt), planned), owner=owner)
        now = self.sessions.clock()
        generator = torch.Generator().manual_seed(config.seed)
        cache = self.pool.acquire() if self.pool else lm.new_cache(self.model)
        session = Session(session_id, config, list(prompt), cache, generator, now, now, owner=owner, planned=planned)
        try:
            self.sessions.add(session)
        except BaseException:
            if isinstance(cache, SlotKV):
                cache.release()  # never stored: the store cannot free it
            raise
        return session

    def close_session(self, session_id: str, owner: str = "") -> CloseSessionResult:
        session = self.sessions.remove(session_id, owner)
        return CloseSessionResult(len(session.tokens), session.rounds)

    # ---- one round --------------------------------------------------------------------

    def verify(self, req: VerifyRequest, queue_ms: float = 0.0) -> VerifyResult:
        """One round on its own: begin, one forward pass, finish."""
        return self._run_alone(self.begin_verify(req), queue_ms)

    def begin_verify(self, req: VerifyRequest, owner: str = "") -> ForwardStep[VerifyResult]:
        """Validate a round against its session (which `owner` must have opened) and reserve
        its KV; the forward pass comes later, possibly batched with other sessions' rounds."""
        start = time.perf_counter()
        session = self.sessions.get(req.session_id, owner)
        self._check_verify(req, session)
        self.sessions.reserve(len(req.committed_tokens) + len(req.draft_tokens) + 1, keep=session.session_id, owner=owner)
        position = len(session.tokens)

        def finish(logits: torch.Tensor, forward_ms: float, queue_ms: float) -> VerifyResult:
            outcome, probs = self._accept(req, session, logits)
            accepted = req.draft_tokens[: outcome.accepted_len]
            session.tokens.extend([*req.committed_tokens, *accepted, outcome.next_token])
            lm.crop(session.cache, len(session.tokens) - 1)
            session.rounds += 1
            self.sessions.touch(session)
            k = len(req.draft_tokens)
            metrics = RoundMetrics(
                alpha_mean=float(outcome.accept_probs.mean()) if k else 0.0,
                la_over_k=outcome.accepted_len / k if k else 0.0,
                verify_ms=_ms_since(start) + queue_ms,
                queue_ms=queue_ms,
                forward_ms=forward_ms,
                hard_tokens=sum(req.hard_mask),
            )
            top_k = _top_k(probs[: outcome.accepted_len + 1], req.want_top_k)
            return VerifyResult(outcome.accepted_len, outcome.next_token, outcome.bonus, len(session.tokens), metrics, top_k)

        # Rows for the last committed token and each draft: k + 1 predictions.
        return ForwardStep(
            session.cache,
            [session.tokens[-1], *req.committed_tokens, *req.draft_tokens],
            len(req.draft_tokens) + 1,
            finish,
            lambda: lm.crop(session.cache, position - 1),
        )

    def run_batch(self, steps: list[tuple[ForwardStep[Any], float]]) -> list[Any]:
        """ONE forward pass over every (step, queue_ms), whatever session or stream each
        belongs to; returns each step's result, or the exception that ended it. A failed
        forward leaves every cache as it was; a step that fails after it is undone alone, so
        it never fails or corrupts the others of its pass."""
        if not steps:
            return []
        gone = [i for i, (step, _) in enumerate(steps) if isinstance(step.cache, SlotKV) and step.cache.released]
        if gone:  # its session left between two chunks of a prefill: that step alone fails
            return self._without(steps, gone)
        fed = [step for step, _ in steps if step.block]  # a one-token prompt has nothing to prefill
        forward_start = time.perf_counter()
        try:
            logits = (
                lm.forward_packed(self.model, [s.cache for s in fed], [s.block for s in fed], [s.keep for s in fed])
                if fed
                else []
            )
        except BaseException:
            for step, _ in steps:
                step.undo()
            raise
        forward_ms = _ms_since(forward_start)
        self.forward_passes += 1 if fed else 0
        rows_of = iter(logits)
        results: list[Any] = []
        for step, queue_ms in steps:
            rows = next(rows_of) if step.block else torch.empty(0)
            try:
                results.append(step.finish(rows, forward_ms, queue_ms))
            except SpecDecError as err:
                step.undo()
                results.append(err)
            except Exception:  # a bug in one step's accept/sample path: that step alone fails
                log.exception("a step failed after the forward pass; undone")
                step.undo()
                results.append(VerifierFault("the verifier failed on this step (see its log)"))
        return results

    def _without(self, steps: list[tuple[ForwardStep[Any], float]], gone: list[int]) -> list[Any]:
        kept = [s for i, s in enumerate(steps) if i not in gone]
        results = iter(self.run_batch(kept))
        return [
            SessionNotFound("the session was closed or evicted while its step waited") if i in gone else next(results)
            for i in range(len(steps))
        ]

    def _accept(self, req: VerifyRequest, session: Session, rows: torch.Tensor) -> tuple[RoundOutcome, torch.Tensor]:
        """The accept/reject outcome of a round and the target distributions [k + 1, V]."""
        config = session.config
        vocab = self._vocab(config)
        penalized = penalized_logits(rows, session.tokens + req.committed_tokens, req.draft_tokens, config.sampling, vocab)
        greedy = config.accept_mode is AcceptMode.GREEDY
        probs = penalized.softmax(dim=-1) if greedy else probs_from_logits(penalized, config.sampling)
        outcome = accept(
            config.accept_mode,
            torch.tensor(req.draft_tokens, dtype=torch.long),
            penalized if greedy else probs,
            session.generator,
            draft_probs=torch.tensor(req.draft_probs, dtype=torch.float32),  # [k]
            sparse_draft=dense_draft(req.sparse_draft, vocab),
        )  # [k, V]
        return outcome, probs

    # ---- target-only decoding (cloud_only baseline) ----------------------------------

    def open_generate(self, req: GenerateRequest, stream_id: str = "", owner: str = "") -> GenerateStream:
        """Validate a Generate call (no model work, no state: safe off the model worker). Its
        stream lives in the session store as a session nobody else can name, so it counts
        against the same session and KV caps; the first step stores it, close() drops it."""
        vocab = self._check_config(req.config)
        self._check_prompt(req.prompt_tokens, vocab)
        if not 0 < req.max_new_tokens <= self.limits.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens must be in [1, {self.limits.max_new_tokens}]")
        self._check_ids("stop_token_ids", req.stop_token_ids, self.model_vocab)
        if len(req.prompt_tokens) + req.max_new_tokens > self.limits.max_context_tokens:
            raise InvalidRequest(f"prompt + max_new_tokens pass the context limit {self.limits.max_context_tokens}")
        return GenerateStream(self, req, vocab, stream_id or self.sessions.new_id(), owner)

    def generate(self, req: GenerateRequest) -> Iterator[GenerateChunk]:
        """Target-only decoding, one forward pass per token, unbatched."""
        stream = self.open_generate(req)
        try:
            while not stream.finished:
                yield self._run_alone(stream.begin_step(), 0.0)
        finally:
            stream.close()

    def _run_alone(self, step: ForwardStep[R], queue_ms: float) -> R:
        result = self.run_batch([(step, queue_ms)])[0]
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]  # run_batch returns the step's own result


R = TypeVar("R")


class Partial:
    """What the head of a split step returns: its tokens are in the cache, the rest follows."""


PARTIAL = Partial()


@dataclass
class ForwardStep(Generic[R]):
    """One sequence's share of a forward pass that may be batched with others: feed `block`
    after `cache`, keep the last `keep` rows of logits, turn them into a result with
    finish(logits, forward_ms, queue_ms); undo() puts the cache back after a failure."""

    cache: lm.KVCache
    block: list[int]
    keep: int
    finish: Callable[[torch.Tensor, float, float], R]
    undo: Callable[[], None]

    def split(self, chunk: int) -> tuple[ForwardStep[Partial], ForwardStep[R]] | None:
        """A long prefill as two steps for consecutive passes: the first `chunk` tokens
        (their result is PARTIAL), then the rest, which keeps the rows and the finish. Each
        part undoes the whole step. None when the block is short enough to feed at once."""
        head = min(chunk, len(self.block) - self.keep)
        if chunk <= 0 or head <= 0 or len(self.block) <= chunk:
            return None
        first = ForwardStep(self.cache, self.block[:head], 1, lambda logits, forward_ms, queue_ms: PARTIAL, self.undo)
        return first, ForwardStep(self.cache, self.block[head:], self.keep, self.finish, self.undo)


class GenerateStream:
    """One Generate call between its steps, one token per step. Its KV is a session in the
    store (under an id only the stream knows), so the caps count it like any session's."""

    def __init__(self, verifier: Verifier, req: GenerateRequest, vocab: int, stream_id: str, owner: str) -> None:
        self.verifier = verifier
        self.req = req
        self.vocab = vocab
        self.stream_id = stream_id
        self.owner = owner
        self.session: Session | None = None  # stored by the first step, on the model worker
        self.produced = 0
        self.finished = False

    @property
    def feed(self) -> list[int]:
        """Tokens the next step feeds: the prompt (the prefill), then the last token."""
        return list(self.req.prompt_tokens) if self.session is None else self.session.tokens[-1:]

    def begin_step(self) -> ForwardStep[GenerateChunk]:
        if self.finished:
            raise InvalidRequest("the stream has finished")
        store = self.verifier.sessions
        if self.session is None:  # its whole length is reserved now: a stream is never cut short for KV
            planned = len(self.req.prompt_tokens) + self.req.max_new_tokens - 1
            self.session = self.verifier.new_session(self.stream_id, self.req.config, self.req.prompt_tokens, self.owner, planned)
            session = self.session
            return ForwardStep(session.cache, list(session.tokens), 1, self._finish, lambda: store.discard(session.session_id))
        session = store.get(self.stream_id, self.owner)  # evicted only if the caller has gone
        length = session.cache.get_seq_length()
        return ForwardStep(session.cache, session.tokens[-1:], 1, self._finish, lambda: lm.crop(session.cache, length))

    def _finish(self, logits: torch.Tensor, forward_ms: float, queue_ms: float) -> GenerateChunk:
        assert self.session is not None
        params = self.req.config.sampling
        penalized = penalized_logits(logits, self.session.tokens, [], params, self.vocab)  # [1, V]
        if params.greedy:
            token = int(penalized[0].argmax())
        else:
            token = sample_token(probs_from_logits(penalized, params)[0], self.session.generator)
        self.session.tokens.append(token)
        self.verifier.sessions.touch(self.session)
        self.produced += 1
        self.finished = token in self.req.stop_token_ids or self.produced == self.req.max_new_tokens
        return GenerateChunk([token], forward_ms, self.finished)

    def close(self) -> None:
        """Drop the stream's KV (on the model worker)."""
        self.verifier.sessions.discard(self.stream_id)


def _top_k(probs: torch.Tensor, k: int) -> list[TopK]:
    if k <= 0:
        return []
    top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return [TopK(ids.tolist(), vals.tolist()) for ids, vals in zip(top.indices, top.values, strict=True)]
