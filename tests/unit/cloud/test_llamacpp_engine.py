"""The llama.cpp engine on a tiny GGUF written from the transformers target: the same logits
for several sessions in one pass, crop-and-continue, a session's rows independent of the others
in its pass, a failed pass that changes nothing, and sequence ids handed back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cloud.engine import KVRequest
from cloud.engine.llamacpp import LlamaCppEngine
from shared import lm
from shared.errors import CapacityExceeded, ConfigError
from tests.tiny_models import save_gguf, tiny_target

ATOL = 3e-3  # f16 KV in llama.cpp against f32 in transformers (as the edge's runtime test)


@pytest.fixture(scope="module")
def target():  # type: ignore[no-untyped-def]
    return tiny_target()


@pytest.fixture(scope="module")
def engine(target, tmp_path_factory: pytest.TempPathFactory) -> LlamaCppEngine:  # type: ignore[no-untyped-def]
    path = save_gguf(target, tmp_path_factory.mktemp("gguf") / "target.gguf")
    engine = LlamaCppEngine(path, threads=1, batch_tokens=32)
    plan = engine.plan_kv(KVRequest("packed", max_sessions=4, max_kv_bytes=1 << 30, max_context_tokens=128, slot_tokens=0))
    assert plan.max_kv_bytes == 4 * 128 * engine.kv_bytes_per_token  # every session at its limit, under the byte cap
    return engine


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 90, size=n).tolist()


def test_one_pass_over_several_sessions_equals_transformers(engine: LlamaCppEngine, target) -> None:  # type: ignore[no-untyped-def]
    prompts = [_tokens(1, 10), _tokens(2, 40), _tokens(3, 3)]  # 53 tokens: two llama_decode calls of 32
    caches = [engine.new_kv() for _ in prompts]
    refs = [lm.new_cache(target) for _ in prompts]
    try:
        got = engine.forward(caches, prompts, [1, 0, 2])
        for rows, ref, prompt, keep in zip(got, refs, prompts, [1, 0, 2], strict=True):
            torch.testing.assert_close(rows, lm.forward(target, ref, prompt, keep), atol=ATOL, rtol=0)
        assert [c.length for c in caches] == [10, 40, 3]
        rounds = [_tokens(4, 5), _tokens(5, 1), _tokens(6, 4)]
        got = engine.forward(caches, rounds, [5, 1, 4])
        for rows, ref, block in zip(got, refs, rounds, strict=True):
            torch.testing.assert_close(rows, lm.forward(target, ref, block, len(block)), atol=ATOL, rtol=0)
        engine.crop(caches[0], 12)  # two of five accepted: the rest of the round's KV goes
        lm.crop(refs[0], 12)
        torch.testing.assert_close(
            engine.forward([caches[0]], [[7, 8]], [2])[0], lm.forward(target, refs[0], [7, 8], 2), atol=ATOL, rtol=0
        )
    finally:
        for cache in caches:
            engine.free(cache)


def test_a_sessions_rows_do_not_depend_on_the_others_in_its_pass(engine: LlamaCppEngine) -> None:
    caches = [engine.new_kv() for _ in range(3)]
    try:
        engine.forward(caches, [_tokens(7, 12), _tokens(8, 30), _tokens(9, 5)], [1, 1, 1])
        rounds = [_tokens(10, 5), _tokens(11, 5), _tokens(12, 2)]
        together = engine.forward(caches, rounds, [5, 5, 2])
        for cache, block in zip(caches, rounds, strict=True):
            engine.crop(cache, cache.length - len(block))
        for cache, block, rows in zip(caches, rounds, together, strict=True):
            assert torch.equal(engine.forward([cache], [block], [len(block)])[0], rows)
    finally:
        for cache in caches:
            engine.free(cache)


def test_a_failed_pass_changes_nothing(engine: LlamaCppEngine) -> None:
    cache, other = engine.new_kv(), engine.new_kv()
    try:
        engine.forward([cache], [_tokens(13, 8)], [1])
        expected = engine.forward([cache], [[5]], [1])[0]
        engine.crop(cache, 8)
        with pytest.raises(Exception):  # noqa: B017 (llama.cpp refuses an out-of-vocabulary id its own way)
            engine.forward([cache, other], [[4], [10**6]], [1, 1])
        assert cache.length == 8 and other.length == 0
        assert torch.equal(engine.forward([cache], [[5]], [1])[0], expected)
    finally:
        engine.free(cache)
        engine.free(other)


def test_sequences_are_handed_back(engine: LlamaCppEngine) -> None:
    taken = [engine.new_kv() for _ in range(4)]
    with pytest.raises(CapacityExceeded):
        engine.new_kv()
    engine.free(taken[2])
    again = engine.new_kv()
    assert again.seq_id == taken[2].seq_id and again.length == 0
    for cache in (*taken[:2], taken[3], again):
        engine.free(cache)


def test_a_file_that_is_no_gguf_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="could not load"):
        LlamaCppEngine(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        LlamaCppEngine(tmp_path / "missing.gguf")


def test_limits_it_cannot_serve_are_one_line(engine: LlamaCppEngine) -> None:
    with pytest.raises(ConfigError, match="kv-layout slots"):
        engine.plan_kv(KVRequest("slots", max_sessions=2, max_kv_bytes=1 << 30, max_context_tokens=64, slot_tokens=64))
    with pytest.raises(ConfigError, match="1 to 256 sessions"):
        engine.plan_kv(KVRequest("packed", max_sessions=300, max_kv_bytes=1 << 30, max_context_tokens=64, slot_tokens=0))
