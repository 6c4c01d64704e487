"""The transformers engine: the target as a transformers model; one forward over several
sessions' new tokens, each after its own KV (a DynamicCache per session, packed for the pass,
or its slot of a pool allocated at start: cloud/engine/kv_slots.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from cloud.engine import EngineName, KVPlan, KVRequest, SessionKV
from cloud.engine.forward_steps import ForwardEngine
from cloud.engine.kv_slots import SlotKV, SlotPool, forward_slots, kept_rows
from shared import lm
from shared.errors import ConfigError

KVCache = DynamicCache | SlotKV  # a session's own cache, or its slot of a pool (cloud/engine/kv_slots.py)


class TransformersEngine(ForwardEngine):
    """A transformers causal LM (full attention) and its sessions' KV, packed or in slots."""

    name: EngineName = "transformers"

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.logits_width = lm.logits_width(model)
        self.kv_bytes_per_token = lm.kv_bytes_per_token(model)
        self.parameters = sum(p.numel() for p in model.parameters())
        self.pool: SlotPool | None = None  # slots: allocated by plan_kv

    def plan_kv(self, request: KVRequest) -> KVPlan:
        """packed: the limits as asked. slots: the pool, and limits that match it: a session's
        context fits its slot, and the KV cap is the pool's size, so a free slot exists whenever
        the store admits a session."""
        if request.layout == "packed":
            return KVPlan(request.max_context_tokens, request.max_kv_bytes)
        slot_tokens = min(request.slot_tokens, request.max_context_tokens)
        slots = min(request.max_sessions, request.max_kv_bytes // (slot_tokens * self.kv_bytes_per_token))
        if slots < 1:
            raise ConfigError(
                f"a KV slot of {slot_tokens} tokens needs {slot_tokens * self.kv_bytes_per_token} bytes, "
                f"over --max-kv-bytes {request.max_kv_bytes}"
            )
        self.pool = SlotPool(self.model, slots, slot_tokens)
        return KVPlan(slot_tokens, self.pool.nbytes, self.pool.slot_bytes)

    def new_kv(self, scope: str = "") -> KVCache:
        return self.pool.acquire() if self.pool else lm.new_cache(self.model)

    def free(self, kv: SessionKV) -> None:
        if isinstance(kv, SlotKV):
            kv.pool.release(kv)  # back to the pool; a DynamicCache goes with its session

    def freed(self, kv: SessionKV) -> bool:
        return isinstance(kv, SlotKV) and kv.released

    def crop(self, kv: SessionKV, length: int) -> None:
        crop(_own(kv), length)

    def forward(self, kvs: Sequence[SessionKV], blocks: Sequence[Sequence[int]], keeps: Sequence[int]) -> list[torch.Tensor]:
        return forward_packed(self.model, [_own(kv) for kv in kvs], blocks, keeps)

    def describe(self) -> dict[str, str]:
        return {"engine": self.name, "dtype": str(self.model.dtype).removeprefix("torch."), "device": str(self.model.device)}


def _own(kv: SessionKV) -> KVCache:
    if not isinstance(kv, DynamicCache | SlotKV):
        raise TypeError(f"the transformers engine holds no {type(kv).__name__}")
    return kv


@torch.inference_mode()
def forward_packed(
    model: PreTrainedModel, caches: Sequence[KVCache], blocks: Sequence[Sequence[int]], keeps: Sequence[int]
) -> list[torch.Tensor]:
    """One forward pass over several sequences, each fed after its own cache: like `forward`
    per sequence, but the weights are read once for all of them (the new tokens packed into
    one row after every cache, a mask keeping each to its own: docs/architecture.md,
    "Batching"). Full-attention models only (every layer keeps all positions). Returns, per
    sequence, the last keeps[i] rows of float32 logits (all rows when 0). Slots
    (cloud/engine/kv_slots.py) take the same pass without the copies."""
    slots = [c for c in caches if isinstance(c, SlotKV)]
    dynamic = [c for c in caches if isinstance(c, DynamicCache)]
    if slots and dynamic:
        raise TypeError("one pass takes slots or dynamic caches, not both")
    if slots:
        return forward_slots(model, slots, blocks, keeps)
    if len(dynamic) == 1:
        return [lm.forward(model, dynamic[0], blocks[0], keeps[0])]
    caches = dynamic
    pasts = [cache.get_seq_length() for cache in caches]
    lengths = [len(block) for block in blocks]
    total_past = sum(pasts)
    mask, positions = _packed_mask(pasts, lengths, model.dtype)
    rows = kept_rows(lengths, keeps)
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
            keys, values = lm.keys_values(layer)
            cache.update(keys[..., block, :].clone(), values[..., block, :].clone(), index)
        new_start += length
    return list(out.logits[0].float().cpu().split([len(r) for r in rows]))


def _packed_past(model: PreTrainedModel, caches: Sequence[DynamicCache], pasts: Sequence[int]) -> DynamicCache:
    """One cache holding every sequence's past, concatenated in order."""
    packed = lm.new_cache(model)
    if sum(pasts):
        for index in range(len(caches[0].layers)):
            filled = [lm.keys_values(cache.layers[index]) for cache, past in zip(caches, pasts, strict=True) if past]
            packed.update(
                torch.cat([keys for keys, _ in filled], dim=-2), torch.cat([values for _, values in filled], dim=-2), index
            )
    return packed


def _packed_mask(pasts: Sequence[int], lengths: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed pass's mask [total_new, total_past + total_new] (0 where a query may look,
    the dtype's min elsewhere) and its position ids [total_new]."""
    total_past, total_new = sum(pasts), sum(lengths)
    allowed = torch.zeros(total_new, total_past + total_new, dtype=torch.bool)
    positions = []
    past_start = new_start = 0
    for past, length in zip(pasts, lengths, strict=True):
        block = slice(new_start, new_start + length)
        allowed[block, past_start : past_start + past] = True
        allowed[block, total_past + new_start : total_past + new_start + length] = torch.ones(
            length, length, dtype=torch.bool
        ).tril()
        positions.append(torch.arange(past, past + length))
        past_start += past
        new_start += length
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask, torch.cat(positions)


def crop(cache: KVCache, length: int) -> None:
    if isinstance(cache, SlotKV):
        cache.crop(length)  # a length update: the positions past it are masked, then overwritten
    else:
        lm.crop(cache, length)
