"""Child processes of a benchmark run: the verifier and the proxy (long-lived, started and
awaited by their log line), and the measured runs (edge-agent, the in-process runner), whose
peak RSS comes from wait4 on that process alone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shared.errors import SpecDecError


class BenchError(SpecDecError):
    """A benchmark child failed or did not start; the message names its log."""


@dataclass(frozen=True)
class Placement:
    """Where processes run: unpinned, or the two-machine emulation: the verifier on one
    core, the edge on another, one torch thread each; an in-process system on one core."""

    name: str  # "unpinned" | "pinned"
    cloud_cores: str = ""
    edge_cores: str = ""
    threads: int = 0  # torch threads per process; 0 = torch's default

    def prefix(self, cores: str) -> list[str]:
        return ["taskset", "-c", cores] if cores else []

    def thread_flags(self) -> list[str]:
        return ["--threads", str(self.threads)] if self.threads else []


UNPINNED = Placement("unpinned")
PINNED = Placement("pinned", cloud_cores="0", edge_cores="1", threads=1)


@dataclass(frozen=True)
class Finished:
    peak_rss_kib: int
    wall_s: float


def run_measured(cmd: Sequence[str], log: Path, what: str, on_tick: Callable[[], None] = lambda: None) -> Finished:
    """Run to completion, calling on_tick about three times a second (progress); its peak RSS
    from wait4, this child alone (taskset execs in place)."""
    start = time.perf_counter()
    with log.open("w") as handle:
        proc = subprocess.Popen(list(cmd), stdout=handle, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            on_tick()
            if pid:
                break
            time.sleep(0.3)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise BenchError(f"{what} exited with {proc.returncode}: {tail[0]} (log: {log})")
    return Finished(int(usage.ru_maxrss), time.perf_counter() - start)


@contextmanager
def running(
    cmd: Sequence[str], log: Path, ready: str, what: str, timeout_s: float = 900.0, env: Mapping[str, str] | None = None
) -> Iterator[tuple[int, str]]:
    """Start a server (with `env` as its environment, else this process's), wait for the log
    line matching `ready` (its group 1 is the address), yield (pid, address), then stop it with
    SIGTERM."""
    handle = log.open("w")
    proc = subprocess.Popen(list(cmd), stdout=handle, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            match = re.search(ready, log.read_text())
            if match:
                break
            if proc.poll() is not None:
                raise BenchError(f"{what} exited with {proc.returncode} before it was ready (log: {log})")
            if time.monotonic() > deadline:
                raise BenchError(f"{what} not ready after {timeout_s:.0f} s (log: {log})")
            time.sleep(0.2)
        yield proc.pid, match.group(1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        handle.close()


def reset_peak_rss(pid: int) -> None:
    """Start a fresh VmHWM window for a long-lived process (Linux >= 4.0: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss_kib(pid: int) -> int:
    """VmHWM: the peak resident set since the process started or since reset_peak_rss."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise BenchError(f"process {pid} has no peak resident set: it exited (killed for memory? see its log and dmesg)")
