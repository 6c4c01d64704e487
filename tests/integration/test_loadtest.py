"""Recording sessions and replaying them under load against a real verifier (tiny models,
grpc.aio on loopback port 0)."""

import asyncio
import json
import sys
import time
from pathlib import Path

from bench.loadtest import LoadtestSettings, run_capacity, run_loadtest
from bench.loadtest_capacity import write_capacity_report
from cloud.engine.transformers import TransformersEngine
from cloud.http import create_app, start_http
from cloud.state import ServerState
from cloud.verifier import Verifier
from edge.drafting.kpolicy import FixedK
from edge.round.generate import speculative_generate
from edge.trace import TraceHeader, read_traces, write_trace
from edge.trace_recorder import SessionRecorder, trace_file_name
from shared.protocol import AcceptMode, SamplingParams
from tests.harness import gen_config, make_drafter, random_prompt, running_verifier, serving
from tests.tiny_models import save_pair

SAMPLED = SamplingParams(temperature=0.8, top_k=20)
REQUIRED_KEYS = {
    "sessions_completed",
    "errors_by_code",
    "verified_tokens_per_s",
    "rounds_per_s",
    "verify_latency_ms",
    "ttft_ms",
    "queue_ms",
    "fidelity",
    "sessions",
    "settings",
    "machine",
    "timeline",
}


async def _record(client, draft_model, folder: Path) -> None:
    """Three greedy sessions and one sampled (sparse) one, written as trace files."""
    for n, (params, mode) in enumerate([(SamplingParams(), AcceptMode.GREEDY)] * 3 + [(SAMPLED, AcceptMode.SPARSE)]):
        prompt = random_prompt(40 + n, length=6)
        cfg = gen_config(max_new_tokens=24, params=params, mode=mode, seed=n)
        drafter = make_drafter(draft_model, params, mode, seed=n + 1)
        header = TraceHeader("speculative", prompt, cfg.session.sampling, n, mode.value, 96, 24, [], started_at=time.time())
        recorder = SessionRecorder(header)
        result = await speculative_generate(prompt, drafter, client.with_tap(recorder), FixedK(4), cfg)
        write_trace(
            folder / trace_file_name(f"s{n}", header.started_at),
            recorder.finish(result.token_ids, result.finish_reason, result.rounds, result.reopens),
        )


def _max_overlap(sessions: list[dict]) -> int:
    edges = sorted([(s["start_s"], 1) for s in sessions] + [(s["end_s"], -1) for s in sessions])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def test_replay_eight_concurrent_sessions_matches_the_recording(target_model, draft_model, tmp_path: Path) -> None:
    async def run() -> None:
        async with running_verifier(target_model) as (client, _):
            await _record(client, draft_model, tmp_path)
            traces = read_traces(tmp_path)
            assert len(traces) == 4 and all(t.replied_verifies() for t in traces)
            # Two copies of the four sessions, all arriving at once (scale shrinks the recorded gaps).
            settings = LoadtestSettings(
                cloud=client.target, output=str(tmp_path / "r.json"), trace=str(tmp_path), sessions=2, scale=1e-6, progress=False
            )
            result = await run_loadtest(settings)
        assert result["sessions_completed"] == 8 and result["errors_by_code"] == {}
        assert _max_overlap(result["sessions"]) == 8
        fidelity = result["fidelity"]
        assert fidelity["rounds_compared"] == 2 * sum(len(t.replied_verifies()) for t in traces)
        assert fidelity["accepted_len_mismatches"] == fidelity["next_token_mismatches"] == 0
        assert fidelity["sessions_output_equal"] == fidelity["sessions_compared"] == 8
        assert result["verified_tokens"] == 2 * sum(len(t.end.output_tokens) for t in traces)

    asyncio.run(run())


async def _cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


def test_record_with_edge_agent_then_loadtest_cli_writes_result_and_report(target_model, tmp_path: Path) -> None:
    """edge-agent --record and the loadtest CLI as processes, against one verifier; the second
    run takes Azure arrivals and lengths in cloud_only mode."""
    draft, _ = save_pair(tmp_path / "models")  # its target has the fixture target's weights
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "w5 w6 w7 w8"}\n{"id": "b", "prompt": "w9 w10 w11"}\n')
    traces, report = tmp_path / "traces", tmp_path / "report"

    async def run() -> None:
        async with running_verifier(target_model) as (client, _):
            code, out = await _cli(
                "-m",
                "edge",
                "--cloud",
                client.target,
                "--prompts",
                str(prompts),
                "--draft-model",
                str(draft),
                "--dtype",
                "float32",
                "--max-new-tokens",
                "16",
                "--k",
                "3",
                "--mode",
                "speculative",
                "--record",
                str(traces),
                "--output",
                str(tmp_path / "out.jsonl"),
            )
            assert code == 0, out

            async def loadtest(*flags: str) -> tuple[int, str]:
                source = ["--cloud", client.target, "--trace", str(traces)]
                return await _cli("-m", "bench.loadtest", *source, "--no-progress", *flags)

            code, out = await loadtest("--sessions", "2", "--output", str(tmp_path / "spec.json"), "--report", str(report))
            assert code == 0, out
            azure = Path(__file__).resolve().parents[2] / "bench" / "data" / "traces" / "azure_code_2023.csv"
            azure_flags = ["--azure", str(azure), "--scale", "0.01", "--max-sessions", "3"]
            code, out = await loadtest(
                *azure_flags,
                *["--max-prompt-tokens", "40", "--max-output-tokens", "12", "--mode", "cloud_only"],
                *["--output", str(tmp_path / "cloud.json")],
            )
            assert code == 0, out
            code, out = await loadtest(
                *["--find-capacity", "--slo-itl-p95-ms", "60000", "--capacity-max-sessions", "1", "--capacity-step-s", "0.1"],
                *["--output", str(tmp_path / "cap.json"), "--report", str(tmp_path / "cap")],
            )
            assert code == 0, out

    asyncio.run(run())
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert REQUIRED_KEYS <= spec.keys()
    assert spec["sessions_completed"] == 4 and spec["errors_by_code"] == {}
    assert spec["fidelity"]["sessions_output_equal"] == 4
    assert spec["verify_latency_ms"]["p50"] > 0 and spec["queue_ms"] is not None
    assert {"scale", "max_prompt_tokens", "max_output_tokens", "sessions", "arrivals"} <= spec["settings"].keys()
    assert spec["machine"]["git_commit"]
    assert {p.name for p in report.iterdir()} >= {"summary.md", "throughput.png", "latency.png", "open_sessions.png"}
    capacity = json.loads((tmp_path / "cap.json").read_text())
    assert capacity["capacity"]["speculative"]["sessions"] == capacity["capacity"]["cloud_only"]["sessions"] == 1
    assert capacity["capacity_ratio"] == 1.0 and capacity["settings"]["find_capacity"]
    assert {p.name for p in (tmp_path / "cap").iterdir()} == {"capacity.md", "capacity.png"}
    cloud = json.loads((tmp_path / "cloud.json").read_text())
    assert cloud["sessions_completed"] == 3 and cloud["mode"] == "cloud_only"
    assert cloud["settings"]["arrivals"].startswith("azure")
    # Lengths from the Azure rows, under the caps: every session generated min(GeneratedTokens, 12).
    assert all(s["output_tokens"] == s["output_target"] <= 12 and s["prompt_tokens"] <= 40 for s in cloud["sessions"])


def test_capacity_search_finds_sessions_for_a_generous_target_and_none_for_an_impossible_one(
    target_model, draft_model, tmp_path: Path
) -> None:
    """--find-capacity end to end on tiny models: both modes, the verifier's /metrics read
    for its busy fraction, the report written."""
    state = ServerState.for_verifier(Verifier(TransformersEngine(target_model), "tiny-target"))

    async def run() -> tuple[dict, dict]:
        async with serving(state) as client:
            http = await start_http(create_app(state, public_metrics=True), "127.0.0.1", 0)
            try:
                await _record(client, draft_model, tmp_path)
                common = {
                    "cloud": client.target,
                    "output": str(tmp_path / "out" / "c.json"),
                    "trace": str(tmp_path),
                    "metrics_url": f"http://127.0.0.1:{http.port}/metrics",
                    "find_capacity": True,
                    "capacity_step_s": 1.0,  # a level long enough for each worker to deliver on a loaded box
                    "progress": False,
                }
                generous = await run_capacity(
                    LoadtestSettings(**common, slo_itl_p95_ms=60_000, slo_ttft_p95_ms=60_000, capacity_max_sessions=3)
                )
                impossible = await run_capacity(LoadtestSettings(**common, slo_itl_p95_ms=1e-3))
            finally:
                await http.stop()
        return generous, impossible

    generous, impossible = asyncio.run(run())
    for mode in ("speculative", "cloud_only"):
        cap = generous["capacity"][mode]
        assert cap["sessions"] == 3  # 1, 2, then the cap itself: every level met the target
        assert [p["sessions"] for p in generous["levels"][mode]] == [1, 2, 3]
        assert cap["itl_ms"]["p95"] > 0 and cap["verified_tokens_per_s"] > 0
        assert 0 < cap["busy_fraction"] <= 1 and cap["forward_passes_per_token"] > 0
        assert impossible["capacity"][mode]["sessions"] == 0
        assert [p["sessions"] for p in impossible["levels"][mode]] == [1]
    assert generous["capacity"]["cloud_only"]["rounds_per_token"] == 1.0
    assert generous["capacity"]["speculative"]["rounds_per_token"] < 1.0  # several tokens per round
    assert generous["capacity_ratio"] == 1.0 and impossible["capacity_ratio"] is None
    written = write_capacity_report(generous, tmp_path / "report")
    assert {p.name for p in written} == {"capacity.md", "capacity.png"}


def test_auto_sessions_decode_until_the_verifier_asks_for_speculation(target_model, draft_model, tmp_path: Path) -> None:
    """auto in the load tester: on a verifier that never asks, every token is the target's own
    decoding (one pass per token); on one that asks above 0 open sessions, sessions speculate
    (fewer passes per token); both give the recorded greedy outputs; a resumed capacity search
    takes the levels it had written instead of measuring them again."""

    async def run() -> dict:  # type: ignore[type-arg]
        found = {}
        for asks_above in (None, 0):
            async with running_verifier(target_model, prefer_speculation_above=asks_above) as (client, _):
                folder = tmp_path / f"traces-{asks_above}"
                folder.mkdir()
                await _record(client, draft_model, folder)
                common = {"cloud": client.target, "trace": str(folder), "progress": False}
                found[asks_above, "replay"] = await run_loadtest(
                    LoadtestSettings(**common, output=str(tmp_path / "r.json"), mode="auto")
                )
                capacity = {
                    **common,
                    "output": str(tmp_path / f"cap-{asks_above}.json"),
                    "find_capacity": True,
                    "systems": "auto,speculative",
                    "capacity_step_s": 1.0,  # a level long enough for each worker to deliver on a loaded box
                    "capacity_max_sessions": 2,
                    "slo_itl_p95_ms": 60_000,
                    "slo_ttft_p95_ms": 60_000,
                }
                found[asks_above] = await run_capacity(LoadtestSettings(**capacity))
                lines = (tmp_path / f"cap-{asks_above}.levels.jsonl").read_text().count("\n")
                found[asks_above, "resumed"] = await run_capacity(LoadtestSettings(**capacity, resume=True))
                found[asks_above, "lines"] = (lines, (tmp_path / f"cap-{asks_above}.levels.jsonl").read_text().count("\n"))
        return found

    found = asyncio.run(run())
    never, asked = found[None]["capacity"], found[0]["capacity"]
    assert never["auto"]["rounds_per_token"] == 1.0  # Decode only: one target pass per token
    assert asked["speculative"]["rounds_per_token"] <= asked["auto"]["rounds_per_token"] < 1.0
    assert never["auto"]["sessions"] == asked["auto"]["sessions"] == 2
    for asks_above in (None, 0):
        replay = found[asks_above, "replay"]
        assert replay["sessions_completed"] == 4 and replay["errors_by_code"] == {}
        assert replay["fidelity"]["sessions_output_equal"] == 3  # the greedy ones; the sampled one is not comparable
        assert found[asks_above, "resumed"]["levels"] == found[asks_above]["levels"]
        lines, after_resume = found[asks_above, "lines"]
        assert lines == after_resume == 4  # 1 and 2 sessions, two systems; none measured again


def test_a_level_dealt_out_to_two_load_processes_counts_every_session(target_model, draft_model, tmp_path: Path) -> None:
    """--load-processes 2: each level's workers run in two spawned processes on one clock; every
    worker gets tokens (a worker in each process), and the processes' CPU is counted."""

    async def run() -> dict:  # type: ignore[type-arg]
        async with running_verifier(target_model) as (client, _):
            await _record(client, draft_model, tmp_path / "traces")
            settings = LoadtestSettings(
                cloud=client.target,
                trace=str(tmp_path / "traces"),
                output=str(tmp_path / "out" / "cap.json"),
                find_capacity=True,
                systems="speculative,cloud_only",
                load_processes=2,
                capacity_step_s=3.0,  # long enough that a freshly spawned process's worker delivers in every level
                capacity_max_sessions=2,
                slo_itl_p95_ms=60_000,
                slo_ttft_p95_ms=60_000,
                progress=False,
            )
            return await run_capacity(settings)

    (tmp_path / "traces").mkdir()
    result = asyncio.run(run())
    for system in ("speculative", "cloud_only"):
        levels = result["levels"][system]
        assert [level["sessions"] for level in levels] == [1, 2] and all(level["meets_slo"] for level in levels)
        assert levels[1]["workers_served"] == 2 and levels[1]["sessions_completed"] >= 2
        assert all(level["loadgen_cpu_cores"] > 0 for level in levels)
    assert result["capacity"]["speculative"]["rounds_per_token"] < 1.0 == result["capacity"]["cloud_only"]["rounds_per_token"]


def test_a_loadtest_started_while_the_model_loads_waits_for_it(target_model, draft_model, tmp_path: Path) -> None:
    """Started before the verifier has loaded its model, the load test waits for SERVING on the
    gRPC health service instead of recording the loading verifier's refusals."""
    import threading

    from tests.ops import running_servers

    async def run() -> None:
        async with running_verifier(target_model) as (client, _):
            await _record(client, draft_model, tmp_path)
        gate = threading.Event()
        async with running_servers(target_model, gate) as (servers, loading):
            settings = LoadtestSettings(
                cloud=f"127.0.0.1:{servers.grpc_port}", output=str(tmp_path / "r.json"), trace=str(tmp_path), progress=False
            )
            test = asyncio.create_task(run_loadtest(settings))
            await asyncio.sleep(1.5)
            assert not test.done()  # waiting for the model, no session sent
            gate.set()
            await loading
            result = await test
        assert result["sessions_completed"] == 4 and result["errors_by_code"] == {}

    asyncio.run(run())
