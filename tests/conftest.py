from collections.abc import Iterator
from typing import get_args

import pytest
import torch

from cloud.engine import EngineName
from edge.drafting.drafter import DraftLM
from edge.drafting.runtime_transformers import TransformersDraftLM
from tests.harness import TargetEngine, close_vllm_runtimes, gguf_lm
from tests.tiny_models import save_gguf, save_model, tiny_draft, tiny_target, tiny_vllm_target

# pytest-xdist (`--dist loadscope`) hands whole modules to its workers in the order they were
# collected. These take minutes each on 2 cores (in `make test` or `make test-vllm`): they go
# first, so that none is left running alone on one core while the other worker has nothing to do.
LONG_MODULES = (
    "tests/unit/edge/test_round_costs.py",
    "tests/unit/cloud/test_sampling_exactness.py",
    "tests/integration/test_outage.py",
    "tests/integration/test_vllm_verifier.py",
    "tests/integration/test_auto_mode_sampling.py",
    "tests/integration/test_shutdown.py",
    "tests/integration/test_vllm_capacity.py",
    "tests/integration/test_vllm_grammar.py",
    "tests/integration/test_greedy_equality.py",
    "tests/integration/test_make_gguf.py",
    "tests/integration/test_overlap_sampling.py",
    "tests/integration/test_api_keys.py",
    "tests/integration/test_vllm_process.py",
    "tests/integration/test_fleet.py",
    "tests/integration/test_grammar.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {module: i for i, module in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    # Tiny models run faster on one thread, and tests must not fight over the 2 cores.
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _vllm_stopped() -> Iterator[None]:
    yield
    close_vllm_runtimes()


@pytest.fixture(scope="session")
def target_model():  # type: ignore[no-untyped-def]
    return tiny_target()


@pytest.fixture(scope="session")
def draft_model(target_model):  # type: ignore[no-untyped-def]
    return tiny_draft(target_model, noise=0.2)


@pytest.fixture(scope="session")
def gguf_draft(draft_model, tmp_path_factory):  # type: ignore[no-untyped-def]
    return gguf_lm(draft_model, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(params=["transformers", "llama.cpp"])
def draft_lm(request, draft_model) -> DraftLM:  # type: ignore[no-untyped-def]
    """The tiny draft model in each edge runtime."""
    if request.param == "llama.cpp":
        return request.getfixturevalue("gguf_draft")  # type: ignore[no-any-return]
    return TransformersDraftLM(draft_model)


@pytest.fixture(scope="session")
def vllm_target(tmp_path_factory) -> TargetEngine:  # type: ignore[no-untyped-def]
    """The tiny target of vLLM's shape (its CPU attention needs heads of 64) in one folder for
    the whole run: every vLLM engine of it shares one vLLM (seconds to start)."""
    model = tiny_vllm_target()
    return TargetEngine("vllm", model, folder=save_model(model, tmp_path_factory.mktemp("vllm") / "target"))


@pytest.fixture(
    scope="session", params=[pytest.param(e, marks=pytest.mark.vllm) if e == "vllm" else e for e in get_args(EngineName)]
)
def target_engine(request, target_model, tmp_path_factory) -> TargetEngine:  # type: ignore[no-untyped-def]
    """The tiny target in each verifier engine: call it for a fresh Engine. Session-scoped so that
    module fixtures (a served verifier) can take it; every call builds a new Engine. vLLM runs
    its own tiny target (of the shape its CPU attention runs)."""
    if request.param == "vllm":
        return request.getfixturevalue("vllm_target")  # type: ignore[no-any-return]
    return _forward_pass_target(request.param, target_model, tmp_path_factory)


@pytest.fixture(scope="session", params=["transformers", "llama.cpp"])
def forward_pass_engine(request, target_model, tmp_path_factory) -> TargetEngine:  # type: ignore[no-untyped-def]
    """The tiny target in each engine whose rounds this project's rejection sampler accepts
    (vLLM's live sessions are accepted by vLLM's own)."""
    return _forward_pass_target(request.param, target_model, tmp_path_factory)


def _forward_pass_target(name: str, target_model, tmp_path_factory) -> TargetEngine:  # type: ignore[no-untyped-def]
    if name == "llama.cpp":
        return TargetEngine("llama.cpp", target_model, save_gguf(target_model, tmp_path_factory.mktemp("gguf") / "target.gguf"))
    return TargetEngine("transformers", target_model)
