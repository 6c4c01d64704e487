"""Causal-LM plumbing used by both sides: loading, one forward over a KV cache, cropping.

Positions are implicit: the cache length is the position of the first new token, so a
cache that holds exactly the committed prefix keeps both sides aligned.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from shared.errors import ConfigError
from shared.hardware import choose_dtype, usable_cores

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ConfigError(f"--device {name}: expected auto, cpu or cuda[:N]")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name}: expected one of {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


# oneDNN's primitive cache and ideep's computation cache (torch's CPU matmuls) keep one entry per
# matrix shape, up to 1,024 each by default. A model sees a new shape for every distinct number of
# rows it is fed (prefill lengths, catch-up blocks), so a long-running process grows by hundreds of
# MB before those caches are full: +564 MiB for the 1.5B bf16 target over a 30-minute soak, and on
# the 0.5B +631 MB for 240 prefill lengths against +32 MB with 64 entries each, the decode step's
# time unchanged (95 against 97 ms). Set before the first matmul; the environment can override.
SHAPE_CACHE_ENTRIES = "64"


def configure_cpu(device: torch.device, threads: int) -> int:
    """Torch's CPU threads: `threads`, or with 0 the cores this process may use (affinity and
    a container's CPU quota; torch's own default counts every core of the machine); and bounded
    per-shape matmul caches (SHAPE_CACHE_ENTRIES)."""
    if device.type != "cpu":
        return 0
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", SHAPE_CACHE_ENTRIES)
    os.environ.setdefault("LRU_CACHE_CAPACITY", SHAPE_CACHE_ENTRIES)
    chosen = threads or usable_cores()
    torch.set_num_threads(chosen)
    return chosen


def load_model(path: str | Path, dtype: str = "bfloat16", device: str = "auto") -> PreTrainedModel:
    """Load a local HF model folder for inference (`dtype` "auto": see shared/hardware.py)."""
    if dtype == "auto":
        dtype = choose_dtype(dtype, resolve_device(device).type).name
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model folder {folder} has no config.json")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype))
    return model.to(resolve_device(device)).eval()  # type: ignore[arg-type]  # transformers stub types .to oddly


def safetensors_parameters(folder: Path) -> int:
    """A model folder's parameter count, read from its safetensors headers (no weights loaded)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def new_cache(model: PreTrainedModel) -> DynamicCache:
    return DynamicCache(config=model.config)


@torch.inference_mode()
def forward(model: PreTrainedModel, cache: DynamicCache, token_ids: Sequence[int], keep: int = 0) -> torch.Tensor:
    """Feed token_ids after the cached prefix; returns float32 logits [n, V] on the CPU, or
    only the last `keep` rows when keep > 0 (the LM head over a long prompt is wasted work)."""
    return forward_with_hidden(model, cache, token_ids, keep, hidden=False)[0]


@torch.inference_mode()
def forward_with_hidden(
    model: PreTrainedModel, cache: DynamicCache, token_ids: Sequence[int], keep: int = 0, hidden: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like forward, plus the last layer's hidden state of the last token [H] when asked."""
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)  # [1, n]
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, output_hidden_states=hidden, logits_to_keep=keep)
    last_hidden = out.hidden_states[-1][0, -1] if hidden else None
    return out.logits[0].float().cpu(), last_hidden


def keys_values(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, kv_heads, positions, head_dim] of one attention layer of a cache."""
    return layer.keys, layer.values


def crop(cache: DynamicCache, length: int) -> None:
    """Shrink the cache to its first `length` positions (no-op when already shorter)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # transformers 5: a negative count of tokens to remove


def cache_bytes(cache: DynamicCache) -> int:
    """The memory a cache's keys and values hold: their storage, which a crop leaves in place
    until the next feed."""
    tensors = [tensor for layer in cache.layers for tensor in keys_values(layer) if tensor is not None]
    return sum(tensor.untyped_storage().nbytes() for tensor in tensors)


def logits_width(model: PreTrainedModel) -> int:
    """Rows of the output embedding; may exceed the tokenizer (padded vocabularies)."""
    return int(model.get_output_embeddings().weight.shape[0])


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Measured, not derived from config fields, so it holds for any architecture."""
    cache = new_cache(model)
    forward(model, cache, [0, 0])
    total = 0
    for layer in cache.layers:
        for tensor in keys_values(layer):
            total += tensor.numel() * tensor.element_size()
    return total // 2
