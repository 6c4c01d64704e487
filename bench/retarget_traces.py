"""Recorded greedy sessions made to fit another target model, round for round.

    python -m bench.retarget_traces --traces TRACE_DIR --model MODEL_DIR --out OUT_DIR [--device auto] [--dtype bfloat16]
    python -m bench.retarget_traces --traces TRACE_DIR --cloud HOST:PORT --out OUT_DIR

Each recorded round keeps its timing (the edge's think-time), its k and its accepted length;
its draft tokens are rewritten so that MODEL_DIR, greedy, accepts exactly as many as the
recorded verifier did: the first `accepted_len` drafts are the model's own greedy tokens,
the next one differs from the model's choice, the rest are the recorded ones. The replies
the model gives (the recovered or bonus token) become the recorded replies, so a replay
against a verifier serving MODEL_DIR can compare them (replay fidelity).

Why: a capacity search on a machine that cannot hold the recorded pair's weights (a GPU box
with no network, say) serves a model of the same architecture with random weights
(bench/random_weights.py). The verifier's cost per round depends on the shapes, not the
weights; the acceptance the replay sees, and so the tokens each round yields, stay the
recorded pair's. Only greedy traces can be rewritten this way.

With --cloud, the greedy tokens come from a running verifier's Generate (no stop tokens) instead
of a model loaded here: a verifier started with `--engine vllm --load-format dummy` then serves
the very model the traces are rewritten for, and no weights are written anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from transformers import PreTrainedModel

from bench.cli import settings_parser
from edge.trace import Event, OpenEvent, SessionTrace, TraceEnd, TraceError, VerifyEvent, read_traces, write_trace
from edge.transport.client import VerifierClient
from shared import lm
from shared.cli import run_cli, settings_from_args
from shared.errors import ConfigError
from shared.protocol import AcceptMode, GenerateRequest, SessionConfig

log = logging.getLogger("retarget-traces")


class GreedyTarget:
    """The model's greedy continuation of one session, a token at a time, with its KV."""

    def __init__(self, model: PreTrainedModel, prompt: Sequence[int]) -> None:
        self.model, self.cache = model, lm.new_cache(model)
        self.logits = lm.forward(model, self.cache, prompt, keep=1)[-1]  # [V]: the next token's
        self.generated: list[int] = []

    def next_tokens(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            token = int(self.logits.argmax())
            out.append(token)
            self.logits = lm.forward(self.model, self.cache, [token])[-1]
        self.generated += out
        return out


class ListedGreedy:
    """The greedy continuation a verifier already streamed, handed out as GreedyTarget does."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.generated: list[int] = []

    def next_tokens(self, n: int) -> list[int]:
        start = len(self.generated)
        if start + n > len(self.tokens):
            raise TraceError(f"the verifier gave {len(self.tokens)} tokens, the trace needs more")
        self.generated += self.tokens[start : start + n]
        return self.tokens[start : start + n]


def tokens_needed(trace: SessionTrace) -> int:
    """The greedy tokens a rewrite takes: each replied round's accepted drafts and reply token."""
    return sum(e.accepted_len + 1 for e in trace.events if isinstance(e, VerifyEvent) and e.error is None)


def _rejected(model_choice: int, recorded: int, vocab: int) -> int:
    """A draft the model does not choose: the recorded one where it differs."""
    return recorded if recorded != model_choice else (model_choice + 1) % vocab


def _round(event: VerifyEvent, target: GreedyTarget | ListedGreedy, vocab: int) -> VerifyEvent:
    drafts, accepted = list(event.request.draft_tokens), event.accepted_len
    greedy = target.next_tokens(accepted + 1)  # the accepted drafts and the reply token
    if accepted < len(drafts):
        drafts[accepted] = _rejected(greedy[accepted], drafts[accepted], vocab)
    drafts[:accepted] = greedy[:accepted]
    return replace(event, request=replace(event.request, draft_tokens=drafts), next_token=greedy[accepted])


def check_retargetable(trace: SessionTrace) -> None:
    if trace.header.accept_mode != "greedy" or trace.header.mode != "speculative":
        raise TraceError(f"{trace.name}: only greedy speculative traces can be retargeted")
    if any(e.request.committed_tokens for e in trace.replied_verifies()):
        raise TraceError(f"{trace.name}: rounds that resend committed tokens cannot be retargeted")


@torch.inference_mode()
def retarget(trace: SessionTrace, model: PreTrainedModel, model_name: str) -> SessionTrace:
    check_retargetable(trace)
    return rewrite(trace, GreedyTarget(model, trace.header.prompt_tokens), lm.logits_width(model), model_name)


def rewrite(trace: SessionTrace, target: GreedyTarget | ListedGreedy, vocab: int, model_name: str) -> SessionTrace:
    """The trace's rounds made to accept what they accepted, on `target`'s greedy tokens."""
    events: list[Event] = []
    for event in trace.events:
        if isinstance(event, OpenEvent):  # a reopen happens on what the session had committed
            events.append(replace(event, prefix_tokens=target.generated[: len(event.prefix_tokens)]))
        elif isinstance(event, VerifyEvent):  # a failed round has no reply to rewrite
            events.append(_round(event, target, vocab) if event.error is None else event)
        else:
            raise TraceError(f"{trace.name}: a {type(event).__name__} cannot be retargeted")
    header = replace(trace.header, target_model=model_name, edge={**trace.header.edge, "retargeted": True})
    end = TraceEnd(trace.end.t, target.generated, trace.end.finish_reason, trace.end.rounds, trace.end.reopens)
    return SessionTrace(header, events, end, trace.name)


class RetargetSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_RETARGET_")

    traces: Path = Field(description="folder of recorded *.jsonl session traces")
    model: Path | None = Field(None, description="the target model folder the traces are rewritten for")
    cloud: str | None = Field(
        None, description="instead of --model: a running verifier (HOST:PORT) whose greedy Generate gives the tokens"
    )
    out: Path = Field(description="folder for the rewritten traces (same file names)")
    device: str = Field("auto", description="where the model runs (auto: CUDA when there is one)")
    dtype: str = Field("bfloat16", description="the dtype the verifier will serve the model in")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "folders": ("traces", "model", "cloud", "out"),
        "the model": ("device", "dtype"),
    }


async def retarget_on_verifier(traces: list[SessionTrace], address: str) -> list[SessionTrace]:
    """Every trace rewritten on the greedy tokens of the verifier at `address` (all at once)."""
    client = VerifierClient(address, verify_timeout_s=600.0)
    try:
        described = await client.describe()
        model_id = described.model_id if described is not None else address

        async def one(trace: SessionTrace) -> SessionTrace:
            check_retargetable(trace)
            h = trace.header
            config = SessionConfig(h.sampling, h.seed, AcceptMode.GREEDY, h.vocab_size)
            tokens: list[int] = []
            async for chunk in client.generate(GenerateRequest(h.prompt_tokens, config, tokens_needed(trace), [])):
                tokens += chunk.tokens
            return rewrite(trace, ListedGreedy(tokens), h.vocab_size, model_id)

        return list(await asyncio.gather(*(one(trace) for trace in traces)))
    finally:
        await client.close()


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.retarget_traces", __doc__, RetargetSettings)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    def run() -> int:
        s = settings_from_args(RetargetSettings, args)
        traces = read_traces(s.traces)
        if (s.model is None) == (s.cloud is None):
            raise ConfigError("give one of --model and --cloud")
        if s.model is not None:
            model = lm.load_model(s.model, s.dtype, s.device)
            rewritten = [retarget(trace, model, s.model.name) for trace in traces]
        else:
            rewritten = asyncio.run(retarget_on_verifier(traces, str(s.cloud)))
        for trace in rewritten:
            write_trace(s.out / f"{trace.name}.jsonl", trace)
        log.info("%d traces rewritten into %s", len(traces), s.out)
        return 0

    return run_cli("python -m bench.retarget_traces", run)


if __name__ == "__main__":
    sys.exit(main())
