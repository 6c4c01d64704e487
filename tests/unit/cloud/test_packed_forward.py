"""forward_packed: several sequences in one forward pass, each as if it ran alone."""

import random

import pytest
import torch

from cloud.engine.transformers import forward_packed
from shared import lm


def _prefilled(model, prompt: list[int]):  # type: ignore[no-untyped-def]
    cache = lm.new_cache(model)
    if prompt:
        lm.forward(model, cache, prompt)
    return cache


@pytest.mark.parametrize("seed", range(6))
def test_packed_forward_equals_each_sequence_alone(target_model, seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    # Some sequences start from an empty cache (a Generate prefill batched with rounds).
    prompts = [[rng.randrange(96) for _ in range(rng.randint(0 if i == 0 else 1, 14))] for i in range(n)]
    blocks = [[rng.randrange(96) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    keeps = [rng.randint(0, len(block)) for block in blocks]
    alone = [_prefilled(target_model, p) for p in prompts]
    packed = [_prefilled(target_model, p) for p in prompts]
    expected = [lm.forward(target_model, cache, block, keep) for cache, block, keep in zip(alone, blocks, keeps, strict=True)]
    got = forward_packed(target_model, packed, blocks, keeps)
    for want, have, cache_a, cache_b in zip(expected, got, alone, packed, strict=True):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(have.argmax(-1), want.argmax(-1))
        assert cache_a.get_seq_length() == cache_b.get_seq_length()
        for layer_a, layer_b in zip(cache_a.layers, cache_b.layers, strict=True):
            torch.testing.assert_close(layer_b.keys, layer_a.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer_b.values, layer_a.values, atol=1e-5, rtol=1e-5)


def test_packed_caches_keep_decoding_like_unpacked_ones(target_model) -> None:
    """After a packed step, each cache continues exactly like one that never was packed."""
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14]]
    alone = [_prefilled(target_model, p) for p in prompts]
    packed = [_prefilled(target_model, p) for p in prompts]
    for step in range(5):
        blocks = [[20 + step + i] for i in range(len(prompts))]
        forward_packed(target_model, packed, blocks, [1] * len(prompts))
        for cache, block in zip(alone, blocks, strict=True):
            lm.forward(target_model, cache, block, 1)
    for cache_a, cache_b in zip(alone, packed, strict=True):
        torch.testing.assert_close(
            lm.forward(target_model, cache_b, [1], 1), lm.forward(target_model, cache_a, [1], 1), atol=1e-5, rtol=1e-5
        )
