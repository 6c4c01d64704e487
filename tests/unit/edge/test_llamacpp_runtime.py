"""The llama.cpp draft runtime on a tiny GGUF written from the transformers draft model:
the same logits, crop-and-continue equal to a fresh evaluation, clear errors."""

from pathlib import Path

import numpy as np
import pytest

from edge.config import EdgeSettings
from edge.drafting.drafter import Drafter, DrafterConfig
from edge.drafting.runtime_llamacpp import LlamaCppDraftLM
from edge.drafting.runtime_transformers import TransformersDraftLM
from shared.errors import ConfigError, DraftFailed
from shared.llamacpp import find_gguf
from shared.protocol import AcceptMode, SamplingParams
from tests.harness import make_drafter, random_prompt


def test_llamacpp_logits_equal_transformers_logits(gguf_draft, draft_model) -> None:
    ours, theirs = gguf_draft.new_cache(0), TransformersDraftLM(draft_model).new_cache(0)
    prompt = random_prompt(1, length=12)
    # f16 KV cache in llama.cpp against f32 in transformers: equal to about 1e-3 on logits of size ~3
    np.testing.assert_allclose(ours.feed(prompt), theirs.feed(prompt), atol=3e-3)
    for token in random_prompt(2, length=6):
        np.testing.assert_allclose(ours.feed([token]), theirs.feed([token]), atol=3e-3)
    ours.crop(5)
    theirs.crop(5)
    np.testing.assert_allclose(ours.feed([7, 8, 9]), theirs.feed([7, 8, 9]), atol=3e-3)
    assert len(ours) == len(theirs) == 8


def test_crop_and_continue_equals_a_fresh_evaluation(gguf_draft) -> None:
    prompt, rejected, accepted = random_prompt(3, length=10), [11, 12, 13, 14], [21, 22, 23]
    cropped = gguf_draft.new_cache(0)
    cropped.feed(prompt)
    cropped.feed(rejected)
    cropped.crop(len(prompt))
    fresh = gguf_draft.new_cache(0)
    fresh.feed(prompt)
    assert len(cropped) == len(fresh) == len(prompt)
    np.testing.assert_array_equal(cropped.feed(accepted), fresh.feed(accepted))  # bit for bit
    for token in (30, 31, 32):
        np.testing.assert_array_equal(cropped.feed([token]), fresh.feed([token]))


def test_drafter_sync_crops_the_llamacpp_cache(gguf_draft, draft_model) -> None:
    """The same greedy drafts from both runtimes through sync/propose rounds (the pair's
    top-1 agrees: logits differ only by float rounding)."""
    tokens = random_prompt(5, length=10)
    ours, theirs = make_drafter(gguf_draft), make_drafter(draft_model)
    for _ in range(4):
        ours.sync(tokens)
        theirs.sync(tokens)
        draft = ours.propose(5)
        assert draft.token_ids == theirs.propose(5).token_ids
        assert len(ours.cache) == len(tokens) + len(draft) - 1
        tokens = tokens + draft.token_ids[:2] + [(draft.token_ids[2] + 1) % 96]  # accept 2, correct the 3rd
    ours.sync(tokens)
    assert len(ours.cache) == len(ours.cached) <= len(tokens) - 1 and ours.cached == tokens[: len(ours.cached)]


def test_a_full_draft_context_is_a_clear_error(tmp_path: Path, gguf_draft) -> None:
    small = LlamaCppDraftLM(gguf_draft.path, threads=1, context_size=16)
    cache = small.new_cache(0)
    cache.feed(list(range(2, 14)))
    with pytest.raises(DraftFailed, match="draft context is full"):
        cache.feed(list(range(2, 8)))


def test_mc_dropout_needs_transformers(gguf_draft) -> None:
    config = DrafterConfig(SamplingParams(), AcceptMode.GREEDY, 96, signals=True, mc_passes=4)
    with pytest.raises(ConfigError, match="draft-runtime transformers"):
        Drafter(gguf_draft, config, seed=0)


def test_not_a_gguf_is_a_config_error(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="could not load"):
        LlamaCppDraftLM(bogus)
    with pytest.raises(ConfigError, match="does not exist"):
        LlamaCppDraftLM(tmp_path / "missing.gguf")


def test_find_gguf_and_the_runtime_choice(tmp_path: Path) -> None:
    assert find_gguf(tmp_path, "--draft-gguf") is None
    (tmp_path / "a.gguf").write_bytes(b"")
    assert find_gguf(tmp_path, "--draft-gguf") == tmp_path / "a.gguf"
    assert find_gguf(tmp_path / "a.gguf", "--draft-gguf") == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match="2 GGUF files"):
        find_gguf(tmp_path, "--draft-gguf")
    auto = EdgeSettings()
    assert auto.resolved_draft_runtime(have_gguf=True) == "llama.cpp"  # llama-cpp-python is installed here
    assert auto.resolved_draft_runtime(have_gguf=False) == "transformers"
    assert EdgeSettings(draft_runtime="transformers").resolved_draft_runtime(have_gguf=True) == "transformers"
