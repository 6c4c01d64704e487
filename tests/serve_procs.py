"""`edge-agent serve` and `cloud-verifier` as subprocesses on port 0, for the serve tests: each
started with its output in a log file and awaited by the line it prints once it serves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
SERVE_READY = r"serving on (http://\S+:\d+)"


def verifier_command(model: Path | str, *flags: str, port: int = 0) -> list[str]:
    """`cloud-verifier` of `model` for a test: fp32, one thread, any free HTTP port."""
    base = [sys.executable, "-m", "cloud", "--model", str(model), "--port", str(port), "--http-port", "0"]
    return [*base, "--dtype", "float32", "--threads", "1", *flags]


def edge_command(*flags: str) -> list[str]:
    """`edge-agent` for a test: fp32, one thread."""
    return [sys.executable, "-m", "edge", "--dtype", "float32", "--threads", "1", *flags]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    log: Path
    match: re.Match[str]

    def stop(self) -> int:
        """SIGTERM; the exit status (0: a clean stop)."""
        self.proc.terminate()
        return self.proc.wait(timeout=60)


def start(cmd: list[str], log: Path, ready: str, timeout_s: float = 180) -> Server:
    """Start a server with its output in `log`; return once a line matches `ready`."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if match := re.search(ready, log.read_text()):
            return Server(proc, log, match)
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {ready!r} in {log}:\n{log.read_text()[-3000:]}")


def start_verifier(target: Path, log: Path, *flags: str, timeout_s: float = 180) -> tuple[Server, str, int]:
    """A cloud-verifier of `target` (and `flags`): (server, gRPC address, HTTP port)."""
    cmd = verifier_command(target, "--drain-grace-s", "1", *flags)  # sessions cut off by a test expire
    server = start(cmd, log, r"serving .* on (\S+:\d+)", timeout_s)
    http = re.search(r"http on \S+:(\d+)", log.read_text())
    assert http, log.read_text()
    return server, server.match.group(1), int(http.group(1))


def serve_vllm_verifier(target: Path, log: Path, *flags: str) -> Iterator[tuple[str, int]]:
    """A cloud-verifier --engine vllm of `target` (vLLM's start takes minutes on a CPU), as a
    fixture yields it: (gRPC address, HTTP port); it must stop cleanly."""
    server, address, http = start_verifier(target, log, "--engine", "vllm", "--max-sessions", "8", *flags, timeout_s=600)
    yield address, http
    assert server.stop() == 0, log.read_text()[-3000:]


def serve_cmd(draft: Path, cloud: str, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "edge",
        "serve",
        "--cloud",
        cloud,
        "--draft-model",
        str(draft),
        "--port",
        "0",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--draft-threads",
        "1",
        *flags,
    ]
