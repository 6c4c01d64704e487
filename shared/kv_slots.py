"""Slot KV: every session's keys and values stay in place across rounds, in one pool per layer
allocated once, instead of being concatenated into a packed cache and copied back each pass.

The pool of a layer is one sequence of slots x slot_tokens positions [1, kv_heads, slots *
slot_tokens, head_dim]; a session owns the slot_tokens positions of one slot (llama.cpp
server's unified KV buffer with fixed slots; gpt-fast's static cache, one row per sequence).
A pass packs the new tokens of every session into one row, as forward_packed does, and the
attention layers see the pool window spanning the slots of the pass (a view, no copy); a
mask built from the lengths keeps each query to its own slot's past and its own block. Only
the new tokens' keys and values are written (index_copy_ at their slot positions). Lengths
move only after a pass succeeds: a failed pass leaves every session as it was (what it wrote
lies past the lengths, masked), and crop is a length update, not a copy.

Cost: attention reads the whole window, gaps included (slots of sessions not in the pass,
positions past a session's length), so slots are handed out lowest first to keep it tight.
Full-attention models only, like forward_packed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from shared.errors import CapacityExceeded, InvalidRequest, SessionNotFound


@dataclass(frozen=True)
class SlotLayer:
    keys: torch.Tensor  # [1, kv_heads, length, head_dim]
    values: torch.Tensor


@dataclass(eq=False)
class SlotKV:
    """One session's KV: positions [slot * slot_tokens, + length) of its pool."""

    pool: SlotPool
    slot: int
    length: int = 0  # positions holding the session's KV
    released: bool = False  # back in the pool (its slot may be someone else's now)

    @property
    def base(self) -> int:
        return self.slot * self.pool.slot_tokens

    def get_seq_length(self) -> int:
        return self.length

    @property
    def layers(self) -> list[SlotLayer]:
        """Views of its keys and values per layer, as a DynamicCache's layers (no copy)."""
        held = slice(self.base, self.base + self.length)
        return [SlotLayer(k[:, :, held], v[:, :, held]) for k, v in zip(self.pool.keys, self.pool.values, strict=True)]

    def crop(self, length: int) -> None:
        self.length = min(self.length, max(length, 0))

    def release(self) -> None:
        self.pool.release(self)


@torch.inference_mode()
def _layer_shapes(model: PreTrainedModel) -> list[tuple[int, int, torch.dtype]]:
    """(kv_heads, head_dim, dtype) per layer, measured with one token (as kv_bytes_per_token
    measures, so it holds for any full-attention architecture)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), past_key_values=cache, use_cache=True)
    shapes = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)  # [1, kv_heads, 1, head_dim]
        if not isinstance(keys, torch.Tensor):
            raise TypeError(f"slot KV needs full-attention layers, not {type(layer).__name__}")
        shapes.append((keys.shape[1], keys.shape[3], keys.dtype))
    return shapes


class SlotPool:
    """The slots of one model, allocated at once on the model's device."""

    @torch.inference_mode()  # written only inside inference-mode passes
    def __init__(self, model: PreTrainedModel, slots: int, slot_tokens: int) -> None:
        self.slots, self.slot_tokens = slots, slot_tokens
        size = slots * slot_tokens
        self.keys: list[torch.Tensor] = []  # per layer [1, kv_heads, slots * slot_tokens, head_dim]
        self.values: list[torch.Tensor] = []
        for heads, head_dim, dtype in _layer_shapes(model):
            self.keys.append(torch.zeros(1, heads, size, head_dim, dtype=dtype, device=model.device))
            self.values.append(torch.zeros(1, heads, size, head_dim, dtype=dtype, device=model.device))
        self._free = list(range(slots))  # a heap: the lowest slot first keeps the window tight

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def slot_bytes(self) -> int:
        return self.nbytes // self.slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> SlotKV:
        if not self._free:
            raise CapacityExceeded(f"all {self.slots} KV slots are in use")
        return SlotKV(self, heapq.heappop(self._free))

    def release(self, kv: SlotKV) -> None:
        if not kv.released:
            kv.released = True
            heapq.heappush(self._free, kv.slot)


class _PoolView:
    """past_key_values for one pass: update() writes the pass's new keys and values at their
    slot positions and returns the pool window the pass attends over."""

    def __init__(self, pool: SlotPool, dest: torch.Tensor, window: slice) -> None:
        self.pool, self.dest, self.window = pool, dest, window

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]  # [1, kv_heads, P, head_dim]
        keys.index_copy_(2, self.dest, key_states.to(keys.dtype))  # key_states [1, kv_heads, new, head_dim]
        values.index_copy_(2, self.dest, value_states.to(values.dtype))
        return keys[:, :, self.window], values[:, :, self.window]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come as position_ids, the mask is given: nothing asks for more


def _check(kvs: Sequence[SlotKV], lengths: Sequence[int]) -> None:
    for kv, length in zip(kvs, lengths, strict=True):
        if kv.released:
            raise SessionNotFound("the session's KV slot was released")
        if kv.length + length > kv.pool.slot_tokens:
            raise InvalidRequest(f"{kv.length + length} positions pass the KV slot's {kv.pool.slot_tokens}")


@torch.inference_mode()
def forward_slots(
    model: PreTrainedModel, kvs: Sequence[SlotKV], blocks: Sequence[Sequence[int]], keeps: Sequence[int]
) -> list[torch.Tensor]:
    """forward_packed over slots: per sequence, the last keeps[i] rows of float32 logits (all
    rows when 0), on the CPU; each slot gains its block's KV."""
    lengths = [len(block) for block in blocks]
    _check(kvs, lengths)
    device, dtype, pool = model.device, model.dtype, kvs[0].pool
    lo = min(kv.base for kv in kvs)
    hi = max(kv.base + kv.length + length for kv, length in zip(kvs, lengths, strict=True))
    # Per new token: its position in its sequence, where its KV goes, and the window columns it may see.
    positions = torch.cat([torch.arange(kv.length, kv.length + n) for kv, n in zip(kvs, lengths, strict=True)])
    bases = torch.cat([torch.full((n,), kv.base) for kv, n in zip(kvs, lengths, strict=True)])
    positions, bases = positions.to(device), bases.to(device)  # [total_new]; the mask is built where it is used
    dest = bases + positions
    columns = torch.arange(lo, hi, device=device)  # [window]
    allowed = (columns[None] >= bases[:, None]) & (columns[None] <= dest[:, None])  # [total_new, window]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    rows, start = [], 0
    for n, keep in zip(lengths, keeps, strict=True):
        rows.append(torch.arange(start + n - (keep or n), start + n))
        start += n
    view = _PoolView(pool, dest, slice(lo, hi))
    out = model(
        input_ids=torch.tensor([[t for block in blocks for t in block]], dtype=torch.long, device=device),
        attention_mask=mask[None, None],
        position_ids=positions[None],
        past_key_values=view,
        use_cache=True,
        logits_to_keep=torch.cat(rows).to(device),
    )
    for kv, n in zip(kvs, lengths, strict=True):  # the pass succeeded: only now do the lengths move
        kv.length += n
    return list(out.logits[0].float().cpu().split([len(r) for r in rows]))
