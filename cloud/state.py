"""What one running verifier shares between its gRPC servicer, its HTTP app and main: the
model once loaded, readiness (loading / ready / draining), the API keys in force, the model
worker and telemetry."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from importlib import metadata

from cloud.batcher import BatchLimits, ForwardBatcher
from cloud.live import LiveStats
from cloud.logs import RefusalLog
from cloud.metrics import VerifierMetrics
from cloud.sessions import session_tag
from cloud.verifier import Verifier
from cloud.worker import ModelWorker
from shared.api_keys import ApiKeys, Caller
from shared.errors import ServerDraining, SpecDecError
from shared.protocol import VerifyResult

ReadinessListener = Callable[[bool], Awaitable[None]]


class ModelLoading(SpecDecError):
    """A call arrived before the model finished loading: retry, as after a restart."""

    status = "UNAVAILABLE"


EVERYONE = Caller("", sees_all=True)  # the server's own view: every session


@dataclass(frozen=True)
class SessionRow:
    session: str  # session_tag(id), as in the log lines
    age_s: float
    idle_s: float
    length: int  # committed tokens: prompt + generated
    rounds: int
    kv_bytes: int


def package_version() -> str:
    try:
        return metadata.version("specedge")
    except metadata.PackageNotFoundError:
        return "unknown"


class ServerState:
    def __init__(
        self,
        max_draft_tokens: int,
        verifier: Verifier | None = None,
        log_prompts: bool = False,
        batch_limits: BatchLimits | None = None,
        api_keys: ApiKeys | None = None,
        prefer_speculation_above: int | None = None,
    ) -> None:
        self.verifier: Verifier | None = None
        self.batcher: ForwardBatcher | None = None
        self.batch_limits = batch_limits or BatchLimits()
        self.draining = False
        self.log_prompts = log_prompts  # debug only: prompts are user data
        # No keys: every caller is let in, as principal "". Read at each call and request, never
        # copied: cloud/key_reload.py replaces it when the keys file changes.
        self.api_keys = api_keys or ApiKeys()
        self.started = time.monotonic()
        self.version = package_version()
        self.worker = ModelWorker()
        self.metrics = VerifierMetrics(max_draft_tokens)
        self.live = LiveStats(max_draft_tokens)  # every key's rounds
        self.live_by_key: dict[str, LiveStats] = {}  # each key's own (keys come from the keys file: bounded)
        self.refusals = RefusalLog()  # refused calls: a bounded log under a flood
        self.prefer_speculation_above = prefer_speculation_above  # None: never ask edges to speculate
        self._listeners: list[ReadinessListener] = []
        if verifier is not None:
            self._serve(verifier)

    @classmethod
    def for_verifier(
        cls, verifier: Verifier, batch_limits: BatchLimits | None = None, prefer_speculation_above: int | None = None
    ) -> ServerState:
        max_k = verifier.limits.max_draft_tokens
        return cls(max_k, verifier, batch_limits=batch_limits, prefer_speculation_above=prefer_speculation_above)

    def _serve(self, verifier: Verifier) -> None:
        self.batcher = ForwardBatcher(verifier, self.worker, self.batch_limits, self.metrics)
        self.verifier = verifier

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        return "loading" if self.verifier is None else "ready"

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    def verifier_for(self, new_session: bool) -> tuple[Verifier, ForwardBatcher]:
        """The loaded verifier and its batcher. While draining, open sessions go on; new ones are refused."""
        if self.verifier is None or self.batcher is None:
            raise ModelLoading("the model is still loading; retry shortly")
        if new_session and self.draining:
            raise ServerDraining("the verifier is shutting down and takes no new sessions")
        return self.verifier, self.batcher

    def prefers_speculation(self) -> bool:
        """Whether edges in auto mode are asked to speculate: more sessions are open than
        --prefer-speculation-above. Open sessions count speculating and decoding users alike, so
        the answer does not flip as edges follow it."""
        limit, verifier = self.prefer_speculation_above, self.verifier
        return limit is not None and verifier is not None and len(verifier.sessions) > limit

    # ---- readiness ----------------------------------------------------------------------

    def on_readiness(self, listener: ReadinessListener) -> None:
        self._listeners.append(listener)

    async def publish(self) -> None:
        for listener in self._listeners:
            await listener(self.ready)

    async def set_verifier(self, verifier: Verifier) -> None:
        self._serve(verifier)
        await self.publish()

    async def drain(self) -> None:
        self.draining = True
        await self.publish()

    # ---- API keys -----------------------------------------------------------------------

    async def end_owner(self, name: str) -> int:
        """End every session and kept prefix of `name`, an API key just removed, and free their
        KV (on the model worker); how many sessions it ended."""
        self.live_by_key.pop(name, None)  # a name that comes back starts afresh
        verifier = self.verifier
        return 0 if verifier is None else await self.worker.run(verifier.sessions.end_owner, name)

    def end_owner_soon(self, name: str) -> None:
        """end_owner(name) after the model work queued now, without waiting for it: for a call
        let in before its key was removed, which may have opened a session since."""
        if self.verifier is not None:
            self.worker.submit(partial(self.verifier.sessions.end_owner, name))

    # ---- telemetry ----------------------------------------------------------------------

    def record_round(self, k: int, result: VerifyResult, key: str = "") -> None:
        self.metrics.record_round(k, result)
        self.live.record_round(k, result.accepted_len, result.metrics.verify_ms)
        if self.api_keys.enabled:
            own = self.live_by_key.setdefault(key, LiveStats(self.live.max_k))
            own.record_round(k, result.accepted_len, result.metrics.verify_ms)

    def prefix_reuse(self, caller: Caller) -> dict[str, int]:
        """New sessions' prompt tokens served from kept prefixes and prefilled, and the kept
        prefixes now: every key's for the server's view, else the caller's own."""
        if self.verifier is None:
            return {}
        owner = None if caller.sees_all else caller.name
        reused, prefilled, entries, nbytes = self.verifier.sessions.prefix_totals(owner)
        return {"reused_tokens": reused, "prefilled_tokens": prefilled, "kept_prefixes": entries, "kept_bytes": nbytes}

    def live_for(self, caller: Caller) -> LiveStats:
        """The recent rounds `caller` may see: every key's, or its own."""
        return self.live if caller.sees_all else self.live_by_key.get(caller.name) or LiveStats(self.live.max_k)

    def sessions(self, caller: Caller = EVERYONE) -> list[SessionRow]:
        """Open sessions `caller` may see (those past their TTL left out, as the store's next
        call drops them); the full view also refreshes the session gauges."""
        if self.verifier is None:
            return []
        store = self.verifier.sessions
        now = store.clock()
        rows = [
            SessionRow(
                session_tag(s.session_id), now - s.created, now - s.last_used, len(s.tokens), s.rounds, store.session_bytes(s)
            )
            for s in store.snapshot()  # read from the event loop: a scrape never queues behind rounds
            if now - s.last_used < store.limits.ttl_s and caller.sees(s.owner)
        ]
        if caller.sees_all:
            self.metrics.set_sessions(len(rows), sum(r.kv_bytes for r in rows))
        self.metrics.record_evictions(store.eviction_totals())
        self.metrics.record_prefixes(*store.prefix_totals())
        self.metrics.record_engine_steps(*self.verifier.engine.own_steps())
        return rows
