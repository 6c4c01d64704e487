"""A Decode stretch that reads its session's own decoding: after the stretch's first token (one
batched step), an engine that decodes ahead on its own (vLLM) decodes the rest in its own loop,
and the call takes the tokens from a TokenFeed as they come (cloud/token_feed.py), with no pass
per token; the session takes them when the call commits them (FollowedStretch.commit).

Built and committed on the model worker, which owns the session; taken from on the event loop,
where only this object's own counts change."""

from __future__ import annotations

from cloud.engine import Engine, TokenSink
from cloud.sessions import Session, SessionStore
from cloud.token_feed import taken_part
from shared.errors import CapacityExceeded


class FollowedStretch:
    """The rest of one Decode stretch: `left` tokens at most, ending after a token of `stops`."""

    def __init__(self, sessions: SessionStore, engine: Engine, session: Session, left: int, stops: frozenset[int]) -> None:
        self.sessions = sessions
        self.engine = engine
        self.session = session
        self.position = len(session.tokens)  # the session's length after the tokens taken so far
        self.left = left
        self.stops = stops
        self.finished = False
        self._taken: list[int] = []  # taken and not committed yet
        self._committed_at = self.position  # the session's length when the taken tokens follow it

    @classmethod
    def start(
        cls, sessions: SessionStore, engine: Engine, session: Session, left: int, stops: frozenset[int], sink: TokenSink
    ) -> FollowedStretch | None:
        """(on the model worker) The stretch's rest from the session's request, its tokens going
        to `sink`; None when the engine does not decode the session on its own, or the KV for
        the rest cannot be held now (its tokens then go one step each, as they would anyway)."""
        if not engine.decodes_ahead:
            return None
        try:
            sessions.reserve(left, keep=session.session_id, owner=session.owner)
        except CapacityExceeded:
            return None
        session.planned = len(session.tokens) - 1 + left  # counted as held while the engine decodes it
        if not engine.follow(session.cache, len(session.tokens), sink):
            session.planned = 0
            return None
        return cls(sessions, engine, session, left, stops)

    def take(self, tokens: list[int]) -> list[int]:
        """(on the event loop) The tokens the engine put that belong to the stretch: up to its
        last one, or its stop token."""
        tokens, stopped = taken_part(tokens, self.left, self.stops)
        self.left -= len(tokens)
        self.position += len(tokens)
        self._taken += tokens
        self.finished = stopped or self.left == 0
        return tokens

    def commit(self) -> None:
        """(on the model worker) The session takes the tokens taken since the last commit, as one
        step a token (a round each) would have left it, and the engine hands the call no more. A
        session closed or evicted meanwhile is left gone; one that another call's step moved on (a
        client that did not wait for the stretch) keeps that step's tokens."""
        taken, self._taken = self._taken, []
        session = self.session
        if not self.sessions.holds(session):
            return
        self.engine.unfollow(session.cache)
        session.planned = 0
        if taken and len(session.tokens) == self._committed_at:  # else another call's step moved it on
            self.engine.extend(session.cache, [session.tokens[-1], *taken[:-1]])  # the KV holds all but the last token
            session.tokens.extend(taken)
            session.rounds += len(taken)
        self._committed_at = len(session.tokens)
        self.sessions.touch(session)
