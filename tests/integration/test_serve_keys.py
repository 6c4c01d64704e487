"""`edge-agent serve` with several callers (--serve-api-keys-file) against a real cloud-verifier
subprocess, driven with the real `openai` client: each caller's conversations are reused for
its own requests only (another caller's exact prompt reuses nothing), one --serve-api-key is
one caller as before, and a bad keys file or both key flags are one readable line."""

import hashlib
import logging
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from edge.config import EdgeSettings
from edge.serve.server import ServeSettings, _check_settings
from tests.serve_procs import ENV, SERVE_READY, Server, serve_cmd, start, start_verifier
from tests.tiny_models import save_pair

ALICE_KEY, BOB_KEY, SOLO_KEY = "alice-secret-1", "bob secret #2", "solo-secret-3"  # bob's: spaces and a '#'
KEYS_FILE = f"""# the callers of this laptop's endpoint
alice  {ALICE_KEY}
bob    sha256:{hashlib.sha256(BOB_KEY.encode()).hexdigest()}   # stored hashed
"""
# Longer than the answer: an entry of it is worth taking (it keeps more than it drops).
HISTORY = " ".join(f"w{i}" for i in range(20, 60))
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def verifier(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, address, _ = start_verifier(models[1], tmp_path_factory.mktemp("verifier") / "verifier.log")
    yield address
    assert server.stop() == 0


def _serve(models: tuple[Path, Path], verifier: str, log: Path, *flags: str) -> Server:
    return start(serve_cmd(models[0], verifier, "--max-new-tokens", str(MAX_TOKENS), "--k", "3", *flags), log, SERVE_READY)


@pytest.fixture(scope="module")
def keyed(models: tuple[Path, Path], verifier: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("keyed")
    (folder / "keys.txt").write_text(KEYS_FILE)
    server = _serve(models, verifier, folder / "serve.log", "--serve-api-keys-file", str(folder / "keys.txt"))
    yield server
    assert server.stop() == 0


def _api(server: Server, key: str) -> OpenAI:
    return OpenAI(base_url=server.match.group(1) + "/v1", api_key=key, max_retries=0, timeout=120)


def _turn(api: OpenAI, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """(answer, prompt tokens, draft tokens reused) of one greedy speculative turn."""
    reply = api.chat.completions.create(
        model="any", messages=messages, temperature=0, extra_body={"speculative": {"enabled": True}}
    )
    assert reply.usage is not None
    stats: dict[str, Any] = reply.model_extra["speculative_decoding"]  # type: ignore[index]
    assert stats["exact"] and stats["draft_reused_tokens"] + stats["draft_prefilled_tokens"] == reply.usage.prompt_tokens
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens, stats["draft_reused_tokens"]


def _next(messages: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "w5 w9"}]


def test_a_caller_reuses_its_own_conversations_and_never_anothers(keyed: Server) -> None:
    alice, bob = _api(keyed, ALICE_KEY), _api(keyed, BOB_KEY)
    first = [{"role": "user", "content": HISTORY}]
    alice_answer, prompt, reused = _turn(alice, first)
    assert reused == 0
    bob_answer, _, bob_reused = _turn(bob, first)  # alice's exact prompt: her cache is not his
    assert bob_reused == 0 and bob_answer == alice_answer
    _, _, alice_next = _turn(alice, _next(first, alice_answer))
    assert alice_next >= prompt - 1  # all her first prompt but its last token, which the template does not repeat
    _, _, bob_next = _turn(bob, _next(first, bob_answer))  # his own first turn's cache
    assert bob_next >= prompt - 1


@pytest.mark.parametrize("key", ["wrong", ALICE_KEY[:-1], hashlib.sha256(BOB_KEY.encode()).hexdigest()])
def test_an_unknown_key_is_refused(keyed: Server, key: str) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        _api(keyed, key).models.list()
    assert refused.value.code == "invalid_api_key" and refused.value.status_code == 401


def test_no_key_is_refused(keyed: Server) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(keyed.match.group(1) + "/v1/models", timeout=10)
    assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"


def test_one_serve_api_key_is_one_caller(models: tuple[Path, Path], verifier: str, tmp_path: Path) -> None:
    server = _serve(models, verifier, tmp_path / "serve.log", "--serve-api-key", SOLO_KEY)
    try:
        with pytest.raises(openai.AuthenticationError):
            _api(server, "wrong").models.list()
        solo = _api(server, SOLO_KEY)
        first = [{"role": "user", "content": HISTORY}]
        answer, prompt, reused = _turn(solo, first)
        assert reused == 0
        assert _turn(solo, _next(first, answer))[2] >= prompt - 1
    finally:
        assert server.stop() == 0


def _serve_error(*flags: str) -> str:
    """The stderr of an `edge-agent serve` that must refuse to start."""
    done = subprocess.run([sys.executable, "-m", "edge", "serve", *flags], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    return done.stderr.strip()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f"# ok\nalice {ALICE_KEY}\nsolo {SOLO_KEY} admin\n", "line 3: expected a key, 'NAME KEY' or 'NAME KEY operator'"),
        (f"alice {ALICE_KEY}\nbob sha256:{'0' * 63}\n", "line 2: a sha256: entry needs exactly 64 hex digits"),
        ("# only a comment\n\n", "no keys in it"),
    ],
)
def test_a_bad_keys_file_is_one_line_naming_the_line(tmp_path: Path, text: str, says: str) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(text)
    error = _serve_error("--serve-api-keys-file", str(keys))
    assert error.startswith(f"edge-agent serve: error: --serve-api-keys-file {keys}") and says in error
    assert SOLO_KEY not in error and ALICE_KEY not in error  # the file's text may hold keys


def test_a_missing_keys_file_and_both_key_flags_are_one_line(tmp_path: Path) -> None:
    assert f"--serve-api-keys-file {tmp_path / 'none.txt'}: No such file" in _serve_error(
        "--serve-api-keys-file", str(tmp_path / "none.txt")
    )
    (tmp_path / "keys.txt").write_text(KEYS_FILE)
    both = _serve_error("--serve-api-key", SOLO_KEY, "--serve-api-keys-file", str(tmp_path / "keys.txt"))
    assert "--serve-api-key or --serve-api-keys-file, not both" in both and SOLO_KEY not in both


def test_a_keys_file_is_a_key_for_another_host(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Serving beyond loopback warns without a key; a keys file is one."""
    edge = EdgeSettings()
    with caplog.at_level(logging.WARNING, logger="edge-agent"):
        _check_settings(edge, ServeSettings(host="0.0.0.0", serve_api_keys_file=str(tmp_path / "keys.txt")))
        assert not caplog.records
        _check_settings(edge, ServeSettings(host="0.0.0.0"))
    assert "without --serve-api-key or --serve-api-keys-file" in caplog.text
