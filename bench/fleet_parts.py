"""The running parts of the fleet benchmark: cloud-verifier replicas as child processes, HAProxy
with deploy/haproxy.cfg in front of them (its replica lines and port replaced), and a replica's
counters read from its /metrics."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.processes import BenchError, running

REPO = Path(__file__).resolve().parent.parent
HAPROXY_CFG = REPO / "deploy" / "haproxy.cfg"


@dataclass
class Replica:
    pid: int
    grpc_port: int
    http_port: int
    log: Path
    alive: bool = True

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye; its sessions' KV is gone."""
        os.kill(self.pid, signal.SIGKILL)
        self.alive = False

    def counters(self) -> dict[str, float]:
        """rounds, and OpenSession calls answered OK, so far."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        found = {"rounds": 0.0, "opens": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "specdec_rounds_total":
                    found["rounds"] = sample.value
                labels = sample.labels
                if sample.name == "specdec_requests_total" and labels == {"method": "OpenSession", "code": "OK"}:
                    found["opens"] = sample.value
        return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def verifier_cmd(target: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cloud",
        "--model",
        str(target),
        "--port",
        "0",
        "--http-port",
        "0",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--drain-grace-s",
        "1",
    ]


@contextmanager
def running_replicas(target: Path, count: int, folder: Path) -> Iterator[list[Replica]]:
    """`count` cloud-verifier processes on loopback ports, each ready (its model loaded)."""
    with ExitStack() as stack:
        replicas = []
        for i in range(count):
            log = folder / f"verifier{i}.log"
            pid, port = stack.enter_context(running(verifier_cmd(target), log, r"serving .* on \S+:(\d+)", f"verifier {i}"))
            http = re.search(r"http on \S+:(\d+)", log.read_text())
            if http is None:
                raise BenchError(f"verifier {i} logged no HTTP port (log: {log})")
            replicas.append(Replica(pid, int(port), int(http.group(1)), log))
        yield replicas


def haproxy_config(replicas: list[Replica], port: int) -> str:
    """deploy/haproxy.cfg as shipped, with these replicas and this port."""
    servers = "".join(
        f"    server v{i} {r.address} proto h2 check check-proto h1 port {r.http_port}\n" for i, r in enumerate(replicas)
    )
    text = re.sub(r"(?m)^    server .*\n", "", HAPROXY_CFG.read_text()) + servers
    return re.sub(r"bind 127\.0\.0\.1:\d+", f"bind 127.0.0.1:{port}", text)


@contextmanager
def running_haproxy(replicas: list[Replica], folder: Path) -> Iterator[str]:
    """Debian's haproxy in front of `replicas`; its address once every replica passed two checks."""
    binary = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    if binary is None:
        raise BenchError("haproxy is not installed (apt-get install haproxy)")
    port = free_port()
    config = folder / "haproxy.cfg"
    config.write_text(haproxy_config(replicas, port))
    with (folder / "haproxy.log").open("w") as log:
        proc = subprocess.Popen([binary, "-W", "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"haproxy did not start (log: {folder / 'haproxy.log'})")
            time.sleep(0.05)
        time.sleep(2.5)  # inter 1s, rise 2: every replica is up in HAProxy's eyes
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
