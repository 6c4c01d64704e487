"""Prometheus metrics of one verifier, in a registry of its own so servers (and tests) never
share counters. Names follow vLLM's speculative-decoding metrics under the prefix `specdec_`
(docs/operations.md); labels stay low-cardinality: RPC method, status code, draft position
(bounded by max_draft_tokens), an API key's name (bounded by the keys file) and an eviction
reason, never a session or request id or a caller's address."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from cloud.sessions import EVICTION_REASONS
from shared.protocol import VerifyResult

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: a CPU round of a small model takes milliseconds, a long GPU prefill seconds.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class VerifierMetrics:
    def __init__(self, max_draft_tokens: int) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds: what a soak watches
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        latency = partial(Histogram, buckets=LATENCY_BUCKETS_S, registry=r)
        self.requests = counter("specdec_requests", "RPCs by method and gRPC status code", ["method", "code"])
        self.received_bytes = counter("specdec_received_bytes", "serialized request bytes", ["method"])
        self.sent_bytes = counter("specdec_sent_bytes", "serialized response bytes", ["method"])
        self.rounds = counter("specdec_rounds", "verify rounds (vLLM: num_drafts)")
        self.draft_tokens = counter("specdec_draft_tokens", "drafted tokens received")
        self.accepted_tokens = counter("specdec_accepted_tokens", "drafted tokens accepted")
        self.accepted_per_pos = counter(
            "specdec_accepted_tokens_per_pos", "accepted tokens by draft position (0-based)", ["position"]
        )
        self.decode_tokens = counter(
            "specdec_decode_tokens", "tokens of Decode stretches: the target's own decoding on a session"
        )
        self.bonus_tokens = counter("specdec_bonus_tokens", "bonus tokens: rounds whose drafts all passed")
        self.verify_latency = latency("specdec_verify_latency_seconds", "server time per round, queue included")
        self.forward_time = latency("specdec_forward_seconds", "target forward pass per round")
        # Once per pass, however many steps it ran: busy / wall time is the verifier's load.
        self.busy_time = counter("specdec_busy_seconds", "model-worker time in target forward passes")
        self.forward_passes = counter("specdec_forward_passes", "target forward passes (batched steps count once)")
        # An engine with its own loop (vLLM) also steps outside passes, for the streams that follow it.
        self.engine_steps = counter("specdec_engine_steps", "steps of the engine's own loop (vLLM)")
        self.engine_step_time = counter("specdec_engine_step_seconds", "time in the engine's own steps (vLLM)")
        self.queue_time = latency("specdec_queue_seconds", "wait in the batch queue per round")
        positions = [float(i) for i in range(max_draft_tokens + 1)]  # one bucket per possible length
        self.draft_len = Histogram("specdec_draft_length", "k: drafted tokens per round", buckets=positions, registry=r)
        self.accepted_len = Histogram("specdec_accepted_length", "accepted drafts per round", buckets=positions, registry=r)
        self.batch_size = Histogram(
            "specdec_batch_size",
            "steps (rounds, prefills and Generate tokens) per target forward pass",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
            registry=r,
        )
        self.queue_depth = gauge("specdec_queue_depth", "steps waiting for a forward pass")
        self.rejected = counter(
            "specdec_rejected_requests", "calls refused with RESOURCE_EXHAUSTED (queue, KV or session caps)", ["method"]
        )
        self.admission_refusals = counter(
            "specdec_admission_refusals",
            "new sessions refused because their prefill could not finish before the caller's deadline",
        )
        self._add_refusals_and_evictions(counter, gauge)
        self._counted: dict[Counter, float] = {}  # what each counter fed from a total elsewhere has counted
        self.open_sessions = gauge("specdec_open_sessions", "sessions holding a KV cache")
        self.kv_cache_bytes = gauge("specdec_kv_cache_bytes", "KV-cache bytes held by open sessions")
        for position in range(max_draft_tokens):  # every position exists from the start, at 0
            self.accepted_per_pos.labels(str(position))

    def _add_refusals_and_evictions(self, counter: Callable[..., Counter], gauge: Callable[..., Gauge]) -> None:
        self.refused_calls = counter(
            "specdec_refused_calls",
            "calls refused for their own request (UNAUTHENTICATED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT, NOT_FOUND) by "
            "code and API key name (empty: no valid key); the log has one line per source and interval",
            ["code", "key"],
        )
        self.evicted_sessions = counter(
            "specdec_evicted_sessions",
            "sessions the verifier dropped, by reason: ttl (idle too long), session_cap and kv_cap (the global caps; "
            "only the key that needed the room loses a session), key_kv_cap (a key's own KV cap)",
            ["reason"],
        )
        for reason in EVICTION_REASONS:  # every reason's series exists from the start, at 0
            self.evicted_sessions.labels(reason)
        self.prefix_reused_tokens = counter(
            "specdec_prefix_reused_tokens",
            "prompt tokens of new sessions whose KV came from a closed session of the same API key (a kept prefix)",
        )
        self.prefix_prefilled_tokens = counter(
            "specdec_prefix_prefilled_tokens", "prompt tokens of new sessions the target computed (prefill)"
        )
        self.prefix_cache_bytes = gauge(
            "specdec_prefix_cache_bytes", "KV bytes kept from closed sessions for their keys' next sessions"
        )
        self.prefix_cache_entries = gauge("specdec_prefix_cache_entries", "closed sessions' KV kept for reuse")

    def record_rpc(self, method: str, code: str, received: int, sent: int) -> None:
        self.requests.labels(method, code).inc()
        if code == "RESOURCE_EXHAUSTED":
            self.rejected.labels(method).inc()
        self.received_bytes.labels(method).inc(received)
        self.sent_bytes.labels(method).inc(sent)

    def record_round(self, k: int, result: VerifyResult) -> None:
        accepted, m = result.accepted_len, result.metrics
        self.rounds.inc()
        self.draft_tokens.inc(k)
        self.accepted_tokens.inc(accepted)
        for position in range(accepted):
            self.accepted_per_pos.labels(str(position)).inc()
        if result.bonus:
            self.bonus_tokens.inc()
        self.verify_latency.observe(m.verify_ms / 1000.0)
        self.forward_time.observe(m.forward_ms / 1000.0)
        self.queue_time.observe(m.queue_ms / 1000.0)
        self.draft_len.observe(k)
        self.accepted_len.observe(accepted)

    def record_evictions(self, totals: Mapping[str, int]) -> None:
        """The session store's eviction totals by reason, as they stand now."""
        for reason, total in totals.items():
            self._count_to(self.evicted_sessions.labels(reason), total)

    def record_prefixes(self, reused: int, prefilled: int, entries: int, nbytes: int) -> None:
        """The kept prefixes now, and the prompt-token totals of new sessions as they stand."""
        self._count_to(self.prefix_reused_tokens, reused)
        self._count_to(self.prefix_prefilled_tokens, prefilled)
        self.prefix_cache_entries.set(entries)
        self.prefix_cache_bytes.set(nbytes)

    def record_engine_steps(self, steps: int, seconds: float) -> None:
        """The engine's own step totals, as they stand now."""
        self._count_to(self.engine_steps, steps)
        self._count_to(self.engine_step_time, seconds)

    def _count_to(self, counter: Counter, total: float) -> None:
        """Raise `counter` to `total`, a total kept elsewhere (it never goes down)."""
        new = total - self._counted.get(counter, 0)
        if new > 0:
            counter.inc(new)
            self._counted[counter] = total

    def set_sessions(self, count: int, kv_bytes: int) -> None:
        self.open_sessions.set(count)
        self.kv_cache_bytes.set(kv_bytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
