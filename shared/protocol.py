"""Plain Python forms of the wire messages. shared/wire.py converts them to and
from protobuf; everything else in the project uses only these."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling import SamplingParams
from shared.speculative import AcceptMode


@dataclass(frozen=True)
class SessionConfig:
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    accept_mode: AcceptMode = AcceptMode.GREEDY  # GREEDY whenever temperature is 0
    vocab_size: int = 0  # 0 = the model's own logits width


@dataclass(frozen=True)
class OpenSessionRequest:
    prompt_tokens: list[int]
    config: SessionConfig


@dataclass(frozen=True)
class OpenSessionResult:
    session_id: str
    position: int
    max_draft_tokens: int
    vocab_size: int
    prefill_ms: float
    model_id: str


@dataclass(frozen=True)
class SparseDistribution:
    token_ids: list[int]
    probs: list[float]


@dataclass(frozen=True)
class VerifyRequest:
    session_id: str
    base_position: int
    draft_tokens: list[int]
    draft_probs: list[float] = field(default_factory=list)  # empty = q of 1 (point drafts)
    committed_tokens: list[int] = field(default_factory=list)  # catch-up, accepted unverified
    hard_mask: list[bool] = field(default_factory=list)  # empty = no token marked
    sparse_draft: list[SparseDistribution] = field(default_factory=list)
    want_top_k: int = 0
    request_id: str = ""


@dataclass(frozen=True)
class RoundMetrics:
    alpha_mean: float = 0.0
    la_over_k: float = 0.0
    verify_ms: float = 0.0
    queue_ms: float = 0.0
    forward_ms: float = 0.0
    hard_tokens: int = 0


@dataclass(frozen=True)
class TopK:
    token_ids: list[int]
    probs: list[float]


@dataclass(frozen=True)
class VerifyResult:
    accepted_len: int
    next_token: int
    bonus: bool
    new_base_position: int
    metrics: RoundMetrics = RoundMetrics()
    target_top_k: list[TopK] = field(default_factory=list)


@dataclass(frozen=True)
class CloseSessionResult:
    position: int
    rounds: int


@dataclass(frozen=True)
class GenerateRequest:
    prompt_tokens: list[int]
    config: SessionConfig
    max_new_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class GenerateChunk:
    tokens: list[int]
    forward_ms: float
    finished: bool
