"""The pair check before the first session, against a real cloud-verifier: a matching pair
prints the startup line (models, size ratio, measured c); a draft whose tokenizer differs at one
id, or in one special token, stops the edge with one line naming it; a draft whose chat template
differs renders prompts with the target's; Describe refuses a bad token range with
INVALID_ARGUMENT and sends its template when asked."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from shared.tokenizer_card import BLOCK
from tests.serve_procs import ENV, edge_command, start_verifier
from tests.tiny_models import save_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def verifier(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, address, _ = start_verifier(pair[1], tmp_path_factory.mktemp("logs") / "verifier.log")
    yield address
    server.stop()


def _edge(address: str, draft: Path) -> subprocess.CompletedProcess[str]:
    flags = ["--cloud", address, "--draft-model", str(draft), "--draft-runtime", "transformers"]
    flags += ["--prompt", "w1 w2", "--max-new-tokens", "4", "--mode", "speculative", "--k", "2"]
    return subprocess.run(edge_command(*flags), capture_output=True, text=True, timeout=300, env=ENV)


def _copy(draft: Path, to: Path) -> Path:
    shutil.copytree(draft, to, ignore=shutil.ignore_patterns("*.gguf"))
    return to


def _edit_tokenizer(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data)
    (folder / "tokenizer.json").write_text(json.dumps(data))


def test_a_matching_pair_prints_sizes_and_the_measured_c(verifier: str, pair: tuple[Path, Path]) -> None:
    done = _edge(verifier, pair[0])
    assert done.returncode == 0, done.stderr[-3000:]
    line = re.search(r"draft draft \((\S+)\) / target target \((\S+)\): size ratio (\S+), c = (\S+) \(a draft token", done.stderr)
    assert line, done.stderr[-3000:]
    assert line.group(1) == line.group(2) and line.group(3) == "1.00"  # the tiny pair: one shape
    assert float(line.group(4)) > 0
    assert "chat template differs" not in done.stderr


def test_a_token_that_differs_is_one_line_naming_it(verifier: str, pair: tuple[Path, Path], tmp_path: Path) -> None:
    draft = _copy(pair[0], tmp_path / "renamed")

    def rename(data: dict) -> None:  # type: ignore[type-arg]
        data["model"]["vocab"]["zz"] = data["model"]["vocab"].pop("w40")

    _edit_tokenizer(draft, rename)
    done = _edge(verifier, draft)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "edge-agent: error: the draft's tokenizer is not the target's: id 42 is 'zz' in the draft (renamed), "
        "'w40' in the target (target); use a draft of the target's model family"
    )


def test_a_special_token_that_differs_is_one_line(verifier: str, pair: tuple[Path, Path], tmp_path: Path) -> None:
    draft = _copy(pair[0], tmp_path / "special")

    def mark_special(data: dict) -> None:  # type: ignore[type-arg]
        added = dict(data["added_tokens"][0]) | {"id": 5, "content": "w3"}
        data["added_tokens"].append(added)

    _edit_tokenizer(draft, mark_special)
    done = _edge(verifier, draft)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "edge-agent: error: the draft's tokenizer is not the target's: special token id 5 is 'w3' in the draft, "
        "absent in the target (special / target)"
    )


def test_a_different_chat_template_gives_way_to_the_targets(verifier: str, pair: tuple[Path, Path], tmp_path: Path) -> None:
    draft = _copy(pair[0], tmp_path / "templated")
    (draft / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((draft / "tokenizer_config.json").read_text())
    (draft / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": "w5 {{ messages[0]['content'] }}"}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "w7 w8"}) + "\n")
    outputs = {}
    for name, folder in (("same", pair[0]), ("other", draft)):
        out = tmp_path / f"{name}.jsonl"
        flags = ["--cloud", verifier, "--draft-model", str(folder), "--draft-runtime", "transformers", "--mode", "cloud_only"]
        done = subprocess.run(
            edge_command(*flags, "--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "8"),
            capture_output=True,
            text=True,
            timeout=300,
            env=ENV,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[name] = (json.loads(out.read_text())["token_ids"], done.stderr)
    assert "prompts are rendered with the target's" in outputs["other"][1]
    assert "chat template differs" not in outputs["same"][1]
    assert outputs["other"][0] == outputs["same"][0]  # the same prompt ids: the target's template rendered it


def test_describe_lists_a_block_of_tokens_and_refuses_a_bad_range(verifier: str) -> None:
    with grpc.insecure_channel(verifier) as channel:
        stub = pb_grpc.VerifierStub(channel)
        whole = stub.Describe(pb.DescribeRequest(), timeout=30)
        assert whole.has_tokenizer and whole.tokenizer_size == 96 and whole.vocab_block_size == BLOCK
        assert len(whole.vocab_block_digests) == 1 and whole.decode_step_ms > 0 and not whole.tokens
        some = stub.Describe(pb.DescribeRequest(tokens_from=2, tokens_count=3), timeout=30)
        assert list(some.tokens) == ["w0", "w1", "w2"] and not some.chat_template
        assert "w1" in stub.Describe(pb.DescribeRequest(chat_template=True), timeout=30).chat_template
        for bad in (pb.DescribeRequest(tokens_count=BLOCK + 1), pb.DescribeRequest(tokens_from=96, tokens_count=1)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Describe(bad, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
