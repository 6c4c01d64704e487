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

import asyncio
import random
import time
from collections import Counter
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from bench.environment import MeasurementSettings, load_measured_model
from cloud.batcher import BatchLimits
from cloud.engine.transformers import TransformersEngine
from cloud.grpc_server import create_server
from cloud.quotas import KeyLimits
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.transport.client import CapacityRetry, VerifierClient
from shared import lm
from shared.api_keys import ApiKeys
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


async def _measure(args: TwoKeysSettings, command: str) -> dict[str, Any]:
    model = load_measured_model(args)
    quota = KeyLimits(max_sessions=args.key_max_sessions, max_queued=args.key_max_queued)
    phases = {
        "alone": await phase(model, args, quota, flood=False),
        f"beside the flood, heavy key limited to {args.key_max_sessions} sessions": await phase(model, args, quota, flood=True),
        "beside the flood, no per-key limits": await phase(model, args, None, flood=True),
    }
    return {**args.described(model, command), "k": args.k, "heavy_sessions": args.heavy_sessions, "phases": phases}


class TwoKeysSettings(MeasurementSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_TWO_KEYS_")
    study: ClassVar[str] = "two_keys"

    prompt_tokens: int = Field(64, ge=1, description="tokens of each session's prompt")
    k: int = Field(4, ge=0, description="draft tokens per round")
    rounds: int = Field(30, ge=1, description="the light key's rounds per phase")
    heavy_sessions: int = Field(12, ge=0, description="sessions the heavy key opens at once")
    key_max_sessions: int = Field(1, ge=0, description="the heavy key's sessions at most, limited phase (0: none)")
    key_max_queued: int = Field(2, ge=0, description="the heavy key's queued rounds at most, limited phase (0: none)")
    flood_head_start_s: float = Field(2.0, ge=0, description="how long the flood runs before the light key's rounds")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        **MeasurementSettings.help_groups,
        "the measurement": ("prompt_tokens", "k", "rounds", "heavy_sessions", "flood_head_start_s"),
        "the heavy key's quota": ("key_max_sessions", "key_max_queued"),
    }

    async def measure(self, command: str) -> dict[str, Any]:
        return await _measure(self, command)

    def report(self, result: dict[str, Any]) -> str:
        return _report(result)


async def phase(model: Any, args: TwoKeysSettings, key_limits: KeyLimits | None, flood: bool) -> dict[str, Any]:
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


def main(argv: list[str] | None = None) -> int:
    return TwoKeysSettings.main(__doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
