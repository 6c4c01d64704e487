"""`specedge-models gguf`: llama.cpp's own converter (fetched once from llama-cpp-python's sdist on
PyPI) makes a GGUF of a draft that has none. On a tiny Llama with f16-exact weights, llama.cpp's
logits from the made f16 file equal transformers' within the runtime test's tolerance, and a
greedy speculative run drafting with it equals cloud_only; q8_0 and q4_k_m files load; each
error a user meets is one line. The same on the real 0.5B draft is marked `real_models`
(`pytest -m real_models`, after `specedge-models fetch`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from edge.drafting.runtime_llamacpp import LlamaCppDraftLM
from edge.drafting.runtime_transformers import TransformersDraftLM
from shared.llamacpp import find_gguf
from shared.models import DRAFT_MODEL
from tests.serve_procs import edge_command
from tests.tiny_models import save_convertible_pair

# The real 0.5B in llama.cpp (f16 weights, f16 KV) against transformers fp32 on the same bf16
# checkpoint, 24 layers deep: at most 0.040 on logits of magnitude ~15-25 over a 16-step greedy
# continuation (2026-11-25, avx512_bf16 box); the tiny model's 3e-3 is for 2 layers of width 32.
REAL_LOGITS_ATOL = 0.1


def _gguf(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "shared.models.store", "gguf", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_convertible_pair(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def made_f16(pair: tuple[Path, Path]) -> Path:
    done = _gguf(str(pair[0]), "--type", "f16")
    assert done.returncode == 0, done.stderr[-3000:]
    path = Path(done.stdout.strip())
    assert path == pair[0] / "draft-f16.gguf" and path.is_file()
    return path


def _assert_same_logits(gguf: Path, folder: Path, prompt: list[int], steps: list[int], atol: float) -> None:
    ours = LlamaCppDraftLM(gguf, threads=1).new_cache(0)
    theirs = TransformersDraftLM(AutoModelForCausalLM.from_pretrained(folder).float().eval()).new_cache(0)
    np.testing.assert_allclose(ours.feed(prompt), theirs.feed(prompt), atol=atol)
    for token in steps:
        np.testing.assert_allclose(ours.feed([token]), theirs.feed([token]), atol=atol)


def test_the_made_f16_gguf_has_the_models_logits(made_f16: Path, pair: tuple[Path, Path]) -> None:
    rng = np.random.default_rng(0)
    prompt, steps = rng.integers(0, 274, 12).tolist(), rng.integers(0, 274, 6).tolist()
    # the same tolerance as the runtime test on a GGUF written from the weights directly
    _assert_same_logits(made_f16, pair[0], prompt, steps, atol=3e-3)


def test_greedy_speculation_drafting_with_the_made_gguf_equals_cloud_only(
    made_f16: Path, pair: tuple[Path, Path], tmp_path: Path
) -> None:
    draft, target = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(["ab cd", "abcd e", "c d a"]))
    )
    outputs = {}
    for mode in ("speculative", "cloud_only"):
        out = tmp_path / f"{mode}.jsonl"
        flags = ["--draft-model", str(draft), "--target-model", str(target), "--draft-runtime", "llama.cpp"]
        flags += ["--prompts", str(prompts), "--output", str(out), "--mode", mode, "--max-new-tokens", "16", "--k", "3"]
        done = subprocess.run(edge_command(*flags), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[mode] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert outputs["speculative"] == outputs["cloud_only"]
    assert all(len(tokens) == 16 for tokens in outputs["speculative"])


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_k_m"])
def test_quantized_files_load_and_the_edge_finds_them(gguf_type: str, pair: tuple[Path, Path], tmp_path: Path) -> None:
    folder = tmp_path / "draft"
    shutil.copytree(pair[0], folder, ignore=shutil.ignore_patterns("*.gguf"))
    done = _gguf(str(folder), "--type", gguf_type)
    assert done.returncode == 0, done.stderr[-3000:]
    made = Path(done.stdout.strip())
    assert made == folder / f"draft-{gguf_type}.gguf"
    assert find_gguf(folder, "--draft-gguf") == made  # the edge's auto runtime takes it
    assert LlamaCppDraftLM(made, threads=1).logits_width == 274
    again = _gguf(str(folder), "--type", gguf_type)  # already there: found, not made again
    assert again.returncode == 0 and again.stdout.strip() == str(made) and "converting" not in again.stderr


def test_an_architecture_the_converter_does_not_know_is_one_line(pair: tuple[Path, Path], tmp_path: Path) -> None:
    folder = tmp_path / "odd"
    shutil.copytree(pair[0], folder, ignore=shutil.ignore_patterns("*.gguf"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["NoSuchModelForCausalLM"]}))
    done = _gguf(str(folder))
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("specedge-models: error: odd: llama.cpp's converter failed: ")
    assert "NoSuchModelForCausalLM" in line and not list(folder.glob("*.gguf*")) and not list(folder.glob(".*partial"))


def test_a_folder_that_is_no_model_and_a_wrong_converter_source_are_one_line(tmp_path: Path) -> None:
    done = _gguf(str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.strip() == f"specedge-models: error: {tmp_path}: not a Hugging Face model folder (no config.json)"
    (tmp_path / "config.json").write_text("{}")
    env = {**os.environ, "SPECEDGE_LLAMA_CPP_SOURCE": str(tmp_path)}
    done = _gguf(str(tmp_path), env=env)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"specedge-models: error: SPECEDGE_LLAMA_CPP_SOURCE={tmp_path}: no convert_hf_to_gguf.py there "
        "(a llama.cpp checkout is expected)"
    )


@pytest.mark.real_models
def test_the_real_draft_converts_and_keeps_its_greedy_choices(tmp_path: Path) -> None:
    from shared.models.store import ensure_model

    packaged = ensure_model(DRAFT_MODEL)
    folder = tmp_path / "qwen-draft"  # the HF files alone: the packaged folder keeps its own GGUF
    folder.mkdir()
    for item in packaged.iterdir():
        if item.suffix != ".gguf" and item.is_file():
            (folder / item.name).symlink_to(item)
    done = _gguf(str(folder), "--type", "f16")
    assert done.returncode == 0, done.stderr[-3000:]
    made = Path(done.stdout.strip())
    prompt = [151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 151645, 198]
    ours = LlamaCppDraftLM(made, threads=2).new_cache(0)
    theirs = TransformersDraftLM(AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()).new_cache(0)
    a, b = ours.feed(prompt), theirs.feed(prompt)
    worst = 0.0
    for _ in range(16):  # a greedy continuation: the same choice at every step, logits close
        width = min(len(a), len(b))
        assert int(np.argmax(a[:width])) == int(np.argmax(b[:width]))
        worst = max(worst, float(np.abs(a[:width] - b[:width]).max()))
        token = int(np.argmax(a[:width]))
        a, b = ours.feed([token]), theirs.feed([token])
    assert worst < REAL_LOGITS_ATOL, worst
