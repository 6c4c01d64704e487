"""`edge-agent`: draft locally, verify in the cloud, print the target model's text.

Exit status: 0 when every prompt was answered; 1 when the run failed (one line on stderr);
3 when a --prompts run finished but some prompts failed (their output lines carry "error").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge.client import CapacityRetry, ClientTls, VerifierClient
from edge.config import EdgeSettings
from edge.display import StepPrinter, TextStream, format_stats
from edge.drafter import Drafter, DrafterConfig, DraftLM, DraftSource
from edge.gating import EscalationRules, GatingThresholds, load_gating_config
from edge.generate import (
    Gating,
    GenerationConfig,
    GenerationResult,
    Observer,
    RoundRecord,
    TimeoutPolicy,
    cloud_only_generate,
    edge_only_generate,
    speculative_generate,
)
from edge.kpolicy import CostK, EgagK, FixedK, KPolicy, LaRatioK
from edge.local_verifier import local_verifier
from edge.metrics import EdgeMetrics, MeteredObserver
from edge.ngram import HybridDrafter, NGramDrafter, NGramStore
from edge.prompts import Prompt, encode_prompt, read_prompts
from edge.runtime_llamacpp import LlamaCppDraftLM, find_gguf
from edge.tokenizer import EdgeTokenizer
from edge.trace import SessionRecorder, TraceHeader, trace_file_name, write_trace
from shared.cli import add_settings_flags, run_cli, settings_from_args
from shared.errors import ConfigError, SpecDecError, TlsHandshakeFailed, Unauthenticated
from shared.models import DRAFT_MODEL
from shared.net import is_loopback
from shared.protocol import AcceptMode, SessionConfig
from tools.model_store import model_folder

log = logging.getLogger("edge-agent")
PROMPTS_FAILED = 3  # exit status of a --prompts run that finished with some prompts failed


@dataclass
class EdgeContext:
    settings: EdgeSettings
    tokenizer: EdgeTokenizer
    draft_lm: DraftLM | None
    vocab_size: int
    stop_token_ids: frozenset[int]
    metrics: EdgeMetrics | None = None
    draft_name: str = ""  # the draft model folder's name, for recorded traces

    def observer(self, inner: Observer | None) -> Observer | None:
        return MeteredObserver(self.metrics, inner) if self.metrics else inner

    def generation_config(self, seed: int) -> GenerationConfig:
        s = self.settings
        session = SessionConfig(s.sampling(), seed, s.resolved_accept_mode(), self.vocab_size)
        timeouts = TimeoutPolicy(s.verify_timeout_ms / 1000, s.timeout_mode(), s.reconnect_window_s)
        stop_rule = (lambda sig: sig.entropy_bits > s.egag_stop_bits) if s.k_policy == "egag" else None
        return GenerationConfig(session, s.max_new_tokens, self.stop_token_ids, timeouts, self.gating(), stop_rule, s.overlap)

    def gating(self) -> Gating | None:
        s = self.settings
        if not s.gating:
            if s.local_commit:
                raise ConfigError("--local-commit needs --gating")
            return None
        thresholds, counts = GatingThresholds(), dict[int, int]()
        if s.gating_config:
            thresholds, counts = load_gating_config(Path(s.gating_config))
        rules = EscalationRules(counts) if s.rules else None
        return Gating(thresholds, rules, self.token_text, s.local_commit)

    def token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def k_policy(self) -> KPolicy:
        s = self.settings
        if s.k_policy == "la-ratio":
            return LaRatioK(min(max(6, s.k_min), s.k_max), s.k_min, s.k_max, s.la_raise_at, s.la_lower_at, s.la_window)
        if s.k_policy == "egag":
            return EgagK(s.k_min, s.k_max, s.egag_ema_beta, stop_bits=s.egag_stop_bits)
        if s.k_policy == "cost":
            return CostK(1, s.k_max, overlap=s.overlap)
        return FixedK(s.k)

    def draft_source(self, seed: int) -> DraftSource:
        """The drafter of --drafter: the model, an n-gram store, or both."""
        s = self.settings
        if s.drafter == "model":
            return self.drafter(seed)
        mode = s.resolved_accept_mode()
        signals = s.gating or s.k_policy == "egag"
        ngram = NGramDrafter(
            NGramStore(s.ngram_order, s.ngram_max_contexts),
            s.filler_top_k,
            self.stop_token_ids,
            with_sparse=mode is AcceptMode.SPARSE,
            with_signals=signals,
        )
        if s.drafter == "ngram":
            return ngram
        return HybridDrafter(self.drafter(seed), ngram, s.hybrid_min_order, s.hybrid_min_count)

    def drafter(self, seed: int) -> Drafter:
        if self.draft_lm is None:
            raise ConfigError("this mode needs a draft model")
        s = self.settings
        mode = s.resolved_accept_mode()
        signals = s.gating or s.k_policy == "egag"
        config = DrafterConfig(
            s.sampling(),
            mode,
            self.vocab_size,
            s.draft_top_k,
            self.stop_token_ids,
            signals=signals,
            mc_passes=s.mc_passes if s.gating else 0,
        )
        return Drafter(self.draft_lm, config, seed + 1)  # the cloud's generator uses `seed`


def load_draft_lm(settings: EdgeSettings, folder: str) -> DraftLM:
    """The draft model in the runtime --draft-runtime names (auto: llama.cpp when it is
    installed and a GGUF is at hand, else transformers)."""
    gguf = Path(settings.draft_gguf) if settings.draft_gguf else find_gguf(folder)
    runtime = settings.resolved_draft_runtime(gguf is not None)
    threads = settings.draft_threads or settings.threads
    if runtime == "llama.cpp":
        if gguf is None:
            raise ConfigError(f"--draft-runtime llama.cpp: no .gguf in {folder} (name one with --draft-gguf)")
        return LlamaCppDraftLM(gguf, threads, settings.draft_context)
    from edge.runtime_transformers import TransformersDraftLM  # torch: only on this path

    return TransformersDraftLM.load(
        folder, settings.dtype, settings.device, threads, keep_hidden=settings.gating and settings.mc_passes > 0
    )


def load_edge(settings: EdgeSettings) -> EdgeContext:
    folder = model_folder(settings.draft_model, DRAFT_MODEL)
    tokenizer = EdgeTokenizer(folder)
    needs_model = settings.mode == "edge_only" or (settings.mode == "speculative" and settings.drafter != "ngram")
    # An n-gram edge never loads a model: only the tokenizer.
    draft_lm = load_draft_lm(settings, folder) if needs_model else None
    vocab = len(tokenizer) if draft_lm is None else min(len(tokenizer), draft_lm.logits_width)
    return EdgeContext(settings, tokenizer, draft_lm, vocab, tokenizer.stop_token_ids, draft_name=Path(folder).name)


@asynccontextmanager
async def cloud_address(settings: EdgeSettings) -> AsyncIterator[str | None]:
    """The verifier to talk to: --cloud, or a cloud-verifier started here on a loopback port."""
    if settings.cloud or settings.mode == "edge_only":
        yield settings.cloud
        return
    flags = ["--dtype", settings.dtype, "--device", settings.device, "--drain-grace-s", "1"]
    if settings.target_model:  # else the verifier's default: the packaged target model
        flags += ["--model", settings.target_model]
    if settings.threads:
        flags += ["--threads", str(settings.threads)]
    async with local_verifier(flags) as address:
        yield address


def verifier_client(settings: EdgeSettings, address: str) -> VerifierClient:
    """A client of the verifier at `address`: TLS and the API key apply to --cloud (a verifier
    started here by cloud_address is plaintext on loopback and asks no key)."""
    retry = CapacityRetry(settings.capacity_retries, settings.capacity_backoff_ms / 1000)
    remote = settings.cloud is not None
    tls = None
    if remote and settings.uses_tls():
        tls = ClientTls.from_files(settings.tls_ca, settings.tls_cert, settings.tls_key, settings.tls_server_name)
    key = settings.api_key.get_secret_value() if settings.api_key and remote else None
    exposed = [a for a in address.split(",") if not is_loopback(a.strip().rsplit(":", 1)[0])]
    if key and tls is None and exposed:
        log.warning("sending the API key to %s without TLS (give --tls-ca)", ",".join(exposed))
    return VerifierClient(address, settings.call_timeout_ms / 1000, capacity_retry=retry, tls=tls, api_key=key)


def _trace_header(ctx: EdgeContext, prompt_ids: list[int], cfg: GenerationConfig) -> TraceHeader:
    s = ctx.settings
    edge = {
        "k_policy": s.k_policy,
        "k": s.k,
        "k_min": s.k_min,
        "k_max": s.k_max,
        "drafter": s.drafter,
        "draft_top_k": s.draft_top_k,
        "overlap": s.overlap,
        "gating": s.gating,
        "timeout_mode": s.timeout_mode(),
        "verify_timeout_ms": s.verify_timeout_ms,
        "dtype": s.dtype,
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
        return edge_only_generate(prompt_ids, ctx.drafter(seed), cfg, on_commit)
    if client is None:
        raise ConfigError("no verifier address")
    recorder = SessionRecorder(_trace_header(ctx, prompt_ids, cfg)) if s.record else None
    client.tap = recorder  # sees every call of this one generation
    try:
        if s.mode == "cloud_only":
            result = await cloud_only_generate(prompt_ids, client, cfg, on_commit)
        else:
            result = await speculative_generate(prompt_ids, ctx.draft_source(seed), client, ctx.k_policy(), cfg, on_commit)
    finally:
        client.tap = None
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
    ctx = load_edge(settings)
    if settings.metrics_port is not None:
        ctx.metrics = EdgeMetrics()
        log.info("edge metrics on 127.0.0.1:%d", ctx.metrics.serve(settings.metrics_port))
    async with cloud_address(settings) as address:
        client = verifier_client(settings, address) if address else None
        try:
            return await (answer_prompts(ctx, client) if settings.prompts else run_single(ctx, client))
        finally:
            if client:
                await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # the OpenAI-compatible endpoint; FastAPI is imported only for it
        from edge.serve import serve_main

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
