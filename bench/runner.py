"""Run every system over the same prompts: in-process and edge-local systems once per
placement, wire systems once per placement and RTT, each as a child process."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.config import BenchSettings
from bench.processes import BenchError, Finished, Placement, peak_rss_kib, reset_peak_rss, run_measured, running
from bench.summarize import load_jsonl
from bench.systems import Kind, System
from bench.tasks import task_of, write_prompts
from edge.prompts import Prompt, encode_prompt
from edge.tokenizer import EdgeTokenizer

# Every child answers this prompt first and the bench drops it: first-touch of the weights
# and the allocator then costs every system the same, instead of the first real prompt.
WARMUP = Prompt("__warmup__", "Hello", "warmup")


@dataclass(frozen=True)
class RunFiles:
    """A run's files, named NAME.EXT (Path.with_suffix would eat the dots in
    "speculative.pinned.rtt50")."""

    folder: Path
    name: str

    def path(self, ext: str) -> Path:
        return self.folder / f"{self.name}{ext}"


@dataclass
class Run:
    system: System
    placement: Placement
    rtt_ms: float | None  # None: the system does not cross the wire
    records: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    peak_rss_kib: int
    wall_s: float
    verifier_peak_rss_kib: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _python() -> list[str]:
    return [sys.executable]


class BenchRunner:
    def __init__(self, settings: BenchSettings, prompts: list[Prompt], bar: tqdm) -> None:
        self.s, self.prompts, self.bar = settings, prompts, bar
        self.files = settings.files
        self.files.mkdir(parents=True, exist_ok=True)
        write_prompts(prompts, self.files / "prompts.jsonl")
        self.child_prompts = self.files / "prompts_with_warmup.jsonl"
        write_prompts([WARMUP, *prompts], self.child_prompts)
        tokenizer = EdgeTokenizer(settings.draft_model)
        self.prompt_tokens = {p.id: len(encode_prompt(tokenizer, p.text, True)) for p in prompts}
        self.kv_bytes_per_token: int | None = None
        self.runner_meta: dict[str, Any] = {}

    # ---- children ------------------------------------------------------------------------

    def _measured(self, cmd: list[str], name: str, output: Path, on_progress: Callable[[int], None] | None = None) -> Finished:
        """Run a child to completion, moving the bar as its output file grows; `on_progress`
        hears how many prompts are done (the warmup aside) about three times a second."""
        shown = 0

        def tick() -> None:
            nonlocal shown
            lines = output.read_text().count("\n") if output.exists() else 0
            done = min(max(lines - 1, 0), len(self.prompts))  # the first line is the warmup
            self.bar.update(done - shown)
            shown = done
            if on_progress is not None:
                on_progress(done)

        output.unlink(missing_ok=True)
        finished = run_measured(cmd, output.with_suffix(".log"), name, tick)
        self.bar.update(len(self.prompts) - shown)
        return finished

    def _run_flags(self, stem: RunFiles) -> list[str]:
        """What every measured child is told alike: the prompts, where its outputs go, how long
        and how it samples."""
        s = self.s
        files = ["--prompts", str(self.child_prompts), "--output", str(stem.path(".jsonl"))]
        files += ["--log-rounds", str(stem.path(".rounds.jsonl"))]
        sampling = ["--max-new-tokens", str(s.max_new_tokens), "--temperature", str(s.temperature), "--seed", str(s.seed)]
        sampling += ["--top-p", str(s.top_p)]
        return [*files, "--dtype", s.dtype, *sampling]

    def _hf_command(self, system: str, placement: Placement, stem: RunFiles, extra: list[str]) -> list[str]:
        s = self.s
        models = ["--target", str(s.target_model), "--draft", str(s.draft_model)]
        return [
            *placement.prefix(placement.cloud_cores),
            *_python(),
            *["-m", "bench.hf_runner", "--system", system, *models],
            *self._run_flags(stem),
            *["--meta", str(stem.path(".meta.json"))],
            *placement.thread_flags(),
            *extra,
        ]

    def measure_kv_bytes_per_token(self) -> int:
        """The target's KV bytes per token, measured on real cache tensors in a child (the
        bench process never loads a model)."""
        if self.kv_bytes_per_token is None:
            stem = RunFiles(self.files, "kv_probe")
            cmd = self._hf_command("target-only", Placement("unpinned"), stem, ["--kv-only"])
            run_measured(cmd, stem.path(".log"), "KV probe")
            self.kv_bytes_per_token = int(json.loads(stem.path(".meta.json").read_text())["kv_bytes_per_token"])
        return self.kv_bytes_per_token

    def _edge_command(self, system: System, placement: Placement, stem: RunFiles, cloud: str | None) -> list[str]:
        s = self.s
        cmd = [
            *placement.prefix(placement.edge_cores),
            *_python(),
            *["-m", "edge", "--draft-model", str(s.draft_model)],
            *self._run_flags(stem),
            *placement.thread_flags(),
        ]
        if cloud is not None:
            cmd += ["--cloud", cloud]
        if s.k is not None:
            cmd += ["--k", str(s.k)]
        return cmd + list(system.edge_flags)

    # ---- runs ----------------------------------------------------------------------------

    def _collect(self, system: System, placement: Placement, rtt: float | None, stem: RunFiles, finished: Finished) -> Run:
        records = [r for r in load_jsonl(stem.path(".jsonl")) if r["id"] != WARMUP.id]
        rounds_path = stem.path(".rounds.jsonl")
        rounds = [r for r in load_jsonl(rounds_path) if r.get("id") != WARMUP.id] if rounds_path.exists() else []
        missing = {p.id for p in self.prompts} - {r["id"] for r in records}
        if missing:
            raise BenchError(f"{system.name}: no output for prompt(s) {', '.join(sorted(missing))}")
        for record in records:
            record["task"] = task_of(record.get("category", ""))
            record.setdefault("prompt_tokens", self.prompt_tokens[record["id"]])
        if system.crosses_wire:
            self._derive_verifier_kv(records, rounds)
        return Run(system, placement, rtt, records, rounds, finished.peak_rss_kib, finished.wall_s)

    def _derive_verifier_kv(self, records: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> None:
        """The verifier holds one cache per session, as long as the committed text plus the
        block in flight: (prompt + output + largest block) x the measured bytes per token."""
        per_token = self.measure_kv_bytes_per_token()
        largest: dict[str, int] = {}
        for r in rounds:
            largest[r["id"]] = max(largest.get(r["id"], 0), int(r.get("k", 0)))
        for record in records:
            length = record["prompt_tokens"] + len(record["token_ids"]) + largest.get(record["id"], 0)
            record["kv_peak_bytes"] = length * per_token

    def run_in_process(self, system: System, placement: Placement) -> Run:
        stem = RunFiles(self.files, f"{system.name}.{placement.name}")
        finished = self._measured(self._hf_command(system.name, placement, stem, []), system.name, stem.path(".jsonl"))
        run = self._collect(system, placement, None, stem, finished)
        meta = json.loads(stem.path(".meta.json").read_text())
        self.kv_bytes_per_token = self.kv_bytes_per_token or int(meta["kv_bytes_per_token"])
        self.runner_meta[system.name] = meta
        return run

    def run_edge(
        self,
        system: System,
        placement: Placement,
        rtt: float | None,
        cloud: str | None,
        verifier_pid: int | None,
        on_progress: Callable[[int], None] | None = None,
        name: str | None = None,
    ) -> Run:
        """`name`: its files' (default SYSTEM.PLACEMENT[.rttMS])."""
        where = f".rtt{rtt:g}" if rtt is not None else ""
        stem = RunFiles(self.files, name or f"{system.name}.{placement.name}{where}")
        stem.path(".rounds.jsonl").unlink(missing_ok=True)  # edge-agent appends to it
        if verifier_pid is not None:
            reset_peak_rss(verifier_pid)
        cmd = self._edge_command(system, placement, stem, cloud)
        finished = self._measured(cmd, system.name, stem.path(".jsonl"), on_progress)
        run = self._collect(system, placement, rtt, stem, finished)
        if verifier_pid is not None:
            run.verifier_peak_rss_kib = peak_rss_kib(verifier_pid)
        return run

    @contextmanager
    def verifier(self, placement: Placement) -> Iterator[tuple[int, str]]:
        s = self.s
        cmd = [
            *placement.prefix(placement.cloud_cores),
            s.verifier_python,
            "-m",
            "cloud",
            "--port",
            "0",
            "--http-port",
            "0",
            "--model",
            str(s.target_model),
            "--dtype",
            s.dtype,
            "--engine",
            s.engine,
            # Every system runs the same prompts on this verifier: none may start from the KV
            # another system's session left (a chat's kept prefix), or the later ones would skip
            # their prefill.
            "--no-prefix-reuse",
            *placement.thread_flags(),
        ]
        with running(cmd, self.files / f"verifier.{placement.name}.log", r"serving .* on (\S+:\d+)", "cloud-verifier") as started:
            yield started

    @contextmanager
    def link(self, address: str, rtt: float) -> Iterator[str]:
        """The verifier's address as the edge sees it: direct, or through the fault proxy."""
        if rtt <= 0 and self.s.bandwidth_kbps <= 0:
            yield address
            return
        cmd = [
            *_python(),
            "-m",
            "tools.netproxy",
            "--target",
            address,
            "--rtt-ms",
            str(rtt),
            "--bandwidth-bytes-per-s",
            str(self.s.bandwidth_kbps * 1000 / 8),
        ]
        with running(cmd, self.files / f"proxy.rtt{rtt:g}.log", r"listening on (\S+:\d+)", "netproxy") as (_, proxied):
            yield proxied

    def run_all(self, log: Callable[[str], None]) -> list[Run]:
        runs: list[Run] = []
        wire = [s for s in self.s.systems if s.crosses_wire]
        for placement in self.s.placements:
            for system in self.s.systems:
                if system.kind is Kind.IN_PROCESS:
                    log(f"{system.name} ({placement.name})")
                    runs.append(self.run_in_process(system, placement))
                elif system.kind is Kind.EDGE_LOCAL:
                    log(f"{system.name} ({placement.name})")
                    runs.append(self.run_edge(system, placement, None, None, None))
            if not wire:
                continue
            with ExitStack() as stack:
                pid, address = stack.enter_context(self.verifier(placement))
                for rtt in self.s.rtts_ms:
                    with self.link(address, rtt) as cloud:
                        for system in (s for s in wire if s.runs_at(rtt)):
                            log(f"{system.name} ({placement.name}, +{rtt:g} ms RTT)")
                            runs.append(self.run_edge(system, placement, rtt, cloud, pid))
        return runs

    def total_prompt_runs(self) -> int:
        local = sum(1 for s in self.s.systems if not s.crosses_wire)
        wire = sum(1 for s in self.s.systems if s.crosses_wire for rtt in self.s.rtts_ms if s.runs_at(rtt))
        return len(self.s.placements) * (local + wire) * len(self.prompts)
