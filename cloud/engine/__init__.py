"""The verifier's model behind one interface, at two levels.

- Engine: a forward pass over several sessions' new tokens, each after its own KV, and that
  KV's life (new, crop, free). cloud/batch_step.py runs the accept rule on its rows
  (cloud/rejection_sampler.py). transformers.py runs a transformers model (`--engine
  transformers`, the default: the reference); llamacpp.py runs the target's GGUF in
  llama.cpp (`--engine llama.cpp`).
- LiveSessions: an engine that also runs a session's steps itself (prefill, decode n
  tokens, verify these drafts) and returns tokens: vllm.py (`--engine vllm`), where each
  session is one live vLLM request that vLLM decodes and verifies in its own loop.

Sessions, admission, the batcher and the wire see only these Protocols. Another engine is
one more module that implements Engine, and one more entry in ENGINES."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from shared.protocol import SessionConfig, SparseDistribution

EngineName = Literal["transformers", "llama.cpp", "vllm"]
ENGINES: tuple[EngineName, ...] = ("transformers", "llama.cpp", "vllm")


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


class Engine(Protocol):
    """The target model as the verifier drives it. Logits come back as float32 on the CPU."""

    name: EngineName
    logits_width: int  # rows of the output layer (may exceed the tokenizer's vocabulary)
    kv_bytes_per_token: int
    parameters: int  # the model's parameter count, as a client's size check reads it
    # True: the engine keeps the KV of past sessions' prefixes itself and serves new sessions
    # from it within their scope (vLLM's prefix cache); False: the verifier keeps closed
    # sessions' KV for reuse (cloud/prefix_cache.py)
    caches_prefixes: bool

    def plan_kv(self, request: KVRequest) -> KVPlan:
        """Hold the KV for these limits (a pool, when the layout has one); called once, first."""
        ...

    def new_kv(self, scope: str = "") -> SessionKV:
        """A new session's empty KV. `scope`: the sessions whose cached prefixes it may share in
        an engine that caches prefixes itself (one API key's); "" shares with none."""
        ...

    def free(self, kv: SessionKV) -> None: ...

    def freed(self, kv: SessionKV) -> bool:
        """Whether kv was freed (its session left while a step for it waited)."""
        ...

    def crop(self, kv: SessionKV, length: int) -> None:
        """Keep the first `length` positions (no-op when already shorter)."""
        ...

    def forward(
        self,
        kvs: Sequence[SessionKV],
        blocks: Sequence[Sequence[int]],
        keeps: Sequence[int],
        argmax_vocab: Sequence[int] = (),
    ) -> list[torch.Tensor]:
        """ONE pass: each block after its KV (which gains the block's KV); per block its last
        keeps[i] rows of logits [keep, logits_width] (all rows when 0). A pass that raises leaves
        every KV as it was. A long prompt comes in several calls (chunked prefill), each block
        after the KV the previous calls left. argmax_vocab[i] > 0: the caller reads only each
        row's argmax among the first argmax_vocab[i] ids, so the engine may return rows that
        hold just enough of the largest logits for that (the rest -inf); 0: full rows."""
        ...

    def describe(self) -> dict[str, str]:
        """What /healthz reports of it: the engine, its dtype and device."""
        ...

    def failure(self) -> str | None:
        """Why the engine can run no more passes (its own processes died), or None."""
        ...

    def close(self) -> None:
        """Release what outlives the process's memory (vLLM's processes); after the last pass."""
        ...


@dataclass(frozen=True)
class LiveStep:
    """One session's step as an engine with live sessions takes it: the session takes `fed` as
    given after its KV (its last token, tokens it caught up on, or a prompt), then `drafts` are
    verified. A step that `reads` yields tokens: the accepted drafts and one more (the
    correction, or the bonus when all pass); a prefill reads nothing. `ahead` is how many
    tokens the session reads from this step on without drafts (a Generate stream, a Decode
    stretch): the engine may decode them on its own in one go, stopping at a token of `stops`,
    for the session's next steps to read. The last `known` tokens of `fed` are tokens the
    session holds but its KV does not count yet (a prefill's last prompt token, which the first
    round feeds): the engine may compute them now, and the session's length grows by the rest.
    `draft_q` is the edge's distribution over each draft (a sparse round); none: each draft is
    a point, q = 1."""

    kv: SessionKV
    fed: list[int]
    drafts: list[int]
    reads: bool = True
    ahead: int = 1
    stops: frozenset[int] = frozenset()
    known: int = 0
    draft_q: Sequence[SparseDistribution] = ()


class TokenSink(Protocol):
    """Where a followed live session's tokens go as the engine makes them, from the engine's
    own thread (cloud/token_feed.py)."""

    def put(self, tokens: list[int], step_ms: float) -> None: ...

    def fail(self, error: Exception) -> None: ...


@runtime_checkable
class LiveSessions(Protocol):
    """An engine that runs each session as one live request of its own (vLLM): it verifies a
    round's drafts with its own rejection sampler and decodes in its own loop, so a step
    returns tokens instead of rows of logits. Only sessions whose accept mode and sampling it
    verifies exactly are opened (check_session refuses the others), and each goes live."""

    def check_session(self, config: SessionConfig, vocab: int) -> None:
        """Raise SessionRefused (shared/errors.py) for a session the engine cannot verify exactly
        (an accept mode it has no exact rule for, settings or a vocabulary it cannot sample
        with), naming the engine and what it refused; before anything is held for it."""
        ...

    def make_live(self, kv: SessionKV, config: SessionConfig, vocab: int) -> bool:
        """Whether kv's steps run live (before its first step): `config` says how its tokens
        are sampled and accepted, `vocab` the ids they may take."""
        ...

    def is_live(self, kv: SessionKV) -> bool: ...

    def run_live(self, steps: Sequence[LiveStep]) -> list[list[int] | Exception]:
        """Every step at once (the engine batches them in its own steps): per step the tokens
        it yields, or what failed it alone. A failure of the engine itself raises."""
        ...

    def follow(self, kv: SessionKV, position: int, sink: TokenSink) -> bool:
        """Hand every token kv's session decodes on its own from `position` on (those it holds
        already, then each step's) to `sink`, until its stream ends; False when it is not
        decoding on its own (its steps go on one at a time)."""
        ...

    def unfollow(self, kv: SessionKV) -> None:
        """No more of kv's tokens go to the sink it followed with, and kv's session stops
        decoding on its own: its stream ended, or stopped reading. What it decoded past the
        stream's tokens stays for the session's next steps."""
        ...

    def extend(self, kv: SessionKV, tokens: list[int]) -> None:
        """kv's session took `tokens` its request decoded on its own (a followed stream's):
        kv counts them, as a step that fed them would have left it."""
        ...

    def own_steps(self) -> tuple[int, float]:
        """The steps the engine ran so far (for passes and for followed streams alike) and the
        seconds they took."""
        ...

    def rows(self, kv: SessionKV, length: int, block: list[int], keep: int) -> torch.Tensor:
        """The target's last `keep` rows of logits [keep, logits_width] for `block` after the
        first `length` tokens of kv's session, leaving kv as it is (a round that asks for the
        target's distributions, which a live step does not return)."""
        ...
