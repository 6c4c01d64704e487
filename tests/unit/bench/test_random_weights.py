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


def test_the_shipped_7b_configuration_is_qwen2_5_coder_7b() -> None:
    """bench/data/configs/qwen2.5-coder-7b: the published architecture (7.62B parameters, 28
    layers, GQA 28/4 heads, a 152,064-row vocabulary padded past the tokenizer's 151,936), built
    on the meta device: no memory, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(Path(__file__).parents[3] / "bench/data/configs/qwen2.5-coder-7b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 7_615_616_512
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (28, 28, 4)
    assert config.vocab_size == 152_064 and not config.tie_word_embeddings
