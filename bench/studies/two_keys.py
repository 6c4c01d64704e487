"""Two API keys on one verifier: a light client's round latency alone and beside a heavy
client that floods the verifier, with the heavy key's quota on and off.

    python -m bench.studies.two_keys --model PATH --out DIR [--heavy-sessions 12] [--rounds 30]

The light key runs one session of k-token rounds back to back (greedy, random drafts:
the cost of a round, not its acceptance, is measured). The heavy key opens many sessions
at once and sends rounds back to back on every one it gets. Three phases, in one run on
one verifier model: the light key alone; beside the flood with per-key limits; beside
the flood without them. Writes two_keys.json and report.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.environment import load_measured_model, measurement_parser, provenance, write_result
from cloud.auth import ApiKeys
from cloud.batcher import BatchLimits
from cloud.engine.transformers import TransformersEngine
from cloud.grpc_server import create_server
from cloud.quotas import KeyLimits
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.transport.client import CapacityRetry, VerifierClient
from shared import lm
from shared.errors import SpecDecError
from shared.protocol import OpenSessionRequest, SessionConfig, VerifyRequest

KEYS = {"light": "light-key-0123456789", "heavy": "heavy-key-0123456789"}


async def _rounds(
    client: VerifierClient, prompt: list[int], k: int, vocab: int, count: int | None, stop: asyncio.Event, latencies: list[float]
) -> None:
    """Open a session and send k-token rounds back to back: `count` of them, or until `stop`."""
    rng = random.Random(len(prompt))
    opened = await client.open_session(OpenSessionRequest(prompt, SessionConfig(vocab_size=vocab)))
    position = opened.position
    try:
        while (count is None or len(latencies) < count) and not stop.is_set():
            draft = [rng.randrange(vocab) for _ in range(k)]
            sent = time.perf_counter()
            reply = await client.verify(VerifyRequest(opened.session_id, position, draft))
            latencies.append((time.perf_counter() - sent) * 1000.0)
            position = reply.new_base_position
    finally:
        await client.close_session(opened.session_id)


async def _heavy(
    client: VerifierClient, prompts: list[list[int]], k: int, vocab: int, stop: asyncio.Event, outcomes: Counter[str]
) -> None:
    async def one(prompt: list[int]) -> None:
        latencies: list[float] = []
        try:
            await _rounds(client, prompt, k, vocab, None, stop, latencies)
            outcomes["served"] += 1
        except SpecDecError as err:
            outcomes[err.status] += 1
        outcomes["rounds"] += len(latencies)

    await asyncio.gather(*(one(p) for p in prompts))


def _percentiles(values: list[float]) -> dict[str, float]:
    return {"p50": round(float(np.percentile(values, 50)), 1), "p95": round(float(np.percentile(values, 95)), 1)}


async def phase(model: Any, args: argparse.Namespace, key_limits: KeyLimits | None, flood: bool) -> dict[str, Any]:
    vocab = min(lm.logits_width(model), 32000)
    limits = key_limits or KeyLimits()
    verifier = Verifier(
        TransformersEngine(model), "target", VerifierLimits(sessions=replace(VerifierLimits().sessions, per_key=limits))
    )
    api_keys = ApiKeys.parse("\n".join(f"{name} {key}" for name, key in KEYS.items()))
    state = ServerState(verifier.limits.max_draft_tokens, verifier, batch_limits=BatchLimits(per_key=limits), api_keys=api_keys)
    server, port = create_server(state, "127.0.0.1:0", reflect=False)
    await server.start()
    no_resends = CapacityRetry(max_retries=0)  # a refusal is an outcome here, not something to wait out
    light = VerifierClient(f"127.0.0.1:{port}", 600, 600, api_key=KEYS["light"])
    heavy = VerifierClient(f"127.0.0.1:{port}", 600, 600, no_resends, api_key=KEYS["heavy"])
    rng = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(vocab // 10, vocab, (args.prompt_tokens,), generator=rng).tolist() for _ in range(args.heavy_sessions + 1)
    ]
    stop, outcomes, latencies = asyncio.Event(), Counter[str](), list[float]()
    try:
        flooding = asyncio.ensure_future(_heavy(heavy, prompts[1:], args.k, vocab, stop, outcomes)) if flood else None
        if flood:
            await asyncio.sleep(args.flood_head_start_s)  # the heavy key's sessions are open and looping
        await _rounds(light, prompts[0], args.k, vocab, args.rounds, asyncio.Event(), latencies)
        stop.set()
        if flooding is not None:
            await flooding
    finally:
        await light.close()
        await heavy.close()
        await server.stop(None)
        state.worker.shutdown()
    return {
        "light_round_ms": _percentiles(latencies),
        "heavy": dict(outcomes),
        "key_limits": None if key_limits is None else vars(key_limits),
    }


def _report(result: dict[str, Any]) -> str:
    m, alone = result["machine"], result["phases"]["alone"]["light_round_ms"]
    lines = [
        "# Two keys on one verifier",
        "",
        f"Target `{result['model']}` ({result['dtype']}), rounds of k={result['k']} after "
        f"{result['prompt_tokens']}-token prompts; the heavy key opens {result['heavy_sessions']} sessions and "
        f"loops rounds on each. {m['cpu_model']}, {m['cores']} cores ({m['cpu_flags']}), {result['date']}.",
        "",
        f"Command: `{result['command']}`",
        "",
        "| phase | light key round p50 / p95 (ms) | p95 / p95 alone | heavy key: sessions served, refused, rounds |",
        "|---|---|---|---|",
    ]
    for name, row in result["phases"].items():
        light, heavy = row["light_round_ms"], row["heavy"]
        refused = sum(v for key, v in heavy.items() if key not in ("served", "rounds"))
        lines.append(
            f"| {name} | {light['p50']} / {light['p95']} | {light['p95'] / alone['p95']:.2f} | "
            f"{heavy.get('served', 0)}, {refused}, {heavy.get('rounds', 0)} |"
        )
    return "\n".join(lines) + "\n"


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    model = load_measured_model(args)
    quota = KeyLimits(max_sessions=args.key_max_sessions, max_queued=args.key_max_queued)
    phases = {
        "alone": await phase(model, args, quota, flood=False),
        f"beside the flood, heavy key limited to {args.key_max_sessions} sessions": await phase(model, args, quota, flood=True),
        "beside the flood, no per-key limits": await phase(model, args, None, flood=True),
    }
    return {
        "model": Path(args.model).name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "k": args.k,
        "prompt_tokens": args.prompt_tokens,
        "heavy_sessions": args.heavy_sessions,
        "phases": phases,
        **provenance("python -m bench.studies.two_keys " + " ".join(args.argv)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = measurement_parser("two_keys", __doc__, prompt_tokens=64)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--rounds", type=int, default=30, help="the light key's rounds per phase")
    parser.add_argument("--heavy-sessions", type=int, default=12)
    parser.add_argument("--key-max-sessions", type=int, default=1, help="the heavy key's quota in the limited phase")
    parser.add_argument("--key-max-queued", type=int, default=2)
    parser.add_argument("--flood-head-start-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    result = asyncio.run(_main(args))
    write_result(args.out, "two_keys", result, _report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
