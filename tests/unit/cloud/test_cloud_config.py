"""cloud-verifier settings: flags over environment over config file over defaults."""

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from cloud.__main__ import main, vllm_kv_bytes, vllm_options
from cloud.config import VerifierSettings, load_settings
from shared.cli import add_settings_flags
from shared.errors import ConfigError

FILES = {
    "json": '{"port": 1111, "http-port": 2222, "max_sessions": 3, "log_format": "json"}',
    "toml": 'port = 1111\nhttp-port = 2222\nmax_sessions = 3\nlog_format = "json"\n',
}


@pytest.mark.parametrize("suffix", sorted(FILES))
def test_flags_beat_env_beat_file_beat_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    path = tmp_path / f"verifier.{suffix}"
    path.write_text(FILES[suffix])
    monkeypatch.setenv("SPECDEC_CLOUD_HTTP_PORT", "3333")
    monkeypatch.setenv("SPECDEC_CLOUD_PORT", "5555")
    settings = load_settings({"config": str(path), "port": 4444})
    assert settings.port == 4444  # flag over env and file
    assert settings.http_port == 3333  # env over file
    assert settings.max_sessions == 3 and settings.log_format == "json"  # file over defaults
    assert settings.max_draft_tokens == VerifierSettings.model_fields["max_draft_tokens"].default


def test_config_file_named_by_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "verifier.toml"
    path.write_text("reflection = false\ndrain_grace_s = 2.5\n")
    monkeypatch.setenv("SPECDEC_CLOUD_CONFIG", str(path))
    settings = load_settings({})
    assert settings.reflection is False and settings.drain_grace_s == 2.5


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("verifier.json", '{"prot": 1}', "unknown setting(s) prot"),
        ("verifier.json", '{"config": "other.json"}', "unknown setting(s) config"),
        ("verifier.json", "[1, 2]", "expected an object"),
        ("verifier.toml", "port = ", "--config"),
        ("verifier.yaml", "port: 1", "expected a .json or .toml file"),
    ],
)
def test_bad_config_files_are_config_errors(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_settings({"config": str(path)})


def test_missing_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(tmp_path / "nope.toml")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cloud-verifier: error: --config") and "nope.toml" in err


def test_help_documents_every_setting_and_the_precedence(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in VerifierSettings.model_fields:
        assert f"--{name.replace('_', '-')}" in text and f"SPECDEC_CLOUD_{name.upper()}" in text
    assert "Precedence, highest first: flags, SPECDEC_CLOUD_* environment variables, the --config file, defaults" in text


def test_the_engine_is_a_setting_of_the_known_engines() -> None:
    assert load_settings({}).engine == "transformers"
    assert load_settings({"engine": "vllm"}).engine == "vllm"
    with pytest.raises(ValidationError):
        load_settings({"engine": "sglang"})


def test_vllm_takes_the_kv_it_is_given_and_on_a_gpu_else_what_its_memory_share_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert vllm_kv_bytes(load_settings({}), cuda=False) == 4 << 30  # a CPU: the default size
    assert vllm_kv_bytes(load_settings({}), cuda=True) == 0  # a GPU: vLLM sizes it (--gpu-memory-utilization)
    assert vllm_kv_bytes(load_settings({"max_kv_bytes": 1 << 30}), cuda=True) == 1 << 30
    path = tmp_path / "verifier.toml"
    path.write_text("max-kv-bytes = 123456\n")
    assert vllm_kv_bytes(load_settings({"config": str(path)}), cuda=True) == 123456
    monkeypatch.setenv("SPECDEC_CLOUD_MAX_KV_BYTES", "654321")
    assert vllm_kv_bytes(load_settings({}), cuda=True) == 654321


def test_vllm_on_a_cpu_runs_on_the_threads_asked() -> None:
    assert vllm_options(load_settings({"threads": 3}), "/models/target", "bfloat16", cuda=False).cpu_threads == 3
    assert vllm_options(load_settings({}), "/models/target", "bfloat16", cuda=False).cpu_threads == 0  # every usable core


def _flags_parser() -> argparse.ArgumentParser:
    """cloud-verifier's settings as command-line flags."""
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, VerifierSettings)
    return parser


def test_vllm_schedules_asynchronously_on_a_gpu_unless_told_not_to_and_on_a_cpu_when_told_to() -> None:
    parser = _flags_parser()
    cases = (([], True, False), (["--no-vllm-async-scheduling"], False, False), (["--vllm-async-scheduling"], True, True))
    for flags, on_gpu, on_cpu in cases:
        settings = load_settings(vars(parser.parse_args(flags)))
        assert vllm_options(settings, "/models/target", "bfloat16", cuda=True).async_scheduling is on_gpu
        assert vllm_options(settings, "/models/target", "bfloat16", cuda=False).async_scheduling is on_cpu


def test_vllm_cuda_graphs_are_vllm_s_choice_unless_a_mode_is_named() -> None:
    parser = _flags_parser()
    for flags, mode in (([], ""), (["--vllm-cudagraph-mode", "FULL"], "FULL")):
        settings = load_settings(vars(parser.parse_args(flags)))
        assert vllm_options(settings, "/models/target", "bfloat16", cuda=True).cudagraph_mode == mode
    with pytest.raises(SystemExit):
        parser.parse_args(["--vllm-cudagraph-mode", "SOME"])


@pytest.mark.parametrize(
    ("flags", "in_child"), [([], True), (["--vllm-engine-process"], True), (["--no-vllm-engine-process"], False)]
)
def test_the_vllm_engine_runs_in_a_child_process_unless_told_not_to(flags: list[str], in_child: bool) -> None:
    parser = _flags_parser()
    assert load_settings(vars(parser.parse_args(flags))).vllm_engine_process is in_child
