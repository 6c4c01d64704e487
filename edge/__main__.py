"""`edge-agent`: draft locally, verify in the cloud, print the target model's text."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from cloud.__main__ import build_verifier
from cloud.config import VerifierSettings
from cloud.grpc_server import create_server
from edge.client import VerifierClient
from edge.config import EdgeSettings
from edge.display import StepPrinter, TextStream, format_stats
from edge.drafter import Drafter, DrafterConfig
from edge.generate import (
    GenerationConfig,
    GenerationResult,
    OnCommit,
    cloud_only_generate,
    edge_only_generate,
    speculative_generate,
)
from edge.kpolicy import make_k_policy
from edge.prompts import Prompt, encode_prompt, read_prompts
from shared import lm
from shared.cli import add_settings_flags, run_cli, settings_from_args
from shared.errors import ConfigError
from shared.protocol import SessionConfig

log = logging.getLogger("edge-agent")


def _packaged(name: str | None, which: str) -> str:
    if name is not None:
        return name
    from shared import model_store

    return str(model_store.ensure_model(getattr(model_store, which)))


@dataclass
class EdgeContext:
    settings: EdgeSettings
    tokenizer: PreTrainedTokenizerBase
    draft_model: PreTrainedModel | None
    vocab_size: int
    stop_token_ids: frozenset[int]

    def generation_config(self, seed: int) -> GenerationConfig:
        s = self.settings
        session = SessionConfig(s.sampling(), seed, s.resolved_accept_mode(), self.vocab_size)
        return GenerationConfig(session, s.max_new_tokens, self.stop_token_ids)

    def drafter(self, seed: int) -> Drafter:
        if self.draft_model is None:
            raise ConfigError("this mode needs a draft model")
        s = self.settings
        mode = s.resolved_accept_mode()
        config = DrafterConfig(s.sampling(), mode, self.vocab_size, s.draft_top_k, self.stop_token_ids)
        return Drafter(self.draft_model, config, seed + 1)  # the cloud's generator uses `seed`


def _stop_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = model.generation_config.eos_token_id if model is not None else None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)


def load_edge(settings: EdgeSettings) -> EdgeContext:
    folder = _packaged(settings.draft_model, "DRAFT_MODEL")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = None if settings.mode == "cloud_only" else lm.load_model(folder, settings.dtype, settings.device)
    vocab = len(tokenizer) if model is None else min(len(tokenizer), lm.logits_width(model))
    return EdgeContext(settings, tokenizer, model, vocab, _stop_ids(tokenizer, model))


@asynccontextmanager
async def cloud_address(settings: EdgeSettings) -> AsyncIterator[str | None]:
    """The verifier to talk to: --cloud, or one started here on a loopback port."""
    if settings.cloud or settings.mode == "edge_only":
        yield settings.cloud
        return
    cloud = VerifierSettings(model=_packaged(settings.target_model, "TARGET_MODEL"),
                             dtype=settings.dtype, device=settings.device)
    server, port = create_server(build_verifier(cloud), "127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def generate_one(ctx: EdgeContext, client: VerifierClient | None, prompt_ids: list[int], seed: int,
                       on_commit: OnCommit | None) -> GenerationResult:
    s = ctx.settings
    cfg = ctx.generation_config(seed)
    if s.mode == "edge_only":
        return edge_only_generate(prompt_ids, ctx.drafter(seed), cfg, on_commit)
    if client is None:
        raise ConfigError("no verifier address")
    if s.mode == "cloud_only":
        return await cloud_only_generate(prompt_ids, client, cfg, on_commit)
    return await speculative_generate(prompt_ids, ctx.drafter(seed), client, make_k_policy(s.k_policy, s.k),
                                      cfg, on_commit)


def _output_record(prompt: Prompt, result: GenerationResult, ctx: EdgeContext) -> dict[str, Any]:
    text = ctx.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return {"id": prompt.id, "category": prompt.category, "mode": ctx.settings.mode, "text": text,
            **result.summary()}


async def run_batch(ctx: EdgeContext, client: VerifierClient | None) -> None:
    s = ctx.settings
    assert s.prompts is not None
    prompts = read_prompts(Path(s.prompts))
    out = open(s.output, "w") if s.output else sys.stdout  # noqa: SIM115
    try:
        for index, prompt in enumerate(prompts):
            ids = encode_prompt(ctx.tokenizer, prompt.text, s.chat)
            result = await generate_one(ctx, client, ids, s.seed, None)
            out.write(json.dumps(_output_record(prompt, result, ctx)) + "\n")
            out.flush()
            log.info("%d/%d %s", index + 1, len(prompts), format_stats(result, s.mode))
    finally:
        if out is not sys.stdout:
            out.close()


async def run_single(ctx: EdgeContext, client: VerifierClient | None) -> None:
    s = ctx.settings
    assert s.prompt is not None
    ids = encode_prompt(ctx.tokenizer, s.prompt, s.chat)
    printer: OnCommit = StepPrinter(ctx.tokenizer) if s.show_steps else TextStream(ctx.tokenizer)
    result = await generate_one(ctx, client, ids, s.seed, printer)
    sys.stdout.write("\n")
    print(format_stats(result, s.mode), file=sys.stderr)  # noqa: T201


async def run_agent(settings: EdgeSettings) -> None:
    if (settings.prompt is None) == (settings.prompts is None):
        raise ConfigError("give exactly one of --prompt or --prompts")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    ctx = load_edge(settings)
    async with cloud_address(settings) as address:
        client = VerifierClient(address, settings.verify_timeout_ms / 1000) if address else None
        try:
            await (run_batch(ctx, client) if settings.prompts else run_single(ctx, client))
        finally:
            if client:
                await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edge-agent", description=__doc__)
    add_settings_flags(parser, EdgeSettings)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    def run() -> int:
        asyncio.run(run_agent(settings_from_args(EdgeSettings, args)))
        return 0

    return run_cli("edge-agent", run)


if __name__ == "__main__":
    sys.exit(main())
