"""The capacity search against the system an operator would run instead: vLLM's own
OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`, a real process) beside
cloud-verifier --engine vllm on the same tiny target, with sessions recorded by the real
edge-agent and rewritten through the verifier's own greedy decoding (bench.retarget_traces
--cloud). In the vLLM venv (`make test-vllm`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fleet_parts import free_port
from edge.trace import VerifyEvent, read_traces
from tests.harness import VLLM_CONTEXT, VLLM_FLAGS
from tests.serve_procs import ENV, edge_command, serve_vllm_verifier
from tests.tiny_models import save_pair

pytestmark = pytest.mark.vllm
SYSTEMS = ("vllm_alone", "speculative", "auto", "cloud_only")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"), vllm=True)


@pytest.fixture(scope="module")
def verifier(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """Asks edges to speculate from the first open session on (auto sessions then speculate)."""
    log = tmp_path_factory.mktemp("verifier") / "verifier.log"
    yield from serve_vllm_verifier(models[1], log, "--prefer-speculation-above", "0", *VLLM_FLAGS)


@pytest.fixture(scope="module")
def vllm_server(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's own server of the same target (CPU, fp32), as `vllm serve` runs it."""
    port, log = free_port(), tmp_path_factory.mktemp("vllm") / "vllm.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models[1]), "--dtype", "float32"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(VLLM_CONTEXT + 1), "--enforce-eager"]
    cmd += ["--served-model-name", "target", "--max-num-seqs", "8"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**ENV, "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=2)
            break
        except OSError:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=120)


def _run(*args: str) -> None:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_capacity_against_vllm_alone_in_one_run(
    models: tuple[Path, Path], verifier: tuple[str, int], vllm_server: str, tmp_path: Path
) -> None:
    recorded, rewritten = tmp_path / "recorded", tmp_path / "rewritten"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 3} w{2 * i + 1}"}) + "\n" for i in range(3)))
    edge = ["--draft-model", str(models[0]), "--cloud", verifier[0], "--prompts", str(prompts), "--mode", "speculative"]
    done = subprocess.run(
        edge_command(*edge, "--k", "4", "--max-new-tokens", "16", "--record", str(recorded)),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    # The verifier's own greedy tokens rewrite the rounds; the same model, so the same rounds.
    _run("-m", "bench.retarget_traces", "--traces", str(recorded), "--cloud", verifier[0], "--out", str(rewritten))
    before, after = read_traces(recorded), read_traces(rewritten)
    assert [t.name for t in before] == [t.name for t in after] and len(after) == 3
    for old, new in zip(before, after, strict=True):
        rounds = [(e.accepted_len, e.next_token) for e in old.events if isinstance(e, VerifyEvent)]
        assert rounds == [(e.accepted_len, e.next_token) for e in new.events if isinstance(e, VerifyEvent)]
        assert new.header.edge["retargeted"] and new.end.output_tokens[:16] == old.end.output_tokens[:16]

    out = tmp_path / "cap"
    search = ["--find-capacity", "--systems", ",".join(SYSTEMS), "--capacity-max-sessions", "2", "--capacity-step-s", "0.5"]
    targets = ["--slo-tpot-p95-ms", "60000", "--slo-ttft-p95-ms", "60000"]
    where = ["--cloud", verifier[0], "--vllm-url", vllm_server, "--metrics-url", f"http://127.0.0.1:{verifier[1]}/metrics"]
    _run("-m", "bench.loadtest", *where, "--trace", str(rewritten), *search, *targets, "--no-progress",
         "--output", str(out / "capacity.json"), "--report", str(out))  # fmt: skip
    result = json.loads((out / "capacity.json").read_text())
    assert list(result["capacity"]) == list(SYSTEMS)
    for system in SYSTEMS:
        cap = result["capacity"][system]
        assert cap["sessions"] == 2, (system, result["levels"][system])
        assert cap["verified_tokens_per_s"] > 0 and cap["loadgen_cpu_cores"] > 0
        assert all(level["sessions_failed"] == 0 for level in result["levels"][system])
    # About a token an event (a step each); vLLM's server puts two tokens in one event now and then,
    # when its client reads behind its engine.
    assert 0.9 < result["capacity"]["vllm_alone"]["rounds_per_token"] <= 1.0
    assert result["capacity"]["vllm_alone"]["busy_fraction"] is None  # vLLM's server reports no busy time
    # The verifier's vLLM steps, those its streams take between passes too (passes alone: one a stream).
    assert 0.3 < result["capacity"]["cloud_only"]["forward_passes_per_token"] <= 1.05
    assert 0 < result["capacity"]["cloud_only"]["busy_fraction"] <= 1
    assert result["capacity"]["auto"]["rounds_per_token"] < 1.0  # asked at once: it speculated
    assert set(result["ratios"]) == {f"{a}/{b}" for a in ("speculative", "auto") for b in ("vllm_alone", "cloud_only")}
    levels = (out / "capacity.levels.jsonl").read_text().splitlines()
    assert sorted((json.loads(line)["system"], json.loads(line)["level"]["sessions"]) for line in levels) == sorted(
        (system, n) for system in SYSTEMS for n in (1, 2)
    )
    assert "vllm_alone" in (out / "capacity.md").read_text() and (out / "capacity.png").stat().st_size > 0


@pytest.mark.parametrize("sampling", [("0", "1"), ("0.7", "0.95")], ids=["greedy", "sampled"])
def test_stream_parity_sets_the_verifier_s_streams_beside_several_vllm_servers(
    verifier: tuple[str, int], vllm_server: str, tmp_path: Path, sampling: tuple[str, str]
) -> None:
    """bench.studies.stream_parity end to end: Generate streams and Decode stretches through the
    verifier beside streams of vLLM's own server, here named twice (as a second vLLM setting
    would be), every ratio of the first; greedy, and sampled as chat traffic is."""
    out = tmp_path / "parity"
    where = ["--cloud", f"verifier={verifier[0]}", "--metrics", f"http://127.0.0.1:{verifier[1]}/metrics"]
    where += ["--vllm-url", f"{vllm_server},again={vllm_server}", "--temperature", sampling[0], "--top-p", sampling[1]]
    _run("-m", "bench.studies.stream_parity", *where, "--streams", "1,2", "--prompt-tokens", "6", "--new-tokens", "5",
         "--repeats", "1", "--vocab", "96", "--stretches", "--out", str(out))  # fmt: skip
    result = json.loads((out / "stream_parity.json").read_text())
    assert result["systems"] == ["vllm_alone", "again", "verifier", "verifier stretch"]
    assert result["reference"] == "vllm_alone"
    assert [row["streams"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["vllm_alone"]["over_vllm_alone"] == 1.0
        for system in result["systems"]:
            assert row[system]["tokens"] == 5 * row["streams"]
            assert row[system]["over_vllm_alone"] == round(row[system]["tok_s"] / row["vllm_alone"]["tok_s"], 3)
        assert row["verifier"]["engine_steps"] >= 4  # the verifier's own vLLM steps, from its /metrics
    report = (out / "report.md").read_text()
    assert "| 2 | again |" in report and "/ vllm_alone |" in report
    assert ("greedy;" in report) == (sampling[0] == "0") and (result["temperature"], result["top_p"]) == tuple(
        map(float, sampling)
    )
