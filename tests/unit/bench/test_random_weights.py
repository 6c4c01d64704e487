"""bench/random_weights.py: a model folder with a config's architecture and random weights,
which the verifier's loader takes like a real one."""

from pathlib import Path

from bench.random_weights import main
from shared import lm


def test_writes_a_loadable_model_of_the_configs_shape(target_model, tmp_path: Path) -> None:
    config_dir = tmp_path / "config"
    target_model.config.save_pretrained(config_dir)
    (config_dir / "tokenizer.json").write_text("{}")
    assert main(["--config-dir", str(config_dir), "--out", str(tmp_path / "model"), "--dtype", "float32", "--device", "cpu"]) == 0
    model = lm.load_model(tmp_path / "model", "float32", "cpu")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads"):
        assert getattr(model.config, name) == getattr(target_model.config, name)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in target_model.parameters())
    assert (tmp_path / "model" / "tokenizer.json").read_text() == "{}"  # the tokenizer travels with it


def test_a_folder_without_config_is_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--config-dir", str(tmp_path), "--out", str(tmp_path / "model")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no config.json" in err
