"""How long one long prompt holds up everyone else's rounds, with and without chunked prefill.

    python -m bench.studies.prefill_stall --model PATH --prompt-tokens 2048 --chunks 0,512,256 --out DIR

A verifier (in this process, on a loopback port) serves one bystander session that sends
k=0 rounds back to back; after a few rounds another client opens a session on a long
prompt. For each --max-prefill-chunk value the bystander's round latency while that prefill
runs (the stall) is measured beside the prefill's own time; the configurations alternate
in one run, so they share the machine's state. Writes prefill_stall.json and report.md.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from bench.environment import MeasurementSettings, load_measured_model
from cloud.batcher import BatchLimits
from cloud.engine.transformers import TransformersEngine
from cloud.grpc_server import create_server
from cloud.state import ServerState
from cloud.verifier import Verifier
from edge.transport.client import VerifierClient
from shared import lm
from shared.protocol import OpenSessionRequest, SessionConfig, VerifyRequest

WARMUP_ROUNDS = 3


async def _bystander(
    client: VerifierClient, session_id: str, position: int, stop: asyncio.Event, rounds: list[tuple[float, float]]
) -> None:
    """k=0 rounds back to back until `stop`; each round's (sent, answered) perf_counter times."""
    while not stop.is_set():
        sent = time.perf_counter()
        reply = await client.verify(VerifyRequest(session_id, position, []), timeout_s=600)
        rounds.append((sent, time.perf_counter()))
        position = reply.new_base_position


async def measure(verifier: Verifier, chunk: int, prompt: list[int]) -> dict[str, Any]:
    """One long prefill beside a bystander's rounds; the bystander's latencies during it."""
    state = ServerState.for_verifier(verifier, BatchLimits(max_prefill_chunk=chunk))
    server, port = create_server(state, "127.0.0.1:0", reflect=False)
    await server.start()
    client = VerifierClient(f"127.0.0.1:{port}", verify_timeout_s=600, open_timeout_s=600)
    config = SessionConfig(vocab_size=verifier.model_vocab)
    try:
        bystander = await client.open_session(OpenSessionRequest(prompt[:16], config))
        timed: list[tuple[float, float]] = []
        stop = asyncio.Event()
        rounds = asyncio.ensure_future(_bystander(client, bystander.session_id, bystander.position, stop, timed))
        while len(timed) < WARMUP_ROUNDS:
            await asyncio.sleep(0.01)
        before = [(end - sent) * 1000.0 for sent, end in timed]
        started = time.perf_counter()
        opened = await client.open_session(OpenSessionRequest(prompt, config))
        ended = time.perf_counter()
        prefill_s = ended - started
        stop.set()
        await rounds  # the round in flight when the prefill ended counts too
        during = [(end - sent) * 1000.0 for sent, end in timed if end > started and sent < ended]
        await client.close_session(opened.session_id)
        await client.close_session(bystander.session_id)
    finally:
        await client.close()
        await server.stop(None)
        state.worker.shutdown()
    return {
        "chunk": chunk,
        "prefill_s": round(prefill_s, 3),
        "bystander_rounds_during": len(during),
        "stall_max_ms": round(max(during), 1) if during else None,
        "stall_median_ms": round(statistics.median(during), 1) if during else None,
        "round_ms_before": round(statistics.median(before), 1),
    }


def _report(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# One long prompt beside a bystander's rounds",
        "",
        f"Target `{result['model']}` ({result['dtype']}), a {result['prompt_tokens']}-token prompt opened while a "
        f"bystander session sends k=0 rounds back to back. {m['cpu_model']}, {m['cores']} cores "
        f"({m['cpu_flags']}), torch {result['versions']['torch']}, {result['date']}.",
        "",
        f"Command: `{result['command']}`",
        "",
        "| --max-prefill-chunk | prefill (s) | bystander rounds during it | longest round (ms) | median round (ms) "
        "| round before (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["runs"]:
        chunk = row["chunk"] or "0 (whole prompt)"
        lines.append(
            f"| {chunk} | {row['prefill_s']} | {row['bystander_rounds_during']} | {row['stall_max_ms']} "
            f"| {row['stall_median_ms']} | {row['round_ms_before']} |"
        )
    return "\n".join(lines) + "\n"


async def _measure(args: PrefillStallSettings, command: str) -> dict[str, Any]:
    model = load_measured_model(args)
    verifier = Verifier(TransformersEngine(model), Path(args.model).name)
    vocab = min(lm.logits_width(model), 30000)
    prompt = torch.randint(vocab // 10, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    chunks = [int(c) for c in args.chunks.split(",")]
    runs = []
    for _ in range(args.repeats):
        for chunk in chunks:  # alternated: every configuration sees the machine in the same states
            runs.append(await measure(verifier, chunk, prompt))
            print(json.dumps(runs[-1]), flush=True)  # noqa: T201  # progress of a long run
    return {**args.described(model, command), "runs": runs}


class PrefillStallSettings(MeasurementSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_PREFILL_STALL_")
    study: ClassVar[str] = "prefill_stall"

    prompt_tokens: int = Field(2048, ge=1, description="tokens of the long prompt")
    chunks: str = Field("0,512,256", pattern=r"^\d+(,\d+)*$", description="--max-prefill-chunk values, comma-separated")
    repeats: int = Field(1, ge=1, description="times each configuration is measured (alternating)")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        **MeasurementSettings.help_groups,
        "the measurement": ("prompt_tokens", "chunks", "repeats"),
    }

    async def measure(self, command: str) -> dict[str, Any]:
        return await _measure(self, command)

    def report(self, result: dict[str, Any]) -> str:
        return _report(result)


def main(argv: list[str] | None = None) -> int:
    return PrefillStallSettings.main(__doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
