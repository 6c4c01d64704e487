"""Helpers for the operations tests: a real verifier (uvicorn + grpc.aio on port 0) in this
event loop, HTTP gets that do not block it, Prometheus parsing, traffic with known outcomes."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedModel

from cloud.config import VerifierSettings
from cloud.engine import Engine
from cloud.engine.transformers import TransformersEngine
from cloud.process import Servers, load_model, shutdown, start_servers
from cloud.verifier import Verifier, VerifierLimits
from shared import lm
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

SETTINGS = VerifierSettings(port=0, http_port=0, max_draft_tokens=8, dtype="float32")


@asynccontextmanager
async def running_servers(
    model: PreTrainedModel | Callable[[], Engine],
    gate: threading.Event | None = None,
    settings: VerifierSettings = SETTINGS,
) -> AsyncIterator[tuple[Servers, asyncio.Task[None]]]:
    """Servers up; the model 'loads' (returns a Verifier of `model`, or of a fresh Engine from a
    factory of them: tests.harness.TargetEngine) once `gate` is set."""

    def load(s: VerifierSettings) -> Verifier:
        if gate is not None:
            gate.wait(30)
        engine = TransformersEngine(model) if isinstance(model, PreTrainedModel) else model()
        return Verifier(engine, "tiny-target", VerifierLimits(max_draft_tokens=s.max_draft_tokens))

    servers = await start_servers(settings)
    loading = asyncio.create_task(load_model(servers, settings, load))
    try:
        yield servers, loading
    finally:
        if gate is not None:
            gate.set()
        await loading
        await shutdown(servers, grace_s=0.0)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    """GET from a thread: the server answers on this very event loop."""
    return await asyncio.to_thread(_get, f"http://127.0.0.1:{port}{path}")


async def http_json(port: int, path: str) -> tuple[int, Any]:
    status, body = await http_get(port, path)
    return status, json.loads(body)


def metric_samples(exposition: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, labels): value} from Prometheus text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def greedy_continuation(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy tokens after prompt, computed here, independently of the server."""
    cache, tokens, feed = lm.new_cache(model), [], list(prompt)
    for _ in range(n):
        token = int(lm.forward(model, cache, feed)[-1].argmax())
        tokens.append(token)
        feed = [token]
    return tokens


def stub(port: int) -> tuple[grpc.aio.Channel, pb_grpc.VerifierStub]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return channel, pb_grpc.VerifierStub(channel)


async def _session_rounds(verifier: pb_grpc.VerifierStub, draft: PreTrainedModel, rng: random.Random, rounds: int) -> None:
    """One session of `rounds` greedy speculative rounds, drafts from `draft`, k in [2, 8]."""
    tokens = [rng.randrange(2, 96) for _ in range(8)]
    opened = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=tokens))
    try:
        for _ in range(rounds):
            drafts = greedy_continuation(draft, tokens, rng.randint(2, 8))
            reply = await verifier.Verify(
                pb.VerifyRequest(session_id=opened.session_id, base_position=len(tokens), draft_tokens=drafts)
            )
            tokens.extend([*drafts[: reply.accepted_len], reply.next_token])
            await asyncio.sleep(0.01)  # spread rounds over the seconds the page charts
    finally:
        await verifier.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))


async def drive_traffic(port: int, draft: PreTrainedModel, seconds: float, concurrent: int = 3, seed: int = 0) -> None:
    """Sessions of 20 rounds each, `concurrent` at a time, for about `seconds`."""
    rng = random.Random(seed)
    channel, verifier = stub(port)
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.gather(*(_session_rounds(verifier, draft, rng, 20) for _ in range(concurrent)))
    finally:
        await channel.close()
