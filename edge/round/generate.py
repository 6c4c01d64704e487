"""Generating text: the speculative round loop (edge/round/session.py) and the two baselines,
cloud_only (the target alone through the verifier's Generate stream) and edge_only (the
draft model alone). The configuration and result types live in edge/round/generation.py and
are re-exported here."""

from __future__ import annotations

from edge.drafting.drafter import Drafter, DraftSource
from edge.drafting.kpolicy import KPolicy
from edge.round.generation import (
    RECOVERABLE,
    Gating,
    GenerationConfig,
    GenerationResult,
    Observer,
    Output,
    Reconnecting,
    RoundRecord,
    TimeoutPolicy,
    reopened_config,
)
from edge.round.session import SpeculativeRun
from edge.transport.client import VerifierClient
from edge.transport.replicas import new_session_key
from shared.protocol import GenerateRequest

__all__ = [
    "Gating",
    "GenerationConfig",
    "GenerationResult",
    "Observer",
    "Reconnecting",
    "RoundRecord",
    "SpeculativeRun",
    "TimeoutPolicy",
    "cloud_only_generate",
    "edge_only_generate",
    "speculative_generate",
]


async def speculative_generate(
    prompt: list[int],
    drafter: DraftSource,
    client: VerifierClient,
    k_policy: KPolicy,
    cfg: GenerationConfig,
    observer: Observer | None = None,
) -> GenerationResult:
    """Draft k tokens, verify them in one cloud round, commit accepted + one, repeat."""
    return await SpeculativeRun(prompt, drafter, client, k_policy, cfg, observer).run()


async def cloud_only_generate(
    prompt: list[int],
    client: VerifierClient,
    cfg: GenerationConfig,
    observer: Observer | None = None,
    *,
    result: GenerationResult | None = None,
) -> GenerationResult:
    """Target alone through the verifier's Generate stream. A stream lost to a recoverable
    error is resumed within the reconnect window on the prompt plus the tokens already
    committed, asking only for the rest, so nothing is duplicated or lost. `result`: where the
    generation counts as it goes, for a caller that may stop it midway."""
    out = Output(cfg, result or GenerationResult(), observer)
    outage: Reconnecting | None = None
    session_key = new_session_key()
    while not out.done():
        req = GenerateRequest(
            prompt + out.result.token_ids,
            reopened_config(cfg.session, out.result.reopens, len(out.result.token_ids)),
            out.remaining(),
            sorted(cfg.stop_token_ids),
        )
        try:
            async for chunk in client.generate(req, session_key):
                out.result.count_wire(chunk.wire)
                outage = None  # it answers again: a later failure starts a new window
                out.result.target_forward_passes += 1
                out.commit(chunk.tokens, None, "cloud_only")
            break  # the stream ended by itself: at max_new_tokens or a stop token
        except RECOVERABLE as err:
            out.result.count_wire(err.wire)
            outage = outage or Reconnecting(cfg.timeouts)
            await outage.wait(err)
            if out.result.token_ids:  # a stream cut midway: resumed with a fresh seed
                out.result.reopens += 1
    return out.finish()


def edge_only_generate(
    prompt: list[int], drafter: Drafter, cfg: GenerationConfig, observer: Observer | None = None
) -> GenerationResult:
    """The draft model alone: one token per step, committed at once."""
    out = Output(cfg, GenerationResult(), observer)
    committed = list(prompt)
    while not out.done():
        drafter.sync(committed)
        draft = drafter.propose(1)
        committed += draft.token_ids
        out.commit(draft.token_ids, None, "edge_only")
    return out.finish()
