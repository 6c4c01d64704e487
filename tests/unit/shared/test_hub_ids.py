"""Hub ids: what reads as one, and the one line each failure a user meets becomes. The Hub's
answers come from a real HTTP server on loopback (HF_ENDPOINT) speaking the status codes and
X-Error-Code headers the Hub sends; huggingface_hub is the real client."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shared.models import hub
from shared.models.catalog import ModelFetchError
from shared.models.store import model_folder


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Qwen/Qwen2.5-Coder-1.5B-Instruct", hub.HubId("Qwen/Qwen2.5-Coder-1.5B-Instruct")),
        ("org/name@v1.0", hub.HubId("org/name", "v1.0")),
        ("org/name@refs/pr/3", hub.HubId("org/name", "refs/pr/3")),
        ("org/name-GGUF:q4_k_m", hub.HubId("org/name-GGUF", None, "q4_k_m")),
        ("./models/x", None),
        ("/abs/folder", None),
        ("~/folder", None),
        ("a/b/c", None),
        ("just-a-name", None),
        ("org/na me", None),
    ],
)
def test_what_reads_as_a_hub_id(text: str, expected: hub.HubId | None) -> None:
    assert hub.parse_hub_id(text) == expected


# What the Hub answers for each made-up repository (status, X-Error-Code).
ANSWERS = {"gated/model": (401, "GatedRepo"), "missing/model": (404, "RepoNotFound"), "norev/model": (404, "RevisionNotFound")}


class _FakeHub(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        repo = "/".join(self.path.split("/")[3:5])  # /api/models/{org}/{name}/revision/{rev}
        status, code = ANSWERS.get(repo, (500, ""))
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "refused"}')

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield url
    server.shutdown()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("gated/model", "gated/model: the repository is gated; accept its terms on the Hub and set HF_TOKEN"),
        ("missing/model", "missing/model: no such folder here and no such model on the Hub (or it is private: set HF_TOKEN)"),
        ("norev/model@v9", "norev/model@v9: no revision 'v9' in norev/model"),
    ],
)
def test_each_refusal_of_the_hub_is_one_line(endpoint: str, model: str, message: str) -> None:
    with pytest.raises(ModelFetchError) as info:
        model_folder(model, "unused")
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_no_network_and_not_cached_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelFetchError) as info:
        model_folder("org/model", "unused")
    assert str(info.value) == (
        f"org/model: not in the cache ({tmp_path}) and the Hub cannot be reached; fetch it once where the Hub is reachable"
    )


def test_a_full_disk_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    full = OSError(errno.ENOSPC, "No space left on device")
    assert hub.explain(hub.HubId("org/model"), full) == (
        f"org/model: the disk is full under {tmp_path}; free space or set HF_HUB_CACHE elsewhere"
    )


def test_a_name_that_is_nothing_is_one_line() -> None:
    with pytest.raises(ModelFetchError, match=r"^no-such-thing: no such folder, packaged model or Hub id"):
        model_folder("no-such-thing", "unused")


def test_describe_names_a_snapshot_by_repo_and_commit(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--org--name" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    assert hub.describe(snapshot) == "org/name@" + "ab" * 6
    assert hub.describe(tmp_path / "plain-folder") == "plain-folder"


def test_a_missing_path_is_named_as_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelFetchError, match=r"^model folder .*/missing does not exist$"):
        model_folder(str(tmp_path / "missing"), "unused")
