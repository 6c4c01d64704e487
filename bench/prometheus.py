"""A real Prometheus (Debian's `prometheus` package) on a loopback port, scraping the given
/metrics addresses every second into a temporary folder, and its HTTP API: instant and range
queries. The fleet benchmark and the dashboard's tests run it; nothing here parses PromQL."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fleet_parts import free_port
from shared.errors import SpecDecError

SCRAPE_INTERVAL_S = 1.0


class PrometheusError(SpecDecError):
    """Prometheus did not start, or answered a query with an error (its message says which)."""


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
    if found is None:
        raise PrometheusError("prometheus is not installed (apt-get install prometheus)")
    return found


def scrape_config(targets: Sequence[str]) -> str:
    """One job, `verifier`, over plain HTTP: what the loopback verifiers of a benchmark serve."""
    return json.dumps(
        {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S:g}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S:g}s"},
            "scrape_configs": [{"job_name": "verifier", "static_configs": [{"targets": list(targets)}]}],
        }
    )  # JSON is YAML: no YAML writer needed


@dataclass(frozen=True)
class Prometheus:
    url: str

    def _get(self, path: str, params: dict[str, str]) -> Any:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as err:  # a bad query is 400 with Prometheus' JSON error
            body = json.loads(err.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{params.get('query', path)}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant vector: [{"metric": labels, "value": [time, "text"]}, ...]."""
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        return list(self._get("/api/v1/query", params)["result"])

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """A matrix: [{"metric": labels, "values": [[time, "text"], ...]}, ...]."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
        return list(self._get("/api/v1/query_range", params)["result"])

    def scrapes(self) -> float:
        """How many scrapes have succeeded so far, over every target."""
        found = self.query("sum(sum_over_time(up[1h]))")
        return float(found[0]["value"][1]) if found else 0.0

    def wait_for_scrapes(self, more_than: float, timeout_s: float = 30.0) -> float:
        deadline = time.monotonic() + timeout_s
        while (count := self.scrapes()) <= more_than:
            if time.monotonic() > deadline:
                raise PrometheusError(f"no new scrape within {timeout_s:g} s")
            time.sleep(0.2)
        return count


@contextmanager
def running_prometheus(targets: Sequence[str], folder: Path) -> Iterator[Prometheus]:
    """Prometheus scraping `targets` (HOST:PORT of /metrics) every second; its data, config and
    log in `folder`; stopped (SIGTERM) on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(scrape_config(targets))
    port = free_port()
    cmd = [
        prometheus_binary(),
        f"--config.file={config}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    with (folder / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}", folder / "prometheus.log")
        yield Prometheus(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise PrometheusError(f"prometheus did not start (log: {log}):\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
