"""Models by Hub id: a cache in huggingface_hub's own layout (refs/main naming a commit, the
files under snapshots/<commit>), made here with the tiny pair under made-up ids, read with
HF_HUB_OFFLINE=1. Both sides resolve their model by id, the greedy speculative output equals
cloud_only, and the commit that ran is named; a missing id is one line. `specedge-models` fetches
an id from that cache and lists it beside the packaged models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.models import TARGET_MODEL, hub
from shared.models import store as model_store
from shared.models.catalog import PACKAGED_MODELS
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


def _specedge_models(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The console entry as it runs: `specedge-models` is shared.models.store's main."""
    command = [sys.executable, "-m", "shared.models.store", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_specedge_models_fetch_prints_each_ids_snapshot_offline(hub_cache: Path, tmp_path: Path) -> None:
    env = {**_env(hub_cache), "SPECEDGE_CACHE_DIR": str(tmp_path / "packaged")}
    done = _specedge_models("fetch", TARGET_ID, f"{DRAFT_ID}@main", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    snapshots = [hub_cache / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT for repo in (TARGET_ID, DRAFT_ID)]
    assert done.stdout.splitlines() == [str(folder) for folder in snapshots]
    missing = _specedge_models("fetch", "specedge-test/no-such-model", env=env)
    assert missing.returncode == 1
    (line,) = missing.stderr.strip().splitlines()
    assert line.startswith("specedge-models: error: specedge-test/no-such-model: not in the cache")
    assert not (tmp_path / "packaged").exists()  # no packaged model was asked for: none was fetched


def test_specedge_models_list_shows_packaged_and_cached_models_reading_only(hub_cache: Path, tmp_path: Path) -> None:
    packaged = tmp_path / "packaged"
    fetched = packaged / TARGET_MODEL  # a finished conversion, as fetch leaves it
    fetched.mkdir(parents=True)
    (fetched / "config.json").write_text("{}")
    manifest = {"format": model_store.MANIFEST_FORMAT, "gguf_sha256": PACKAGED_MODELS[TARGET_MODEL].sha256}
    (fetched / model_store.MANIFEST_NAME).write_text(json.dumps(manifest))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    done = _specedge_models("list", env={**_env(hub_cache), "SPECEDGE_CACHE_DIR": str(packaged)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    want_packaged = [
        ["packaged", name, *(["fetched"] if name == TARGET_MODEL else ["not", "fetched"]), str(packaged / name)]
        for name in PACKAGED_MODELS
    ]
    assert lines[: len(PACKAGED_MODELS)] == want_packaged
    hub_lines = lines[len(PACKAGED_MODELS) :]
    assert [line[1] for line in hub_lines] == sorted([DRAFT_ID, TARGET_ID])
    for line in hub_lines:
        repo_dir = hub_cache / ("models--" + line[1].replace("/", "--"))
        size = sum(f.stat().st_size for f in repo_dir.rglob("*") if f.is_file() and "snapshots" in f.parts)
        assert line == ["hub", line[1], COMMIT, "(main)", *model_store.readable_size(size).split(), str(repo_dir)]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing fetched, nothing written
