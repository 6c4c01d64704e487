"""Prometheus metrics of one edge-agent process (`--metrics-port`): drafting time, round trip,
k, accepted length, and the provisional / retracted / unverified / local counts.

An Observer wrapper updates them as rounds commit, so batch and streaming runs both count.
The registry is the process's own (not the global default), served by prometheus_client's
small HTTP server in a background thread.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from edge.round.generate import GenerationResult, Observer, RoundRecord

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
K_BUCKETS = tuple(float(k) for k in range(17))


class EdgeMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.rounds = Counter("specdec_edge_rounds", "Verify rounds completed", registry=r)
        self.committed_tokens = Counter("specdec_edge_committed_tokens", "final tokens shown to the user", registry=r)
        self.draft_tokens = Counter("specdec_edge_draft_tokens", "tokens drafted and sent", registry=r)
        self.accepted_tokens = Counter("specdec_edge_accepted_tokens", "drafted tokens the cloud accepted", registry=r)
        self.provisional_tokens = Counter("specdec_edge_provisional_tokens", "tokens shown before the cloud answered", registry=r)
        self.retracted_tokens = Counter("specdec_edge_retracted_tokens", "provisional tokens the cloud rejected", registry=r)
        self.local_tokens = Counter("specdec_edge_local_tokens", "LOSSY: tokens committed without the cloud", registry=r)
        self.draft_time = Histogram(
            "specdec_edge_draft_seconds", "drafting time per round", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.rtt = Histogram("specdec_edge_rtt_seconds", "Verify call wall time", buckets=LATENCY_BUCKETS_S, registry=r)
        self.k = Histogram("specdec_edge_k", "drafted tokens per round", buckets=K_BUCKETS, registry=r)
        self.accepted_len = Histogram("specdec_edge_accepted_length", "accepted drafts per round", buckets=K_BUCKETS, registry=r)
        self.tokens_by_mode = Counter(
            "specdec_edge_tokens_by_mode",
            "final tokens by what produced them: speculative rounds or the target's own decoding (cloud_only)",
            ["mode"],
            registry=r,
        )
        self.mode_switches = Counter(
            "specdec_edge_mode_switches",
            "auto mode's switches by the mode switched to and why "
            "(start, drafter_ready, slower, probe_speculation, probe_target, verifier_loaded)",
            ["to", "why"],
            registry=r,
        )
        self.draft_reused_tokens = Counter(
            "specdec_edge_draft_reused_tokens",
            "edge-agent serve: prompt tokens whose draft KV came from the conversation cache",
            registry=r,
        )
        self.draft_prefilled_tokens = Counter(
            "specdec_edge_draft_prefilled_tokens",
            "edge-agent serve: prompt tokens whose draft KV the draft model computed",
            registry=r,
        )
        self.conversation_cache_bytes = Gauge(
            "specdec_edge_conversation_cache_bytes", "draft KV kept for conversations' next turns (edge-agent serve)", registry=r
        )
        self.conversation_cache_entries = Gauge(
            "specdec_edge_conversation_cache_entries", "draft caches kept for conversations' next turns", registry=r
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the exposition server; returns the bound port (port 0 = any free one)."""
        server, _ = start_http_server(port, host, registry=self.registry)
        return int(server.server_port)

    def record(self, tokens: list[int], record: RoundRecord | None) -> None:
        self.committed_tokens.inc(len(tokens))
        if record is None:
            return
        if record.local:
            self.local_tokens.inc(len(tokens))
            return
        self.rounds.inc()
        self.draft_tokens.inc(record.k)
        self.accepted_tokens.inc(record.accepted_len)
        self.retracted_tokens.inc(record.retracted)
        self.draft_time.observe(record.edge_time_ms / 1000.0)
        self.rtt.observe(record.rtt_ms / 1000.0)
        self.k.observe(record.k)
        self.accepted_len.observe(record.accepted_len)

    def record_generation(self, result: GenerationResult) -> None:
        """What a finished generation produced by mode, and its mode switches."""
        for mode, tokens in result.tokens_by_mode.items():
            self.tokens_by_mode.labels(mode).inc(tokens)
        for switch in result.mode_switches:
            self.mode_switches.labels(switch["to"], switch["why"]).inc()

    def record_draft_prompt(self, reused: int, prefilled: int) -> None:
        """A served generation's drafter: its prompt's KV taken from the conversation cache, and computed."""
        self.draft_reused_tokens.inc(reused)
        self.draft_prefilled_tokens.inc(prefilled)

    def record_conversation_cache(self, nbytes: int, entries: int) -> None:
        self.conversation_cache_bytes.set(nbytes)
        self.conversation_cache_entries.set(entries)


class MeteredObserver:
    """Counts every event into EdgeMetrics, then passes it on to the inner observer (if any)."""

    def __init__(self, metrics: EdgeMetrics, inner: Observer | None) -> None:
        self.metrics, self.inner = metrics, inner

    def committed(self, tokens: list[int], record: RoundRecord | None) -> None:
        self.metrics.record(tokens, record)
        if self.inner:
            self.inner.committed(tokens, record)

    def provisional(self, tokens: list[int]) -> None:
        self.metrics.provisional_tokens.inc()  # one more token shown each time
        if self.inner:
            self.inner.provisional(tokens)
