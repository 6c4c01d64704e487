"""Models by Hub id: a cache in huggingface_hub's own layout (refs/main naming a commit, the
files under snapshots/<commit>), made here with the tiny pair under made-up ids, read with
HF_HUB_OFFLINE=1. Both sides resolve their model by id, the greedy speculative output equals
cloud_only, and the commit that ran is named; a missing id is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shared.models import hub
from tests.serve_procs import edge_command
from tests.tiny_models import save_pair

DRAFT_ID, TARGET_ID = "specedge-test/tiny-draft", "specedge-test/tiny-target"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _add_to_cache(cache: Path, repo: str, folder: Path) -> Path:
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / COMMIT
    shutil.copytree(folder, snapshot, ignore=shutil.ignore_patterns("*.gguf"))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    draft, target = save_pair(tmp_path_factory.mktemp("models"))
    cache = tmp_path_factory.mktemp("hub")
    _add_to_cache(cache, DRAFT_ID, draft)
    _add_to_cache(cache, TARGET_ID, target)
    return cache


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_an_id_resolves_to_its_snapshot_offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = hub.resolve(TARGET_ID)
    assert folder.name == COMMIT and (folder / "config.json").exists()
    assert hub.resolve(f"{TARGET_ID}@main") == folder
    assert hub.describe(folder) == f"{TARGET_ID}@{COMMIT[:12]}"


def test_greedy_by_id_equals_cloud_only(hub_cache: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 5}"}) + "\n" for i in range(3)))
    outputs = {}
    for mode in ("speculative", "cloud_only"):
        out = tmp_path / f"{mode}.jsonl"
        flags = ["--draft-model", DRAFT_ID, "--target-model", TARGET_ID, "--draft-runtime", "transformers"]
        flags += ["--prompts", str(prompts), "--output", str(out), "--mode", mode, "--max-new-tokens", "16", "--k", "3"]
        done = subprocess.run(edge_command(*flags), capture_output=True, text=True, env=_env(hub_cache), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[mode] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert outputs["speculative"] == outputs["cloud_only"]
    assert all(len(tokens) == 16 for tokens in outputs["speculative"])


def test_an_id_not_in_the_cache_is_one_line_offline(hub_cache: Path) -> None:
    flags = ["--draft-model", "specedge-test/no-such-model", "--mode", "edge_only", "--prompt", "w1"]
    done = subprocess.run(edge_command(*flags), capture_output=True, text=True, env=_env(hub_cache), timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"edge-agent: error: specedge-test/no-such-model: not in the cache ({hub_cache}) and HF_HUB_OFFLINE is set; "
        "fetch it once where the Hub is reachable"
    ]
