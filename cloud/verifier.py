"""The target model and its sessions: prefill once, one forward pass per Verify round.
Methods are synchronous and not thread-safe; cloud/grpc_server.py runs them on one model
worker so rounds never interleave on a cache."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from cloud.batch_step import Batch, BatchStep, ForwardStep, Partial
from cloud.engine import Engine, KVPlan, KVRequest, SessionKV, StepOutcome, TokenSink
from cloud.followed_stretch import FollowedStretch
from cloud.grammars import SessionGrammars
from cloud.model_card import ModelCard, measure_decode_step
from cloud.prefix_cache import KeptPrefix, ReuseMode, ReuseScopes, Scope
from cloud.rejection_sampler import RoundRule
from cloud.sessions import Session, SessionLimits, SessionStore
from cloud.validation import RequestChecks
from shared.protocol import (
    AcceptMode,
    CloseSessionResult,
    DecodeRequest,
    GenerateChunk,
    GenerateRequest,
    OpenSessionRequest,
    OpenSessionResult,
    RoundMetrics,
    SessionConfig,
    VerifyRequest,
    VerifyResult,
)
from shared.tokenizer_card import TokenizerCard

R = TypeVar("R")


@dataclass(frozen=True)
class VerifierLimits:
    max_draft_tokens: int = 16  # k limit per round
    max_catchup_tokens: int = 64
    max_context_tokens: int = 32768
    max_top_k: int = 16  # cap on want_top_k
    max_new_tokens: int = 4096  # Generate
    sessions: SessionLimits = SessionLimits()
    # The rest as their flags' help says (cloud/config.py: --kv-layout, --prefix-reuse, --shared-prefix-cache)
    kv_layout: Literal["packed", "slots"] = "packed"  # slots: cloud/engine/kv_slots.py
    kv_slot_tokens: int = 4096  # slots: positions per session (its context limit)
    reuse_prefixes: bool = True  # cloud/prefix_cache.py
    share_prefixes: bool = False  # a scope is a key instead (without keys: every client): they trust each other


def _kv_request(limits: VerifierLimits) -> KVRequest:
    sessions = limits.sessions
    return KVRequest(
        limits.kv_layout, sessions.max_sessions, sessions.max_kv_bytes, limits.max_context_tokens, limits.kv_slot_tokens
    )


def _reuse_mode(limits: VerifierLimits) -> ReuseMode:
    if not limits.reuse_prefixes:
        return "off"
    return "shared" if limits.share_prefixes else "client"


def _fitted(limits: VerifierLimits, plan: KVPlan) -> VerifierLimits:
    """The limits with the context and KV caps of the KV the engine holds."""
    sessions = replace(limits.sessions, max_kv_bytes=plan.max_kv_bytes)
    return replace(limits, max_context_tokens=plan.max_context_tokens, sessions=sessions)


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


class Verifier:
    def __init__(
        self,
        engine: Engine,
        model_id: str,
        limits: VerifierLimits | None = None,
        dtype_reason: str = "",
        tokenizer: TokenizerCard | None = None,
    ) -> None:
        self.engine = engine
        self.model_id = model_id
        self.card = ModelCard(model_id, engine.parameters, engine.logits_width, tokenizer)  # what Describe answers
        self.dtype_reason = dtype_reason  # why the model runs in its dtype (`--dtype auto`), for /healthz
        limits = limits or VerifierLimits()
        self.kv_plan = engine.plan_kv(_kv_request(limits))
        self.limits = _fitted(limits, self.kv_plan)
        self.model_vocab = engine.logits_width
        self.sessions = SessionStore(
            self.limits.sessions,
            engine.kv_bytes_per_token,
            kv=engine,
            slot_bytes=self.kv_plan.session_bytes,
            keep_prefixes=self.limits.reuse_prefixes and not engine.caches_prefixes,
            note_prefixes=self.limits.reuse_prefixes and engine.caches_prefixes,
        )
        self.checks = RequestChecks(self.limits, self.model_vocab)
        # an engine that masks with grammars itself (vLLM) holds the one vocabulary: built once
        own, source = getattr(engine, "grammars", None), tokenizer.source if tokenizer else ""
        self.grammars = own if isinstance(own, SessionGrammars) else SessionGrammars(source, engine.logits_width)
        self.step = BatchStep(engine)
        self.scopes = ReuseScopes(_reuse_mode(self.limits))

    @property
    def forward_passes(self) -> int:
        return self.step.passes

    def warm_up(self) -> float:
        """Run the model's first (slow) passes before serving, and put what one decode step
        costs in the card; returns that, in ms."""
        self.card.decode_step_ms = measure_decode_step(self.engine)
        self.grammars.warm_up()
        return self.card.decode_step_ms

    # ---- sessions ---------------------------------------------------------------------

    def open_session(self, req: OpenSessionRequest) -> OpenSessionResult:
        """Prefill on its own: begin, one forward pass, finish."""
        return self._run_alone(self.begin_open(req), 0.0)

    def begin_open(
        self, req: OpenSessionRequest, session_id: str | None = None, owner: str = "", planned: int = 0
    ) -> ForwardStep[OpenSessionResult]:
        """Validate a new session and hold its KV (`planned`: positions reserved ahead); its prefill is a forward step
        like a round's, sharing a pass with other sessions' steps. The session is stored at once, its id chosen by the
        caller or new (why: docs/architecture.md, "The batcher and a batch step")."""
        vocab = self.checks.session(req.config, req.prompt_tokens)
        start = time.perf_counter()
        session_id = session_id or self.sessions.new_id()
        session = self.new_session(session_id, req.config, req.prompt_tokens, owner, planned, req.reuse_token)
        # The cache holds the KV of tokens[:-1]: the last prompt token is the first round's first row.
        max_k, reuse_token = self.limits.max_draft_tokens, session.reuse_token
        opened = OpenSessionResult(session_id, len(session.tokens), max_k, vocab, 0.0, self.model_id, reuse_token=reuse_token)
        prefill = _Prefill(self, session, opened, start)
        held = session.cache.get_seq_length()  # a kept prefix's tokens: only the rest is prefilled
        # the last prompt token is known: the first round feeds it, a live engine computes it now
        return ForwardStep(session.cache, req.prompt_tokens[held:], known=1, work=prefill)

    def begin_open_decode(
        self, req: OpenSessionRequest, session_id: str, owner: str = "", stretch: DecodeStretchStep | None = None
    ) -> ForwardStep[tuple[OpenSessionResult, VerifyResult]]:
        """A new session and its first token in ONE forward pass (a Decode call that opens its
        session): the pass feeds the whole prompt, and its last row is accepted as a Verify
        round with no drafts would accept it, so the token is the one that round would give.
        `stretch` tells an engine with its own decoding loop the tokens the call goes on for."""
        planned = len(req.prompt_tokens) - 1 + stretch.tokens if stretch and stretch.reserved else 0
        opening = self.begin_open(req, session_id, owner, planned)
        prefill = opening.work
        assert isinstance(prefill, _Prefill)
        session = prefill.session
        try:
            self.sessions.reserve(1, keep=session_id, owner=owner, scope=session.scope)  # the first token's KV
        except BaseException:
            prefill.undo()  # never opened: its id reaches no one
            raise
        position, vocab = len(session.tokens), self.checks.vocab(session.config)
        first = VerifyRequest(session_id, position, [])
        rows = _grammar_rows(session, first, self.engine)
        token = _Round(self.sessions, self.engine, first, session, vocab, prefill.start, position, rows)
        opened = _OpenedRound(prefill, token)
        ahead, stops = _ahead(stretch, self.limits.max_context_tokens - position, session)
        return ForwardStep(opening.kv, opening.fed, ahead=ahead, stops=stops, work=opened)  # its last token computed and read

    def new_session(
        self, session_id: str, config: SessionConfig, prompt: list[int], owner: str, planned: int = 0, reuse_token: str = ""
    ) -> Session:
        """A session stored with room for its prompt's KV (or `planned` positions), counted
        against the caps from now on. Its KV starts as a kept prefix of its reuse scope's (the
        client `reuse_token` names, under API key `owner`) when one holds the prompt's first
        tokens (its length says how many), else empty. Refused, the kept prefix stays kept."""
        vocab = self.checks.vocab(config)
        scope = self.scopes.of(owner, reuse_token)
        self.engine.check_session(config, vocab)  # refused before any KV is made room for
        constraint = None if config.grammar is None else self.grammars.start(config.grammar, prompt)
        kept = self.sessions.take_prefix(scope.name, prompt)
        kv: SessionKV | None = None
        try:
            kv, held = self._session_kv(scope, owner, max(len(prompt), planned), kept)
            self.engine.start_session(kv, config, vocab)
            now = self.sessions.clock()
            generator = torch.Generator().manual_seed(config.seed)
            session = Session(session_id, config, list(prompt), kv, generator, now, now, owner=owner, planned=planned)
            session.scope, session.reuse_token, session.reused = scope.name, scope.token, held
            session.constraint, session.prompt_len = constraint, len(prompt) - (config.grammar.generated if config.grammar else 0)
            self.sessions.add(session)
        except BaseException:
            self._unwind(kept, kv)
            raise
        return session

    def _session_kv(self, scope: Scope, owner: str, positions: int, kept: tuple[KeptPrefix, int] | None) -> tuple[SessionKV, int]:
        """Room for a new session's KV, and the KV: the kept prefix it took, cropped to the
        tokens it shares with the prompt (and how many those are), or a new one."""
        self.sessions.reserve(positions, owner=owner, scope=scope.name)
        if kept is None:
            self.sessions.room_for_session(scope.name, owner)
            return self.engine.new_kv(scope.salt), 0
        entry, held = kept
        self.engine.crop(entry.kv, held)
        return entry.kv, held

    def _unwind(self, kept: tuple[KeptPrefix, int] | None, kv: SessionKV | None) -> None:
        """A session refused before it was stored: the kept prefix it took goes back to the
        cache, a new KV is freed."""
        if kept is not None:
            self.sessions.give_back(kept[0])
        elif kv is not None:
            self.engine.free(kv)

    def close_session(self, session_id: str, owner: str = "") -> CloseSessionResult:
        session = self.sessions.remove(session_id, owner)
        return CloseSessionResult(len(session.tokens), session.rounds)

    # ---- one round --------------------------------------------------------------------

    def verify(self, req: VerifyRequest, queue_ms: float = 0.0) -> VerifyResult:
        """One round on its own: begin, one forward pass, finish."""
        return self._run_alone(self.begin_verify(req), queue_ms)

    def begin_verify(
        self, req: VerifyRequest, owner: str = "", stretch: DecodeStretchStep | None = None
    ) -> ForwardStep[VerifyResult]:
        """Validate a round against its session (which `owner` must have opened) and reserve
        its KV; the forward pass comes later, possibly batched with other sessions' rounds.
        A token of a Decode stretch (`stretch`) tells an engine with its own decoding loop the
        tokens the stretch goes on for, which it may decode in one go."""
        start = time.perf_counter()
        session = self.sessions.get(req.session_id, owner)
        self.checks.verify(req, session)
        rows = _grammar_rows(session, req, self.engine)  # before any KV is reserved: a token off the grammar is refused
        grows = len(req.committed_tokens) + len(req.draft_tokens) + 1
        self.sessions.reserve(grows, keep=session.session_id, owner=owner, scope=session.scope)
        # Rows for the last committed token and each draft: k + 1 predictions.
        fed, drafts = [session.tokens[-1], *req.committed_tokens], list(req.draft_tokens)
        vocab = self.checks.vocab(session.config)
        work = _Round(self.sessions, self.engine, req, session, vocab, start, len(session.tokens), rows)
        room = self.limits.max_context_tokens - len(session.tokens) - len(req.committed_tokens)  # the rest would be refused
        ahead, stops = _ahead(stretch, room, session)
        return ForwardStep(session.cache, fed, drafts, ahead=ahead, stops=stops, top_k=req.want_top_k, work=work)

    def follow_stretch(
        self, session_id: str, owner: str, left: int, stops: frozenset[int], sink: TokenSink
    ) -> FollowedStretch | None:
        """The rest of a Decode stretch (`left` tokens at most, `stops`) from the session's own
        decoding, its tokens going to `sink`; None: its tokens go one step each."""
        session = self.sessions.get(session_id, owner)
        if session.constraint is not None:  # each token's mask follows from the ones before: a step each
            return None
        left = min(left, self.limits.max_context_tokens - len(session.tokens))  # past it, a step refuses the token
        return FollowedStretch.start(self.sessions, self.engine, session, left, stops, sink) if left > 0 else None

    def run_batch(self, steps: Batch) -> list[Any]:
        """ONE forward pass over every (step, queue_ms), whatever session or stream each
        belongs to: BatchStep.run."""
        return self.step.run(steps)

    # ---- target-only decoding (cloud_only baseline) ----------------------------------

    def as_decode(self, req: GenerateRequest) -> DecodeRequest:
        """A Generate call, validated (no model work, no state: safe off the model worker), as
        the Decode call that serves it: one that opens a session of its own, whose tokens are
        the target's own draws whatever accept mode the caller names (an engine that refuses
        approximate modes serves it). Its stretch's KV is reserved as it opens (`reserved`)."""
        self.checks.generate(req)
        mode = AcceptMode.GREEDY if req.config.sampling.greedy else AcceptMode.POINT
        opening = OpenSessionRequest(req.prompt_tokens, replace(req.config, accept_mode=mode), req.reuse_token)
        return DecodeRequest("", 0, req.max_new_tokens, req.stop_token_ids, open=opening)

    def generate(self, req: GenerateRequest) -> Iterator[GenerateChunk]:
        """Target-only decoding as a Generate call's (as_decode), one forward pass per token,
        unbatched; its session closes however the stream ends."""
        opening = self.as_decode(req).open
        assert opening is not None
        session_id, stops = self.sessions.new_id(), frozenset(req.stop_token_ids)
        try:
            stretch = DecodeStretchStep(req.max_new_tokens, stops, reserved=True)
            opened, result = self._run_alone(self.begin_open_decode(opening, session_id, "", stretch), 0.0)
            reuse: dict[str, Any] = {"reuse_token": opened.reuse_token, "reused_tokens": opened.reused_tokens}
            for left in reversed(range(req.max_new_tokens)):  # the tokens after this one
                finished = result.next_token in stops or left == 0
                yield GenerateChunk([result.next_token], result.metrics.forward_ms, finished, **reuse)
                if finished:
                    return
                reuse, position = {}, result.new_base_position  # only the first chunk says how it opened
                step = self.begin_verify(VerifyRequest(session_id, position, []), "", DecodeStretchStep(left, stops))
                result = self._run_alone(step, 0.0)
        finally:
            self.sessions.retire(session_id)

    def _run_alone(self, step: ForwardStep[R], queue_ms: float) -> R:
        result = self.run_batch([(step, queue_ms)])[0]
        while isinstance(result, Partial):  # a prompt longer than the engine computes in a step
            result = self.run_batch([(result.rest, queue_ms)])[0]
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]  # run_batch returns the step's own result


@dataclass(frozen=True)
class DecodeStretchStep:
    """A token of a Decode stretch: the tokens the stretch goes on for from it, and the tokens
    that end it."""

    tokens: int
    stops: frozenset[int] = frozenset()
    reserved: bool = False  # opening: the stretch's KV held from the start (a Generate stream is never cut short for KV)


@dataclass(frozen=True)
class _Prefill:
    """A new session's prefill: its result is the opened session; undone, the session goes."""

    verifier: Verifier
    session: Session
    opened: OpenSessionResult  # the result, but for the time it took and the tokens it reused
    start: float

    def rule(self) -> None:
        return None

    def finish(self, outcome: StepOutcome | None, forward_ms: float, queue_ms: float) -> OpenSessionResult:
        """The prompt is computed: the tokens of it served from its scope's kept KV (the
        verifier's, and the engine's own cache's) are counted in the reuse totals."""
        session = self.session
        session.reused += self.verifier.engine.cached_tokens(session.cache)
        self.verifier.sessions.prefixes.count_open(session.owner, session.reused, len(session.tokens))
        return replace(self.opened, prefill_ms=_ms_since(self.start), reused_tokens=session.reused)

    def undo(self) -> None:
        self.verifier.sessions.discard(self.session.session_id)


@dataclass(frozen=True)
class _Round:
    """One Verify round: its accept rule before the engine runs it, then the commit of the
    accepted prefix and the next token; undone, the cache drops the round's positions."""

    sessions: SessionStore
    engine: Engine
    req: VerifyRequest
    session: Session
    vocab: int
    start: float
    position: int  # the session's length when the round began
    grammar_rows: np.ndarray | None = None  # the session's grammar's masks of the round's rows

    def rule(self) -> RoundRule:
        req, config = self.req, self.session.config
        return RoundRule(
            config.accept_mode,
            config.sampling,
            self.vocab,
            self.session.tokens + req.committed_tokens,
            req.draft_probs,
            req.sparse_draft,
            self.session.generator,
            self.grammar_rows,
        )

    def finish(self, outcome: StepOutcome | None, forward_ms: float, queue_ms: float) -> VerifyResult:
        assert outcome is not None  # a round reads its outcome
        req, session, accepted = self.req, self.session, outcome.round
        self.sessions.extend(session, [*req.committed_tokens, *req.draft_tokens[: accepted.accepted_len], accepted.next_token])
        session.rounds += 1
        self.sessions.touch(session)
        k, probs = len(req.draft_tokens), accepted.accept_probs
        metrics = RoundMetrics(
            alpha_mean=sum(probs) / k if k else 0.0,
            la_over_k=accepted.accepted_len / k if k else 0.0,
            verify_ms=_ms_since(self.start) + queue_ms,
            queue_ms=queue_ms,
            forward_ms=forward_ms,
            hard_tokens=sum(req.hard_mask),
            alpha_prefix=_prefix_acceptance(probs, accepted.accepted_len),
        )
        new_base = len(session.tokens)
        return VerifyResult(accepted.accepted_len, accepted.next_token, accepted.bonus, new_base, metrics, outcome.top_k)

    def undo(self) -> None:
        self.engine.crop(self.session.cache, self.position - 1)


@dataclass(frozen=True)
class _OpenedRound:
    """A prefill whose pass also gives the session's first token (its last row, accepted as a
    round with no drafts); undone, the session goes."""

    prefill: _Prefill
    first: _Round

    def rule(self) -> RoundRule:
        return self.first.rule()

    def finish(self, outcome: StepOutcome | None, forward_ms: float, queue_ms: float) -> tuple[OpenSessionResult, VerifyResult]:
        opened = self.prefill.finish(outcome, forward_ms, queue_ms)
        return opened, self.first.finish(outcome, forward_ms, queue_ms)

    def undo(self) -> None:
        self.prefill.undo()


def _ahead(stretch: DecodeStretchStep | None, room: int, session: Session) -> tuple[int, frozenset[int]]:
    """The tokens a step's session reads from it on without drafts (at most the `room` the
    context leaves: a step past it is refused; one under a grammar, whose masks follow each
    token), and the tokens that end them."""
    if stretch is None or session.constraint is not None:
        return 1, frozenset()
    return max(min(stretch.tokens, room), 1), stretch.stops


def _grammar_rows(session: Session, req: VerifyRequest, engine: Engine) -> np.ndarray | None:
    """The masks of a round's rows under its session's grammar (None: no grammar, or an engine
    that masks by itself): after the committed tokens and catch-up, and after each draft
    (GrammarRefused: a catch-up token off the grammar, whichever engine)."""
    if session.constraint is None:
        return None
    session.constraint.sync([*session.tokens[session.prompt_len :], *req.committed_tokens])
    return None if engine.applies_grammars else session.constraint.mask_rows(req.draft_tokens)


def _prefix_acceptance(accept_probs: list[float], accepted_len: int) -> float | None:
    """Mean acceptance over the drafts verified on an accepted prefix (the accepted ones and the
    first rejected one): what a k policy's i.i.d. model means by acceptance. The drafts after the
    first rejection were verified on a wrong prefix and are left out."""
    verified = accept_probs[: accepted_len + 1]
    return sum(verified) / len(verified) if verified else None
