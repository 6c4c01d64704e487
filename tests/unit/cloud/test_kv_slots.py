"""cloud/engine/kv_slots.py: sessions' KV in place in a slot pool, each pass equal to every sequence
run alone over its own DynamicCache (greedy fp32, tiny model)."""

import json
import random

import pytest
import torch

from cloud.engine.kv_slots import SlotKV, SlotPool, choose_shape, forward_slots
from cloud.engine.transformers import crop, forward_packed
from shared import lm
from shared.errors import InvalidRequest, SessionNotFound


def _slot_keys(kv: SlotKV, layer: int) -> torch.Tensor:
    return kv.pool.keys[layer][:, :, kv.base : kv.base + kv.length]  # [1, kv_heads, length, head_dim]


def _assert_same_kv(kv: SlotKV, cache) -> None:  # type: ignore[no-untyped-def]
    assert kv.length == cache.get_seq_length()
    for index, layer in enumerate(cache.layers):
        if kv.length:
            torch.testing.assert_close(_slot_keys(kv, index), layer.keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", ["batch", "packed", "auto"])
@pytest.mark.parametrize("seed", range(4))
def test_slot_pass_equals_each_sequence_alone(target_model, seed: int, shape: str) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    pool = SlotPool(target_model, slots=8, slot_tokens=64)
    kvs = [pool.acquire() for _ in range(n)]
    alone = [lm.new_cache(target_model) for _ in range(n)]
    for kv, cache in zip(kvs, alone, strict=True):  # prefills of different lengths, one at a time
        prompt = [rng.randrange(96) for _ in range(rng.randint(0, 14))]
        if prompt:
            forward_slots(target_model, [kv], [prompt], [1])
            lm.forward(target_model, cache, prompt)
    blocks = [[rng.randrange(96) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    keeps = [rng.randint(0, len(block)) for block in blocks]
    expected = [lm.forward(target_model, c, b, k) for c, b, k in zip(alone, blocks, keeps, strict=True)]
    if seed % 2:  # a slot of the range not in the pass: a padding row (batch), a gap (packed)
        kvs, alone, blocks, keeps, expected = kvs[1:], alone[1:], blocks[1:], keeps[1:], expected[1:]
        kvs, alone, blocks, keeps, expected = ([x[0]] + x[2:] for x in (kvs, alone, blocks, keeps, expected))
    got = forward_slots(target_model, kvs, blocks, keeps, shape)
    for want, have, kv, cache in zip(expected, got, kvs, alone, strict=True):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(have.argmax(-1), want.argmax(-1))
        _assert_same_kv(kv, cache)


@pytest.mark.parametrize("shape", ["batch", "packed", "auto"])
def test_many_rounds_with_crops_joins_and_leaves_decode_like_alone(target_model, shape: str) -> None:
    """Greedy rounds over a changing set of sessions: each round a random subset feeds a block,
    keeps a random prefix of it (crop, as a rejected draft does), some sessions leave and new
    ones take their slots; every token equals the unbatched path's."""
    rng = random.Random(7)
    pool = SlotPool(target_model, slots=5, slot_tokens=160)
    live: list[tuple[SlotKV, object, list[int]]] = []  # (slot, DynamicCache alone, tokens fed)
    for _ in range(30):
        while len(live) < 5 and rng.random() < 0.5:
            live.append((pool.acquire(), lm.new_cache(target_model), []))
        if not live:
            continue
        batch = rng.sample(live, rng.randint(1, len(live)))
        blocks = [[rng.randrange(96) for _ in range(rng.randint(1, 12 if not fed else 5))] for _, _, fed in batch]
        got = forward_slots(target_model, [kv for kv, _, _ in batch], blocks, [0] * len(batch), shape)
        for (kv, cache, fed), block, rows in zip(batch, blocks, got, strict=True):
            want = lm.forward(target_model, cache, block)  # type: ignore[arg-type]
            assert torch.equal(rows.argmax(-1), want.argmax(-1))
            torch.testing.assert_close(rows, want, atol=1e-5, rtol=1e-5)
            fed += block
            keep = rng.randint(len(fed) - len(block), len(fed))  # a rejected tail is cropped away
            del fed[keep:]
            crop(kv, keep)
            crop(cache, keep)
            _assert_same_kv(kv, cache)
        if rng.random() < 0.3:
            leaving = live.pop(rng.randrange(len(live)))
            pool.release(leaving[0])
    assert pool.free_slots == 5 - len(live)


@pytest.mark.parametrize("shape", ["batch", "packed"])
def test_a_failed_pass_leaves_every_slot_as_it_was(target_model, shape: str) -> None:
    pool = SlotPool(target_model, slots=3, slot_tokens=32)
    a, b = pool.acquire(), pool.acquire()
    forward_slots(target_model, [a, b], [[5, 6, 7], [8, 9]], [1, 1], shape)
    before = [t.clone() for t in (*pool.keys, *pool.values)]
    with pytest.raises(IndexError):  # an id past the embedding: the pass fails inside the model
        forward_slots(target_model, [a, b], [[1, 2], [10_000]], [1, 1], shape)
    assert (a.length, b.length) == (3, 2)
    # What the failed pass wrote (if anything) lies past the lengths: the live KV is unchanged.
    for old, new in zip(before, (*pool.keys, *pool.values), strict=True):
        assert torch.equal(old[:, :, a.base : a.base + 3], new[:, :, a.base : a.base + 3])
        assert torch.equal(old[:, :, b.base : b.base + 2], new[:, :, b.base : b.base + 2])
    with pytest.raises(InvalidRequest):  # past the slot: refused before the pass
        forward_slots(target_model, [a], [list(range(30))], [1])
    pool.release(b)
    with pytest.raises(SessionNotFound):
        forward_slots(target_model, [a, b], [[1], [2]], [1, 1])
    assert a.length == 3


def test_short_blocks_run_as_batch_rows_and_a_long_chunk_packed(target_model) -> None:
    pool = SlotPool(target_model, slots=4, slot_tokens=300)
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    assert choose_shape([a, b, c], [5, 5, 4]) == "batch"  # rounds: little padding
    assert choose_shape([a, c], [5, 5]) == "batch"  # slot b idle: 3 rows for 10 tokens
    assert choose_shape([a, b, c], [256, 5, 5]) == "packed"  # a prefill chunk: padding would triple the tokens


def test_pool_bytes_are_the_tensors_allocated(target_model) -> None:
    pool = SlotPool(target_model, slots=4, slot_tokens=100)
    allocated = sum(t.numel() * t.element_size() for t in (*pool.keys, *pool.values))
    assert pool.nbytes == allocated == 4 * 100 * lm.kv_bytes_per_token(target_model)
    assert pool.slot_bytes == 100 * lm.kv_bytes_per_token(target_model)
    assert [pool.acquire().slot for _ in range(4)] == [0, 1, 2, 3] and pool.free_slots == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slots_on_cuda_bf16_match_packed(target_model) -> None:
    """The same code on the GPU in bf16: pool, mask and positions on the model's device."""
    import copy

    model = copy.deepcopy(target_model).to(device="cuda", dtype=torch.bfloat16)
    pool = SlotPool(model, slots=3, slot_tokens=64)
    assert pool.keys[0].device.type == "cuda" and pool.keys[0].dtype == torch.bfloat16
    kvs, caches = [pool.acquire() for _ in range(3)], [lm.new_cache(model) for _ in range(3)]
    blocks = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    got = forward_packed(model, kvs, blocks, [0, 0, 0])
    want = forward_packed(model, caches, blocks, [0, 0, 0])
    for have, expected in zip(got, want, strict=True):
        torch.testing.assert_close(have, expected, atol=5e-2, rtol=5e-2)


def test_timing_script_runs_both_layouts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from bench.studies.kv_layout_timing import main

    out = tmp_path / "kv.json"
    assert (
        main(
            ["--model", "tiny", "--sessions", "1,3", "--contexts", "32", "--rounds", "1", "--device", "cpu", "--output", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(r["layout"], r["sessions"]) for r in rows} == {
        (lay, n) for lay in ("packed", "slots", "slots-packed") for n in (1, 3)
    }
    assert all(r["ms_p50"] > 0 for r in rows)
