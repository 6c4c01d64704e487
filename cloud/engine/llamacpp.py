"""The llama.cpp engine: the target's GGUF in one llama.cpp context whose sequences are the sessions, one
`llama_decode` a batched pass (docs/architecture.md, "Engines and session steps")."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cloud.engine import EngineName, KVPlan, KVRequest, SessionKV
from cloud.engine.forward_steps import ForwardEngine
from shared import llamacpp
from shared.errors import CapacityExceeded, ConfigError, VerifierFault

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ


@dataclass
class LlamaCppKV:
    """One session's share of the context: its sequence id and how many positions it holds."""

    seq_id: int
    length: int = 0
    released: bool = False

    def get_seq_length(self) -> int:
        return self.length


class LlamaCppEngine(ForwardEngine):
    """A GGUF target; its context (one sequence per session) is made by plan_kv for the
    verifier's limits."""

    name: EngineName = "llama.cpp"

    def __init__(self, gguf: str | Path, *, threads: int = 0, batch_tokens: int = 2048) -> None:
        self.api = llama = llamacpp.api("--engine llama.cpp")
        self.path = Path(gguf)
        self.model = llamacpp.load_model(llama, gguf)
        llamacpp.free_with(self, llama, self.model)
        self.logits_width = llamacpp.logits_width(llama, self.model)
        self.kv_bytes_per_token = llamacpp.kv_bytes_per_token(llama, self.model)
        self.parameters = int(self.api.llama_model_n_params(self.model))
        self.threads, self.batch_tokens = threads, batch_tokens
        self.ctx: Any = None
        self.free_ids: list[int] = []

    def plan_kv(self, request: KVRequest) -> KVPlan:
        """One context for every session: `max_sessions` sequences over one unified pool of KV
        cells, as many as --max-kv-bytes holds (at most every session at its context limit)."""
        if request.layout != "packed":
            raise ConfigError("--engine llama.cpp keeps its own KV: --kv-layout slots is for the transformers engine")
        sessions = request.max_sessions
        if not 1 <= sessions <= MAX_SEQUENCES:
            raise ConfigError(f"--engine llama.cpp serves 1 to {MAX_SEQUENCES} sessions (--max-sessions), not {sessions}")
        cells = min(request.max_kv_bytes // self.kv_bytes_per_token, sessions * request.max_context_tokens)
        if cells < request.max_context_tokens:
            raise ConfigError(f"--max-kv-bytes {request.max_kv_bytes} holds {cells} tokens of KV, under one context")
        self.ctx = self._context(cells, sessions)
        self.memory = self.api.llama_get_memory(self.ctx)
        self.batch = self.api.llama_batch_init(self.batch_tokens, 0, 1)
        weakref.finalize(self, _free_context, self.api, self.ctx, self.batch)
        self.free_ids = list(range(sessions - 1, -1, -1))  # pop() hands out 0 first
        return KVPlan(request.max_context_tokens, cells * self.kv_bytes_per_token)

    def _context(self, n_ctx: int, sequences: int) -> Any:
        llama = self.api
        params = llama.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = self.batch_tokens
        params.n_ubatch = min(self.batch_tokens, 512)
        params.n_seq_max = sequences
        params.kv_unified = True  # one pool of cells for every sequence, as the KV cap counts it
        params.no_perf = True
        if self.threads:
            params.n_threads = params.n_threads_batch = self.threads
        ctx = llama.llama_init_from_model(self.model, params)
        if not ctx:
            raise ConfigError(f"llama.cpp could not create a context of {n_ctx} tokens for {sequences} sessions")
        return ctx

    def describe(self) -> dict[str, str]:
        return {"engine": self.name, "dtype": "gguf", "device": "cpu", "gguf": self.path.name}

    # ---- a session's KV -----------------------------------------------------------------

    def new_kv(self, scope: str = "") -> LlamaCppKV:
        if not self.free_ids:
            raise CapacityExceeded("every llama.cpp sequence is in use (raise --max-sessions)")
        return LlamaCppKV(self.free_ids.pop())

    def free(self, kv: SessionKV) -> None:
        kv = _own(kv)
        if not kv.released:
            self.api.llama_memory_seq_rm(self.memory, kv.seq_id, 0, -1)
            kv.released = True
            self.free_ids.append(kv.seq_id)

    def freed(self, kv: SessionKV) -> bool:
        return _own(kv).released

    def crop(self, kv: SessionKV, length: int) -> None:
        kv = _own(kv)
        if length < kv.length:
            self.api.llama_memory_seq_rm(self.memory, kv.seq_id, length, -1)
            kv.length = length

    # ---- one batched pass -----------------------------------------------------------------

    def forward(self, kvs: Sequence[SessionKV], blocks: Sequence[Sequence[int]], keeps: Sequence[int]) -> list[torch.Tensor]:
        """Feed each block after its KV in one pass; per block, the last keeps[i] rows of
        float32 logits [keep, V] (all rows when 0). On failure every KV is as it was."""
        caches = [_own(kv) for kv in kvs]
        entries = _entries(caches, blocks, keeps)
        rows: list[list[np.ndarray]] = [[] for _ in caches]
        try:
            for first in range(0, len(entries), self.batch_tokens):
                chunk = entries[first : first + self.batch_tokens]
                self._decode(chunk)
                for index, entry in enumerate(chunk):
                    if entry.logits:
                        rows[entry.step].append(self._row(index))
        except BaseException:
            for kv in caches:
                self.api.llama_memory_seq_rm(self.memory, kv.seq_id, kv.length, -1)
            raise
        for kv, block in zip(caches, blocks, strict=True):
            kv.length += len(block)
        return [torch.from_numpy(np.stack(r)) if r else torch.empty(0, self.logits_width) for r in rows]

    def _decode(self, entries: list[_Entry]) -> None:
        """One llama_decode over the entries (at most the context's batch)."""
        batch = self.batch
        batch.n_tokens = len(entries)
        for index, entry in enumerate(entries):
            batch.token[index] = entry.token
            batch.pos[index] = entry.pos
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = entry.seq_id
            batch.logits[index] = entry.logits
        code = self.api.llama_decode(self.ctx, batch)
        if code == 1:
            raise CapacityExceeded("the llama.cpp KV cache has no room for this pass")
        if code != 0:
            raise VerifierFault(f"llama.cpp could not evaluate the pass (llama_decode returned {code})")

    def _row(self, index: int) -> np.ndarray:
        row = self.api.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(row, shape=(self.logits_width,)).copy()


@dataclass(frozen=True)
class _Entry:
    """One token of a pass: whose step, on which sequence, at which position, logits or not."""

    step: int
    seq_id: int
    token: int
    pos: int
    logits: bool


def _entries(caches: Sequence[LlamaCppKV], blocks: Sequence[Sequence[int]], keeps: Sequence[int]) -> list[_Entry]:
    return [
        _Entry(step, kv.seq_id, token, kv.length + i, i >= len(block) - (keep or len(block)))  # logits at the kept rows
        for step, (kv, block, keep) in enumerate(zip(caches, blocks, keeps, strict=True))
        for i, token in enumerate(block)
    ]


def _own(kv: SessionKV) -> LlamaCppKV:
    if not isinstance(kv, LlamaCppKV):
        raise TypeError(f"the llama.cpp engine holds no {type(kv).__name__}")
    return kv


def target_gguf(path: str | Path) -> Path:
    """The GGUF to serve: the path itself when it is a file, else the folder's one .gguf."""
    gguf = llamacpp.find_gguf(path, "--model")
    if gguf is None:
        raise ConfigError(f"--engine llama.cpp: {Path(path).expanduser()} holds no .gguf; give --model the GGUF file")
    return gguf


def _free_context(llama: Any, ctx: Any, batch: Any) -> None:
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)
