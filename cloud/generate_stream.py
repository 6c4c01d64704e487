"""Target-only decoding (the cloud_only baseline): one Generate call, a session whose every
step is a round with no drafts (its token drawn by the same rule as a Decode stretch's). Its
first step (the prompt's prefill and the first token) is batched with other streams' steps
and sessions' rounds. After it, on an engine that decodes ahead on its own (vLLM) the stream
follows its session (cloud/token_feed.py); on the other engines each token is one more step."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from cloud.batch_step import ForwardStep
from cloud.engine import Engine, StepOutcome, TokenSink
from cloud.rejection_sampler import RoundRule
from cloud.sessions import Session
from cloud.token_feed import taken_part
from shared.errors import InvalidRequest
from shared.protocol import AcceptMode, GenerateChunk, GenerateRequest, SessionConfig

if TYPE_CHECKING:
    from cloud.verifier import Verifier  # which imports this module


class GenerateStream:
    """One Generate call. Its KV is a session in the store (under an id only the stream
    knows), so the session and KV caps count it like any session's; the first step stores
    it, close() drops it. A stream is the work of each of its steps."""

    def __init__(self, opener: Verifier, engine: Engine, req: GenerateRequest, vocab: int, stream_id: str, owner: str) -> None:
        self.opener = opener
        self.engine = engine
        self.req = req
        self.vocab = vocab
        self.stream_id = stream_id
        self.owner = owner
        self.session: Session | None = None  # stored by the first step, on the model worker
        self.produced = 0
        self.finished = False
        self._undo_to: int | None = None  # the cache length before the step in flight (None: the prefill)

    @property
    def tokens_to_feed(self) -> int:
        """Tokens the next step feeds, as far as can be told before it begins: the prompt but for
        what a kept prefix holds (the prefill), then the last token."""
        if self.session is None:
            scope = self.opener.scopes.known(self.owner, self.req.reuse_token)
            return len(self.req.prompt_tokens) - self.opener.sessions.reusable(scope.name, self.req.prompt_tokens)
        return 1

    def begin_step(self) -> ForwardStep[GenerateChunk]:
        if self.finished:
            raise InvalidRequest("the stream has finished")
        if self.session is None:  # its whole length is reserved now: a stream is never cut short for KV
            planned = len(self.req.prompt_tokens) + self.req.max_new_tokens - 1
            config, prompt, token = _target_only(self.req.config), self.req.prompt_tokens, self.req.reuse_token
            self.session = self.opener.new_session(self.stream_id, config, prompt, self.owner, planned, token)
            self._undo_to = None
            held = self.session.cache.get_seq_length()  # a kept prefix's tokens: only the rest is prefilled
            return self._step(self.session, self.session.tokens[held:])
        session = self.opener.sessions.get(self.stream_id, self.owner)  # evicted only if the caller has gone
        self._undo_to = session.cache.get_seq_length()
        return self._step(session, session.tokens[-1:])

    def _step(self, session: Session, block: list[int]) -> ForwardStep[GenerateChunk]:
        """A step feeding `block`: the stream reads its next token, and the rest of the stream
        (the tokens and stops left) is what an engine that decodes ahead may make in one go."""
        left, stops = self.req.max_new_tokens - self.produced, frozenset(self.req.stop_token_ids)
        if session.constraint is not None:  # each token's mask follows from the ones before: a step each
            left = 1
        return ForwardStep(session.cache, block, self, ahead=left, stops=stops)

    def rule(self) -> RoundRule:
        """A round with no drafts: the token is the target's own draw."""
        session = self.session
        assert session is not None  # the first step stored it
        rule = RoundRule.next_token(session.config, self.vocab, session.tokens, session.generator)
        if session.constraint is None or self.engine.applies_grammars:
            return rule
        session.constraint.sync(session.tokens[session.prompt_len :])  # its own draws: under the grammar
        return replace(rule, grammar_rows=session.constraint.mask_rows([]))

    def finish(self, outcome: StepOutcome | None, forward_ms: float, queue_ms: float) -> GenerateChunk:
        assert self.session is not None and outcome is not None  # every step reads its token
        first = self.produced == 0
        reused = self.opener.count_opened(self.session) if first else 0
        token = outcome.round.next_token
        self.session.tokens.append(token)
        self.opener.sessions.touch(self.session)
        self.produced += 1
        self.finished = token in self.req.stop_token_ids or self.produced == self.req.max_new_tokens
        reuse_token = self.session.reuse_token if first else ""
        return GenerateChunk([token], forward_ms, self.finished, reuse_token=reuse_token, reused_tokens=reused)

    def follow(self, sink: TokenSink) -> bool:
        """(on the model worker, after the first step) Whether the rest of the stream comes from
        the engine's own decoding, each token as it is made, to `sink`."""
        session = self.session
        if session is None or self.finished or session.constraint is not None:
            return False
        return self.engine.follow(session.cache, len(session.tokens), sink)

    def take(self, tokens: list[int], step_ms: float) -> GenerateChunk:
        """Tokens a followed stream's engine decoded, as one chunk, up to the stream's end (its
        last token, or a stop token). They stay in the engine's request: the stream's session
        is only its KV from here on."""
        tokens, stopped = taken_part(tokens, self.req.max_new_tokens - self.produced, self.req.stop_token_ids)
        self.produced += len(tokens)
        self.finished = stopped or self.produced == self.req.max_new_tokens
        return GenerateChunk(tokens, step_ms, self.finished)

    def undo(self) -> None:
        """The step in flight failed: a prefill drops the stream, a token step its KV row."""
        if self._undo_to is None:
            self.opener.sessions.discard(self.stream_id)
        elif self.session is not None:
            self.engine.crop(self.session.cache, self._undo_to)

    def close(self) -> None:
        """End the stream (on the model worker): its KV may stay as a kept prefix of its key."""
        self.opener.sessions.retire(self.stream_id)


def _target_only(config: SessionConfig) -> SessionConfig:
    """A stream's session verifies no drafts: whatever accept mode its caller names, its tokens
    are the target's own draws (an engine that refuses approximate modes serves it)."""
    return replace(config, accept_mode=AcceptMode.GREEDY if config.sampling.greedy else AcceptMode.POINT)
