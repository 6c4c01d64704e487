"""`python -m bench.chat_turns --quick` end to end: a real cloud-verifier and `edge-agent serve`
started by the command on loopback ports, the openai client streaming three turns of the
shipped chat script on tiny random models; the result's shape, growing prompts, positive TTFTs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_chat_turns_quick_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "chat"
    flags = ["--quick", "--turns", "3", "--max-new-tokens", "6", "--repeats", "2", "--threads", "1", "--out", str(out)]
    cmd = [sys.executable, "-m", "bench.chat_turns", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "chat_turns.json").read_text())

    assert {"command", "machine", "versions", "date", "git", "settings", "metrics", "summary", "repeats"} <= result.keys()
    assert result["machine"]["cpu_model"] and result["machine"]["cpu_flags"]
    assert result["settings"]["turns"] == 3 and result["settings"]["mode"] == "auto"
    first, second = result["repeats"]
    assert first["system_prompt"] != second["system_prompt"]  # a fresh conversation each repeat
    turns = first["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert all(t["prompt_tokens_from"] == "usage" for t in turns)
    prompts = [t["prompt_tokens"] for t in turns]
    assert prompts[0] < prompts[1] < prompts[2], prompts
    assert all(t["ttft_s"] > 0 and t["total_s"] >= t["ttft_s"] for t in turns)
    assert all(1 <= t["completion_tokens"] <= 6 for t in turns)
    # both /metrics were found and read (their reuse counters, where the build has them)
    assert result["metrics"]["verifier"]["read"] and result["metrics"]["edge"]["read"]
    assert all(t["counters"]["verifier"] is not None and t["counters"]["edge"] is not None for t in turns)

    summary = result["summary"]
    assert [row["turn"] for row in summary["turns"]] == [1, 2, 3]
    assert len(summary["max_ttft_over_turn1_by_repeat"]) == 2
    assert summary["turns"][0]["ttft_over_turn1"] == 1.0
    assert summary["max_ttft_over_turn1"] > 0
    report = (out / "report.md").read_text()
    assert "Max TTFT of turns >= 2 over turn 1's" in report and "| 3 |" in report
    assert (out / "verifier.log").is_file() and (out / "serve.log").is_file()
