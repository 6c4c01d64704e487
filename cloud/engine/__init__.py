"""The verifier's model behind one interface (Engine): a batch of session steps in, per step its outcome; the
engine also owns each session's KV. The engines, and why one Protocol: docs/architecture.md, "Engines and session steps"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from cloud.rejection_sampler import RoundOutcome, RoundRule
from shared.protocol import SessionConfig, SparseDistribution

EngineName = Literal["transformers", "llama.cpp", "vllm"]


class SessionKV(Protocol):
    """One session's KV as an engine holds it: its length is the position of the next token."""

    def get_seq_length(self) -> int: ...


@dataclass(frozen=True)
class KVRequest:
    """The KV the verifier's limits ask for."""

    layout: Literal["packed", "slots"]  # packed: each session its own, grown as it goes; slots: a pool allocated at start
    max_sessions: int
    max_kv_bytes: int
    max_context_tokens: int
    slot_tokens: int  # slots: positions per session


@dataclass(frozen=True)
class KVPlan:
    """The KV an engine holds for those limits: the context and byte caps admission enforces."""

    max_context_tokens: int
    max_kv_bytes: int
    session_bytes: int = 0  # > 0: each session holds this many bytes whatever its length (a slot)


@dataclass(frozen=True)
class SessionStep:
    """One session's share of a batch: `fed` taken as given after its KV, then `drafts` verified and its next
    token drawn by `rule` (None: it reads nothing); every field: docs/architecture.md, "Engines and session steps"."""

    kv: SessionKV
    fed: list[int]
    drafts: list[int] = field(default_factory=list)
    rule: RoundRule | None = None
    known: int = 0
    ahead: int = 1
    stops: frozenset[int] = frozenset()
    top_k: int = 0
    chunk: int = 0

    @property
    def grows_by(self) -> int:
        """Positions the step computes before its drafts (fed but for the known tokens)."""
        return len(self.fed) - self.known


@dataclass(frozen=True)
class StepOutcome:
    """What a step that reads yields: its accepted drafts and next token (`round`; an engine
    that reports no p/q gives each draft's acceptance as the 1 or 0 it was) and the top-k rows
    it asked for."""

    round: RoundOutcome
    top_k: list[SparseDistribution] = field(default_factory=list)


@dataclass(frozen=True)
class PromptChunk:
    """What a step yields whose new tokens the engine computed only in part (a chunk of a long prompt): its KV
    holds the first `computed` of them, it reads nothing, and the caller feeds the rest in a later step."""

    computed: int


class TokenSink(Protocol):
    """Where a followed session's tokens go as the engine makes them, from the engine's own
    thread (cloud/token_feed.py)."""

    def put(self, tokens: list[int], step_ms: float) -> None: ...

    def fail(self, error: Exception) -> None: ...


class Engine(Protocol):
    """The target model as the verifier drives it."""

    name: EngineName
    logits_width: int  # rows of the output layer (may exceed the tokenizer's vocabulary)
    kv_bytes_per_token: int
    parameters: int  # the model's parameter count, as a client's size check reads it
    # What the engine does itself, else the verifier does: docs/architecture.md, "Engines and session steps"
    caches_prefixes: bool
    decodes_ahead: bool
    applies_grammars: bool

    def plan_kv(self, request: KVRequest) -> KVPlan:
        """Hold the KV for these limits (a pool, when the layout has one); called once, first."""

    def new_kv(self, scope: str = "") -> SessionKV:
        """A new session's empty KV. `scope`: the sessions whose cached prefixes it may share in
        an engine that caches prefixes itself (one reuse scope's, cloud/prefix_cache.py); ""
        shares with none."""

    def cached_tokens(self, kv: SessionKV) -> int:
        """Of the prompt kv's session was opened with, the tokens the engine served from its own
        prefix cache rather than computing them, by the engine's own account (0 for an engine
        without one); read once the prompt is computed."""

    def free(self, kv: SessionKV) -> None: ...

    def freed(self, kv: SessionKV) -> bool:
        """Whether kv was freed (its session left while a step for it waited)."""

    def crop(self, kv: SessionKV, length: int) -> None:
        """Keep the first `length` positions (no-op when already shorter)."""

    def check_session(self, config: SessionConfig, vocab: int) -> None:
        """Raise SessionRefused (shared/errors.py) for a session the engine cannot verify exactly
        (an accept mode it has no exact rule for, settings or a vocabulary it cannot sample
        with), naming the engine and what it refused; before anything is held for it."""

    def start_session(self, kv: SessionKV, config: SessionConfig, vocab: int) -> None:
        """kv is a session's, sampled and accepted as `config` says within `vocab` ids (before
        its first step)."""

    def run_steps(self, steps: Sequence[SessionStep]) -> list[StepOutcome | PromptChunk | None | Exception]:
        """Every step at once: per step its outcome (None: it reads nothing), a PromptChunk, or what failed it
        alone; what each KV then holds: docs/architecture.md, "Engines and session steps"."""

    def follow(self, kv: SessionKV, position: int, sink: TokenSink) -> bool:
        """Hand every token kv's session decodes on its own from `position` on (those it holds
        already, then each step's) to `sink`, until its stream ends; False when it is not
        decoding on its own (its steps go on one at a time)."""

    def unfollow(self, kv: SessionKV) -> None:
        """No more of kv's tokens go to the sink it followed with, and kv's session stops
        decoding on its own. What it decoded past the stream's tokens stays for its next steps."""

    def extend(self, kv: SessionKV, tokens: list[int]) -> None:
        """kv's session took `tokens` its request decoded on its own (a followed stream's):
        kv counts them, as a step that fed them would have left it."""

    def own_steps(self) -> tuple[int, float]:
        """The steps the engine ran in its own loop so far and the seconds they took (0 for an
        engine whose every pass is a batch's)."""

    def describe(self) -> dict[str, str]:
        """What /healthz reports of it: the engine, its dtype and device."""

    def failure(self) -> str | None:
        """Why the engine can run no more steps (its own processes died), or None."""

    def close(self) -> None:
        """Release what outlives the process's memory (vLLM's processes); after the last step."""
