"""`python -m bench.loadtest`: replay recorded edge sessions against a verifier, open-loop, and report.

    python -m bench.loadtest --cloud 127.0.0.1:50051 --output result.json [--trace DIR] [--azure FILE.csv | --rate R]
             [--sessions N] [--scale X] [--max-prompt-tokens N] [--max-output-tokens N]
             [--max-sessions N] [--duration S] [--mode speculative|cloud_only] [--report DIR]
             [--metrics-url http://127.0.0.1:8080/metrics] [--api-key KEY] [--tls-ca CA.pem]
    python -m bench.loadtest --cloud ... --output capacity.json --find-capacity [--slo-tpot-p95-ms X] [--slo-ttft-p95-ms Y]
             [--slo-itl-p95-ms Z] [--capacity-max-sessions N] [--capacity-step-s S] [--metrics-url ...] [--report DIR]
             [--systems speculative,auto,cloud_only,vllm_alone --vllm-url http://127.0.0.1:8000] [--resume]

Sessions come from the traces `edge-agent --record DIR` writes (default: the Qwen traces shipped
in bench/data/traces/qwen). Arrivals (loadtest_arrivals.py): the traces' own start times
(`--sessions N` copies of them), the Azure 2023 trace's timestamps and lengths (`--azure`), or
Poisson at `--rate` per second. Each session is replayed as loadtest_replay.py says, in its own
task and on its own channel, like one edge each; arrivals never wait for completions (the
pattern of vLLM's benchmark_serving). Loopback only: this is a tool for a verifier on this machine.
--find-capacity searches the largest number of concurrent sessions within a latency target for
each of --systems (loadtest_capacity.py): speculative, auto and cloud_only sessions through the
verifier, and vllm_alone, the same sessions as streaming generations on vLLM's own server at
--vllm-url (loadtest_vllm.py); --metrics-url adds the verifier's busy fraction to it. Each level
is appended to OUTPUT.levels.jsonl as it finishes; --resume takes the levels found there (same
target, step and sessions) instead of measuring them again. The default target is the pace a
reader feels: TPOT p95 <= 50 ms (20 tokens/s per session) and TTFT p95 <= 1 s, with ITL
reported beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import ssl
import sys
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from tqdm import tqdm

from bench.cli import settings_parser
from bench.loadtest_arrivals import Caps, PlannedSession, azure_plan, poisson_plan, read_azure, trace_plan
from bench.loadtest_capacity import (
    CapacitySearch,
    LevelShare,
    SessionRunner,
    ShareRunner,
    System,
    draft_costs,
    find_capacity,
    no_probe,
    ratio_line,
    run_share,
    slo_line,
    write_capacity_report,
)
from bench.loadtest_replay import LoadClock, SessionOutcome, replay
from bench.loadtest_report import ServerSample, ended_by_line, machine, summarize, write_report
from bench.loadtest_vllm import PeerServer, replay_on_peer
from edge.trace import read_traces
from edge.transport.client import CapacityRetry, ClientTls, VerifierClient
from shared.cli import run_cli, settings_from_args
from shared.errors import ConfigError

log = logging.getLogger("loadtest")
SHIPPED_TRACES = Path(__file__).resolve().parent / "data" / "traces" / "qwen"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
DRAIN_TIMEOUT_CODE = "LOADTEST_DRAIN_TIMEOUT"  # sessions still running when the drain time ran out


# The capacity target a reader feels, when none is given: 20 tokens/s per session, the first
# token within a second.
DEFAULT_SLO_TPOT_P95_MS = 50.0
DEFAULT_SLO_TTFT_P95_MS = 1000.0
VERIFIER_SYSTEMS = ("speculative", "auto", "cloud_only")
SYSTEMS = (*VERIFIER_SYSTEMS, "vllm_alone")


class LoadtestSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_LOADTEST_")

    cloud: str = Field(description="verifier HOST:PORT on this machine (loopback only)")
    api_key: SecretStr | None = Field(
        None, description="API key of a verifier started with --api-keys-file (also sent to --metrics-url)"
    )
    api_keys_file: str | None = Field(
        None,
        description="several keys (the verifier's keys-file format, the keys themselves, not sha256: digests): "
        "sessions take them in turn, like several tenants; /metrics is read with the first",
    )
    tls_ca: str | None = Field(
        None, description="PEM CA bundle of a verifier started with --tls-cert (gRPC and an https --metrics-url)"
    )
    output: str = Field(description="RESULT.json to write")
    trace: str | None = Field(None, description="folder of recorded session traces; default: the shipped Qwen traces")
    azure: str | None = Field(None, description="arrivals and lengths from an Azure 2023 trace CSV")
    rate: float | None = Field(None, gt=0, description="Poisson arrivals per second")
    sessions: int = Field(1, ge=1, description="trace arrivals: copies of the recorded sessions, each starting at 0")
    scale: float = Field(1.0, gt=0, description="multiplies every arrival time (2 = half the rate)")
    think_scale: float = Field(1.0, ge=0, description="multiplies the recorded edge think-time between rounds")
    max_prompt_tokens: int | None = Field(None, ge=1, description="cap on prompt length (tiled/cut recorded prompts)")
    max_output_tokens: int | None = Field(None, ge=1, description="cap on tokens generated per session")
    max_sessions: int | None = Field(None, ge=1, description="stop planning arrivals after this many sessions")
    duration: float | None = Field(None, gt=0, description="no arrivals after this many seconds (scaled time)")
    drain_timeout: float = Field(600.0, gt=0, description="after the last arrival, seconds to wait for sessions to end")
    mode: Literal["speculative", "auto", "cloud_only"] = Field(
        "speculative", description="replay Verify rounds, Decode until the verifier asks for speculation (auto), or Generate"
    )
    seed: int = Field(0, ge=0, description="seeds the Poisson arrivals")
    capacity_retries: int = Field(
        0, ge=0, description="resend RESOURCE_EXHAUSTED after the server's hint (0: count it, end the session)"
    )
    call_timeout: float = Field(120.0, gt=0, description="deadline of one call, seconds")
    ready_timeout: float = Field(
        900.0, gt=0, description="seconds to wait for the verifier's gRPC health to say SERVING (its model loaded) first"
    )
    report: str | None = Field(None, description="folder for summary.md and plots over time")
    metrics_url: str | None = Field(None, description="verifier /metrics to poll for specdec_kv_cache_bytes (loopback)")
    bin_s: float = Field(1.0, gt=0, description="time bin of the series over time, seconds")
    progress: bool = Field(True, description="progress bar on stderr")
    find_capacity: bool = Field(
        False,
        description="search the most concurrent sessions within the latency target (default: TPOT p95 "
        f"<= {DEFAULT_SLO_TPOT_P95_MS:g} ms and TTFT p95 <= {DEFAULT_SLO_TTFT_P95_MS:g} ms), speculative and cloud_only "
        "(each session: its trace, recorded lengths under the caps)",
    )
    slo_itl_p95_ms: float | None = Field(None, gt=0, description="capacity target: inter-token latency p95, ms")
    slo_ttft_p95_ms: float | None = Field(None, gt=0, description="capacity target: time to first token p95, ms")
    slo_tpot_p95_ms: float | None = Field(
        None,
        gt=0,
        description="capacity target: time per output token p95 (per session: first to last token over the tokens), ms",
    )
    capacity_max_sessions: int = Field(64, ge=1, description="capacity search: most concurrent sessions tried")
    capacity_step_s: float = Field(30.0, gt=0, description="capacity search: seconds each level keeps N sessions going")
    capacity_resolution: float = Field(
        0.0, ge=0, lt=1, description="capacity search: stop once the first level missed is within this fraction of the last met"
    )
    systems: str = Field(
        "speculative,cloud_only",
        description="capacity search: the systems, in order, from speculative, auto (Decode until the verifier asks for "
        "speculation), cloud_only and vllm_alone (the same sessions on vLLM's own server at --vllm-url)",
    )
    vllm_url: str | None = Field(
        None,
        description="vLLM's OpenAI-compatible server (`vllm serve`, same model and GPU share) on this machine, http://HOST:PORT",
    )
    resume: bool = Field(False, description="capacity search: take the levels OUTPUT.levels.jsonl already holds")
    load_processes: int = Field(
        1,
        ge=1,
        description="capacity search: processes a level's sessions are dealt out to (when one process's CPU, "
        "reported per level, nears a core)",
    )

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the verifier": (
            "cloud",
            "api_key",
            "api_keys_file",
            "tls_ca",
            "mode",
            "call_timeout",
            "ready_timeout",
            "capacity_retries",
            "metrics_url",
        ),
        "sessions and arrivals": (
            "trace",
            "azure",
            "rate",
            "sessions",
            "scale",
            "think_scale",
            "seed",
            "max_prompt_tokens",
            "max_output_tokens",
            "max_sessions",
            "duration",
            "drain_timeout",
        ),
        "capacity search": (
            "find_capacity",
            "slo_itl_p95_ms",
            "slo_tpot_p95_ms",
            "slo_ttft_p95_ms",
            "capacity_max_sessions",
            "capacity_step_s",
            "capacity_resolution",
            "systems",
            "vllm_url",
            "resume",
            "load_processes",
        ),
        "results": ("output", "report", "bin_s", "progress"),
    }

    @model_validator(mode="after")
    def _one_arrival_source(self) -> LoadtestSettings:
        if self.azure and self.rate:
            raise ValueError("give at most one of --azure and --rate")
        if (self.azure or self.rate) and self.max_sessions is None and self.duration is None:
            raise ValueError("--azure and --rate need --max-sessions or --duration to end")
        if self.api_key and self.api_keys_file:
            raise ValueError("give at most one of --api-key and --api-keys-file")
        unknown = [name for name in self.system_names() if name not in SYSTEMS]
        if unknown or not self.system_names():
            raise ValueError(f"--systems: each one of {', '.join(SYSTEMS)}")
        if "vllm_alone" in self.system_names() and not self.vllm_url:
            raise ValueError("--systems vllm_alone needs --vllm-url")
        if self.find_capacity and self.slo_itl_p95_ms is None and self.slo_tpot_p95_ms is None:
            self.slo_tpot_p95_ms = DEFAULT_SLO_TPOT_P95_MS
            self.slo_ttft_p95_ms = self.slo_ttft_p95_ms or DEFAULT_SLO_TTFT_P95_MS
        return self

    def system_names(self) -> list[str]:
        return [name.strip() for name in self.systems.split(",") if name.strip()]

    def arrivals(self) -> str:
        if self.azure:
            return f"azure {Path(self.azure).name}"
        return f"poisson {self.rate}/s" if self.rate else f"trace start times x{self.sessions} copies"

    def caps(self) -> Caps:
        return Caps(self.max_prompt_tokens, self.max_output_tokens, self.max_sessions, self.duration)

    def keys(self) -> list[str | None]:
        """The keys sessions take in turn: those of --api-keys-file, else --api-key, else none."""
        if self.api_keys_file:
            return read_plain_keys(Path(self.api_keys_file))
        return [self.api_key.get_secret_value() if self.api_key else None]


def read_plain_keys(path: Path) -> list[str | None]:
    """Keys from a file in the verifier's keys-file format (`KEY`, `NAME KEY` or `NAME KEY
    operator` per line, `#` comments). A client needs the keys themselves: sha256: entries are
    refused. Errors name the line, never its text."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"--api-keys-file: cannot read {path}: {err.strerror}") from err
    keys: list[str | None] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        key = fields[1] if len(fields) >= 2 else fields[0]
        if key.lower().startswith("sha256:"):
            raise ConfigError(f"--api-keys-file line {number}: a sha256: digest, but a client needs the key itself")
        keys.append(key)
    if not keys:
        raise ConfigError(f"--api-keys-file: no keys in {path}")
    return keys


def _check_loopback(host: str | None, what: str) -> None:
    if (host or "").strip("[]") not in LOOPBACK:
        raise ConfigError(f"{what} must be on this machine (127.0.0.1, localhost, ::1), got {host!r}")


def plan_sessions(s: LoadtestSettings) -> list[PlannedSession]:
    traces = read_traces(Path(s.trace) if s.trace else SHIPPED_TRACES)
    if any(t.header.mode != "speculative" for t in traces) and s.mode == "speculative":
        raise ConfigError("speculative replay needs traces recorded in speculative mode")
    if s.azure:
        return azure_plan(traces, read_azure(Path(s.azure)), s.scale, s.caps())
    if s.rate:
        return poisson_plan(traces, s.rate, s.scale, s.caps(), s.seed)
    return trace_plan(traces, s.sessions, s.scale, s.caps())


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def engine_steps(metrics_text: str) -> tuple[float, float] | None:
    """(seconds, steps) of the verifier's engine's own loop (vLLM: its steps for passes and for
    streams alike) from its /metrics; None for an engine that runs no loop of its own."""
    steps = _metric(metrics_text, "specdec_engine_steps_total")
    seconds = _metric(metrics_text, "specdec_engine_step_seconds_total")
    return (seconds, steps) if steps and seconds is not None else None


def fetch_metrics(url: str, s: LoadtestSettings) -> str:
    key = s.keys()[0]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    context = ssl.create_default_context(cafile=s.tls_ca) if s.tls_ca else None
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=2, context=context) as reply:  # noqa: S310 (loopback, checked)
        return str(reply.read().decode())


async def busy_counters(s: LoadtestSettings) -> tuple[float, float] | None:
    """(busy seconds, passes) the verifier counted so far; None without --metrics-url. On an
    engine with its own loop (vLLM) they are its steps and their time, which count the steps it
    runs for streams between passes too; else the batcher's forward passes and their time."""
    if not s.metrics_url:
        return None
    try:
        text = await asyncio.to_thread(fetch_metrics, s.metrics_url, s)
    except OSError as err:
        log.warning("metrics read failed: %s", err)
        return None
    if (own := engine_steps(text)) is not None:
        return own
    busy, passes = _metric(text, "specdec_busy_seconds_total"), _metric(text, "specdec_forward_passes_total")
    return None if busy is None or passes is None else (busy, passes)


def server_sample(t_s: float, metrics_text: str) -> ServerSample:
    return ServerSample(
        t_s,
        _metric(metrics_text, "specdec_kv_cache_bytes"),
        _metric(metrics_text, "specdec_open_sessions"),
        _metric(metrics_text, "process_resident_memory_bytes"),
    )


async def poll_metrics(url: str, clock: LoadClock, samples: list[ServerSample], every_s: float, s: LoadtestSettings) -> None:
    while True:
        try:
            text = await asyncio.to_thread(fetch_metrics, url, s)
            samples.append(server_sample(clock.now(), text))
        except OSError as err:
            log.debug("metrics poll failed: %s", err)
        await asyncio.sleep(every_s)


def check_targets(s: LoadtestSettings) -> None:
    _check_loopback(s.cloud.rsplit(":", 1)[0], "--cloud")
    if s.metrics_url:
        _check_loopback(urlparse(s.metrics_url).hostname, "--metrics-url")
    if s.vllm_url:
        _check_loopback(urlparse(s.vllm_url).hostname, "--vllm-url")


def _connect(s: LoadtestSettings, key: str | None) -> VerifierClient:
    """One client (one channel) per replayed session, like one edge each."""
    return VerifierClient(
        s.cloud,
        s.call_timeout,
        s.call_timeout,
        CapacityRetry(max_retries=s.capacity_retries),
        tls=ClientTls.from_files(s.tls_ca) if s.tls_ca else None,
        api_key=key,
    )


async def wait_until_serving(s: LoadtestSettings) -> None:
    """Wait until every verifier address says SERVING on the standard gRPC health service (no
    API key needed): a load started while the model loads measures refusals, not capacity."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + s.ready_timeout
    for address in s.cloud.split(","):
        credentials = ClientTls.from_files(s.tls_ca).credentials() if s.tls_ca else None
        channel = grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)
        try:
            while not await _serving(health_pb2_grpc.HealthStub(channel)):
                if loop.time() > deadline:
                    raise ConfigError(f"the verifier at {address} did not become ready within {s.ready_timeout:g} s")
                await asyncio.sleep(0.5)
        finally:
            await channel.close()


async def _serving(health: health_pb2_grpc.HealthStub) -> bool:
    try:
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        return False  # not listening yet, or restarting
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _verifier_session(s: LoadtestSettings, mode: str) -> SessionRunner:
    async def run(plan: PlannedSession, clock: LoadClock) -> SessionOutcome:
        client = _connect(s, s.keys()[0])
        try:
            return await replay(plan, client, clock, mode, s.think_scale)
        finally:
            await client.close()

    return run


def _session_runner(s: LoadtestSettings, name: str, peer: PeerServer | None) -> SessionRunner:
    if name == "vllm_alone" and peer is not None:
        return partial(replay_on_peer, server=peer)
    return _verifier_session(s, name)


def _share_in_process(
    s: LoadtestSettings,
    name: str,
    peer: PeerServer | None,
    plans: list[PlannedSession],
    search: CapacitySearch,
    n: int,
    ids: list[int],
    t0: float,
) -> LevelShare:
    """A load process's share of a level (run in a process of the pool)."""
    return asyncio.run(run_share(plans, n, _session_runner(s, name, peer), search, ids, t0))


async def capacity_systems(
    s: LoadtestSettings, plans: list[PlannedSession], search: CapacitySearch, pool: Executor | None = None
) -> list[System]:
    """The systems of --systems, each ready: the verifier SERVING, vLLM's server listing its
    model; with a pool, each level is dealt out to its processes."""
    names = s.system_names()
    if any(name in VERIFIER_SYSTEMS for name in names):
        await wait_until_serving(s)
    peer = None
    if "vllm_alone" in names and s.vllm_url:
        peer = await PeerServer.from_url(s.vllm_url, s.keys()[0]).wait_ready(s.ready_timeout)
    loop = asyncio.get_running_loop()

    def spread(name: str) -> ShareRunner | None:
        if pool is None:
            return None

        async def share(n: int, ids: list[int], t0: float) -> LevelShare:
            return await loop.run_in_executor(pool, _share_in_process, s, name, peer, plans, search, n, ids, t0)

        return share

    return [
        System(
            name,
            _session_runner(s, name, peer),
            partial(busy_counters, s) if name in VERIFIER_SYSTEMS else no_probe,
            spread(name),
            s.load_processes,
        )
        for name in names
    ]


def levels_file(s: LoadtestSettings) -> Path:
    return Path(s.output).with_suffix(".levels.jsonl")


def _level_key(s: LoadtestSettings) -> dict[str, Any]:
    """What a stored level must share with this run to be taken as measured by it."""
    return {
        "slo": [s.slo_itl_p95_ms, s.slo_ttft_p95_ms, s.slo_tpot_p95_ms],
        "step_s": s.capacity_step_s,
        "think_scale": s.think_scale,
        "trace": s.trace or str(SHIPPED_TRACES),
        "max_output_tokens": s.max_output_tokens,
        "max_prompt_tokens": s.max_prompt_tokens,
    }


def known_levels(s: LoadtestSettings) -> dict[str, dict[int, dict[str, Any]]]:
    """--resume: the levels OUTPUT.levels.jsonl holds for this run's target, step and sessions."""
    path, key = levels_file(s), _level_key(s)
    if not s.resume or not path.exists():
        return {}
    known: dict[str, dict[int, dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short when the run was stopped
        if record.get("key") == key:
            known.setdefault(record["system"], {})[record["level"]["sessions"]] = record["level"]
    return known


async def run_capacity(s: LoadtestSettings) -> dict[str, Any]:
    """--find-capacity: one session per recorded trace (lengths under the caps), each system."""
    check_targets(s)
    traces = read_traces(Path(s.trace) if s.trace else SHIPPED_TRACES)
    if any(t.header.mode != "speculative" for t in traces):
        raise ConfigError("--find-capacity replays speculative rounds: it needs traces recorded in speculative mode")
    plans = trace_plan(traces, 1, 0.0, s.caps())
    if not plans:
        raise ConfigError("no session to replay within the given bounds")
    search = CapacitySearch(s.slo_itl_p95_ms, s.slo_ttft_p95_ms, s.capacity_max_sessions, s.capacity_step_s, s.slo_tpot_p95_ms)
    known, key = known_levels(s), _level_key(s)
    path = levels_file(s)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not s.resume:
        path.write_text("")

    def keep(system: str, level: dict[str, Any]) -> None:
        with path.open("a") as f:
            f.write(json.dumps({"key": key, "system": system, "level": level}) + "\n")
        log.info("%s at %d sessions: %s", system, level["sessions"], "meets" if level["meets_slo"] else "misses")

    pool = (
        ProcessPoolExecutor(s.load_processes, mp_context=multiprocessing.get_context("spawn")) if s.load_processes > 1 else None
    )
    try:
        systems = await capacity_systems(s, plans, search, pool)
        result = await find_capacity(plans, search, systems, known, keep, draft_costs(traces, s.think_scale))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return result | {"settings": result_settings(s), "machine": machine()}


@dataclass
class LoadRun:
    """What one replayed load left: each session's outcome, every round and error (the clock),
    the /metrics polls, and the wall time from the first arrival to the last session's end."""

    outcomes: list[SessionOutcome]
    clock: LoadClock
    samples: list[ServerSample]
    wall_s: float


async def replay_load(s: LoadtestSettings, plan: list[PlannedSession]) -> LoadRun:
    """Replay the planned sessions open-loop (sessions take the keys in turn); poll --metrics-url
    meanwhile. A session still running drain_timeout after the last arrival is cancelled and
    counted under LOADTEST_DRAIN_TIMEOUT."""
    keys = s.keys()
    clock = LoadClock()
    samples: list[ServerSample] = []
    poller = asyncio.create_task(poll_metrics(s.metrics_url, clock, samples, s.bin_s / 2, s)) if s.metrics_url else None
    bar = tqdm(total=len(plan), unit="session", disable=not s.progress, file=sys.stderr)
    outcomes: list[SessionOutcome] = []

    async def one(session: PlannedSession) -> None:
        await asyncio.sleep(max(session.arrival_s - clock.now(), 0.0))
        client = _connect(s, keys[session.index % len(keys)])
        try:
            outcomes.append(await replay(session, client, clock, s.mode, s.think_scale))
        finally:
            await client.close()
        bar.update(1)
        bar.set_postfix(rounds=len(clock.rounds), errors=sum(clock.errors_by_code.values()))

    tasks = [asyncio.create_task(one(p)) for p in plan]
    _, unfinished = await asyncio.wait(tasks, timeout=plan[-1].arrival_s + s.drain_timeout)
    for task in unfinished:
        task.cancel()
    if unfinished:
        clock.errors_by_code[DRAIN_TIMEOUT_CODE] += len(unfinished)
        await asyncio.wait(unfinished)
    for task in tasks:  # a bug in a replay must not pass as a quiet, smaller result
        if not task.cancelled() and (crash := task.exception()) is not None:
            raise crash
    wall_s = clock.now()
    if poller is not None:
        poller.cancel()
    bar.close()
    return LoadRun(sorted(outcomes, key=lambda o: o.index), clock, samples, wall_s)


def result_settings(s: LoadtestSettings) -> dict[str, Any]:
    """The settings a result records: never a key, and the trace folder and arrivals spelled out."""
    return s.model_dump(exclude={"api_key"}) | {"arrivals": s.arrivals(), "trace": s.trace or str(SHIPPED_TRACES)}


async def run_loadtest(s: LoadtestSettings) -> dict[str, Any]:
    check_targets(s)
    plan = plan_sessions(s)
    if not plan:
        raise ConfigError("no session to replay within the given bounds")
    await wait_until_serving(s)
    run = await replay_load(s, plan)
    return summarize(run.outcomes, run.clock, run.samples, run.wall_s, result_settings(s), len(plan), s.bin_s)


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.loadtest", __doc__, LoadtestSettings)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    def run() -> int:
        settings = settings_from_args(LoadtestSettings, args)
        if settings.find_capacity:
            return _capacity_cli(settings)
        result = asyncio.run(run_loadtest(settings))
        Path(settings.output).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.output).write_text(json.dumps(result, indent=1) + "\n")
        if settings.report:
            write_report(result, Path(settings.report))
        log.info(
            "%s of %d planned; %.1f verified tokens/s -> %s",
            ended_by_line(result),
            result["sessions_planned"],
            result["verified_tokens_per_s"],
            settings.output,
        )
        return 0

    return run_cli("loadtest", run)


def _capacity_cli(settings: LoadtestSettings) -> int:
    result = asyncio.run(run_capacity(settings))
    Path(settings.output).parent.mkdir(parents=True, exist_ok=True)
    Path(settings.output).write_text(json.dumps(result, indent=1) + "\n")
    if settings.report:
        write_capacity_report(result, Path(settings.report))
    sessions = ", ".join(f"{name} {c['sessions']}" for name, c in result["capacity"].items())
    log.info("capacity at %s: %s sessions (%s) -> %s", slo_line(result["slo"]), sessions, ratio_line(result), settings.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
