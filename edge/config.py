"""edge-agent settings: flags, environment variables (SPECDEC_EDGE_*), defaults."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from edge.drafting.runtime_llamacpp import available as llama_cpp_available
from shared.hardware import runs_on_every_core
from shared.net import is_loopback
from shared.protocol import AcceptMode, SamplingParams

FIXED_K = 4  # the fixed policy's k when --k is not given


class EdgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_EDGE_")
    # How --help groups the flags (shared/cli.py); a field in no group is listed under "options".
    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "what to generate": ("prompt", "prompts", "output", "mode", "max_new_tokens", "chat"),
        "the verifier": (
            "cloud",
            "api_key",
            "tls_ca",
            "tls",
            "tls_cert",
            "tls_key",
            "tls_server_name",
            "target_model",
            "verify_timeout_ms",
            "call_timeout_ms",
            "round_streams",
            "reconnect_window_s",
            "capacity_retries",
            "capacity_backoff_ms",
        ),
        "the draft model": (
            "draft_model",
            "draft_runtime",
            "draft_gguf",
            "draft_threads",
            "draft_context",
            "draft_window",
            "draft_prefill",
            "conversation_cache_mb",
            "dtype",
            "device",
            "threads",
        ),
        "sampling": ("temperature", "top_k", "top_p", "repetition_penalty", "seed", "accept_mode"),
        "drafting and k": (
            "drafter",
            "ngram_order",
            "ngram_max_contexts",
            "filler_top_k",
            "hybrid_min_order",
            "hybrid_min_count",
            "draft_top_k",
            "k",
            "k_policy",
            "k_min",
            "k_max",
            "cost_plan_verify_ms",
            "cost_plan_network_ms",
            "cost_plan_draft_ms",
            "la_raise_at",
            "la_lower_at",
            "la_window",
            "egag_ema_beta",
            "egag_stop_bits",
            "overlap",
        ),
        "gating and a slow cloud": (
            "gating",
            "gating_config",
            "rules",
            "mc_passes",
            "local_commit",
            "strict",
            "accept_unverified",
        ),
        "records and telemetry": ("record", "log_rounds", "metrics_port", "show_steps"),
    }

    prompt: str | None = Field(None, description="one prompt to answer (plain text; the chat template is applied)")
    prompts: str | None = Field(None, description="JSONL of prompts ({id, prompt} or Spec-Bench question.jsonl)")
    output: str | None = Field(None, description="JSONL results of --prompts, one line per prompt")
    cloud: str | None = Field(
        None,
        description="verifier HOST:PORT (a proxy's), or several comma-separated: each "
        "session goes to one by rendezvous hashing, the next one if it dies; without it a "
        "verifier starts in-process on loopback",
    )
    api_key: SecretStr | None = Field(None, description="API key sent to the verifier with every call")
    tls_ca: str | None = Field(None, description="PEM CA bundle to trust: TLS to the verifier")
    tls: bool = Field(False, description="TLS to the verifier, trusting the system's CAs (implied by --tls-ca)")
    tls_cert: str | None = Field(None, description="PEM client certificate, for a verifier that requires one (mTLS)")
    tls_key: str | None = Field(None, description="PEM private key of --tls-cert")
    tls_server_name: str | None = Field(
        None, description="name the verifier's certificate must carry, when it is not --cloud's host"
    )
    mode: Literal["auto", "speculative", "cloud_only", "edge_only"] = Field(
        "auto",
        description="what generates the text: auto starts each generation on the target (the first token as fast as "
        "cloud_only) while the drafter prefills, then speculates whenever that measures faster than the target "
        "alone | speculative (always) | cloud_only (the target alone) | edge_only (the draft model alone)",
    )
    draft_model: str | None = Field(
        None,
        description="draft model: a folder, a packaged model name or a Hugging Face Hub id (org/name[@revision], "
        "from the Hub cache; HF_HUB_OFFLINE=1 for the cache alone); default: the packaged Qwen2.5-Coder-0.5B-Instruct",
    )
    target_model: str | None = Field(
        None,
        description="target model of the local verifier (no --cloud), named as --draft-model; "
        "default: the packaged Qwen2.5-Coder-1.5B-Instruct",
    )
    draft_runtime: Literal["auto", "llama.cpp", "transformers"] = Field(
        "auto",
        description="what runs the draft model: llama.cpp on the folder's GGUF, or transformers on its HF "
        "weights (auto: llama.cpp when llama-cpp-python is installed and a GGUF is there)",
    )
    draft_gguf: str | None = Field(None, description="llama.cpp: the GGUF file (default: the draft folder's .gguf)")
    # 512 drafted more tokens/s than the whole prompt in auto mode over Spec-Bench (docs/results.md):
    # a RAG prompt's drafter prefill shrinks to a quarter and the drafts hardly change.
    draft_window: int = Field(
        512,
        ge=0,
        description="the draft model reads only the last N prompt tokens (0 = the whole prompt): a long prompt's "
        "drafter prefill costs N tokens; the verifier still sees everything (the n-gram drafter always does)",
    )
    draft_prefill: Literal["auto", "beside", "between"] = Field(
        "auto",
        description="auto mode: the drafter prefills the prompt beside the target's first tokens, or between "
        "them (the stream pauses); auto: between where the verifier runs on this machine's cores (a loopback "
        "--cloud, or none, and an edge free to run on every core), else beside",
    )
    draft_threads: int = Field(0, ge=0, description="draft model CPU threads (0 = --threads, else every usable core)")
    draft_context: int = Field(
        4096,
        ge=16,
        description="llama.cpp: tokens the draft's KV cache holds per session "
        "(prompt + generated; 4096 keeps the 0.5B edge under 700 MiB)",
    )
    # About 20 conversations of the packaged 0.5B draft in llama.cpp (a 4,096-token context
    # holds 48 MiB of KV).
    conversation_cache_mb: int = Field(
        1024,
        ge=0,
        description="edge-agent serve: MiB of draft KV kept from ended generations, so that a conversation's next "
        "turn drafts on from its last turn's instead of prefilling the history again (its draft window stretching "
        "up to --draft-context tokens); least recently used evicted first (0 = off)",
    )
    dtype: str = Field(
        "auto",
        description="auto | float32 | bfloat16 | float16 for models run by transformers "
        "(auto: bf16 on CUDA and on CPUs with avx512_bf16/amx_bf16, else fp32)",
    )
    device: str = Field("auto", description="auto | cpu | cuda[:N] for models run by transformers")
    threads: int = Field(0, ge=0, description="CPU threads of local models (0 = the runtime's default)")
    max_new_tokens: int = Field(128, ge=1, description="tokens to generate per prompt")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="1 = off")
    repetition_penalty: float = Field(1.0, gt=0, description="1 = off")
    seed: int = Field(0, ge=0, description="seeds the cloud's and the drafter's generators")
    accept_mode: Literal["sparse", "point", "scalar", "shortcut", "top1"] = Field(
        "sparse",
        description="sampling only: sparse/point are exact; scalar/shortcut/top1 are APPROXIMATE "
        "(--drafter ngram uses point unless top1 is asked for)",
    )
    drafter: Literal["model", "ngram", "hybrid"] = Field(
        "model",
        description="model (draft LM) | ngram (no model: n-gram store, NASD: N-gram Assisted Speculative Decoding) "
        "| hybrid (n-gram where confident)",
    )
    ngram_order: int = Field(4, ge=1, le=16, description="longest n-gram context")
    ngram_max_contexts: int = Field(200_000, ge=1, description="n-gram store cap; least recently updated evicted")
    filler_top_k: int = Field(
        1,
        ge=1,
        le=16,
        description="learn the target's top-K per verified position (1 = NAPD: the n-gram drafting of Ou et al., "
        "Adaptive N-gram Parallel Decoding, arXiv:2404.08698)",
    )
    # A 3-token match of the prompt is already a copy: order >= 3 seen once drafted 2.6x more
    # n-gram tokens than order >= 2 seen twice on Spec-Bench at the same tau (README Results).
    hybrid_min_order: int = Field(3, ge=1, description="hybrid: n-gram used when its context has this many tokens")
    hybrid_min_count: float = Field(1.0, ge=0, description="hybrid: ... and its continuation this much weight")
    draft_top_k: int = Field(16, ge=1, description="sparse mode: draft support size sent per token")
    k: int | None = Field(
        None, ge=0, description=f"draft tokens per round: a fixed k (default: the cost policy's k; fixed alone: {FIXED_K})"
    )
    # The cost policy drafted more tokens/s than a fixed k = 4 in auto mode on the Qwen pair
    # (docs/results.md): it weighs the measured drafting time, the verifier's cost per row and
    # the round trip, so it follows the machine and the link where a fixed k was chosen on one.
    k_policy: Literal["fixed", "la-ratio", "egag", "cost"] | None = Field(
        None,
        description="cost (max expected tokens/s from measured costs; the default, or fixed when --k is given) "
        "| fixed | la-ratio (accepted-length ratio: k follows accepted/k; seed: 6 in [3, 12]) "
        "| egag (EGAG, entropy-adaptive gamma: k follows the draft's entropy)",
    )
    k_min: int = Field(3, ge=1, description="la-ratio: smallest k (egag: gamma_min)")
    k_max: int = Field(12, ge=1, description="la-ratio, egag, cost: largest k")
    cost_plan_verify_ms: float | None = Field(
        None,
        gt=0,
        description="cost: plan k as if the verifier's pass took this many ms whatever its size (a GPU verifier's "
        "pass is about flat in k) instead of the verify time measured; with --cost-plan-network-ms, to record "
        "sessions that draft as a laptop drafts for a GPU verifier while a CPU verifier checks them",
    )
    cost_plan_network_ms: float | None = Field(
        None, ge=0, description="cost: plan k as if each round also spent this many ms on the network, instead of the measured"
    )
    cost_plan_draft_ms: float | None = Field(
        None,
        gt=0,
        description="cost: plan k as if drafting a token took this many ms (a laptop's drafter) instead of the measured; "
        "for recording sessions on a machine that drafts slower than the laptop they stand for",
    )
    la_raise_at: float = Field(0.8, description="la-ratio: +1 when accepted/k over the window >= this")
    la_lower_at: float = Field(0.4, description="la-ratio: -1 when accepted/k over the window <= this")
    la_window: int = Field(1, ge=1, description="la-ratio: rounds averaged")
    egag_ema_beta: float = Field(0.7, ge=0, lt=1, description="egag: EMA weight of the past entropy")
    egag_stop_bits: float = Field(3.5, gt=0, description="egag: end a block after a token above this entropy")
    gating: bool = Field(False, description="hard-token gating: a hard token ends the block (lossless); mask sent")
    gating_config: str | None = Field(None, description="thresholds + token counts from edge-calibrate (JSON)")
    rules: bool = Field(True, description="with --gating: numbers, dates, amounts, entities, rare words escalate")
    mc_passes: int = Field(0, ge=0, description="with --gating: MC-dropout passes per drafted token (0 = off)")
    local_commit: bool = Field(False, description="LOSSY: commit easy blocks without the cloud (counted, reported)")
    verify_timeout_ms: float = Field(400.0, gt=0, description="soft deadline of a Verify: then a token goes provisional")
    call_timeout_ms: float = Field(30000.0, gt=0, description="hard deadline of a Verify call: then reconnect")
    round_streams: bool = Field(
        True,
        description="a session's Verify rounds on one gRPC call (VerifyRounds; less per round than a call each); "
        "--no-round-streams: a unary Verify call each round, for a proxy that ends long calls",
    )
    # Long enough for a verifier to restart and load its model; past it a --prompts run records
    # the prompt as failed and goes on with the next one.
    reconnect_window_s: float = Field(
        300.0,
        ge=0,
        description="seconds to keep reconnecting to a lost or still-loading verifier (waits of 0.1 s "
        "doubling to 2 s, jittered); then the prompt fails (0 = at the first failure)",
    )
    capacity_retries: int = Field(
        6, ge=0, description="RESOURCE_EXHAUSTED: resends after the server's retry hint (jitter), within the call's deadline"
    )
    capacity_backoff_ms: float = Field(
        50.0, gt=0, description="RESOURCE_EXHAUSTED without a hint: first wait before a resend, doubled each time (max 2 s)"
    )
    record: str | None = Field(None, description="write each session as a JSONL trace (token ids only) into this folder")
    strict: bool = Field(False, description="never show unverified text: wait and retry")
    accept_unverified: bool = Field(False, description="LOSSY: on timeout a draft token is final, counted UNVERIFIED")
    overlap: bool = Field(False, description="draft the next block while Verify is in flight (kept if all pass)")
    log_rounds: str | None = Field(None, description="write one JSON line per round to this file")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus metrics of this edge on 127.0.0.1:PORT (0 = any)"
    )
    chat: bool = Field(True, description="apply the tokenizer's chat template")
    show_steps: bool = Field(False, description="print every round in colour: accepted, rejected, correction")

    @model_validator(mode="after")
    def _one_timeout_mode(self) -> EdgeSettings:
        if self.strict and self.accept_unverified:
            raise ValueError("--strict and --accept-unverified exclude each other")
        return self

    @model_validator(mode="after")
    def _tls_files_together(self) -> EdgeSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        return self

    def resolved_k_policy(self) -> Literal["fixed", "la-ratio", "egag", "cost"]:
        """--k-policy, else fixed when --k is given, else cost."""
        return self.k_policy or ("fixed" if self.k is not None else "cost")

    def fixed_k(self) -> int:
        return self.k if self.k is not None else FIXED_K

    def prefills_beside(self) -> bool:
        """Whether the drafter prefills beside the target's tokens (see --draft-prefill)."""
        if self.draft_prefill != "auto":
            return self.draft_prefill == "beside"
        hosts = [address.rpartition(":")[0] for address in self.cloud.split(",")] if self.cloud else ["localhost"]
        return not (all(is_loopback(host) for host in hosts) and runs_on_every_core())

    def drafts(self) -> bool:
        """Whether the run drafts (auto or speculative)."""
        return self.mode in ("auto", "speculative")

    def uses_tls(self) -> bool:
        return self.tls or self.tls_ca is not None or self.tls_cert is not None

    def timeout_mode(self) -> Literal["provisional", "strict", "accept-unverified"]:
        return "strict" if self.strict else "accept-unverified" if self.accept_unverified else "provisional"

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.repetition_penalty)

    def resolved_draft_runtime(self, have_gguf: bool) -> Literal["llama.cpp", "transformers"]:
        if self.draft_runtime != "auto":
            return self.draft_runtime
        return "llama.cpp" if have_gguf and llama_cpp_available() else "transformers"

    def resolved_accept_mode(self) -> AcceptMode:
        if self.temperature == 0:
            return AcceptMode.GREEDY
        if self.drafter == "ngram" and self.accept_mode != "top1":
            return AcceptMode.POINT  # n-gram drafts are point masses: point mode is their exact rule
        return AcceptMode(self.accept_mode)
