"""cloud-verifier settings: flags, environment variables (SPECDEC_CLOUD_*), defaults."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cloud.sessions import SessionLimits
from cloud.verifier import VerifierLimits


class VerifierSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_CLOUD_")

    model: str | None = Field(
        None, description="target model folder (HF format); default: the packaged Qwen2.5-Coder-1.5B-Instruct")
    dtype: str = Field("bfloat16", description="float32 | bfloat16 | float16 (greedy equality checks need float32)")
    device: str = Field("auto", description="auto | cpu | cuda[:N]")
    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 to serve other machines")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = any free port)")
    threads: int = Field(0, ge=0, description="torch CPU threads (0 = torch's default)")
    max_draft_tokens: int = Field(16, ge=0, description="largest k accepted per round")
    max_context_tokens: int = Field(32768, ge=2, description="prompt + generated tokens per session")
    session_ttl_s: float = Field(600.0, gt=0, description="idle seconds before a session is dropped")
    max_sessions: int = Field(64, ge=1, description="open sessions; the least recently used is evicted past it")
    max_kv_bytes: int = Field(4 << 30, ge=1, description="KV-cache bytes across sessions; LRU eviction past it")

    def limits(self) -> VerifierLimits:
        sessions = SessionLimits(self.session_ttl_s, self.max_sessions, self.max_kv_bytes)
        return VerifierLimits(max_draft_tokens=self.max_draft_tokens,
                              max_context_tokens=self.max_context_tokens, sessions=sessions)
