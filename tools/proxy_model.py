"""A model folder whose vLLM step on a CPU is as short as a real model's on a GPU: the config of
the project's target (Qwen2.5-Coder, fetched by `specedge-models fetch`) shrunk to 2 layers,
hidden 128, 2 attention heads of 64 (a head size vLLM's CPU attention takes) and 1 KV head, with
the full 151,936-token vocabulary and the real tokenizer files, and no weights: engines load it
with `--load-format dummy` (vLLM's random weights in the folder's shapes).

On such a model a step costs a few milliseconds, as a 7B model's decode step does on a GPU, so
what the verifier adds around vLLM's step (Python, hand-offs, scheduling) shows as it would
there. tools/parity_cpu.sh runs the parity benchmark on it.

    python -m tools.proxy_model [--source FOLDER] OUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from shared.cli import run_cli
from shared.errors import ConfigError
from shared.models import default_cache_dir

SOURCE = "qwen2.5-coder-1.5b-instruct"  # the pair's target: its tokenizer and architecture
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "head_dim": 64,
    "num_key_value_heads": 1,
    "max_window_layers": 2,
}


def build(source: Path, out: Path) -> Path:
    """Write the proxy folder `out` from the model folder `source` (config and tokenizer)."""
    config_path = source / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{source} holds no config.json: run `specedge-models fetch` first, or pass --source")
    config = json.loads(config_path.read_text())
    config.update(SHAPE)
    config["layer_types"] = ["full_attention"] * SHAPE["num_hidden_layers"]
    config["tie_word_embeddings"] = False
    config["_name_or_path"] = f"{source.name} shape, 2 layers of 128 (dummy weights)"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    prog = "python -m tools.proxy_model"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--source", type=Path, help=f"the model folder to shrink (default: the fetched {SOURCE})")
    args = parser.parse_args(argv)

    def run() -> int:
        print(build(args.source or default_cache_dir() / SOURCE, args.out))  # noqa: T201
        return 0

    return run_cli(prog, run)


if __name__ == "__main__":
    raise SystemExit(main())
