"""The generations behind `edge-agent serve`: each request runs as its own task with its own
cloud session, its settings the server's with the request's values over them.

- The draft model is one for all requests (each has its own KV cache): its forward passes
  are serialised by one lock and run in worker threads, so the event loop keeps serving
  other requests and streams while a block is drafted.
- Text is released only once verified (TextStreamer: stop strings, whole characters);
  provisional tokens become previews when the request asks for them.
- Cancelling a generation (its client went away) ends its task; the round loop closes the
  cloud session on the way out.
- When a generation ends, its model drafter's cache goes to the conversation cache
  (edge/drafting/conversations.py), from which the next turn of the conversation begins.
- One verifier client serves every request (one gRPC channel per verifier address); each
  reply carries its own bytes, so requests in flight together count only their own.
- Each request belongs to a caller (the name of its API key; "" without keys): it takes only
  that caller's conversation caches, and calls the verifier through that caller's view of the
  client (its own reuse tokens), so neither the draft caches nor (on a verifier without API
  keys) the verifier's kept prefixes tell one caller about another's prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, ParamSpec, TypeVar

import numpy as np

from edge.config import EdgeSettings
from edge.context import EdgeContext, verifier_client
from edge.drafting.conversations import ConversationCache, model_drafter
from edge.drafting.drafter import Draft, DraftCache, DraftKV, DraftLM, DraftSource, StopRule
from edge.drafting.feedback import RoundFeedback
from edge.drafting.kpolicy import CostK
from edge.round.generate import GenerationResult, RoundRecord, SpeculativeRun, cloud_only_generate
from edge.serve.text import TextStreamer
from shared.errors import ConfigError, InvalidParameter, SpecDecError
from shared.grammar import Grammar, GrammarRefused, GrammarVocab

log = logging.getLogger("edge-agent")
CLOSE_WAIT_S = 10.0  # at shutdown, for cancelled generations to close their sessions
P = ParamSpec("P")
T = TypeVar("T")


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

    def nbytes(self) -> int:
        return self.inner.nbytes()


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


class DrafterHandedBack(Exception):  # noqa: N818 (a call nobody reads the answer of)
    """A worker thread of a cancelled generation called its drafter after the generation ended."""


class DrafterLease:
    """A generation's draft source until the generation ends: one call at a time, none after.
    asyncio cannot stop a worker thread, so a cancelled generation may still be drafting in one;
    `end` waits for that call to return and refuses later ones, so a cache handed on is never
    fed by two generations. A call that raised leaves `failed` set: the cache may be out of step
    with its tokens."""

    def __init__(self, source: DraftSource) -> None:
        self.source, self.filler_top_k = source, source.filler_top_k
        self.failed = False
        self._ended = False
        self._lock = threading.Lock()

    def sync(self, tokens: Sequence[int]) -> None:
        self._call(self.source.sync, tokens)

    def prefill(self) -> None:
        self._call(self.source.prefill)

    def propose(self, k: int, stop_after: StopRule | None = None) -> Draft:
        return self._call(self.source.propose, k, stop_after)

    def update(self, feedback: RoundFeedback) -> None:
        self._call(self.source.update, feedback)

    def end(self) -> DraftSource:
        """The source, once no call is running (blocks: from a worker thread)."""
        with self._lock:
            self._ended = True
        return self.source

    def _call(self, method: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        with self._lock:
            if self._ended:
                raise DrafterHandedBack
            try:
                return method(*args, **kwargs)
            except BaseException:
                self.failed = True
                raise


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
    caller: str = ""  # the name of the request's API key: the scope of its caches
    draft_reused_tokens: int = 0  # prompt tokens whose draft KV came from the conversation cache
    draft_prefilled_tokens: int = 0  # prompt tokens whose draft KV the draft model computed
    # the cost k policy's: rounds this server had measured when the generation began (its first
    # k comes from their figures); None under another policy
    k_costs_rounds: int | None = None

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


def _conversation_cache(ctx: EdgeContext) -> ConversationCache | None:
    """The pool of draft caches between a conversation's turns; None where it is off, there is
    no draft model, or MC dropout draws its masks from each cache's own seeded generator."""
    s = ctx.settings
    if not s.conversation_cache_mb or ctx.draft_lm is None or (s.gating and s.mc_passes > 0):
        return None
    return ConversationCache(s.conversation_cache_mb << 20)


def _grammar_vocab(ctx: EdgeContext) -> Future[GrammarVocab]:
    """The served tokenizer as grammars see it, built on a thread of its own."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-vocab")
    try:
        return pool.submit(lambda: GrammarVocab(ctx.tokenizer.path.read_text(encoding="utf-8"), ctx.vocab_size))
    finally:
        pool.shutdown(wait=False)


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
        self.conversations = _conversation_cache(ctx)  # None: off
        self.grammar_vocab = _grammar_vocab(ctx)  # built in the background: half a second for 152k tokens

    def start(
        self,
        request_id: str,
        settings: EdgeSettings,
        prompt_ids: list[int],
        stop: Sequence[str],
        previews: bool,
        *,
        caller: str,
        grammar: str = "",
    ) -> Generation:
        """Start generating for `caller` (the name of the request's API key); read
        Generation.events(). grammar: what the output must follow (shared/grammar.py; "" for
        free text), checked here: GrammarRefused (a 400) when it is not one."""
        self._check_room(settings, len(prompt_ids))
        ctx = dataclasses.replace(self.ctx, settings=settings, grammar=self._grammar(grammar) if grammar else None)
        ctx.generation_config(settings.seed)  # a bad combination of options fails here, as a 400
        gen = Generation(request_id, settings, len(prompt_ids), TextStreamer(ctx.tokenizer, stop), caller=caller)
        relay = _Relay(gen.streamer, gen.queue, previews)
        gen.task = asyncio.create_task(self._run(gen, ctx, prompt_ids, relay))
        self.running.add(gen.task)
        gen.task.add_done_callback(self.running.discard)
        return gen

    def _grammar(self, text: str) -> Grammar:
        """The request's grammar, compiled on the served tokenizer (GrammarRefused: a 400)."""
        try:
            vocab = self.grammar_vocab.result()
        except Exception as err:  # noqa: BLE001 - llguidance's own errors: a tokenizer it cannot read
            raise GrammarRefused(
                f"this model's tokenizer cannot carry grammars ({' '.join(str(err).split())[:160]})", None
            ) from None
        return vocab.compile(text)

    def _check_room(self, settings: EdgeSettings, prompt_tokens: int) -> None:
        uses_model = settings.drafts() and settings.drafter != "ngram"
        if uses_model and self.ctx.draft_lm is None:
            raise InvalidParameter('this server loaded no draft model (drafter "ngram" needs none)', "speculative.drafter")
        context = getattr(self.ctx.draft_lm, "context_size", None)
        # A fresh drafter's window; one that continues a conversation's keeps an earlier start
        # only where the prompt from there and max_tokens fit this context (ConversationCache.take).
        drafted_from = min(prompt_tokens, settings.draft_window) if settings.draft_window else prompt_tokens
        if uses_model and context and drafted_from + settings.max_new_tokens > context:
            raise InvalidParameter(
                f"the prompt ({prompt_tokens} tokens) and max_tokens ({settings.max_new_tokens}) "
                f"exceed the draft model's context of {context} tokens",
                "max_tokens",
            )

    async def _run(self, gen: Generation, ctx: EdgeContext, prompt_ids: list[int], relay: _Relay) -> None:
        try:
            result = await self._generate(gen, ctx, prompt_ids, relay)
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

    async def _generate(self, gen: Generation, ctx: EdgeContext, prompt_ids: list[int], relay: _Relay) -> GenerationResult:
        s = ctx.settings
        cfg = ctx.generation_config(s.seed)
        started = time.perf_counter()
        observer = ctx.observer(relay)
        client = self.client.for_caller(gen.caller)
        try:
            if s.mode == "cloud_only":
                relay.live = GenerationResult()
                return await cloud_only_generate(prompt_ids, client, cfg, observer, result=relay.live)
            kv = self._take_draft_kv(gen.caller, s, prompt_ids)
            lease = DrafterLease(
                await asyncio.to_thread(ctx.draft_source, s.seed, kv, len(prompt_ids))
            )  # a llama.cpp context: allocation
            policy = ctx.k_policy()
            gen.k_costs_rounds = policy.costs.rounds if isinstance(policy, CostK) else None
            run = SpeculativeRun(prompt_ids, lease, client, policy, cfg, observer)
            relay.live = run.result
            try:
                result = await run.run()
            finally:
                await self._hand_back(gen, lease, prompt_ids)
            if ctx.metrics is not None:
                ctx.metrics.record_generation(result)
            return result
        except StopText:
            return relay.stopped_result(started)

    def _take_draft_kv(self, caller: str, settings: EdgeSettings, prompt_ids: list[int]) -> DraftKV | None:
        """The draft KV of `caller`'s conversations for this prompt, if any is worth taking."""
        if self.conversations is None or settings.drafter == "ngram":
            return None
        context = getattr(self.ctx.draft_lm, "context_size", None) or settings.draft_context
        kv = self.conversations.take(caller, prompt_ids, settings.draft_window, settings.max_new_tokens, context)
        self._count_conversations()
        return kv

    async def _hand_back(self, gen: Generation, lease: DrafterLease, prompt_ids: list[int]) -> None:
        """Count what the model drafter computed of the prompt and what it reused, and keep its
        cache for the conversation's next turn unless a call of it failed. A cancelled
        generation's drafter may still be drafting in a worker thread: `end` waits it out."""
        drafter = model_drafter(await asyncio.to_thread(lease.end))
        if drafter is None:
            return
        gen.draft_reused_tokens, gen.draft_prefilled_tokens = drafter.reused_tokens, drafter.prefilled_tokens
        if self.ctx.metrics is not None:
            self.ctx.metrics.record_draft_prompt(drafter.reused_tokens, drafter.prefilled_tokens)
        kv = drafter.kv()
        if self.conversations is not None and kv is not None and not lease.failed:
            self.conversations.give_back(gen.caller, prompt_ids, kv)
            self._count_conversations()

    def _count_conversations(self) -> None:
        if self.ctx.metrics is not None and self.conversations is not None:
            self.ctx.metrics.record_conversation_cache(self.conversations.nbytes, len(self.conversations))

    async def close(self) -> None:
        """Cancel what still runs, let it close its sessions, then close the client."""
        for task in list(self.running):
            _cancel_once(task)
        if self.running:
            await asyncio.wait(self.running, timeout=CLOSE_WAIT_S)
        await self.client.close()
