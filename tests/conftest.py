import pytest
import torch

from tests.tiny_models import tiny_draft, tiny_target


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    # Tiny models run faster on one thread, and tests must not fight over the 2 cores.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target_model():  # type: ignore[no-untyped-def]
    return tiny_target()


@pytest.fixture(scope="session")
def draft_model(target_model):  # type: ignore[no-untyped-def]
    return tiny_draft(target_model, noise=0.2)
