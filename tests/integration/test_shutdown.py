"""cloud-verifier as its own process: HTTP up before the model, JSON logs, and SIGTERM
draining (no new sessions, open ones finish their rounds, exit 0)."""

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from tests.harness import TargetEngine
from tests.serve_procs import verifier_command
from tests.tiny_models import save_pair

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Verifier:
    """A cloud-verifier process and its stderr, read line by line on a thread."""

    def __init__(self, model: Path | str, *flags: str) -> None:
        cmd = verifier_command(model, "--log-format", "json", *flags)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines seen so far (other stderr lines, e.g. library warnings, skipped)."""
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return [json.loads(line) for line in self.seen if line.startswith("{")]

    def wait_for(self, prefix: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events() if e["message"].startswith(prefix)]
            if found:
                return found[0]
            assert self.reader.is_alive() or not self.lines.empty(), "exited:\n" + "\n".join(self.seen)
            time.sleep(0.05)
        raise AssertionError(f"no {prefix!r} line in:\n" + "\n".join(self.seen))

    def exit_code(self, timeout: float) -> int:
        """The process's exit status; past `timeout`, a failure that shows its last log lines."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.events()
            raise AssertionError(f"still running {timeout} s on; its last lines:\n" + "\n".join(self.seen[-40:])) from None

    def port(self, field: str) -> int:
        return next(e[field] for e in self.events() if field in e)


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture(scope="module")
def target(target_engine: TargetEngine, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[str, ...]]:
    """The tiny target as cloud-verifier serves it in each engine: its --model and engine flags."""
    return target_engine.served_model(save_pair(tmp_path_factory.mktemp("models"))[1])


@pytest.fixture
def verifier(target: tuple[Path, tuple[str, ...]]) -> Iterator[Verifier]:
    model, engine_flags = target
    process = Verifier(model, *engine_flags, "--drain-grace-s", "60")
    yield process
    if process.proc.poll() is None:
        process.proc.kill()
        process.proc.wait()


def test_http_comes_up_before_the_model_and_logs_are_json(verifier: Verifier) -> None:
    verifier.wait_for("serving")
    order = [e["message"].split(" ")[0] for e in verifier.events()]
    assert order.index("http") < order.index("loading") < order.index("serving")
    assert all({"time", "level", "logger", "message"} <= e.keys() for e in verifier.events())
    assert _readyz(verifier.port("http_port")) == 200


def test_sigterm_finishes_rounds_refuses_sessions_and_exits_zero(verifier: Verifier) -> None:
    verifier.wait_for("serving")
    http_port = verifier.port("http_port")
    channel = grpc.insecure_channel(f"127.0.0.1:{verifier.port('grpc_port')}")
    stub = pb_grpc.VerifierStub(channel)
    opened = stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=[5, 6, 7, 8]), timeout=30)

    in_flight = stub.Verify.future(pb.VerifyRequest(session_id=opened.session_id, base_position=4, draft_tokens=[9, 10, 11]))
    verifier.proc.send_signal(signal.SIGTERM)
    first = in_flight.result(timeout=30)  # the round under way when the signal came completes
    assert first.new_base_position == 4 + first.accepted_len + 1

    verifier.wait_for("draining")
    assert _readyz(http_port) == 503
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    # The open session goes on; a new one is refused with UNAVAILABLE.
    second = stub.Verify(
        pb.VerifyRequest(session_id=opened.session_id, base_position=first.new_base_position, draft_tokens=[3]), timeout=30
    )
    assert second.new_base_position > first.new_base_position
    with pytest.raises(grpc.RpcError) as refused:
        stub.OpenSession(pb.OpenSessionRequest(prompt_tokens=[5, 6]), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
    assert verifier.proc.poll() is None  # still draining: a session is open

    stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=30)
    started = time.monotonic()
    assert verifier.exit_code(timeout=30) == 0
    assert time.monotonic() - started < 20  # left once the last session closed, long before the 60 s grace
    assert verifier.wait_for("stopped")["left_open"] == 0
    channel.close()


def test_grace_period_ends_the_drain(target: tuple[Path, tuple[str, ...]]) -> None:
    model, engine_flags = target
    process = Verifier(model, *engine_flags, "--drain-grace-s", "1")
    try:
        process.wait_for("serving")
        with grpc.insecure_channel(f"127.0.0.1:{process.port('grpc_port')}") as channel:
            pb_grpc.VerifierStub(channel).OpenSession(pb.OpenSessionRequest(prompt_tokens=[5, 6]), timeout=30)
        process.proc.send_signal(signal.SIGTERM)
        assert process.exit_code(timeout=30) == 0
        assert process.wait_for("stopped")["left_open"] == 1
    finally:
        if process.proc.poll() is None:
            process.proc.kill()


def test_model_load_failure_is_one_line(tmp_path: Path) -> None:
    """One engine: both engines resolve --model through the same model_folder, whose message this checks."""
    process = Verifier(tmp_path / "missing")
    assert process.exit_code(timeout=120) == 1
    process.reader.join(timeout=10)
    process.events()
    assert process.seen[-1].startswith("cloud-verifier: error: model folder") and "Traceback" not in "\n".join(process.seen)
