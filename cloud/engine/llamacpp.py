"""The llama.cpp engine: the target's GGUF in one llama.cpp context whose sequences are the
sessions (a unified KV cache), as llama-server serves parallel slots.

One batched pass is one `llama_decode` over every step's new tokens (split into several when
they exceed the context's batch), each token on its session's sequence at its own position,
with logits kept at the verified positions only. Crop is `llama_memory_seq_rm` from a
position on; a session's sequence id goes back to the pool when it is released. Full logits
rows come back, so every accept mode reads the same distributions as on the transformers
engine. A pass that fails leaves every sequence as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared import llamacpp
from shared.errors import CapacityExceeded, ConfigError, VerifierFault

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
_F16_BYTES = 2  # the KV cache's type (llama.cpp's default)


@dataclass
class LlamaCppKV:
    """One session's share of the context: its sequence id and how many positions it holds."""

    seq_id: int
    length: int = 0
    released: bool = False

    def get_seq_length(self) -> int:
        return self.length


class LlamaCppEngine:
    """A GGUF target served to `max_sessions` sequences of at most `context_tokens` each."""

    name = "llama.cpp"

    def __init__(
        self, gguf: str | Path, *, max_sessions: int, context_tokens: int, batch_tokens: int = 2048, threads: int = 0
    ) -> None:
        if not 1 <= max_sessions <= MAX_SEQUENCES:
            raise ConfigError(f"--engine llama.cpp serves 1 to {MAX_SEQUENCES} sessions, not {max_sessions}")
        self.api = llama = llamacpp.api("--engine llama.cpp")
        self.path = Path(gguf)
        self.model = llamacpp.load_model(llama, gguf)
        llamacpp.free_with(self, llama, self.model)
        self.logits_width = llamacpp.logits_width(llama, self.model)
        self.kv_bytes_per_token = self._kv_bytes_per_token()
        self.batch_tokens = batch_tokens
        self.ctx = self._context(max_sessions * context_tokens, max_sessions, batch_tokens, threads)
        self.memory = llama.llama_get_memory(self.ctx)
        self.batch = llama.llama_batch_init(batch_tokens, 0, 1)
        self.free_ids = list(range(max_sessions - 1, -1, -1))  # pop() hands out 0 first

    def _context(self, n_ctx: int, sequences: int, batch_tokens: int, threads: int) -> Any:
        llama = self.api
        params = llama.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = batch_tokens
        params.n_ubatch = min(batch_tokens, 512)
        params.n_seq_max = sequences
        params.kv_unified = True  # one pool of cells for every sequence, as the session caps assume
        params.no_perf = True
        if threads:
            params.n_threads = params.n_threads_batch = threads
        ctx = llama.llama_init_from_model(self.model, params)
        if not ctx:
            raise ConfigError(f"llama.cpp could not create a context of {n_ctx} tokens for {sequences} sessions")
        return ctx

    def _kv_bytes_per_token(self) -> int:
        llama, model = self.api, self.model
        layers, embd = llama.llama_model_n_layer(model), llama.llama_model_n_embd(model)
        heads, kv_heads = llama.llama_model_n_head(model), llama.llama_model_n_head_kv(model)
        return int(layers * 2 * (embd // heads) * kv_heads * _F16_BYTES)

    def close(self) -> None:
        if self.ctx:
            self.api.llama_batch_free(self.batch)
            self.api.llama_free(self.ctx)
            self.ctx = None

    # ---- a session's KV -----------------------------------------------------------------

    def new_cache(self) -> LlamaCppKV:
        if not self.free_ids:
            raise CapacityExceeded("every llama.cpp sequence is in use (raise --max-sessions)")
        return LlamaCppKV(self.free_ids.pop())

    def release(self, kv: LlamaCppKV) -> None:
        if not kv.released:
            self.api.llama_memory_seq_rm(self.memory, kv.seq_id, 0, -1)
            kv.released = True
            self.free_ids.append(kv.seq_id)

    def crop(self, kv: LlamaCppKV, length: int) -> None:
        if length < kv.length:
            self.api.llama_memory_seq_rm(self.memory, kv.seq_id, length, -1)
            kv.length = length

    # ---- one batched pass -----------------------------------------------------------------

    def forward(self, caches: Sequence[LlamaCppKV], blocks: Sequence[Sequence[int]], keeps: Sequence[int]) -> list[torch.Tensor]:
        """Feed each block after its cache in one pass; per block, the last keeps[i] rows of
        float32 logits [keep, V] (all rows when 0). On failure every cache is as it was."""
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
    entries = []
    for step, (kv, block, keep) in enumerate(zip(caches, blocks, keeps, strict=True)):
        first_kept = len(block) - (keep or len(block))
        for i, token in enumerate(block):
            entries.append(_Entry(step, kv.seq_id, token, kv.length + i, i >= first_kept))
    return entries
