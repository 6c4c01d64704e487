"""`edge-agent`: draft locally, verify in the cloud, print the target model's text.

Exit status: 0 when every prompt was answered; 1 when the run failed (one line on stderr);
3 when a --prompts run finished but some prompts failed (their output lines carry "error").
"""

# ruff: noqa: E402 (the environment is set before grpc is imported)
from __future__ import annotations

import os

# gRPC's C core reads its log level once, as grpc loads, and would otherwise write lines of its
# own on stderr (a failed TLS handshake's, at INFO) beside the edge's one-line error. Its errors
# only, unless GRPC_VERBOSITY says otherwise.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from edge.config import EdgeSettings
from edge.context import EdgeContext, cloud_address, load_edge, verifier_client
from edge.display import StepPrinter, TextStream, format_stats
from edge.metrics import EdgeMetrics
from edge.pair_check import apply_pair_check, check_pair
from edge.prompts import Prompt, encode_prompt, read_prompts
from edge.round.generate import (
    GenerationConfig,
    GenerationResult,
    Observer,
    RoundRecord,
    cloud_only_generate,
    edge_only_generate,
    speculative_generate,
)
from edge.trace import TraceHeader, write_trace
from edge.trace_recorder import SessionRecorder, trace_file_name
from edge.transport.client import VerifierClient
from shared.cli import add_settings_flags, run_cli, settings_from_args
from shared.errors import ConfigError, SpecDecError, TlsHandshakeFailed, Unauthenticated
from shared.hardware import matmul_flags, proc_field, usable_cores

log = logging.getLogger("edge-agent")
PROMPTS_FAILED = 3  # exit status of a --prompts run that finished with some prompts failed


def recording_cpu() -> str:
    """The CPU a trace is recorded on: its model, matmul flags and the cores the edge may use."""
    model = proc_field("/proc/cpuinfo", "model name") or "unknown CPU"
    return f"{model} ({' '.join(matmul_flags()) or 'no avx2'}), {usable_cores()} cores"


def _trace_header(ctx: EdgeContext, prompt_ids: list[int], cfg: GenerationConfig) -> TraceHeader:
    s = ctx.settings
    edge = {
        "k_policy": s.resolved_k_policy(),
        "k": s.fixed_k() if s.resolved_k_policy() == "fixed" else None,
        "k_min": s.k_min,
        "k_max": s.k_max,
        "drafter": s.drafter,
        "draft_top_k": s.draft_top_k,
        "overlap": s.overlap,
        "gating": s.gating,
        "timeout_mode": s.timeout_mode(),
        "verify_timeout_ms": s.verify_timeout_ms,
        "dtype": s.dtype,
        # planned costs (None: measured): a recording made beside a CPU verifier that drafts as
        # a laptop would for a GPU verifier behind a link
        "cost_plan_verify_ms": s.cost_plan_verify_ms,
        "cost_plan_network_ms": s.cost_plan_network_ms,
        "cost_plan_draft_ms": s.cost_plan_draft_ms,
        # a replay's think-time between a reply and the next request is what this edge spent
        # before sending it: drafting, and with overlap off nothing else of note
        "think_time": "drafting (overlap off)" if not s.overlap else "drafting left after overlap",
        # what recorded it: a replay's think-time between rounds is this drafter's on this CPU
        "draft_runtime": ctx.draft_lm.runtime if ctx.draft_lm is not None else None,
        "cpu": recording_cpu(),
    }
    session = cfg.session
    return TraceHeader(
        s.mode,
        list(prompt_ids),
        session.sampling,
        session.seed,
        session.accept_mode.value,
        session.vocab_size,
        cfg.max_new_tokens,
        sorted(cfg.stop_token_ids),
        ctx.draft_name,
        started_at=time.time(),
        edge=edge,
    )


async def generate_one(
    ctx: EdgeContext,
    client: VerifierClient | None,
    prompt_ids: list[int],
    seed: int,
    on_commit: Observer | None,
    label: str = "prompt",
) -> GenerationResult:
    s = ctx.settings
    cfg = ctx.generation_config(seed)
    if s.mode == "edge_only":
        return edge_only_generate(prompt_ids, ctx.drafter(seed, None, len(prompt_ids)), cfg, on_commit)
    if client is None:
        raise ConfigError("no verifier address")
    recorder = SessionRecorder(_trace_header(ctx, prompt_ids, cfg)) if s.record else None
    calls = client.with_tap(recorder) if recorder is not None else client  # the recorder sees this generation's calls
    if s.mode == "cloud_only":
        result = await cloud_only_generate(prompt_ids, calls, cfg, on_commit)
    else:  # auto or speculative: the generation config says which
        result = await speculative_generate(
            prompt_ids, ctx.draft_source(seed, None, len(prompt_ids)), calls, ctx.k_policy(), cfg, on_commit
        )
    if ctx.metrics is not None:
        ctx.metrics.record_generation(result)
    if recorder is not None and s.record:
        trace = recorder.finish(result.token_ids, result.finish_reason, result.rounds, result.reopens)
        write_trace(Path(s.record) / trace_file_name(label, recorder.header.started_at), trace)
    return result


def _output_record(prompt: Prompt, result: GenerationResult, ctx: EdgeContext) -> dict[str, Any]:
    text = ctx.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    runtime = ctx.draft_lm.runtime if ctx.draft_lm is not None else None
    return {
        "id": prompt.id,
        "category": prompt.category,
        "mode": ctx.settings.mode,
        "text": text,
        "draft_runtime": runtime,
        **result.summary(),
    }


def _log_rounds(path: str | None, prompt_id: str, result: GenerationResult) -> None:
    if path is None:
        return
    with open(path, "a") as log_file:
        for record in result.round_log:
            log_file.write(json.dumps({"id": prompt_id, **asdict(record)}) + "\n")


class _Committed:
    """Keeps the final tokens of a generation, so a failed prompt still reports what it got."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []

    def committed(self, tokens: list[int], record: RoundRecord | None) -> None:
        self.token_ids += tokens

    def provisional(self, tokens: list[int]) -> None:
        pass


def _one_line(err: SpecDecError) -> str:
    return " ".join(str(err).split()) or type(err).__name__


async def _answer(ctx: EdgeContext, client: VerifierClient | None, prompt: Prompt) -> tuple[GenerationResult, str | None]:
    """One prompt's result, and its error as one line if it failed. A failed prompt (after the
    reconnect window, a request the verifier refuses, ...) keeps the tokens committed before
    the error, with finish_reason "error"; a bad option stops the whole run instead."""
    s = ctx.settings
    ids = encode_prompt(ctx.tokenizer, prompt.text, s.chat)
    kept, start = _Committed(), time.perf_counter()
    try:
        return await generate_one(ctx, client, ids, s.seed, ctx.observer(kept), prompt.id), None
    except (ConfigError, Unauthenticated, TlsHandshakeFailed):
        raise  # every later prompt would fail the same way: stop the run with one line
    except SpecDecError as err:
        failed = GenerationResult(token_ids=kept.token_ids, finish_reason="error", elapsed_s=time.perf_counter() - start)
        return failed, _one_line(err)


async def answer_prompts(ctx: EdgeContext, client: VerifierClient | None) -> int:
    """Answer every prompt, one output line each, a failed one included; returns how many failed."""
    s = ctx.settings
    assert s.prompts is not None
    prompts = read_prompts(Path(s.prompts))
    out = open(s.output, "w") if s.output else sys.stdout  # noqa: SIM115
    failed = 0
    try:
        for index, prompt in enumerate(prompts):
            result, error = await _answer(ctx, client, prompt)
            record = _output_record(prompt, result, ctx)
            out.write(json.dumps(record if error is None else {**record, "error": error}) + "\n")
            out.flush()
            _log_rounds(s.log_rounds, prompt.id, result)
            if error is None:
                log.info("%d/%d %s", index + 1, len(prompts), format_stats(result, s.mode))
            else:
                failed += 1
                log.error("%d/%d %s failed: %s", index + 1, len(prompts), prompt.id, error)
    finally:
        if out is not sys.stdout:
            out.close()
    if failed:
        log.error('%d of %d prompts failed (finish_reason "error" in their output lines)', failed, len(prompts))
    else:
        log.info("all %d prompts answered", len(prompts))
    return failed


async def run_single(ctx: EdgeContext, client: VerifierClient | None) -> int:
    """Stream one answer; an error ends the run (one line, exit status 1)."""
    s = ctx.settings
    assert s.prompt is not None
    ids = encode_prompt(ctx.tokenizer, s.prompt, s.chat)
    printer: Observer = StepPrinter(ctx.tokenizer) if s.show_steps else TextStream(ctx.tokenizer)
    result = await generate_one(ctx, client, ids, s.seed, ctx.observer(printer))
    _log_rounds(s.log_rounds, "prompt", result)
    sys.stdout.write("\n")
    print(format_stats(result, s.mode), file=sys.stderr)  # noqa: T201
    return 0


async def run_agent(settings: EdgeSettings) -> int:
    """Returns how many prompts failed (a --prompts run goes on past them)."""
    if (settings.prompt is None) == (settings.prompts is None):
        raise ConfigError("give exactly one of --prompt or --prompts")
    if settings.record and settings.mode == "edge_only":
        raise ConfigError("--record records calls to the verifier: edge_only makes none")
    if settings.record and settings.mode == "auto":
        raise ConfigError("--record replays one mode's calls: give --mode speculative or --mode cloud_only with it")
    ctx = load_edge(settings)
    if settings.metrics_port is not None:
        ctx.metrics = EdgeMetrics()
        log.info("edge metrics on 127.0.0.1:%d", ctx.metrics.serve(settings.metrics_port))
    async with cloud_address(settings) as address:
        client = verifier_client(settings, address) if address else None
        try:
            if client:
                apply_pair_check(ctx, await check_pair(ctx, client))
            return await (answer_prompts(ctx, client) if settings.prompts else run_single(ctx, client))
        finally:
            if client:
                await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # the OpenAI-compatible endpoint; FastAPI is imported only for it
        from edge.serve.server import serve_main

        return serve_main(argv[1:])
    parser = argparse.ArgumentParser(prog="edge-agent", description=__doc__)
    add_settings_flags(parser, EdgeSettings)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    def run() -> int:
        failed = asyncio.run(run_agent(settings_from_args(EdgeSettings, args)))
        return PROMPTS_FAILED if failed else 0

    return run_cli("edge-agent", run)


if __name__ == "__main__":
    sys.exit(main())
