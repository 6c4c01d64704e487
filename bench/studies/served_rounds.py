"""A Verify round as the edge sees it: the round trip of a k-draft round over loopback gRPC to a
running cloud-verifier, against the time its engine took for the round's batch (the
`forward_ms` every VerifyResult reports: the engine's run of the batch the round was in).

What lies between the two is the serving: the gRPC call both ways, validation, the batcher's
queue and hand-off to the model worker, the round's commit and its reply. Beside it, each level
measures the transport alone (bench/grpc_echo.py): a message's round trip on an open gRPC call
to an echo process, sent after a pause as long as the engine's round, the floor under the
serving on this machine. At each session count of `--sessions`, that many sessions open
`--context`-token prompts and then run `--rounds` rounds each, all at once (each session its
next round as soon as its last one answers: the batcher puts them in one pass). Drafts are
random tokens (rejected at the first: every round computes its 1 + k positions and adds one
token), with the edge's sparse q over each when the sessions sample. Each figure is the median
over every round after `WARM_UP` of each session.

    python -m bench.studies.served_rounds --cloud 127.0.0.1:50071 [--sessions 1,16] [--k 4] \\
        [--context 200] [--rounds 40] [--vocab 151936] [--temperature 0.7 --top-p 0.95] [--out DIR]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench import grpc_echo
from bench.cli import study_settings
from bench.environment import machine_line, provenance, write_result
from bench.tasks import random_token_ids, sampling_label, session_config
from edge.transport.client import VerifierClient
from shared.cli import run_cli
from shared.protocol import OpenSessionRequest, SparseDistribution, VerifyRequest

WARM_UP = 3  # rounds of each session left out (the first shapes of a batch)
ECHOES = 60  # messages timed for the transport alone, fewer where the pauses would pass ECHO_S
ECHO_S = 20.0
SUPPORT = 8  # ids in a sampled round's q over each draft


class ServedRoundSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_SERVED_ROUNDS_")

    cloud: str = Field(description="the verifier's HOST:PORT")
    sessions: str = Field("1,16", description="sessions running rounds together, comma-separated")
    k: int = Field(4, ge=1, le=16, description="drafts per round")
    context: int = Field(200, ge=2, description="prompt tokens of each session (random ids)")
    rounds: int = Field(40, ge=WARM_UP + 1, description="rounds of each session")
    vocab: int = Field(151936, ge=2, description="the sessions' vocabulary")
    temperature: float = Field(0.0, ge=0, le=2, description="the sessions' sampling (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="the sampling sessions' nucleus (1: off)")
    out: Path = Field(Path("docs/served_rounds"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "server": ("cloud",),
        "rounds": ("sessions", "k", "context", "rounds", "vocab", "temperature", "top_p"),
        "output": ("out",),
    }


def _round(rng: np.random.Generator, args: ServedRoundSettings, session_id: str, position: int) -> VerifyRequest:
    """k random drafts, with a sparse q over each (the draft and SUPPORT - 1 other ids) where the
    sessions sample."""
    tokens = random_token_ids(rng, args.vocab, args.k)
    if args.temperature <= 0:
        return VerifyRequest(session_id, position, tokens)
    q = [0.6, *[0.4 / (SUPPORT - 1)] * (SUPPORT - 1)]
    sparse = []
    for token in tokens:
        others = [int(t) for t in rng.choice(args.vocab, SUPPORT, replace=False) if t != token]
        sparse.append(SparseDistribution([token, *others][:SUPPORT], q))
    return VerifyRequest(session_id, position, tokens, sparse_draft=sparse)


async def _rounds(
    client: VerifierClient, args: ServedRoundSettings, opened: tuple[str, int], rng: np.random.Generator
) -> list[tuple[float, float]]:
    """One session's rounds: (round trip, the engine's time for its batch) of each, in ms."""
    (session_id, position), times = opened, []
    for _ in range(args.rounds):
        request = _round(rng, args, session_id, position)
        began = time.perf_counter()
        result = await client.verify(request)
        times.append(((time.perf_counter() - began) * 1000.0, result.metrics.forward_ms))
        position = result.new_base_position
    return times[WARM_UP:]


async def level(client: VerifierClient, args: ServedRoundSettings, count: int) -> dict[str, Any]:
    """`count` sessions opened, then their rounds all at once: the medians."""
    config = session_config(args.vocab, args.temperature, args.top_p)
    rngs = [np.random.default_rng(count * 1000 + i) for i in range(count)]
    prompts = [OpenSessionRequest(random_token_ids(rng, args.vocab, args.context), config) for rng in rngs]
    opened = [await client.open_session(prompt) for prompt in prompts]
    try:
        sessions = [(o.session_id, o.position) for o in opened]
        runs = [
            t for times in await asyncio.gather(*map(_rounds, [client] * count, [args] * count, sessions, rngs)) for t in times
        ]
    finally:
        for o in opened:
            await client.close_session(o.session_id)
    trip = statistics.median(t for t, _ in runs)
    engine = statistics.median(e for _, e in runs)
    serving = statistics.median(t - e for t, e in runs)
    echoes = max(10, min(ECHOES, int(ECHO_S * 1000.0 / max(engine, 1.0))))
    transport = await grpc_echo.round_trip_ms(engine / 1000.0, messages=echoes)
    return {
        "sessions": count,
        "rounds": len(runs),
        "round_trip_ms": round(trip, 3),
        "engine_ms": round(engine, 3),
        "serving_ms": round(serving, 3),
        "transport_ms": round(transport, 3),
        "beyond_transport_ms": round(serving - transport, 3),
        "trip_over_engine": round(trip / engine, 3) if engine else None,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        "# A served round from the edge's side: the Verify round trip against the engine's round",
        "",
        f"{machine_line(result['provenance']['machine'])}; {result['context']} prompt tokens a session; "
        f"k = {result['k']} random drafts; {sampling_label(result['temperature'], result['top_p'])}; "
        f"median over {result['rounds'] - WARM_UP} rounds of each session.",
        "",
        "| sessions | round trip, ms | the engine's round, ms | serving, ms | the transport alone, ms | "
        "serving beyond it, ms | trip / engine |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['sessions']} | {row['round_trip_ms']:.2f} | {row['engine_ms']:.2f} | {row['serving_ms']:.2f} | "
            f"{row['transport_ms']:.2f} | {row['beyond_transport_ms']:.2f} | {row['trip_over_engine']:.2f}x |"
        )
    lines += [
        "",
        "The transport alone: one message's round trip on an open gRPC call to an echo process on this machine, "
        "sent after a pause as long as the engine's round (bench/grpc_echo.py).",
    ]
    return "\n".join(lines) + "\n\nCommand: `" + result["provenance"]["command"] + "`\n"


async def measure(args: ServedRoundSettings, result: dict[str, Any]) -> None:
    client = VerifierClient(args.cloud, verify_timeout_s=600.0)
    try:
        await level(client, args, 1)  # warm-up: the server's first rounds
        for count in (int(n) for n in args.sessions.split(",")):
            result["rows"].append(await level(client, args, count))
            write_result(args.out, "served_rounds", result, report(result))
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    args, command = study_settings("bench.studies.served_rounds", __doc__, ServedRoundSettings, argv)
    result: dict[str, Any] = {
        "provenance": provenance(command),
        "k": args.k,
        "context": args.context,
        "rounds": args.rounds,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "rows": [],
    }
    asyncio.run(measure(args, result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m bench.studies.served_rounds", main))
