"""What edge-agent has loaded and what it derives from its settings: the tokenizer and the
draft model, the drafters, the k policy, gating, a generation's configuration, the verifier
to talk to (--cloud, or one started here) and a client of it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from edge.config import EdgeSettings
from edge.drafting.drafter import Drafter, DrafterConfig, DraftGrammar, DraftKV, DraftLM, DraftSource
from edge.drafting.gating import EscalationRules, GatingThresholds, load_gating_config
from edge.drafting.kpolicy import CostK, EgagK, FixedK, KPolicy, LaRatioK
from edge.drafting.ngram import HybridDrafter, NGramDrafter, NGramStore
from edge.drafting.round_costs import PlannedCosts, RoundCosts
from edge.drafting.runtime_llamacpp import LlamaCppDraftLM
from edge.metrics import EdgeMetrics, MeteredObserver
from edge.round.generation import Gating, GenerationConfig, Observer, TimeoutPolicy
from edge.round.mode_switch import ModeMemory, SwitchRules
from edge.tokenizer import EdgeTokenizer
from edge.transport.client import CapacityRetry, ClientTls, VerifierClient
from edge.transport.local_verifier import local_verifier
from shared import llamacpp
from shared.errors import ConfigError
from shared.grammar import Grammar
from shared.models import DRAFT_MODEL
from shared.models.hub import describe as describe_model
from shared.models.store import model_folder
from shared.net import is_loopback
from shared.protocol import AcceptMode, GrammarSpec, SessionConfig

log = logging.getLogger("edge-agent")


@dataclass
class EdgeContext:
    settings: EdgeSettings
    tokenizer: EdgeTokenizer
    draft_lm: DraftLM | None
    vocab_size: int
    stop_token_ids: frozenset[int]
    metrics: EdgeMetrics | None = None
    draft_name: str = ""  # the draft model folder's name, for recorded traces
    mode_memory: ModeMemory = field(default_factory=ModeMemory)  # auto mode, from one generation to the next
    # the cost policy's measured costs and exploration counts, for the process's life: the
    # endpoint's (one --cloud target per process) and the drafter's; serve's per-request copies
    # of the context share it, and each generation's CostK plans over it
    round_costs: RoundCosts = field(default_factory=RoundCosts)
    grammar: Grammar | None = None  # what a generation's output must follow (serve sets it per request)

    def observer(self, inner: Observer | None) -> Observer | None:
        return MeteredObserver(self.metrics, inner) if self.metrics else inner

    def generation_config(self, seed: int) -> GenerationConfig:
        s = self.settings
        grammar = None if self.grammar is None else GrammarSpec(self.grammar.text, tuple(sorted(self.stop_token_ids)))
        session = SessionConfig(s.sampling(), seed, s.resolved_accept_mode(), self.vocab_size, grammar)
        timeouts = TimeoutPolicy(s.verify_timeout_ms / 1000, s.timeout_mode(), s.reconnect_window_s)
        egag = s.resolved_k_policy() == "egag"
        stop_rule = (lambda sig: sig.entropy_bits > s.egag_stop_bits) if egag else None
        switch = SwitchRules() if s.mode == "auto" else None
        return GenerationConfig(
            session,
            s.max_new_tokens,
            self.stop_token_ids,
            timeouts,
            self.gating(),
            stop_rule,
            s.overlap,
            mode_switch=switch,
            mode_memory=self.mode_memory,
            prefill_beside=s.prefills_beside(),
        )

    def gating(self) -> Gating | None:
        s = self.settings
        if not s.gating:
            if s.local_commit:
                raise ConfigError("--local-commit needs --gating")
            return None
        thresholds, counts = GatingThresholds(), dict[int, int]()
        if s.gating_config:
            thresholds, counts = load_gating_config(Path(s.gating_config))
        rules = EscalationRules(counts) if s.rules else None
        return Gating(thresholds, rules, self.token_text, s.local_commit)

    def token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def k_policy(self) -> KPolicy:
        s = self.settings
        policy = s.resolved_k_policy()
        if policy == "la-ratio":
            return LaRatioK(min(max(6, s.k_min), s.k_max), s.k_min, s.k_max, s.la_raise_at, s.la_lower_at, s.la_window)
        if policy == "egag":
            return EgagK(s.k_min, s.k_max, s.egag_ema_beta, stop_bits=s.egag_stop_bits)
        if policy == "cost":
            return CostK(1, s.k_max, s.overlap, self.round_costs)
        return FixedK(s.fixed_k())

    def draft_source(self, seed: int, kv: DraftKV | None = None, prompt_len: int = 0) -> DraftSource:
        """The drafter of --drafter: the model, an n-gram store, or both. kv: a draft cache for
        the model's drafter to begin from (a conversation's last turn); prompt_len: where the
        generation's own tokens begin (its grammar, if any, starts there)."""
        s = self.settings
        if s.drafter == "model" or self.grammar is not None:  # n-grams know no grammar: the model drafts under it
            return self.drafter(seed, kv, prompt_len)
        mode = s.resolved_accept_mode()
        signals = s.gating or s.resolved_k_policy() == "egag"
        ngram = NGramDrafter(
            NGramStore(s.ngram_order, s.ngram_max_contexts),
            s.filler_top_k,
            self.stop_token_ids,
            with_sparse=mode is AcceptMode.SPARSE,
            with_signals=signals,
        )
        if s.drafter == "ngram":
            return ngram
        return HybridDrafter(self.drafter(seed, kv), ngram, s.hybrid_min_order, s.hybrid_min_count)

    def drafter(self, seed: int, kv: DraftKV | None = None, prompt_len: int = 0) -> Drafter:
        if self.draft_lm is None:
            raise ConfigError("this mode needs a draft model")
        s = self.settings
        mode = s.resolved_accept_mode()
        signals = s.gating or s.resolved_k_policy() == "egag"
        config = DrafterConfig(
            s.sampling(),
            mode,
            self.vocab_size,
            s.draft_top_k,
            self.stop_token_ids,
            signals=signals,
            mc_passes=s.mc_passes if s.gating else 0,
            window=s.draft_window,
        )
        grammar = None if self.grammar is None else DraftGrammar(self.grammar.start(self.stop_token_ids), prompt_len)
        return Drafter(self.draft_lm, config, seed + 1, kv, grammar)  # the cloud's generator uses `seed`


def load_draft_lm(settings: EdgeSettings, folder: str) -> DraftLM:
    """The draft model in the runtime --draft-runtime names (auto: llama.cpp when it is
    installed and a GGUF is at hand, else transformers)."""
    gguf = Path(settings.draft_gguf) if settings.draft_gguf else llamacpp.find_gguf(folder, "--draft-gguf")
    runtime = settings.resolved_draft_runtime(gguf is not None)
    threads = settings.draft_threads or settings.threads
    if runtime == "llama.cpp":
        if gguf is None:
            raise ConfigError(f"--draft-runtime llama.cpp: no .gguf in {folder} (name one with --draft-gguf)")
        return LlamaCppDraftLM(gguf, threads, settings.draft_context)
    from edge.drafting.runtime_transformers import TransformersDraftLM  # torch: only on this path

    return TransformersDraftLM.load(
        folder, settings.dtype, settings.device, threads, keep_hidden=settings.gating and settings.mc_passes > 0
    )


def load_edge(settings: EdgeSettings) -> EdgeContext:
    folder = model_folder(settings.draft_model, DRAFT_MODEL)
    tokenizer = EdgeTokenizer(folder)
    needs_model = settings.mode == "edge_only" or (settings.drafts() and settings.drafter != "ngram")
    # An n-gram edge never loads a model: only the tokenizer.
    draft_lm = load_draft_lm(settings, folder) if needs_model else None
    vocab = len(tokenizer) if draft_lm is None else min(len(tokenizer), draft_lm.logits_width)
    planned = PlannedCosts(settings.cost_plan_verify_ms, settings.cost_plan_network_ms, settings.cost_plan_draft_ms)
    return EdgeContext(
        settings,
        tokenizer,
        draft_lm,
        vocab,
        tokenizer.stop_token_ids,
        draft_name=describe_model(folder),
        round_costs=RoundCosts(planned=planned),
    )


@asynccontextmanager
async def cloud_address(settings: EdgeSettings) -> AsyncIterator[str | None]:
    """The verifier to talk to: --cloud, or a cloud-verifier started here on a loopback port."""
    if settings.cloud or settings.mode == "edge_only":
        yield settings.cloud
        return
    flags = ["--dtype", settings.dtype, "--device", settings.device, "--drain-grace-s", "1"]
    if settings.target_model:  # else the verifier's default: the packaged target model
        flags += ["--model", settings.target_model]
    if settings.threads:
        flags += ["--threads", str(settings.threads)]
    async with local_verifier(flags) as address:
        yield address


def verifier_client(settings: EdgeSettings, address: str) -> VerifierClient:
    """A client of the verifier at `address`: TLS and the API key apply to --cloud (a verifier
    started here by cloud_address is plaintext on loopback and asks no key)."""
    retry = CapacityRetry(settings.capacity_retries, settings.capacity_backoff_ms / 1000)
    remote = settings.cloud is not None
    tls = None
    if remote and settings.uses_tls():
        tls = ClientTls.from_files(settings.tls_ca, settings.tls_cert, settings.tls_key, settings.tls_server_name)
    key = settings.api_key.get_secret_value() if settings.api_key and remote else None
    exposed = [a for a in address.split(",") if not is_loopback(a.strip().rsplit(":", 1)[0])]
    if key and tls is None and exposed:
        log.warning("sending the API key to %s without TLS (give --tls-ca)", ",".join(exposed))
    return VerifierClient(
        address,
        settings.call_timeout_ms / 1000,
        capacity_retry=retry,
        tls=tls,
        api_key=key,
        round_streams=settings.round_streams,
    )
