"""The draft model in transformers (PyTorch): any HF causal-LM folder, on the CPU or a GPU.

The heavier runtime: it needs torch and reads the dequantized HF weights, but it is the one
that can compute MC-dropout signals (they read the last hidden state).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from edge.experimental.mc_dropout import mc_dropout_variance
from shared import lm


class TransformersCache:
    def __init__(self, model: PreTrainedModel, seed: int, keep_hidden: bool) -> None:
        self.model = model
        self.kv = lm.new_cache(model)
        self.keep_hidden = keep_hidden
        self.hidden: torch.Tensor | None = None  # [H] last layer, last fed token (MC dropout)
        self.generator = torch.Generator().manual_seed(seed)  # dropout masks, never reseeded

    def __len__(self) -> int:
        return self.kv.get_seq_length()

    def feed(self, token_ids: Sequence[int]) -> np.ndarray:  # [V_model] float32
        logits, self.hidden = lm.forward_with_hidden(self.model, self.kv, token_ids, keep=1, hidden=self.keep_hidden)
        return logits[-1].numpy()

    def crop(self, length: int) -> None:
        lm.crop(self.kv, length)

    def mc_dropout_variance(self, token: int, passes: int, dropout_p: float) -> float:
        if self.hidden is None:
            return 0.0
        return mc_dropout_variance(self.hidden, self.model.get_output_embeddings(), token, passes, dropout_p, self.generator)

    def nbytes(self) -> int:
        return lm.cache_bytes(self.kv)


class TransformersDraftLM:
    runtime = "transformers"

    def __init__(self, model: PreTrainedModel, keep_hidden: bool = False) -> None:
        self.model = model
        self.keep_hidden = keep_hidden  # MC dropout reads the last hidden state
        self.logits_width = lm.logits_width(model)
        self.parameters = sum(p.numel() for p in model.parameters())

    @classmethod
    def load(cls, folder: str | Path, dtype: str, device: str, threads: int, keep_hidden: bool) -> TransformersDraftLM:
        """dtype "auto" and threads 0 choose for the hardware (shared/hardware.py)."""
        lm.configure_cpu(lm.resolve_device(device), threads)
        return cls(lm.load_model(folder, dtype, device), keep_hidden)

    def new_cache(self, seed: int) -> TransformersCache:
        return TransformersCache(self.model, seed, self.keep_hidden)
