"""Kept prefixes across clients: no client's open reuses another's kept KV (the probe), and one
key's flood of new prompts leaves another key's kept conversation in place (the flood).

    python -m bench.studies.prefix_isolation --model PATH --out DIR [--prompt-tokens 512] [--repeats 3]

One model on the transformers engine, served in-process over real gRPC: verifiers with two API
keys, without keys, and without keys with --shared-prefix-cache (the probe's contrast). The
report says what each number means. Writes prefix_isolation.json and report.md.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from bench.environment import MeasurementSettings, load_measured_model, machine_line
from cloud.engine.transformers import TransformersEngine
from cloud.grpc_server import create_server
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.transport.client import VerifierClient
from shared import lm
from shared.api_keys import ApiKeys
from shared.protocol import DecodeRequest, GenerateRequest, OpenSessionRequest, SessionConfig

KEYS = {"a": "key-a-0123456789abcdef", "b": "key-b-0123456789abcdef"}
PROBE_NEW_TOKENS = 2  # what a probe's (and the flood's) stream makes: only its open is measured
PAIRS = {"two keys": (True, False), "two keys-off clients": (False, False), "keys-off shared": (False, True)}  # keyed, shared
C = TypeVar("C")


@dataclass(frozen=True)
class Opened:
    """One open: prompt tokens its scope's kept KV served, its prefill time in ms (OpenSession:
    the verifier's prefill_ms; a stream: its first chunk, at the client), the tokens it made."""

    reused: int
    ms: float
    tokens: list[int] = field(default_factory=list)


async def _drained(chunks: AsyncIterator[C], sent: float) -> tuple[C, float, list[C]]:
    """A stream's first chunk, the ms to it, and every chunk (read to the end: its session's
    KV is then kept)."""
    first = await anext(chunks)
    ms = (time.perf_counter() - sent) * 1000.0
    return first, ms, [first, *[chunk async for chunk in chunks]]


async def _open_session(client: VerifierClient, prompt: list[int], config: SessionConfig, new: int) -> Opened:
    opened = await client.open_session(OpenSessionRequest(prompt, config))
    await client.close_session(opened.session_id)
    return Opened(opened.reused_tokens, opened.prefill_ms)


async def _generate(client: VerifierClient, prompt: list[int], config: SessionConfig, new: int) -> Opened:
    sent = time.perf_counter()
    first, ms, chunks = await _drained(client.generate(GenerateRequest(prompt, config, max_new_tokens=new)), sent)
    return Opened(first.reused_tokens, ms, [t for chunk in chunks for t in chunk.tokens])


async def _decode(client: VerifierClient, prompt: list[int], config: SessionConfig, new: int) -> Opened:
    sent = time.perf_counter()
    first, ms, chunks = await _drained(client.decode(DecodeRequest("", 0, new, open=OpenSessionRequest(prompt, config))), sent)
    assert first.opened is not None  # the first chunk of a call that opens its session says so
    await client.close_session(first.opened.session_id)
    return Opened(first.opened.reused_tokens, ms, [t for chunk in chunks for t in chunk.tokens])


Opener = Callable[[VerifierClient, list[int], SessionConfig, int], Awaitable[Opened]]
OPENERS: dict[str, Opener] = {"open_session": _open_session, "generate": _generate, "decode": _decode}


@asynccontextmanager
async def _served(
    model: Any, limits: VerifierLimits, keyed: bool
) -> AsyncIterator[tuple[Verifier, Callable[[str], VerifierClient]]]:
    """A fresh verifier behind the real gRPC server (keys "a" and "b" when `keyed`), and a maker
    of clients (each its own channel and reuse token)."""
    verifier = Verifier(TransformersEngine(model), "target", limits)
    api_keys = ApiKeys.parse("\n".join(f"{name} {key}" for name, key in KEYS.items())) if keyed else None
    state = ServerState(verifier.limits.max_draft_tokens, verifier, api_keys=api_keys)
    server, port = create_server(state, "127.0.0.1:0", reflect=False)
    await server.start()
    clients: list[VerifierClient] = []

    def client(name: str) -> VerifierClient:
        clients.append(VerifierClient(f"127.0.0.1:{port}", 600, 600, api_key=KEYS[name] if keyed else None))
        return clients[-1]

    try:
        yield verifier, client
    finally:
        for made in clients:
            await made.close()
        await server.stop(None)
        state.worker.shutdown()


def _tokens(vocab: int, count: int, seed: int) -> list[int]:
    """Random tokens, past the low ids where special tokens sit."""
    return torch.randint(vocab // 10, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _probe(model: Any, args: PrefixIsolationSettings, config: SessionConfig) -> dict[str, Any]:
    rows, vocab = [], config.vocab_size
    for p, (pair, (keyed, shared)) in enumerate(PAIRS.items()):
        async with _served(model, VerifierLimits(share_prefixes=shared), keyed) as (_, client):
            a, b = client("a"), client("b")
            for n, (path, opener) in enumerate(OPENERS.items()):
                prompt = _tokens(vocab, args.prompt_tokens, 10 * p + n)
                await opener(a, prompt, config, PROBE_NEW_TOKENS)
                other = await opener(b, prompt + _tokens(vocab, args.turn_tokens, 1000 + n), config, PROBE_NEW_TOKENS)
                own = await opener(a, prompt + _tokens(vocab, args.turn_tokens, 2000 + n), config, PROBE_NEW_TOKENS)
                rows.append({"path": path, "pair": pair, **_pair_row("other", other), **_pair_row("own", own)})
    isolated = [r for r in rows if not PAIRS[r["pair"]][1]]
    return {"cross_scope_reuses": sum(r["other_reused"] > 0 for r in isolated), "isolated_opens": len(isolated), "rows": rows}


def _pair_row(whose: str, opened: Opened) -> dict[str, Any]:
    return {f"{whose}_reused": opened.reused, f"{whose}_ms": round(opened.ms, 1)}


async def _next_turn(
    model: Any, args: PrefixIsolationSettings, config: SessionConfig, repeat: int, flood: bool
) -> dict[str, Any]:
    """On a fresh verifier under the KV cap: key B's first turn, key A's flood (when `flood`),
    and B's next turn, measured."""
    vocab, limits = config.vocab_size, VerifierLimits()
    limits = replace(limits, sessions=replace(limits.sessions, max_kv_bytes=_kv_cap(model, args)))
    async with _served(model, limits, keyed=True) as (verifier, client):
        a, b = client("a"), client("b")
        history = _tokens(vocab, args.prompt_tokens, 3000 + repeat)
        reply = (await _generate(b, history, config, args.reply_tokens)).tokens
        if flood:
            prompts = [_tokens(vocab, args.prompt_tokens, 4000 + 100 * repeat + n) for n in range(args.flood_prompts)]
            await _flood(a, prompts, config)
        turn = history + reply + _tokens(vocab, args.turn_tokens, 5000 + repeat)
        opened = await _generate(b, turn, config, args.reply_tokens)
        return {
            "ttft_ms": round(opened.ms, 1),
            "reused": opened.reused,
            "computed": len(turn) - opened.reused,
            "evictions": verifier.sessions.eviction_totals(),
            "a_kept_left": verifier.sessions.prefix_totals("a")[2],
        }


async def _flood(a: VerifierClient, prompts: list[list[int]], config: SessionConfig) -> None:
    """Half the prompts as short Generate streams (each leaves a kept prefix), half as sessions
    opened and left idle: both press on the KV cap."""
    half = len(prompts) // 2
    for prompt in prompts[:half]:
        await _generate(a, prompt, config, PROBE_NEW_TOKENS)
    for prompt in prompts[half:]:
        await a.open_session(OpenSessionRequest(prompt, config))


def _kv_cap(model: Any, args: PrefixIsolationSettings) -> int:
    return args.max_kv_bytes or args.flood_room * (args.prompt_tokens + args.turn_tokens) * lm.kv_bytes_per_token(model)


async def _flood_study(model: Any, args: PrefixIsolationSettings, config: SessionConfig) -> dict[str, Any]:
    runs = [
        {"no_flood": await _next_turn(model, args, config, r, False), "flood": await _next_turn(model, args, config, r, True)}
        for r in range(args.repeats)
    ]
    median = {side: _medians([run[side] for run in runs]) for side in runs[0]}
    ratio = median["flood"]["ttft_ms"] / median["no_flood"]["ttft_ms"]
    return {"max_kv_bytes": _kv_cap(model, args), "median": median, "ttft_ratio": round(ratio, 2), "runs": runs}


def _medians(turns: list[dict[str, Any]]) -> dict[str, Any]:
    computed = statistics.median_low(t["computed"] for t in turns)  # one run's count, not a mean of two
    return {"ttft_ms": statistics.median(t["ttft_ms"] for t in turns), "computed": computed}


async def _measure(args: PrefixIsolationSettings, command: str) -> dict[str, Any]:
    model = load_measured_model(args)
    config = SessionConfig(vocab_size=min(lm.logits_width(model), 32000))
    settings = args.model_dump(include={"turn_tokens", "reply_tokens", "flood_prompts", "flood_room", "repeats"})
    probe = await _probe(model, args, config)
    return {**args.described(model, command), **settings, "probe": probe, "flood": await _flood_study(model, args, config)}


class PrefixIsolationSettings(MeasurementSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_PREFIX_ISOLATION_")
    study: ClassVar[str] = "prefix_isolation"

    dtype: str = Field("bfloat16", description="float32 | bfloat16 | float16")
    prompt_tokens: int = Field(512, ge=2, description="tokens of each probe prompt, of B's history, of each flood prompt")
    turn_tokens: int = Field(32, ge=1, description="new tokens of a next turn (the probe's later opens too)")
    reply_tokens: int = Field(16, ge=1, description="tokens key B's Generate makes each turn")
    flood_prompts: int = Field(12, ge=0, description="key A's distinct prompts: half Generate streams, half sessions left open")
    flood_room: int = Field(4, ge=1, description="the flood's KV cap, in prompts of --prompt-tokens + --turn-tokens")
    max_kv_bytes: int = Field(0, ge=0, description="the flood's KV cap in bytes (0: from --flood-room)")
    repeats: int = Field(3, ge=1, description="B's next turn measured this many times, with and without the flood")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        **MeasurementSettings.help_groups,
        "the measurement": ("prompt_tokens", "turn_tokens", "reply_tokens", "repeats"),
        "the flood": ("flood_prompts", "flood_room", "max_kv_bytes"),
    }

    async def measure(self, command: str) -> dict[str, Any]:
        return await _measure(self, command)

    def report(self, result: dict[str, Any]) -> str:
        return _report(result)


def _report(result: dict[str, Any]) -> str:
    return "\n".join([*_headline(result), *_probe_lines(result), *_flood_lines(result)]) + "\n"


def _headline(result: dict[str, Any]) -> list[str]:
    probe, flood = result["probe"], result["flood"]
    computed = {side: flood["median"][side]["computed"] for side in ("flood", "no_flood")}
    return [
        "# Kept prefixes across clients: isolation and fair eviction",
        "",
        f"**Cross-scope reuses: {probe['cross_scope_reuses']}** of {probe['isolated_opens']} opens over another client's "
        "prompt, keys on and off (must be 0).",
        f"**Key B's next turn beside key A's flood: TTFT {flood['ttft_ratio']}x** its TTFT without it (medians of "
        f"{result['repeats']}; goal at most 1.3x); B computed {computed['flood']} prompt tokens with it, "
        f"{computed['no_flood']} without.",
        "",
        f"Target `{result['model']}` ({result['dtype']}, transformers engine), {result['prompt_tokens']}-token prompts; "
        f"{machine_line(result['machine'])}; {result['date']}. Command: `{result['command']}`",
        "",
    ]


def _probe_lines(result: dict[str, Any]) -> list[str]:
    rows = result["probe"]["rows"]
    return [
        "## Probe: does one client's open reuse another's kept prefix?",
        "",
        f"Client A opens a fresh prompt P and closes it (or its stream ends); B opens P + {result['turn_tokens']} new "
        "tokens (*other's*); then A does (*own*). Reused: prompt tokens the open reports its scope's kept KV served. "
        "Ms: OpenSession's prefill_ms at the verifier; Generate and Decode: the first chunk, at the client. Other's "
        "reused must be 0 but in *keys-off shared* (--shared-prefix-cache): the contrast shows the probe sees sharing.",
        "",
        "| path | pair | other's reused | own reused | other's ms | own ms |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['path']} | {r['pair']} | {r['other_reused']} | {r['own_reused']} | {r['other_ms']} | {r['own_ms']} |"
            for r in rows
        ),
        "",
    ]


def _flood_lines(result: dict[str, Any]) -> list[str]:
    flood, turn = result["flood"], result["turn_tokens"]
    lines = [
        "## Flood: does one key's churn take another key's kept conversation?",
        "",
        f"KV cap {flood['max_kv_bytes']} bytes ({result['flood_room']} prompts of {result['prompt_tokens']} + {turn} "
        f"tokens). Key B sends its history, gets a {result['reply_tokens']}-token Generate reply (kept); key A sends "
        f"{result['flood_prompts']} distinct prompts (half short Generate streams, which leave kept prefixes; half "
        f"sessions left open and idle); then B's next turn (history, reply, {turn} new tokens) as a Generate stream. "
        "TTFT: its first chunk, at the client; computed: its prompt tokens no kept prefix served; no flood: the same "
        "on a fresh verifier without A. Evictions: A's sessions the cap dropped, by reason (freed kept prefixes are "
        "not counted); A's kept: its kept prefixes left.",
        "",
        "| run | TTFT no flood / flood (ms) | reused no flood / flood | computed no flood / flood | evictions | A's kept |",
        "|---|---|---|---|---|---|",
    ]
    for n, run in enumerate(flood["runs"], start=1):
        off, on = run["no_flood"], run["flood"]
        evictions = ", ".join(f"{k} {v}" for k, v in on["evictions"].items()) or "none"
        lines.append(
            f"| {n} | {off['ttft_ms']} / {on['ttft_ms']} | {off['reused']} / {on['reused']} | "
            f"{off['computed']} / {on['computed']} | {evictions} | {on['a_kept_left']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    return PrefixIsolationSettings.main(__doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
