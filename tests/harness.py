"""A real grpc.aio verifier on a loopback port 0, and the edge pieces around it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from cloud.engine import Engine, EngineName, KVRequest, SessionStep, StepOutcome
from cloud.engine.llamacpp import LlamaCppEngine
from cloud.engine.transformers import TransformersEngine
from cloud.grpc_server import create_server
from cloud.model_card import measure_decode_step
from cloud.rejection_sampler import RoundRule
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.drafting.drafter import Drafter, DrafterConfig, DraftLM
from edge.drafting.runtime_llamacpp import LlamaCppDraftLM
from edge.drafting.runtime_transformers import TransformersDraftLM
from edge.round.generate import GenerationConfig
from edge.transport.client import VerifierClient
from shared.errors import PositionMismatch
from shared.protocol import AcceptMode, DecodeRequest, OpenSessionRequest, SamplingParams, SessionConfig, VerifyRequest
from shared.tokenizer_card import TokenizerCard
from tests.ops import greedy_continuation
from tests.tiny_models import save_gguf, save_model, tiny_draft, tiny_target, tiny_vllm_target

GREEDY = SamplingParams()


@dataclass(frozen=True)
class TargetEngine:
    """The tiny target in one of the verifier's engines: fresh Engines of it in this process,
    the model flags of a cloud-verifier process of it, and its own greedy continuation (the
    reference a test compares a verifier of this engine against)."""

    name: EngineName
    model: PreTrainedModel
    gguf: Path | None = None  # the target written to an f32 GGUF (llama.cpp)
    folder: Path | None = None  # the target as an HF folder (vLLM loads it in its own processes)
    async_scheduling: bool = False  # vLLM's steps scheduled asynchronously (a GPU's way)

    def __call__(self) -> Engine:
        if self.gguf is not None:
            return LlamaCppEngine(self.gguf, threads=1, batch_tokens=512)
        if self.folder is not None:
            return vllm_engine(self.folder, self.async_scheduling)
        return TransformersEngine(self.model)

    def draft_model(self) -> PreTrainedModel:
        """A draft of this target (the draft_model fixture's, for the shared tiny target)."""
        return tiny_draft(self.model, noise=0.2)

    def tiny_target(self, vocab: int) -> PreTrainedModel:
        """A tiny target of another vocabulary, of the shape this engine runs."""
        return tiny_vllm_target(vocab=vocab) if self.folder is not None else tiny_target(vocab=vocab)

    def of(self, model: PreTrainedModel, folder: Path) -> TargetEngine:
        """Another transformers model in this engine (its GGUF or HF folder written under `folder`)."""
        gguf = None if self.gguf is None else save_gguf(model, folder / "target.gguf")
        return TargetEngine(self.name, model, gguf, None if self.folder is None else save_model(model, folder / "target"))

    def as_draft(self) -> PreTrainedModel | DraftLM:
        """The target as the edge's runtime of this engine drafts with it (the edge's llama.cpp
        runtime reads the same GGUF)."""
        return self.model if self.gguf is None else LlamaCppDraftLM(self.gguf, threads=1, context_size=1024)

    def served_model(self, checkpoint: Path) -> tuple[Path, tuple[str, ...]]:
        """cloud-verifier's --model of the target in this engine (the transformers checkpoint, or
        the GGUF), and the flags that pick the engine."""
        if self.gguf is not None:
            return self.gguf, ("--engine", "llama.cpp")
        if self.folder is not None:  # the checkpoint's shape is not one vLLM's CPU attention runs
            return self.folder, ("--engine", "vllm", "--dtype", "float32", *VLLM_FLAGS)
        return checkpoint, ()

    def greedy_continuation(self, prompt: list[int], n: int) -> list[int]:
        """The engine's own greedy tokens after prompt, one step per token, without a verifier
        (on transformers: through shared.lm, as tests.ops computes it)."""
        if self.gguf is None and self.folder is None:
            return greedy_continuation(self.model, prompt, n)
        engine = self()
        context = len(prompt) + n
        engine.plan_kv(KVRequest("packed", max_sessions=1, max_kv_bytes=1 << 30, max_context_tokens=context, slot_tokens=0))
        kv, tokens, feed, config = engine.new_kv(), [], list(prompt), SessionConfig()
        engine.start_session(kv, config, engine.logits_width)
        for _ in range(n):
            rule = RoundRule.next_token(config, engine.logits_width, [*prompt, *tokens], torch.Generator())
            [outcome] = engine.run_steps([SessionStep(kv, feed, rule=rule)])
            assert isinstance(outcome, StepOutcome), outcome
            tokens.append(outcome.round.next_token)
            feed = [tokens[-1]]
        engine.free(kv)
        return tokens


VLLM_CONTEXT = 1000  # under the tiny models' 1024 positions
VLLM_FLAGS = ("--max-context-tokens", str(VLLM_CONTEXT), "--max-kv-bytes", str(64 << 20), "--enforce-eager")
_VLLM_RUNTIMES: dict[tuple[Path, bool], Any] = {}


def vllm_engine(folder: Path, async_scheduling: bool = False) -> Engine:
    """A fresh vLLM Engine of the model in `folder`; its vLLM (seconds to start) is shared by
    every engine of that folder and scheduling in this test process, each session under its own
    cache salt. Asynchronous scheduling, which vLLM leaves off on a CPU, is the GPU's way of
    stepping: on, it tests the same scheduler logic a GPU runs."""
    from cloud.engine.vllm import VllmEngine
    from cloud.engine.vllm_runtime import VllmOptions, VllmRuntime

    key = (folder, async_scheduling)
    if key not in _VLLM_RUNTIMES:
        # One thread, as every model of the tests: the suite runs in a process per core.
        options = VllmOptions(
            str(folder), "float32", VLLM_CONTEXT, max_sessions=32, max_kv_bytes=64 << 20, enforce_eager=True, cpu_threads=1
        )
        options = replace(options, async_scheduling=async_scheduling)
        _VLLM_RUNTIMES[key] = VllmRuntime(options)
        measure_decode_step(VllmEngine(_VLLM_RUNTIMES[key], owns_runtime=False))  # as the verifier's warm-up
    return VllmEngine(_VLLM_RUNTIMES[key], owns_runtime=False)


@contextmanager
def padded_steps(engine: Engine) -> Iterator[list[int]]:
    """A shared vLLM engine whose steps of requests decoding on their own are padded to K
    drafts (--pad-decode-steps, which a CPU never turns on by itself) for a while, with the
    number of requests each step padded."""
    scheduler = engine.runtime.scheduler  # type: ignore[attr-defined]
    counts: list[int] = []
    schedule = scheduler.schedule

    def counting(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        counts.append(len(out.scheduled_spec_decode_tokens))
        return out

    scheduler.pad_limit, scheduler.schedule = 1024, counting
    try:
        yield counts
    finally:
        scheduler.pad_limit = 0
        del scheduler.schedule


def close_vllm_runtimes() -> None:
    """Stop the shared vLLM processes (while the test run's logging still works)."""
    for runtime in _VLLM_RUNTIMES.values():
        runtime.close()
    _VLLM_RUNTIMES.clear()


def engine_of(target: PreTrainedModel | TargetEngine) -> Engine:
    """A fresh Engine: a transformers model's, or a TargetEngine's."""
    return target() if isinstance(target, TargetEngine) else TransformersEngine(target)


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
async def running_verifier(
    target: PreTrainedModel | TargetEngine,
    limits: VerifierLimits | None = None,
    prefer_speculation_above: int | None = None,
    tokenizer: TokenizerCard | None = None,
) -> AsyncIterator[tuple[VerifierClient, Verifier]]:
    """A verifier of a transformers model, or of a fresh Engine of the target in one engine;
    `tokenizer`: its model's (grammars need one)."""
    verifier = Verifier(engine_of(target), "tiny-target", limits, tokenizer=tokenizer)
    state = ServerState.for_verifier(verifier, prefer_speculation_above=prefer_speculation_above)
    async with serving(state) as client:
        yield client, verifier


def cap_kv(verifier: Verifier, tokens: int) -> None:
    """A KV cap of `tokens` positions on a running verifier's sessions. Set after the engine holds
    its KV: the llama.cpp engine holds at least one context's worth, as --max-kv-bytes must."""
    limits = verifier.sessions.limits
    verifier.sessions.limits = replace(limits, max_kv_bytes=tokens * verifier.sessions.kv_bytes_per_token)


def random_prompt(seed: int, length: int = 8, vocab: int = 96) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_drafter(
    model: PreTrainedModel | DraftLM,
    params: SamplingParams = GREEDY,
    mode: AcceptMode = AcceptMode.GREEDY,
    seed: int = 1,
    vocab: int = 96,
    stop: frozenset[int] = frozenset(),
    signals: bool = False,
) -> Drafter:
    config = DrafterConfig(params, mode, vocab, draft_top_k=8, stop_token_ids=stop, signals=signals)
    draft_lm = TransformersDraftLM(model) if isinstance(model, PreTrainedModel) else model
    return Drafter(draft_lm, config, seed)


def gen_config(
    max_new_tokens: int = 40,
    params: SamplingParams = GREEDY,
    mode: AcceptMode = AcceptMode.GREEDY,
    seed: int = 0,
    vocab: int = 96,
    stop: frozenset[int] = frozenset(),
    **options: Any,
) -> GenerationConfig:
    """options: GenerationConfig's timeouts, gating, stop_rule."""
    return GenerationConfig(SessionConfig(params, seed, mode, vocab), max_new_tokens, stop, **options)


def gguf_lm(model: PreTrainedModel, folder: Path) -> LlamaCppDraftLM:
    """`model` as llama.cpp runs it: written to an f32 GGUF, one thread."""
    return LlamaCppDraftLM(save_gguf(model, folder / "draft.gguf"), threads=1, context_size=1024)


async def dropped_stretch(
    client: VerifierClient, prompt: list[int], stretch: int, dropped: Callable[[], None] = lambda: None
) -> tuple[int, list[int]]:
    """A Decode stretch of `stretch` tokens that opens its session, dropped after its first 3
    tokens: where the server says the session is then (asked until it shows the dropped call's
    tokens; `dropped` runs once it does), and the 10 tokens a stretch from there decodes."""
    stream = client.decode(DecodeRequest("", 0, stretch, open=OpenSessionRequest(prompt, SessionConfig(vocab_size=96))))
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if sum(len(c.tokens) for c in chunks) >= 3:
            break
    await stream.aclose()
    assert chunks[0].opened is not None
    session, at = chunks[0].opened.session_id, 0
    for _ in range(100):  # the server sees the cancel soon after the client's next call
        try:
            await client.verify(VerifyRequest(session, len(prompt), []))
        except PositionMismatch as moved:  # the client asks where the session is
            at = moved.server_position
        if at >= len(prompt) + 3:
            break
        await asyncio.sleep(0.05)
    dropped()
    more = [t async for chunk in client.decode(DecodeRequest(session, at, 10)) for t in chunk.tokens]
    return at, more
