"""The real console programs: cloud-verifier on port 0 in its own process, edge-agent against it."""

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve_procs import edge_command, verifier_command
from tests.tiny_models import save_pair

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def verifier_address(models: tuple[Path, Path]) -> Iterator[str]:
    cmd = verifier_command(models[1])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
    assert proc.stderr is not None
    address = None
    for line in proc.stderr:
        if match := re.search(r"serving .* on (\S+:\d+)", line):
            address = match.group(1)
            break
    assert address, "cloud-verifier did not start"
    yield address
    proc.terminate()
    assert proc.wait(timeout=30) == 0  # SIGTERM is a clean shutdown


def _edge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(edge_command(*args), capture_output=True, text=True, env=ENV, timeout=300)


def _answer(address: str, draft: Path, prompts: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """edge-agent answering a prompts file into `out`."""
    return _edge("--cloud", address, "--draft-model", str(draft), "--prompts", str(prompts), "--output", str(out), *flags)


def test_batch_speculative_equals_cloud_only(models: tuple[Path, Path], verifier_address: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 7} w{2 * i + 3}"}) + "\n" for i in range(4)))
    outputs = {}
    for mode in ("speculative", "cloud_only"):
        out = tmp_path / f"{mode}.jsonl"
        done = _answer(verifier_address, models[0], prompts, out, "--mode", mode, "--max-new-tokens", "24", "--k", "3")
        assert done.returncode == 0, done.stderr
        outputs[mode] = [json.loads(line) for line in out.read_text().splitlines()]
    spec, cloud = outputs["speculative"], outputs["cloud_only"]
    assert [r["id"] for r in spec] == ["p0", "p1", "p2", "p3"]
    for s, c in zip(spec, cloud, strict=True):
        assert s["token_ids"] == c["token_ids"] and s["text"] == c["text"]
        assert s["rounds"] > 0 and s["target_forward_passes"] == s["rounds"] + 1
        assert s["bytes_up"] > 0 and s["bytes_down"] > 0 and s["elapsed_s"] > 0
        assert {"draft_tokens", "accepted_tokens"} <= s.keys()


def test_spec_bench_file_is_read_as_is(models: tuple[Path, Path], verifier_address: str, tmp_path: Path) -> None:
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["w4 w5", "w6"]}) + "\n")
    done = _edge(
        "--cloud", verifier_address, "--draft-model", str(models[0]), "--prompts", str(questions), "--max-new-tokens", "8"
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["id"] == "81" and record["category"] == "writing" and len(record["token_ids"]) <= 8


def test_single_prompt_streams_text_and_stats(models: tuple[Path, Path], verifier_address: str) -> None:
    done = _edge(
        "--cloud",
        verifier_address,
        "--draft-model",
        str(models[0]),
        "--prompt",
        "w5 w9",
        "--max-new-tokens",
        "12",
        "--k",
        "4",
        "--show-steps",
    )
    assert done.returncode == 0, done.stderr
    assert "k= 4" in done.stdout  # one line per round: --k alone picks the fixed policy
    assert re.search(r"\[auto\] \d+ tokens .* tau .* tokens speculative/cloud_only \d+/\d+", done.stderr)


def test_cli_errors_are_one_line(models: tuple[Path, Path], tmp_path: Path) -> None:
    done = _edge("--draft-model", str(tmp_path / "missing"), "--prompt", "hi", "--mode", "edge_only")
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "edge-agent: error:" in done.stderr and "missing" in done.stderr


def test_unreachable_cloud_is_one_line(models: tuple[Path, Path]) -> None:
    done = _edge(
        "--cloud",
        "127.0.0.1:1",
        "--draft-model",
        str(models[0]),
        "--prompt",
        "w5",
        "--verify-timeout-ms",
        "2000",
        "--reconnect-window-s",
        "1",
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert "unreachable" in last and "gave up reconnecting to the verifier after 1." in last


def test_ngram_edge_loads_no_model(models: tuple[Path, Path], verifier_address: str, tmp_path: Path) -> None:
    """--drafter ngram needs only a tokenizer: a folder without weights works, and the output
    still equals cloud_only."""
    from transformers import AutoTokenizer

    tokenizer_only = tmp_path / "tokenizer-only"
    AutoTokenizer.from_pretrained(models[0]).save_pretrained(tokenizer_only)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "r", "prompt": "w5 w6 w7 w5 w6 w7 w5 w6"}) + "\n")
    records = {}
    for mode in ("speculative", "cloud_only"):
        out = tmp_path / f"{mode}.jsonl"
        flags = ["--drafter", "ngram", "--mode", mode, "--max-new-tokens", "16"]
        done = _answer(verifier_address, tokenizer_only, prompts, out, *flags)
        assert done.returncode == 0, done.stderr
        records[mode] = json.loads(out.read_text())
    assert records["speculative"]["token_ids"] == records["cloud_only"]["token_ids"]
    assert records["speculative"]["rounds"] > 0


# Run edge-agent with torch, transformers and the cloud package unimportable: a lean edge install.
LEAN = """
import sys
from importlib.abc import MetaPathFinder

class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "cloud"):
            raise ImportError(f"{name} is not installed (lean edge)")
        return None

sys.meta_path.insert(0, Missing())
from edge.__main__ import main
code = main(sys.argv[1:])
assert not any(m.split(".")[0] in ("torch", "transformers", "cloud") for m in sys.modules), "heavy import"
sys.exit(code)
"""


def test_a_llamacpp_edge_imports_no_torch(models: tuple[Path, Path], verifier_address: str, tmp_path: Path) -> None:
    """The llama.cpp and n-gram drafters run without torch, transformers or the cloud's code,
    and the llama.cpp edge's output equals cloud_only's."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i + 3} w{i + 9} w{i}"}) + "\n" for i in range(3)))
    tokens = {}
    for name, flags in {
        "llama.cpp": ["--draft-runtime", "llama.cpp"],
        "ngram": ["--drafter", "ngram"],
        "cloud_only": ["--mode", "cloud_only"],
    }.items():
        out = tmp_path / f"{name}.jsonl"
        cmd = [
            sys.executable,
            "-c",
            LEAN,
            "--cloud",
            verifier_address,
            "--draft-model",
            str(models[0]),
            "--draft-threads",
            "1",
            "--prompts",
            str(prompts),
            "--output",
            str(out),
            "--max-new-tokens",
            "20",
            *flags,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
        assert done.returncode == 0, done.stderr
        tokens[name] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert tokens["llama.cpp"] == tokens["ngram"] == tokens["cloud_only"]
    # Without --cloud the lean edge says what it needs instead of failing on an import.
    done = subprocess.run(
        [sys.executable, "-c", LEAN, "--draft-model", str(models[0]), "--prompt", "w5"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert done.returncode == 1 and "cloud-verifier is not installed" in done.stderr
