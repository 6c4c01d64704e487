"""`python -m bench --quick` end to end: a real verifier on port 0, real edge-agent and in-process
runner children, the proxy at +50 ms; the result must match its schema and every system
must have answered every prompt."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema

from bench.result import schema
from bench.systems import DEFAULT_SYSTEMS

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_quick_bench_end_to_end(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"id": "p1", "prompt": "w5 w6 w7", "category": "qa"}\n{"id": "p2", "prompt": "w9 w10 w11 w12", "category": "writing"}\n'
    )
    output = tmp_path / "result.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--prompts",
            str(prompts),
            "--rtt-ms",
            "50",
            "--max-new-tokens",
            "8",
            "--k",
            "3",
            "--output",
            str(output),
            "--report",
            str(tmp_path / "report"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(output.read_text())
    jsonschema.validate(result, schema())

    runs = {run["system"]: run for run in result["runs"]}
    assert list(runs) == list(DEFAULT_SYSTEMS)
    for name, run in runs.items():
        answered = {r["id"]: r for r in run["requests"]}
        assert set(answered) == {"p1", "p2"}, name
        assert all(r["token_ids"] for r in answered.values()), name
    assert runs["cloud_only"]["rtt_ms"] == 50 and runs["speculative"]["rtt_ms"] == 50
    assert runs["target-only"]["rtt_ms"] is None and runs["edge_only"]["rtt_ms"] is None
    # Greedy fp32: the lossless systems reproduce the reference token for token.
    for name in ("hf-assisted", "cloud_only", "speculative", "auto"):
        assert runs[name]["identical_to_target_only"] == 2, name
    speculative = runs["speculative"]["summary"]
    assert speculative["tau"] is not None and speculative["tau"] >= 1
    assert 1 <= len(speculative["acceptance_by_position"]) <= 3  # --k 3 reached the edge
    assert runs["speculative"]["process"]["verifier_peak_rss_mib"] > 0
    assert runs["speculative"]["ratios"].keys() == {"vs_target_only", "vs_hf_assisted", "vs_cloud_only"}
    # the exact prompt set and every run's raw JSONL are kept beside the result
    assert (tmp_path / "result_files" / "speculative.unpinned.rtt50.jsonl").is_file()
    assert (tmp_path / "result_files" / "target-only.unpinned.jsonl").is_file()
    kept = (tmp_path / "result_files" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in kept] == ["p1", "p2"]  # a --prompts file keeps its order
    report = tmp_path / "report"
    assert "## Overall" in (report / "report.md").read_text()
    for plot in ("tokens_per_s.png", "acceptance.png", "latency_cdf.png"):
        assert (report / plot).read_bytes().startswith(b"\x89PNG"), plot
