"""Causal-LM plumbing used by both sides: loading, one forward over a KV cache, cropping.

Positions are implicit: the cache length is the position of the first new token, so a
cache that holds exactly the committed prefix keeps both sides aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from shared.errors import ConfigError
from shared.hardware import choose_dtype, usable_cores
from shared.kv_slots import SlotKV, forward_slots

KVCache = DynamicCache | SlotKV  # a session's own cache, or its slot of a pool (shared/kv_slots.py)
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


def configure_cpu(device: torch.device, threads: int) -> int:
    """Torch's CPU threads: `threads`, or with 0 the cores this process may use (affinity and
    a container's CPU quota; torch's own default counts every core of the machine)."""
    if device.type != "cpu":
        return 0
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


@torch.inference_mode()
def forward_packed(
    model: PreTrainedModel, caches: Sequence[KVCache], blocks: Sequence[Sequence[int]], keeps: Sequence[int]
) -> list[torch.Tensor]:
    """One forward pass over several sequences, each fed after its own cache: like `forward`
    per sequence, but the weights are read once for all of them.

    The new tokens of every sequence are packed into one row (as vLLM flattens a batch, so
    no padding rows run through the MLPs) after the concatenation of all caches; a
    block-diagonal causal mask keeps each sequence to its own past and its own block, and
    per-token position ids restart at each cache's length. Each cache then gains its
    sequence's new KV. Full-attention models only (every layer keeps all positions).
    Returns, per sequence, the last keeps[i] rows of float32 logits (all rows when 0).
    Slots (shared/kv_slots.py) take the same pass without the copies.
    """
    slots = [c for c in caches if isinstance(c, SlotKV)]
    dynamic = [c for c in caches if isinstance(c, DynamicCache)]
    if slots and dynamic:
        raise TypeError("one pass takes slots or dynamic caches, not both")
    if slots:
        return forward_slots(model, slots, blocks, keeps)
    if len(dynamic) == 1:
        return [forward(model, dynamic[0], blocks[0], keeps[0])]
    caches = dynamic
    pasts = [cache.get_seq_length() for cache in caches]
    lengths = [len(block) for block in blocks]
    total_past = sum(pasts)
    mask, positions, rows = _packed_mask(pasts, lengths, keeps, model.dtype)
    device = model.device
    packed = _packed_past(model, caches, pasts)
    out = model(
        input_ids=torch.tensor([[t for block in blocks for t in block]], dtype=torch.long, device=device),
        attention_mask=mask[None, None].to(device),
        position_ids=positions[None].to(device),
        past_key_values=packed,
        use_cache=True,
        logits_to_keep=torch.cat(rows).to(device),
    )
    new_start = 0
    for cache, length in zip(caches, lengths, strict=True):
        block = slice(total_past + new_start, total_past + new_start + length)
        for index, layer in enumerate(packed.layers):
            keys, values = _keys_values(layer)
            cache.update(keys[..., block, :].clone(), values[..., block, :].clone(), index)
        new_start += length
    logits = out.logits[0].float().cpu()
    return list(logits.split([len(r) for r in rows]))


def _packed_past(model: PreTrainedModel, caches: Sequence[DynamicCache], pasts: Sequence[int]) -> DynamicCache:
    """One cache holding every sequence's past, concatenated in order."""
    packed = new_cache(model)
    if sum(pasts):
        for index in range(len(caches[0].layers)):
            filled = [_keys_values(cache.layers[index]) for cache, past in zip(caches, pasts, strict=True) if past]
            packed.update(
                torch.cat([keys for keys, _ in filled], dim=-2), torch.cat([values for _, values in filled], dim=-2), index
            )
    return packed


def _packed_mask(
    pasts: Sequence[int], lengths: Sequence[int], keeps: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The packed pass's mask [total_new, total_past + total_new] (0 where a query may look,
    the dtype's min elsewhere), its position ids [total_new], and each sequence's kept rows."""
    total_past, total_new = sum(pasts), sum(lengths)
    allowed = torch.zeros(total_new, total_past + total_new, dtype=torch.bool)
    positions, rows = [], []
    past_start = new_start = 0
    for past, length, keep in zip(pasts, lengths, keeps, strict=True):
        block = slice(new_start, new_start + length)
        allowed[block, past_start : past_start + past] = True
        allowed[block, total_past + new_start : total_past + new_start + length] = torch.ones(
            length, length, dtype=torch.bool
        ).tril()
        positions.append(torch.arange(past, past + length))
        first_kept = new_start + length - (keep or length)
        rows.append(torch.arange(first_kept, new_start + length))
        past_start += past
        new_start += length
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask, torch.cat(positions), rows


def _keys_values(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, kv_heads, positions, head_dim] of one attention layer of a cache."""
    return layer.keys, layer.values


def crop(cache: KVCache, length: int) -> None:
    """Shrink the cache to its first `length` positions (no-op when already shorter)."""
    if isinstance(cache, SlotKV):
        cache.crop(length)  # a length update: the positions past it are masked, then overwritten
        return
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # transformers 5: a negative count of tokens to remove


def logits_width(model: PreTrainedModel) -> int:
    """Rows of the output embedding; may exceed the tokenizer (padded vocabularies)."""
    return int(model.get_output_embeddings().weight.shape[0])


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Measured, not derived from config fields, so it holds for any architecture."""
    cache = new_cache(model)
    forward(model, cache, [0, 0])
    total = 0
    for layer in cache.layers:
        for tensor in _keys_values(layer):
            total += tensor.numel() * tensor.element_size()
    return total // 2
