"""A Decode stretch that reads its session's own decoding, on an engine that decodes ahead (vLLM): no pass per token
after the first (docs/architecture.md, "Decode stretches and followed streams")."""

from __future__ import annotations

from cloud.engine import Engine, TokenSink
from cloud.sessions import Session, SessionStore
from shared.errors import CapacityExceeded


class FollowedStretch:
    """The rest of one Decode stretch: `left` tokens at most, ending after a token of `stops`."""

    def __init__(
        self, sessions: SessionStore, engine: Engine, session: Session, left: int, stops: frozenset[int], planned: int
    ) -> None:
        self.sessions = sessions
        self.engine = engine
        self.session = session
        self.position = len(session.tokens)  # the session's length after the tokens taken so far
        self.left = left
        self.stops = stops
        self.finished = False
        self._taken: list[int] = []  # taken and not committed yet
        self._committed_at = self.position  # the session's length when the taken tokens follow it
        self._planned = planned  # the positions the session held reserved before the stretch: again at its commit

    @classmethod
    def start(
        cls, sessions: SessionStore, engine: Engine, session: Session, left: int, stops: frozenset[int], sink: TokenSink
    ) -> FollowedStretch | None:
        """(on the model worker) The stretch's rest from the session's request, its tokens going
        to `sink`; None when the engine does not decode the session on its own, or the KV for
        the rest cannot be held now (its tokens then go one step each, as they would anyway)."""
        if not engine.decodes_ahead:
            return None
        before = session.planned  # a Generate stream's whole length, reserved as it opened
        planned = len(session.tokens) - 1 + left  # counted as held while the engine decodes it
        try:
            more = planned - max(len(session.tokens) - 1, before)
            sessions.reserve(max(more, 0), keep=session.session_id, owner=session.owner)
        except CapacityExceeded:
            return None
        sessions.plan(session, max(planned, before))
        if not engine.follow(session.cache, len(session.tokens), sink):
            sessions.plan(session, before)
            return None
        return cls(sessions, engine, session, left, stops, before)

    def take(self, tokens: list[int]) -> list[int]:
        """(on the event loop) The tokens the engine put that belong to the stretch: up to its
        last one, or its first stop token (the engine may have decoded past either)."""
        tokens = tokens[: self.left]
        stop = next((i for i, token in enumerate(tokens) if token in self.stops), None)
        tokens = tokens if stop is None else tokens[: stop + 1]
        self.left -= len(tokens)
        self.position += len(tokens)
        self._taken += tokens
        self.finished = stop is not None or self.left == 0
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
        self.sessions.plan(session, self._planned)
        if taken and len(session.tokens) == self._committed_at:  # else another call's step moved it on
            self.engine.extend(session.cache, [session.tokens[-1], *taken[:-1]])  # the KV holds all but the last token
            self.sessions.extend(session, taken)
            session.rounds += len(taken)
        self._committed_at = len(session.tokens)
        self.sessions.touch(session)
