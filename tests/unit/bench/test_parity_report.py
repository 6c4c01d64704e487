"""The CPU parity benchmark's pieces that need no server: the GPU-short model folder
(tools/proxy_model.py) and the one report of a run (bench/studies/parity_report.py), pooled over
the times each server was up and each figure beside its goal."""

import json
from pathlib import Path

import pytest

from bench.studies.parity_report import build, main, report
from shared.errors import ConfigError
from tools.proxy_model import SHAPE
from tools.proxy_model import build as build_proxy


def _source(folder: Path) -> Path:
    folder.mkdir()
    config = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 28, "hidden_size": 1536, "vocab_size": 151936}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_text("weights")
    return folder


def test_the_proxy_keeps_the_tokenizer_and_vocabulary_and_shrinks_the_rest(tmp_path: Path) -> None:
    out = build_proxy(_source(tmp_path / "target"), tmp_path / "proxy")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 151936 and config["architectures"] == ["Qwen2ForCausalLM"]
    assert {key: config[key] for key in SHAPE} == SHAPE
    assert (out / "tokenizer.json").read_text() == "{}"
    assert not (out / "model.safetensors").exists()  # dummy weights: vLLM fills the shapes
    with pytest.raises(ConfigError, match="config.json"):
        build_proxy(tmp_path / "missing", tmp_path / "other")


def _streams(out: Path, system: str, temperature: str, turn: int, tok_s: dict[int, list[float]], ttft: float) -> None:
    folder = out / "streams" / f"{system}-t{temperature}-{turn}"
    folder.mkdir(parents=True)
    rows = [
        {"streams": n, system: {"tok_s_runs": runs, "ttft_ms_median": ttft, "tpot_ms_median": 2.0}} for n, runs in tok_s.items()
    ]
    (folder / "stream_parity.json").write_text(json.dumps({"systems": [system], "rows": rows}))


def test_a_run_s_figures_are_pooled_per_server_and_set_beside_their_goals(tmp_path: Path) -> None:
    _streams(tmp_path, "vllm_alone", "0", 1, {1: [100.0, 110.0], 64: [1000.0]}, 10.0)
    _streams(tmp_path, "vllm_alone", "0", 2, {1: [90.0, 120.0], 64: [1000.0]}, 30.0)
    _streams(tmp_path, "cloud_only", "0", 1, {1: [104.0, 106.0], 64: [900.0]}, 12.0)
    _streams(tmp_path, "cloud_only", "0", 2, {1: [103.0, 107.0], 64: [800.0]}, 13.0)
    (tmp_path / "served_rounds").mkdir()
    served = {
        "rows": [
            {"sessions": 1, "round_trip_ms": 4.0, "engine_ms": 3.5, "serving_ms": 0.5, "transport_ms": 0.3},
            {"sessions": 16, "round_trip_ms": 9.0, "engine_ms": 7.0, "serving_ms": 2.0, "trip_over_engine": 1.29},
        ]
    }
    (tmp_path / "served_rounds" / "served_rounds.json").write_text(json.dumps(served))
    result = build(tmp_path)
    level = result["streams"]["0"]["1"]
    assert level["vllm_alone"]["tok_s"] == 105.0  # the median of all four runs
    assert level["vllm_alone"]["ttft_ms"] == 20.0 and level["vllm_alone"]["times_up"] == 2
    text = report(result)
    assert "| 1 | 105 | 105 | 1.00x yes |" in text  # tok/s goal met
    assert "| 64 | 1,000 | 850 | 0.85x **no** |" in text  # not met, said so
    assert "0.62x yes" in text  # TTFT 12.5 against 20 ms
    assert "| 1 | 4.00 | 3.50 | 0.50 | 0.30 | ≤ engine + 1 ms | yes |" in text
    assert "| 16 | 9.00 | 7.00 | 2.00 | – | ≤ 1.2x engine | **no** |" in text  # a result from before the transport's floor
    assert main([str(tmp_path)]) == 0 and (tmp_path / "parity.json").is_file() and (tmp_path / "report.md").is_file()


def test_a_folder_without_results_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no parity results"):
        build(tmp_path)
