"""Slot KV (`--kv-layout slots`): every session's keys and values stay in place across rounds, in one pool per layer
allocated once, instead of being concatenated into a packed cache and copied back each pass. Full-attention models
only; the pool, and the two shapes of a pass: docs/architecture.md, "Slot KV"."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from shared.errors import CapacityExceeded, InvalidRequest, SessionNotFound


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

    def crop(self, length: int) -> None:
        self.length = min(self.length, max(length, 0))


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
    slot positions and returns what the pass attends over (`window`, a view of the pool)."""

    def __init__(
        self,
        pool: SlotPool,
        dest: torch.Tensor,
        window: Callable[[torch.Tensor], torch.Tensor],
        new_tokens: torch.Tensor | None = None,  # batch shape: which of the padded tokens are real
    ) -> None:
        self.pool, self.dest, self.window, self.new_tokens = pool, dest, window, new_tokens

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]  # [1, kv_heads, P, head_dim]
        keys.index_copy_(2, self.dest, self._real(key_states).to(keys.dtype))
        values.index_copy_(2, self.dest, self._real(value_states).to(values.dtype))
        return self.window(keys), self.window(values)

    def _real(self, states: torch.Tensor) -> torch.Tensor:
        """[rows, kv_heads, new, head_dim] -> [1, kv_heads, real new tokens, head_dim]."""
        if self.new_tokens is None:
            return states  # packed: one row of real tokens
        heads, dim = states.shape[1], states.shape[3]
        return states.transpose(0, 1).reshape(heads, -1, dim)[:, self.new_tokens][None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come as position_ids, the mask is given: nothing asks for more


def _check(kvs: Sequence[SlotKV], lengths: Sequence[int]) -> None:
    for kv, length in zip(kvs, lengths, strict=True):
        if kv.released:
            raise SessionNotFound("the session's KV slot was released")
        if kv.length + length > kv.pool.slot_tokens:
            raise InvalidRequest(f"{kv.length + length} positions pass the KV slot's {kv.pool.slot_tokens}")


def _slot_rows(layer: torch.Tensor, first_slot: int, rows: int, width: int, slot_tokens: int) -> torch.Tensor:
    """[1, kv_heads, slots * slot_tokens, head_dim] -> [rows, kv_heads, width, head_dim]: the
    first `width` positions of slots first_slot.. as batch rows (a strided view, no copy)."""
    _, heads, _, dim = layer.shape
    return layer.as_strided(
        (rows, heads, width, dim),
        (slot_tokens * dim, layer.stride(1), dim, 1),
        layer.storage_offset() + first_slot * slot_tokens * dim,
    )


def choose_shape(kvs: Sequence[SlotKV], lengths: Sequence[int]) -> str:
    """batch when padding every slot row of the range to the longest block at most doubles
    the tokens fed (rounds, decode steps); packed otherwise (a long prefill chunk in the pass)."""
    rows = max(kv.slot for kv in kvs) - min(kv.slot for kv in kvs) + 1
    return "batch" if rows * max(lengths) <= 2 * sum(lengths) else "packed"


@torch.inference_mode()
def forward_slots(
    model: PreTrainedModel, kvs: Sequence[SlotKV], blocks: Sequence[Sequence[int]], keeps: Sequence[int], shape: str = "auto"
) -> list[torch.Tensor]:
    """forward_packed over slots: per sequence, the last keeps[i] rows of float32 logits
    (all rows when 0), on the CPU; each slot gains its block's KV. `shape`: auto, batch or
    packed (docs/architecture.md, "Slot KV"; the results are the same)."""
    lengths = [len(block) for block in blocks]
    _check(kvs, lengths)
    if shape == "auto":
        shape = choose_shape(kvs, lengths)
    logits = (_forward_batch if shape == "batch" else _forward_packed)(model, kvs, blocks, keeps)
    for kv, n in zip(kvs, lengths, strict=True):  # the pass succeeded: only now do the lengths move
        kv.length += n
    return logits


def kept_rows(lengths: Sequence[int], keeps: Sequence[int]) -> list[torch.Tensor]:
    """Per sequence, the indices of its kept rows among the pass's packed new tokens."""
    rows, start = [], 0
    for n, keep in zip(lengths, keeps, strict=True):
        rows.append(torch.arange(start + n - (keep or n), start + n))
        start += n
    return rows


def _forward_packed(
    model: PreTrainedModel, kvs: Sequence[SlotKV], blocks: Sequence[Sequence[int]], keeps: Sequence[int]
) -> list[torch.Tensor]:
    lengths = [len(block) for block in blocks]
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
    rows = kept_rows(lengths, keeps)
    out = model(
        input_ids=torch.tensor([[t for block in blocks for t in block]], dtype=torch.long, device=device),
        attention_mask=mask[None, None],
        position_ids=positions[None],
        past_key_values=_PoolView(pool, dest, lambda layer: layer[:, :, lo:hi]),
        use_cache=True,
        logits_to_keep=torch.cat(rows).to(device),
    )
    return list(out.logits[0].float().cpu().split([len(r) for r in rows]))


def _forward_batch(
    model: PreTrainedModel, kvs: Sequence[SlotKV], blocks: Sequence[Sequence[int]], keeps: Sequence[int]
) -> list[torch.Tensor]:
    device, dtype, pool = model.device, model.dtype, kvs[0].pool
    first = min(kv.slot for kv in kvs)
    rows = max(kv.slot for kv in kvs) - first + 1  # slots of the range not in the pass run padding
    block = max(len(b) for b in blocks)
    width = max(kv.length + len(b) for kv, b in zip(kvs, blocks, strict=True))
    past = torch.zeros(rows, dtype=torch.long)  # per row: the positions its slot holds
    fed = torch.zeros(rows, dtype=torch.long)  # per row: the real tokens of its block
    input_ids = torch.zeros(rows, block, dtype=torch.long)
    for kv, b in zip(kvs, blocks, strict=True):
        row = kv.slot - first
        past[row], fed[row] = kv.length, len(b)
        input_ids[row, : len(b)] = torch.tensor(b, dtype=torch.long)
    offsets = torch.arange(block)
    positions = past[:, None] + offsets[None]  # [rows, block]
    real = offsets[None] < fed[:, None]  # [rows, block]
    # A real token sees its slot up to itself; a padding token sees position 0 only (no empty row).
    allowed = torch.arange(width)[None, None] <= torch.where(real, positions, 0)[:, :, None]  # [rows, block, width]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    slot_of_row = first + torch.arange(rows)
    dest = (slot_of_row[:, None] * pool.slot_tokens + positions)[real]  # [total_new], row-major like _real
    view = _PoolView(
        pool, dest.to(device), lambda layer: _slot_rows(layer, first, rows, width, pool.slot_tokens), real.reshape(-1).to(device)
    )
    out = model(
        input_ids=input_ids.to(device),
        attention_mask=mask[:, None].to(device),
        position_ids=positions.to(device),
        past_key_values=view,
        use_cache=True,
    )
    # Only the kept rows leave the device (not the padding's nor the idle slots'): [kept, V] each.
    kept = [
        out.logits[kv.slot - first, len(b) - (keep or len(b)) : len(b)] for kv, b, keep in zip(kvs, blocks, keeps, strict=True)
    ]
    return list(torch.cat(kept).float().cpu().split([len(rows_kept) for rows_kept in kept]))
