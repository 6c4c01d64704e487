"""The verifier's model step behind one interface: a forward pass over several sessions' new
tokens, each after its own KV, and that KV's life (new, crop, free). Sessions, admission, the
batcher, the wire and the accept rule see only this Protocol. transformers.py runs a
transformers model (`--engine transformers`, the default: the reference); llamacpp.py runs the
target's GGUF in llama.cpp (`--engine llama.cpp`); vllm.py runs it in vLLM (`--engine vllm`,
from its own venv: tools/vllm_env.sh). Another engine is one more module that
implements Engine, and one more entry in ENGINES."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from shared.protocol import GenerateRequest

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

    def plan_kv(self, request: KVRequest) -> KVPlan:
        """Hold the KV for these limits (a pool, when the layout has one); called once, first."""
        ...

    def new_kv(self) -> SessionKV: ...

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


@runtime_checkable
class OwnDecoding(Protocol):
    """An engine that decodes a Generate stream with its own loop (vLLM's continuous batching)
    instead of one pass per token: once a stream's KV is handed over, each pass over that KV
    returns a row whose only finite entry is the next token the engine decoded."""

    def decode_on_its_own(self, kv: SessionKV, req: GenerateRequest, vocab: int) -> None:
        """Before its first pass: kv's passes follow req (sampling, seed, stops, length). On a
        session's KV (a Decode stretch), req's prompt is every token of the session so far."""
        ...

    def decoding_on_its_own(self, kv: SessionKV) -> bool:
        """Whether kv's passes read the engine's own decoding."""
        ...

    def stop_own_decoding(self, kv: SessionKV) -> None:
        """kv's passes are requests of their own again (a round with drafts after a stretch)."""
        ...
