"""The generations behind `edge-agent serve`: each request runs as its own task with its own
cloud session, its settings the server's with the request's values over them.

- The draft model is one for all requests (each has its own KV cache): its forward passes
  are serialised by one lock and run in worker threads, so the event loop keeps serving
  other requests and streams while a block is drafted.
- Text is released only once verified (TextStreamer: stop strings, whole characters);
  provisional tokens become previews when the request asks for them.
- Cancelling a generation (its client went away) ends its task; the round loop closes the
  cloud session on the way out.
- One verifier client serves every request (one gRPC channel per verifier address); each
  reply carries its own bytes, so requests in flight together count only their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from edge.config import EdgeSettings
from edge.context import EdgeContext, verifier_client
from edge.drafting.drafter import DraftCache, DraftLM
from edge.round.generate import GenerationResult, RoundRecord, SpeculativeRun, cloud_only_generate
from edge.serve.text import TextStreamer
from shared.errors import ConfigError, InvalidParameter, SpecDecError

log = logging.getLogger("edge-agent")
CLOSE_WAIT_S = 10.0  # at shutdown, for cancelled generations to close their sessions


class LockedCache:
    """One request's draft KV cache; forward passes wait for the model's lock. Cropping is
    the cache's own memory and needs no lock."""

    def __init__(self, inner: DraftCache, lock: threading.Lock) -> None:
        self.inner, self.lock = inner, lock

    def __len__(self) -> int:
        return len(self.inner)

    def feed(self, token_ids: Sequence[int]) -> np.ndarray:  # [V_model] logits after the last token
        with self.lock:
            return self.inner.feed(token_ids)

    def crop(self, length: int) -> None:
        self.inner.crop(length)

    def mc_dropout_variance(self, token: int, passes: int, dropout_p: float) -> float:
        with self.lock:
            return self.inner.mc_dropout_variance(token, passes, dropout_p)


class LockedDraftLM:
    """The shared draft model: one forward pass at a time, whichever request asks."""

    def __init__(self, inner: DraftLM) -> None:
        self.inner = inner
        self.runtime, self.logits_width, self.parameters = inner.runtime, inner.logits_width, inner.parameters
        self.context_size: int | None = getattr(inner, "context_size", None)  # llama.cpp: tokens per session
        self.lock = threading.Lock()

    def new_cache(self, seed: int) -> LockedCache:
        with self.lock:
            return LockedCache(self.inner.new_cache(seed), self.lock)


class StopText(Exception):  # noqa: N818 (control flow, not an error)
    """A stop string was produced: the generation ends here (raised from the observer)."""


@dataclass(frozen=True)
class Event:
    kind: Literal["text", "provisional", "done", "error"]
    text: str = ""
    result: GenerationResult | None = None
    error: BaseException | None = None


class _Relay:
    """The Observer of one served generation: verified text and previews into its queue."""

    def __init__(self, streamer: TextStreamer, queue: asyncio.Queue[Event], previews: bool) -> None:
        self.streamer, self.queue, self.previews = streamer, queue, previews
        self.live: GenerationResult | None = None  # the generation's result, updated as it goes

    def committed(self, tokens: list[int], record: RoundRecord | None) -> None:
        text = self.streamer.push(tokens)
        if text:
            self.queue.put_nowait(Event("text", text))
        if self.streamer.stopped:
            raise StopText

    def provisional(self, tokens: list[int]) -> None:
        if self.previews:
            self.queue.put_nowait(Event("provisional", self.streamer.preview(tokens)))

    def stopped_result(self, started: float) -> GenerationResult:
        """The result so far of a generation a stop string ended."""
        assert self.live is not None, "the engine hands every generation its result"
        result = self.live
        result.finish_reason = "stop"
        result.elapsed_s = time.perf_counter() - started
        return result


@dataclass
class Generation:
    """One request's generation as the HTTP side sees it: events to read, and a way to stop it."""

    id: str
    settings: EdgeSettings
    prompt_tokens: int
    streamer: TextStreamer
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None

    async def events(self) -> AsyncIterator[Event]:
        """Every event up to and including the last ("done" or "error")."""
        while True:
            event = await self.queue.get()
            yield event
            if event.kind in ("done", "error"):
                return

    def cancel(self) -> None:
        """Stop a generation still running (its client went away); the session closes."""
        if self.task is not None and _cancel_once(self.task):
            log.info("%s: client gone after %d tokens; generation cancelled", self.id, len(self.streamer.ids))


def _cancel_once(task: asyncio.Task[None]) -> bool:
    """Cancel a task not yet done nor cancelled: a second cancel would land in the round loop's
    cleanup and cut the CloseSession call short."""
    if task.done() or task.cancelling():
        return False
    return task.cancel()


class Engine:
    def __init__(self, ctx: EdgeContext, address: str) -> None:
        if ctx.draft_lm is not None and not isinstance(ctx.draft_lm, LockedDraftLM):
            ctx = dataclasses.replace(ctx, draft_lm=LockedDraftLM(ctx.draft_lm))
        self.ctx, self.address = ctx, address
        self.client = verifier_client(ctx.settings, address)
        self.running: set[asyncio.Task[None]] = set()

    def start(
        self, request_id: str, settings: EdgeSettings, prompt_ids: list[int], stop: Sequence[str], previews: bool
    ) -> Generation:
        """Start generating; the caller reads Generation.events()."""
        self._check_room(settings, len(prompt_ids))
        ctx = dataclasses.replace(self.ctx, settings=settings)
        ctx.generation_config(settings.seed)  # a bad combination of options fails here, as a 400
        gen = Generation(request_id, settings, len(prompt_ids), TextStreamer(ctx.tokenizer, stop))
        relay = _Relay(gen.streamer, gen.queue, previews)
        gen.task = asyncio.create_task(self._run(gen, ctx, prompt_ids, relay))
        self.running.add(gen.task)
        gen.task.add_done_callback(self.running.discard)
        return gen

    def _check_room(self, settings: EdgeSettings, prompt_tokens: int) -> None:
        uses_model = settings.drafts() and settings.drafter != "ngram"
        if uses_model and self.ctx.draft_lm is None:
            raise InvalidParameter('this server loaded no draft model (drafter "ngram" needs none)', "speculative.drafter")
        context = getattr(self.ctx.draft_lm, "context_size", None)
        drafted_from = min(prompt_tokens, settings.draft_window) if settings.draft_window else prompt_tokens
        if uses_model and context and drafted_from + settings.max_new_tokens > context:
            raise InvalidParameter(
                f"the prompt ({prompt_tokens} tokens) and max_tokens ({settings.max_new_tokens}) "
                f"exceed the draft model's context of {context} tokens",
                "max_tokens",
            )

    async def _run(self, gen: Generation, ctx: EdgeContext, prompt_ids: list[int], relay: _Relay) -> None:
        try:
            result = await self._generate(ctx, prompt_ids, relay)
            tail = gen.streamer.finish()
            if tail:
                gen.queue.put_nowait(Event("text", tail))
            gen.queue.put_nowait(Event("done", result=result))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # every failure reaches the client, as an OpenAI error
            if not isinstance(err, InvalidParameter | ConfigError):
                log.warning("%s failed: %s: %s", gen.id, type(err).__name__, err, exc_info=not isinstance(err, SpecDecError))
            gen.queue.put_nowait(Event("error", error=err))

    async def _generate(self, ctx: EdgeContext, prompt_ids: list[int], relay: _Relay) -> GenerationResult:
        s = ctx.settings
        cfg = ctx.generation_config(s.seed)
        started = time.perf_counter()
        observer = ctx.observer(relay)
        try:
            if s.mode == "cloud_only":
                relay.live = GenerationResult()
                return await cloud_only_generate(prompt_ids, self.client, cfg, observer, result=relay.live)
            source = await asyncio.to_thread(ctx.draft_source, s.seed)  # a llama.cpp context: allocation
            run = SpeculativeRun(prompt_ids, source, self.client, ctx.k_policy(), cfg, observer)
            relay.live = run.result
            result = await run.run()
            if ctx.metrics is not None:
                ctx.metrics.record_generation(result)
            return result
        except StopText:
            return relay.stopped_result(started)

    async def close(self) -> None:
        """Cancel what still runs, let it close its sessions, then close the client."""
        for task in list(self.running):
            _cancel_once(task)
        if self.running:
            await asyncio.wait(self.running, timeout=CLOSE_WAIT_S)
        await self.client.close()
