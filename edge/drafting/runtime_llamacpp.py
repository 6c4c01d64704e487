"""The draft model in llama.cpp, through llama-cpp-python's C API, on a GGUF file as is.

This is how laptops run small models: quantized weights, no torch, a few hundred MB of
memory. Only llama.cpp's model evaluation is used. Token ids come from the edge's HF
tokenizer (the verifier's), sampling is shared/sampling/edge_numpy.py, and a session's KV cache is
one llama.cpp context whose sequence 0 is cropped with `llama_memory_seq_rm`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shared import llamacpp
from shared.errors import ConfigError, DraftFailed
from shared.hardware import usable_cores


def available() -> bool:
    """True when llama-cpp-python imports (it is an optional part of the edge install)."""
    return llamacpp.available()


class LlamaCppCache:
    """One session: a llama.cpp context whose sequence 0 holds the fed tokens' KV."""

    def __init__(self, lm: LlamaCppDraftLM) -> None:
        api = lm.api
        self.lm = lm  # the context uses the model's weights: the model must outlive it
        self.api, self.width, self.batch_size = api, lm.logits_width, lm.batch_size
        params = api.llama_context_default_params()
        params.n_ctx = lm.context_size
        params.n_batch = params.n_ubatch = lm.batch_size
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = lm.threads
        params.no_perf = True
        self.ctx = api.llama_init_from_model(lm.model, params)
        if not self.ctx:
            raise ConfigError(f"llama.cpp could not create a context of {lm.context_size} tokens")
        self.batch = api.llama_batch_init(lm.batch_size, 0, 1)
        self.memory = api.llama_get_memory(self.ctx)
        self.length = 0  # tokens whose KV the context holds
        self.context_size = lm.context_size
        weakref.finalize(self, _free_context, api, self.ctx, self.batch)

    def __len__(self) -> int:
        return self.length

    def feed(self, token_ids: Sequence[int]) -> np.ndarray:  # [V_model] float32 after the last token
        tokens = list(token_ids)
        if not tokens:
            raise DraftFailed("nothing to feed the draft model")
        if self.length + len(tokens) > self.context_size:
            raise DraftFailed(f"the draft context is full ({self.context_size} tokens; raise --draft-context)")
        for start in range(0, len(tokens), self.batch_size):
            chunk = tokens[start : start + self.batch_size]
            self._decode(chunk, wants_logits=start + len(chunk) == len(tokens))
        row = self.api.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self.width,)).copy()

    def _decode(self, chunk: list[int], wants_logits: bool) -> None:
        batch = self.batch
        batch.n_tokens = len(chunk)
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = self.length + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = wants_logits and i == len(chunk) - 1
        code = self.api.llama_decode(self.ctx, batch)
        if code != 0:
            raise DraftFailed(f"llama.cpp could not evaluate the draft (llama_decode returned {code})")
        self.length += len(chunk)

    def crop(self, length: int) -> None:
        if length < self.length:
            self.api.llama_memory_seq_rm(self.memory, 0, length, -1)
            self.length = length

    def mc_dropout_variance(self, token: int, passes: int, dropout_p: float) -> float:
        raise ConfigError("MC-dropout signals need --draft-runtime transformers")

    def nbytes(self) -> int:
        return self.context_size * self.lm.kv_bytes_per_token  # the whole context is allocated up front


def _free_context(api: Any, ctx: Any, batch: Any) -> None:
    api.llama_batch_free(batch)
    api.llama_free(ctx)


# Prompt tokens per llama_decode. The 0.5B draft on 2 threads of an avx512_bf16 EPYC prefilled
# 1,024 tokens at 211 tok/s in batches of 64, 226 at 128, 244 at 256 and 246 at 512, for a peak
# RSS of 645, 650, 659 and 679 MiB (docs/results.md): 256 is the fast one that costs little memory.
PREFILL_BATCH = 256


class LlamaCppDraftLM:
    runtime = "llama.cpp"

    def __init__(self, gguf: str | Path, threads: int = 0, context_size: int = 4096, batch_size: int = PREFILL_BATCH) -> None:
        self.api = llamacpp.api("--draft-runtime llama.cpp")
        self.path = Path(gguf).expanduser()
        self.model = llamacpp.load_model(self.api, self.path)
        llamacpp.free_with(self, self.api, self.model)
        self.logits_width = llamacpp.logits_width(self.api, self.model)
        self.parameters = int(self.api.llama_model_n_params(self.model))
        self.threads = threads or usable_cores()  # affinity, capped by a container's CPU quota
        self.context_size, self.batch_size = context_size, batch_size
        self.kv_bytes_per_token = llamacpp.kv_bytes_per_token(self.api, self.model)

    def new_cache(self, seed: int) -> LlamaCppCache:
        return LlamaCppCache(self)
