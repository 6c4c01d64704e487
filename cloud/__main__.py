"""`cloud-verifier`: serve the target model over gRPC, with probes, Prometheus metrics and a
live page over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from cloud.config import PRECEDENCE, VerifierSettings, load_settings
from cloud.engine import Engine
from cloud.engine.transformers import TransformersEngine
from cloud.logs import configure_logging, log_event
from cloud.process import serve
from cloud.verifier import Verifier
from shared import lm
from shared.cli import add_settings_flags, run_cli
from shared.hardware import choose_dtype, usable_cores
from shared.models import TARGET_MODEL
from shared.models.hub import describe as describe_model
from shared.models.store import ensure_model, model_folder
from shared.tokenizer_card import TokenizerCard

if TYPE_CHECKING:
    from cloud.engine.vllm_runtime import VllmOptions

log = logging.getLogger("cloud-verifier")


def build_verifier(settings: VerifierSettings) -> Verifier:
    if settings.engine == "llama.cpp":
        return _llamacpp_verifier(settings)
    if settings.engine == "vllm":
        return _vllm_verifier(settings)
    device = lm.resolve_device(settings.device)
    dtype = choose_dtype(settings.dtype, device.type)
    threads = lm.configure_cpu(device, settings.threads)
    where = f"{device.type}, {dtype.name} ({dtype.reason})" + (f", {threads} CPU threads" if threads else "")
    log_event(log, logging.INFO, where, dtype=dtype.name, dtype_reason=dtype.reason, threads=threads)
    path = model_folder(settings.model, TARGET_MODEL)
    model = lm.load_model(path, dtype.name, str(device))
    return _warmed(TransformersEngine(model), path, settings, dtype.reason)


def _llamacpp_verifier(settings: VerifierSettings) -> Verifier:
    """The target's GGUF in llama.cpp: --model names the file or a folder holding one (the
    packaged target keeps its GGUF for this)."""
    from cloud.engine.llamacpp import LlamaCppEngine, target_gguf

    if settings.model is None:
        folder = str(ensure_model(TARGET_MODEL, keep_gguf=True))
    else:  # a GGUF file or a folder holding one is returned as it is
        folder = model_folder(settings.model, TARGET_MODEL)
    gguf = target_gguf(folder)
    threads = settings.threads or usable_cores()
    # llama.cpp's threads own the cores; torch only runs the accept on a few rows of logits. At
    # its default (a thread per core) torch's idle OpenMP threads spin after each op, taking
    # those cores from llama.cpp: a decode step took 42 ms instead of 38 on 2 cores.
    lm.configure_cpu(lm.resolve_device("cpu"), 1)
    engine = LlamaCppEngine(gguf, threads=threads, batch_tokens=settings.max_batch_tokens)
    log_event(log, logging.INFO, f"llama.cpp on {gguf.name}, {threads} CPU threads", engine="llama.cpp", threads=threads)
    return _warmed(engine, folder, settings, "the GGUF's own types")


def _vllm_verifier(settings: VerifierSettings) -> Verifier:
    """The target folder in vLLM, which holds the KV itself and serves up to
    --max-context-tokens a session. Admission counts sessions against the KV vLLM allocated."""
    from cloud.engine.vllm import VllmEngine
    from cloud.engine.vllm_process import ProcessEngine
    from cloud.engine.vllm_runtime import VllmRuntime

    folder = model_folder(settings.model, TARGET_MODEL)
    cuda = torch.cuda.is_available()
    dtype = choose_dtype(settings.dtype, "cuda" if cuda else "cpu")
    options = vllm_options(settings, folder, dtype.name, cuda)
    engine: VllmEngine | ProcessEngine = (
        ProcessEngine(options) if settings.vllm_engine_process else VllmEngine(VllmRuntime(options))
    )
    facts = engine.describe()
    threads, scheduling = facts.get("threads"), facts["scheduling"]  # threads: on a CPU
    where = f"{dtype.name} ({dtype.reason})" + (f", {threads} CPU threads" if threads else "") + f", {scheduling} scheduling"
    log_event(
        log, logging.INFO, f"vLLM on {folder}, {where}", engine="vllm", dtype=dtype.name, threads=threads, scheduling=scheduling
    )
    held = engine.kv_bytes_held()
    log_event(log, logging.INFO, f"vLLM holds KV for {engine.kv_tokens()} tokens, {held / 2**30:.2f} GiB", kv_bytes=held)
    return _warmed(engine, folder, settings, dtype.reason)


def vllm_options(settings: VerifierSettings, folder: str, dtype: str, cuda: bool) -> VllmOptions:
    """What the verifier's settings ask of vLLM."""
    from cloud.engine.vllm_runtime import VllmOptions

    return VllmOptions(
        folder,
        dtype=dtype,
        max_context_tokens=settings.max_context_tokens,
        max_sessions=settings.max_sessions,
        max_kv_bytes=vllm_kv_bytes(settings, cuda),
        tensor_parallel_size=settings.tensor_parallel_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enforce_eager=settings.enforce_eager,
        load_format=settings.load_format,
        max_draft_tokens=max(settings.max_draft_tokens, 1),  # vLLM's speculative tokens a step
        max_top_k=settings.limits().max_top_k,  # the top-k a round may ask for: vLLM's logprobs
        pad_decode=settings.pad_decode_steps,
        cpu_threads=settings.threads,
        async_scheduling=settings.vllm_async_scheduling and (cuda or "vllm_async_scheduling" in settings.model_fields_set),
        cudagraph_mode="" if settings.vllm_cudagraph_mode == "auto" else settings.vllm_cudagraph_mode,
    )


def vllm_kv_bytes(settings: VerifierSettings, cuda: bool) -> int:
    """The KV vLLM allocates: --max-kv-bytes on a CPU, and on a GPU when it is given; else 0,
    what --gpu-memory-utilization leaves after the weights (the default --max-kv-bytes, sized
    for a CPU, would leave most of a GPU idle)."""
    return settings.max_kv_bytes if not cuda or "max_kv_bytes" in settings.model_fields_set else 0


def _warmed(engine: Engine, folder: str, settings: VerifierSettings, dtype_reason: str) -> Verifier:
    """The verifier of `engine`, warmed up, serving the model of `folder` (the folder of its
    weights, or the GGUF file with a tokenizer.json beside it, if any)."""
    # A name, not a path, reaches callers (OpenSession, /healthz, /v1/stats): the folder's name,
    # or `org/name@commit` for a Hub model, so the revision that ran is pinned.
    tokenizer = TokenizerCard.from_folder(folder)
    verifier = Verifier(engine, describe_model(folder), settings.limits(), dtype_reason=dtype_reason, tokenizer=tokenizer)
    step_ms = verifier.warm_up()
    card = verifier.card
    loaded = f"{verifier.model_id}: {card.parameters / 1e9:.2f}B parameters, one decode step {step_ms:.1f} ms"
    if card.tokenizer is None:
        loaded += "; no tokenizer.json beside it: clients cannot check their tokenizer against it"
    log_event(log, logging.INFO, loaded, parameters=card.parameters, decode_step_ms=round(step_ms, 3))
    return verifier


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cloud-verifier", description=__doc__, epilog=PRECEDENCE)
    add_settings_flags(parser, VerifierSettings)
    args = parser.parse_args(argv)

    def run() -> int:
        settings = load_settings(vars(args))
        configure_logging(settings.log_format, settings.log_level)
        asyncio.run(serve(settings, build_verifier))
        return 0

    return run_cli("cloud-verifier", run)


if __name__ == "__main__":
    sys.exit(main())
