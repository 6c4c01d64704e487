"""cloud-verifier --engine llama.cpp, a real process on the tiny target's GGUF, answering the
real edge-agent: greedy speculative output equals cloud_only on the same engine, token for
token, for a batch of prompts; /healthz names the engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve_procs import edge_command, verifier_command
from tests.tiny_models import save_gguf, save_pair

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM

    draft, target = save_pair(tmp_path_factory.mktemp("models"))
    gguf = save_gguf(AutoModelForCausalLM.from_pretrained(target), tmp_path_factory.mktemp("gguf") / "target.gguf")
    return draft, gguf


@pytest.fixture(scope="module")
def verifier(models: tuple[Path, Path]) -> Iterator[tuple[str, int]]:
    cmd = verifier_command(models[1], "--engine", "llama.cpp", "--max-sessions", "8")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
    assert proc.stderr is not None
    address, http = None, None
    for line in proc.stderr:
        if match := re.search(r"http on \S+:(\d+)", line):
            http = int(match.group(1))
        if match := re.search(r"serving .* on (\S+:\d+)", line):
            address = match.group(1)
            break
    assert address and http, "cloud-verifier --engine llama.cpp did not start"
    yield address, http
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def test_greedy_speculative_equals_cloud_only_on_llamacpp(
    models: tuple[Path, Path], verifier: tuple[str, int], tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 3} w{3 * i + 1}"}) + "\n" for i in range(4)))
    outputs = {}
    for mode in ("speculative", "cloud_only"):
        out = tmp_path / f"{mode}.jsonl"
        flags = ["--cloud", verifier[0], "--draft-model", str(models[0]), "--prompts", str(prompts), "--output", str(out)]
        flags += ["--mode", mode, "--max-new-tokens", "24", "--k", "4"]
        done = subprocess.run(edge_command(*flags), capture_output=True, text=True, env=ENV, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[mode] = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert outputs["speculative"] == outputs["cloud_only"]
    assert all(len(tokens) == 24 for tokens in outputs["cloud_only"].values())


def test_healthz_names_the_engine(verifier: tuple[str, int]) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{verifier[1]}/healthz", timeout=10) as reply:
        health = json.load(reply)
    assert health["engine"] == "llama.cpp" and health["model_ids"] == ["target.gguf"]
