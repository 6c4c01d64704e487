"""Plain Python forms of the wire messages. shared/wire.py converts them to and
from protobuf; everything else in the project uses only these."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class AcceptMode(enum.Enum):
    """How the verifier accepts drafts; cloud/rejection_sampler.py says what each mode does."""

    GREEDY = "greedy"
    POINT = "point"
    SPARSE = "sparse"
    SCALAR = "scalar"
    SHORTCUT = "shortcut"
    TOP1 = "top1"

    @property
    def exact(self) -> bool:
        return self not in (AcceptMode.SCALAR, AcceptMode.SHORTCUT, AcceptMode.TOP1)

    @property
    def reads_draft_probs(self) -> bool:
        """Whether the verifier reads q(y) of each drafted token (the scalar modes): only then
        does the edge send it. Greedy and point drafts are points; sparse drafts carry their
        whole support."""
        return self in (AcceptMode.SCALAR, AcceptMode.SHORTCUT)


@dataclass(frozen=True)
class SamplingParams:
    """Logits processors of a session; shared/sampling/verifier_torch.py applies them (in transformers' order)."""

    temperature: float = 0.0  # 0 = greedy: argmax of the penalised logits
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off (HF semantics: divide positive, multiply negative)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def argmax_only(self) -> bool:
        """Greedy without a penalty: a token is each row's argmax of the raw logits."""
        return self.greedy and self.repetition_penalty == 1.0


REOPEN_SEED_STRIDE = 1_000_003  # a session reopened n times is seeded seed + n * this


@dataclass(frozen=True)
class SessionConfig:
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    accept_mode: AcceptMode = AcceptMode.GREEDY  # GREEDY whenever temperature is 0
    vocab_size: int = 0  # 0 = the model's own logits width
    grammar: GrammarSpec | None = None  # what every generated token must follow (None: free text)


@dataclass(frozen=True)
class GrammarSpec:
    """A session's grammar (shared/grammar.py): llguidance's text, and the ids that end the
    generation where the grammar is complete."""

    text: str
    stop_ids: tuple[int, ...]
    generated: int = 0  # the prompt's last tokens the generation made (a session reopened midway): already under the grammar


@dataclass(frozen=True)
class WireBytes:
    """The bytes one call put on the wire each way (serialized message sizes), as the edge's
    client counts them; it sets them on each reply it returns (zero on the verifier's side)."""

    up: int = 0
    down: int = 0

    def __add__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.up + other.up, self.down + other.down)


@dataclass(frozen=True)
class OpenSessionRequest:
    prompt_tokens: list[int]
    config: SessionConfig
    reuse_token: str = ""  # the token the verifier gave this client: its kept prefixes' scope


@dataclass(frozen=True)
class OpenSessionResult:
    session_id: str
    position: int
    max_draft_tokens: int
    vocab_size: int
    prefill_ms: float
    model_id: str
    wire: WireBytes = WireBytes()  # set by the edge's client
    reuse_token: str = ""  # the client's token for its next sessions
    reused_tokens: int = 0  # prompt tokens served from the scope's kept KV, not computed


@dataclass(frozen=True)
class SparseDistribution:
    """A distribution over a few token ids (the rest have probability 0): a sparse draft's
    support, or the target's top-k at a verified position."""

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
    alpha_prefix: float | None = None  # over the drafts verified on an accepted prefix; None: no drafts


@dataclass(frozen=True)
class VerifyResult:
    accepted_len: int
    next_token: int
    bonus: bool
    new_base_position: int
    metrics: RoundMetrics = RoundMetrics()
    target_top_k: list[SparseDistribution] = field(default_factory=list)
    prefer_speculation: bool = False  # the verifier is loaded: an edge in auto mode speculates
    wire: WireBytes = WireBytes()  # set by the edge's client


@dataclass(frozen=True)
class CloseSessionResult:
    position: int
    rounds: int
    wire: WireBytes = WireBytes()  # set by the edge's client


@dataclass(frozen=True)
class GenerateRequest:
    prompt_tokens: list[int]
    config: SessionConfig
    max_new_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)
    reuse_token: str = ""  # as in OpenSessionRequest


@dataclass(frozen=True)
class GenerateChunk:
    tokens: list[int]
    forward_ms: float
    finished: bool
    wire: WireBytes = WireBytes()  # set by the edge's client
    reuse_token: str = ""  # the first chunk: as in OpenSessionResult
    reused_tokens: int = 0  # the first chunk: as in OpenSessionResult


@dataclass(frozen=True)
class DecodeRequest:
    """A stretch of the target's own decoding on a session: `max_tokens` tokens, each one
    advancing the session as a Verify with no drafts would. With `open`, the call opens its
    session first (then session_id and base_position are ignored)."""

    session_id: str
    base_position: int
    max_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)
    committed_tokens: list[int] = field(default_factory=list)  # catch-up, as in Verify
    open: OpenSessionRequest | None = None


@dataclass(frozen=True)
class DecodeChunk:
    tokens: list[int]
    position: int  # the session's committed length after these tokens
    forward_ms: float
    step_ms: float  # server time for these tokens, queue included
    finished: bool
    opened: OpenSessionResult | None = None  # the first chunk of a call that opened its session
    prefer_speculation: bool = False  # the verifier is loaded: an edge in auto mode speculates
    wire: WireBytes = WireBytes()  # set by the edge's client


@dataclass(frozen=True)
class SpecialToken:
    id: int
    content: str


@dataclass(frozen=True)
class ModelDescription:
    """Describe's answer: the served model, its tokenizer as block digests (shared/tokenizer_card.py)
    and, when asked, one run of its tokens; the measured cost of one decode step."""

    model_id: str
    parameters: int  # 0 = unknown
    logits_width: int
    has_tokenizer: bool
    tokenizer_size: int = 0
    block_size: int = 0
    block_digests: tuple[bytes, ...] = ()
    special_tokens: tuple[SpecialToken, ...] = ()
    chat_template_sha256: bytes = b""
    decode_step_ms: float = 0.0  # 0 = not measured
    tokens: tuple[str, ...] = ()
    chat_template: str = ""  # when asked for
