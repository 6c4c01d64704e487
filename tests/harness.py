"""A real grpc.aio verifier on a loopback port 0, and the edge pieces around it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
from transformers import PreTrainedModel

from cloud.grpc_server import create_server
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.client import VerifierClient
from edge.drafter import Drafter, DrafterConfig
from edge.generate import GenerationConfig
from shared.protocol import SessionConfig
from shared.sampling import SamplingParams
from shared.speculative import AcceptMode

GREEDY = SamplingParams()


@asynccontextmanager
async def serving(state: ServerState, verify_timeout_s: float = 10) -> AsyncIterator[VerifierClient]:
    """A real grpc.aio server for `state` on a loopback port 0, and a client of it."""
    server, port = create_server(state, "127.0.0.1:0")
    await server.start()
    client = VerifierClient(f"127.0.0.1:{port}", verify_timeout_s=verify_timeout_s)
    try:
        yield client
    finally:
        await client.close()
        await server.stop(None)


@asynccontextmanager
async def running_verifier(model: PreTrainedModel, limits: VerifierLimits | None = None,
                           ) -> AsyncIterator[tuple[VerifierClient, Verifier]]:
    verifier = Verifier(model, "tiny-target", limits)
    async with serving(ServerState.for_verifier(verifier)) as client:
        yield client, verifier


def random_prompt(seed: int, length: int = 8, vocab: int = 96) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_drafter(model: PreTrainedModel, params: SamplingParams = GREEDY,
                 mode: AcceptMode = AcceptMode.GREEDY, seed: int = 1, vocab: int = 96,
                 stop: frozenset[int] = frozenset(), signals: bool = False) -> Drafter:
    config = DrafterConfig(params, mode, vocab, draft_top_k=8, stop_token_ids=stop, signals=signals)
    return Drafter(model, config, seed)


def gen_config(max_new_tokens: int = 40, params: SamplingParams = GREEDY,
               mode: AcceptMode = AcceptMode.GREEDY, seed: int = 0, vocab: int = 96,
               stop: frozenset[int] = frozenset(), **options: Any) -> GenerationConfig:
    """options: GenerationConfig's timeouts, gating, stop_rule."""
    return GenerationConfig(SessionConfig(params, seed, mode, vocab), max_new_tokens, stop, **options)
