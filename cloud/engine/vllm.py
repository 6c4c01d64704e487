"""The vLLM engine: the target in vLLM (`--engine vllm`), which owns the KV as paged,
prefix-cached blocks and batches every request of a step itself.

A session is ONE live vLLM request for its whole life (LiveSessions in cloud/engine/__init__.py,
the scheduler in cloud/engine/vllm_scheduler.py). Its prefill is the request's prompt; a
Verify round puts the edge's drafts on it as speculative tokens for one step, verified by
vLLM's rejection sampler: greedy drafts by the argmax, point drafts as q = 1, sparse drafts
with the edge's distribution over each handed to the sampler as its draft probabilities. A
Generate stream or a Decode stretch is vLLM decoding it on its own. Between its steps the
request is parked: it keeps its KV and costs no step. The tokens a request holds past the
session's own (a stretch decoded ahead, the token its prefill sampled) are read by the
session's next steps: a draft that equals the token vLLM sampled there is accepted without a
step, the first that differs is corrected by it. Whatever the accept mode, this is exact: the
token at that position is the target's own draw (a sparse draft is accepted there with
probability p(y) where the sampler's rule gives min(1, p(y)/q(y)): a lower acceptance, at one
position after a prefill). A session whose tokens no longer extend its request's (a round
that caught up on tokens of its own) gets a new request; its salted prefix-cache blocks serve
the whole blocks of it. A session vLLM cannot verify exactly (an approximate accept mode, a
vocabulary narrower than the model's that vLLM cannot mask) is refused when it opens.

Rows of logits (the target's top-k a round asks for, `want_top_k`) come from requests of their
own: a step is a request for the session's tokens so far plus the block, under its cache salt,
whose prefix cache serves the whole blocks it already holds. They come back in one of two ways:
- argmax rows (a step that reads only each row's argmax over a vocabulary): ONE request with
  prompt log-probabilities, whose rows hold the TOP_ROWS largest raw logits (the rest -inf).
  The argmax inside the vocabulary is among them whenever one of them lies inside it; a step
  with a row whose largest logits all lie past it (padded embedding rows) runs again for full
  rows. vLLM leaves the rows of positions its cache served unset, so a request whose cache
  hit reaches a kept row runs again without reading the cache.
- full rows (every other step): one request per kept row, ending at that row, asking for the
  raw logits of every token of its sampled row: the model's own logits, at the price of one
  request (a full sort of the vocabulary and its transfer) per row.

vLLM's engine core runs in the process that holds the VllmEngine, on a thread of its own, so
the engine reaches the scheduler of its live requests directly: the verifier's own process,
or a child of it (`--vllm-engine-process`, cloud/engine/vllm_process.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from cloud.engine import EngineName, KVPlan, KVRequest, LiveStep, SessionKV, TokenSink
from shared import lm
from shared.errors import CapacityExceeded, ConfigError, SessionNotFound, SessionRefused, VerifierFault
from shared.hardware import usable_cores
from shared.protocol import SessionConfig, SparseDistribution
from shared.token_ids import shared_prefix

if TYPE_CHECKING:
    from cloud.engine.vllm_scheduler import LiveScheduler

log = logging.getLogger("cloud-verifier")
T = TypeVar("T")
TOP_ROWS = 4  # the largest raw logits an argmax row holds
CPU_BLOCK = 32  # vLLM's CPU attention wants blocks of a multiple of 32 tokens


@dataclass(frozen=True)
class VllmOptions:
    """What cloud-verifier passes to vLLM."""

    model: str
    dtype: str = "auto"
    max_context_tokens: int = 32768
    max_sessions: int = 64
    max_kv_bytes: int = 0  # the KV's size across GPUs (0: what gpu_memory_utilization leaves; on a CPU, vLLM's default)
    block_size: int = 0  # 0: 32 on a CPU, vLLM's default on a GPU
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no compiled graphs: a quicker start, slower steps
    seed: int = 0
    load_format: str = "auto"  # dummy: vLLM's random weights in the folder's shapes (capacity measurements)
    max_draft_tokens: int = 16  # drafts a round may verify (vLLM's speculative tokens per step)
    pad_decode: bool = True  # steps of requests decoding on their own padded to K drafts, for vLLM's full CUDA graph
    pad_limit: int = 0  # the most tokens such a step may have (0: vLLM's largest CUDA graph)
    cpu_threads: int = 0  # on a CPU, the threads vLLM's model runs on (0: the cores this process may use)
    async_scheduling: bool = False  # vLLM schedules a step while the one before it runs (no pads then)
    cudagraph_mode: str = ""  # vLLM's CUDA graph mode (FULL: full graphs for steps of any shape); "": vLLM's choice


class VllmRuntime:
    """One vLLM engine (its engine core, in this process) and its requests: the live sessions'
    and the requests of one pass at a time. vLLM runs on one thread of its own, as in its own
    engine-core process (its CPU kernels read per-thread OpenMP settings it makes when it
    starts): every call into it goes through `call`, which also makes callers from several
    threads (engines sharing it in tests) take turns. While a stream follows a live request
    (`follow`), vLLM also steps on that thread by itself (the pump), one step at a time between
    the other calls, and each step's new tokens go to the streams' sinks."""

    def __init__(self, options: VllmOptions) -> None:
        cpu = not torch.cuda.is_available()
        if not cpu:  # workers of a target over several GPUs: the verifier may have touched CUDA
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # The context, and the one token a request samples; at most the model's positions.
        self.max_context_tokens = min(options.max_context_tokens, _positions(options.model) - 1)
        args = _engine_args(options, self.max_context_tokens + 1, cpu)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm")
        self._ident = self._thread.submit(threading.get_ident).result()
        if cpu:
            self.call(_set_cpu_threads, options.cpu_threads or usable_cores())
        try:
            # The engine core in this process: the verifier wakes and parks live requests in its
            # scheduler between steps. vLLM reads the setting while it builds the engine only.
            with _environment(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
                self.llm: Any = self.call(_start_engine, args, options.async_scheduling)
        except Exception as err:  # vLLM's own config errors name the setting that failed
            self._thread.shutdown()
            raise ConfigError(f"vLLM could not start on {options.model}: {str(err)[:300]}") from err
        self.scheduler: LiveScheduler = self.llm.engine_core.engine_core.scheduler
        self._caught = _CaughtOutputs(self.llm.engine_core.get_output)
        self.llm.engine_core.get_output = self._caught
        if options.pad_decode and not options.async_scheduling:
            self.scheduler.pad_limit = options.pad_limit or _largest_graph(self.llm.vllm_config)
        self.options = options
        self.device = "cpu" if cpu else "cuda"
        self.cpu_threads = self.call(torch.get_num_threads) if cpu else 0  # what vLLM's CPU kernels run on
        self._ids = itertools.count()
        self._pending: set[str] = set()  # requests of the pass in flight
        self._done: dict[str, Any] = {}  # their outputs, until the pass takes them
        self._live: dict[str, LiveRequest] = {}  # live requests by vLLM's id of them
        self._followed: dict[str, LiveRequest] = {}  # live requests whose tokens go to a sink, by vLLM's id
        self._pumping = False  # a pump step is queued on vLLM's thread
        self._stalled = 0  # pump steps in a row that gave a followed request no token
        self._failed: str | None = None  # why vLLM can run no more steps
        self._closing = threading.Event()
        self.step_seconds = 0.0  # the time vLLM's steps took
        self._closer = weakref.finalize(self, _shutdown, self.llm, self._thread, self._closing)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on vLLM's thread (at once when called from it)."""
        if threading.get_ident() == self._ident:
            return fn(*args)
        return self._thread.submit(fn, *args).result()

    def soon(self, fn: Callable[[], None]) -> None:
        """fn() on vLLM's thread after what waits for it now (the step running, a pump step
        queued): without waiting for it."""
        self._thread.submit(fn)

    @property
    def steps(self) -> int:
        """The steps vLLM ran the model in so far."""
        return self.scheduler.steps

    def steps_taken(self) -> tuple[int, float]:
        """The steps vLLM ran so far, and the seconds they took."""
        return self.steps, self.step_seconds

    def run(self, requests: Sequence[tuple[list[int], str, Any]]) -> list[Any]:
        """Each (prompt tokens, cache salt, SamplingParams) as one request, all in flight
        together, until each has finished; their outputs in order. On failure none of them
        is left running."""
        return self.call(self._run, requests)

    def _run(self, requests: Sequence[tuple[list[int], str, Any]]) -> list[Any]:
        from vllm import TokensPrompt

        ids = [f"r{next(self._ids)}" for _ in requests]
        try:
            for request_id, (prompt, salt, params) in zip(ids, requests, strict=True):
                self._pending.add(request_id)
                self.llm.add_request(request_id, TokensPrompt(prompt_token_ids=prompt, cache_salt=salt), params)
            while any(i in self._pending for i in ids):
                self.step()
        except Exception as err:
            self._forget(ids)
            raise VerifierFault(f"vLLM could not run the pass ({type(err).__name__})") from err
        except BaseException:
            self._forget(ids)
            raise
        return [self._done.pop(i) for i in ids]

    def _forget(self, ids: list[str]) -> None:
        """A failed pass's requests: the running ones aborted, the finished ones' outputs dropped."""
        self._abort([i for i in ids if i in self._pending])
        for request_id in ids:
            self._done.pop(request_id, None)

    # ---- live requests (on vLLM's thread) ----------------------------------------------------

    def start_live(self, prompt: list[int], salt: str, params: Any) -> LiveRequest:
        """A session's live request: its prefill samples one token, then it parks."""
        from vllm import TokensPrompt

        from cloud.engine.vllm_scheduler import LIVE_PREFIX

        live = LiveRequest(f"{LIVE_PREFIX}{next(self._ids)}", list(prompt))
        params = params.clone()
        params.max_tokens = self.max_context_tokens + 1 - len(prompt)
        try:
            live.engine_id = self.llm.add_request(live.request_id, TokensPrompt(prompt_token_ids=prompt, cache_salt=salt), params)
        except Exception as err:
            raise VerifierFault(f"vLLM could not start the session's request ({type(err).__name__})") from err
        # Its tokens are read from the engine core's outputs (step): vLLM's output processor,
        # which would build a RequestOutput for it each step, forgets it (the engine keeps it).
        self.llm.output_processor.abort_requests([live.engine_id], internal=True)
        self._live[live.engine_id] = live
        return live

    def wake(
        self, live: LiveRequest, drafts: list[int], tokens: int, stops: frozenset[int], draft_q: Sequence[SparseDistribution] = ()
    ) -> None:
        """Run a parked request for `tokens` more tokens, `drafts` (with the edge's `draft_q`
        over each: a sparse round) verified in its first step."""
        q = [(list(d.token_ids), list(d.probs)) for d in draft_q] or None
        self.scheduler.wake(live.engine_id, drafts, tokens, stops, q)

    def park(self, live: LiveRequest) -> bool:
        return self.scheduler.park(live.engine_id)

    def parked(self, live: LiveRequest) -> bool:
        return self.scheduler.is_parked(live.engine_id)

    def settling(self, live: LiveRequest) -> bool:
        """Parked, the outputs of its last step still to come (asynchronous scheduling)."""
        return live.engine_id in self.scheduler.settling

    def end_live(self, live: LiveRequest) -> None:
        self.unfollow(live, SessionNotFound("the session was closed or evicted"))
        if self._live.pop(live.engine_id, None) is not None and not live.ended:
            try:
                self.llm.engine_core.abort_requests([live.engine_id])
            except Exception:
                log.exception("vLLM could not abort a session's request")

    def follow(self, live: LiveRequest, position: int, sink: TokenSink) -> None:
        """Hand `sink` the tokens `live` holds from `position` on, then each step's, while it
        decodes on its own; vLLM steps for it (the pump) with no other caller. Once it parks
        (its stretch done) or ends, the sink is told no more will come."""
        live.sink = sink
        sink.put(live.tokens[position:], 0.0)
        if live.ended or self.scheduler.is_parked(live.engine_id):
            self.unfollow(live)
            return
        self._followed[live.engine_id] = live
        if not self._pumping:
            self._pumping = True
            self._thread.submit(self._pump)

    def _pump(self) -> None:
        """One step while a followed request decodes on its own, then the next one queued behind
        whatever else waits for vLLM's thread (a pass's rounds take their turn between them)."""
        for live in [live for live in self._followed.values() if self.scheduler.is_parked(live.engine_id)]:
            self.unfollow(live)  # parked since: its stretch is done
        followed = list(self._followed.values())
        if not followed or self._failed is not None or self._closing.is_set():
            self._pumping = False
            return
        before = sum(len(live.tokens) for live in followed)
        with contextlib.suppress(VerifierFault):  # a failed step has failed the sinks
            self.step()
        self._stalled = 0 if sum(len(live.tokens) for live in followed) > before else self._stalled + 1
        if self._stalled >= MAX_STALLED_STEPS:
            self._stalled = 0
            for live in followed:
                self.unfollow(live, CapacityExceeded("vLLM has no KV blocks free for the stream's steps", STALLED_RETRY_MS))
                self.end_live(live)
        self._thread.submit(self._pump)

    def stop_following(self, live: LiveRequest) -> None:
        """A stream that stopped reading `live`: no more tokens go to its sink, and the request
        parks (what it decoded past the stream stays for the session's next steps)."""
        self.unfollow(live)
        if not live.ended:
            self.scheduler.park(live.engine_id)

    def unfollow(self, live: LiveRequest, error: Exception | None = None) -> None:
        """No more tokens go to the request's sink: it is told why."""
        self._followed.pop(live.engine_id, None)
        if live.sink is not None:
            live.sink.fail(error or VerifierFault("the session's request stopped decoding before the stream's end"))
            live.sink = None

    def computed(self, live: LiveRequest) -> int:
        """The tokens of a live request whose KV vLLM computed (0 once it ended)."""
        request = self.scheduler.requests.get(live.engine_id)
        return int(request.num_computed_tokens) if request is not None else 0

    def stepping(self) -> bool:
        """Whether vLLM has a request to step (one decoding on its own, or waking)."""
        return bool(self.scheduler.running) or len(self.scheduler.waiting) > 0

    def busy(self) -> bool:
        """Whether vLLM has a request to step, or a parked request's outputs still to come."""
        return self.stepping() or self.scheduler.in_flight()

    def step(self) -> None:
        """One step of vLLM: every running request advances; outputs go to their owners (under
        asynchronous scheduling, those of the step before, while this one runs). A step that
        fails leaves vLLM in a state nobody knows: no step runs after it."""
        if self._failed is not None:
            raise VerifierFault(self._failed)
        start = time.perf_counter()
        self._caught.last = None
        try:
            outputs = self.llm.step()  # the passes' requests; the live ones' come as the engine core gave them
        except Exception as err:
            self._failed = f"vLLM's engine failed in a step ({type(err).__name__}: {str(err)[:200]})"
            for followed in list(self._followed.values()):
                self.unfollow(followed, VerifierFault(self._failed))
            raise VerifierFault(self._failed) from err
        step_ms = (time.perf_counter() - start) * 1000.0
        self.step_seconds += step_ms / 1000.0
        self._hand_out(step_ms)
        for output in outputs:
            if output.finished and output.request_id in self._pending:
                self._pending.discard(output.request_id)
                self._done[output.request_id] = output

    def _hand_out(self, step_ms: float) -> None:
        """The live requests' new tokens of the step: to their tokens, and to the sinks of those
        a stream follows."""
        for output in self._caught.last.outputs if self._caught.last is not None else ():
            live = self._live.get(output.request_id)
            if live is None or not (output.new_token_ids or output.finished):
                continue
            new = list(output.new_token_ids)  # one token, or more where drafts passed
            live.tokens.extend(new)
            live.ended = output.finished
            if live.sink is not None:
                live.sink.put(new, step_ms)
            if live.ended:
                self.unfollow(live)

    def _abort(self, ids: list[str]) -> None:
        self._pending.difference_update(ids)
        try:
            self.llm.abort_request(ids)
        except Exception:
            log.exception("vLLM could not abort requests")

    def kv_tokens(self) -> int:
        """The tokens of KV vLLM allocated."""
        return int(self.llm.vllm_config.cache_config.num_gpu_blocks or 0) * self.block_size

    @property
    def block_size(self) -> int:
        return int(self.llm.vllm_config.cache_config.block_size)

    def failure(self) -> str | None:
        return self._failed

    def close(self) -> None:
        self._closer()


VLLM_MAX_TOKEN_LIST = 1024  # vLLM's engine core refuses (and dies of) a longer allowed_token_ids
VLLM_MAX_BANNED = 128  # single-token bad words vLLM masks per request (VLLM_MAX_NUM_BAD_WORDS)
LIVE_SEED_STRIDE = 7_919  # a session's request starting at position p samples with seed + p * this
MAX_STALLED_STEPS = 8  # vLLM steps in a row that advance none of a pass's requests: it cannot schedule them
STALLED_RETRY_MS = 1000


class BannedSpan(list[list[int]]):
    """Single-token bad words that are one span of ids, [start, end): a session's vocabulary
    narrower than the model's rows (a draft's 151,936 tokens on a target padded to 152,064).
    vLLM masks bad words one word and one row at a time, a tensor write each (128 words on the
    17 rows of a padded step: 2,176 writes a request a step); a span is masked with one write
    for all the rows of a run of requests (cloud/engine/vllm_scheduler.py)."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__([token] for token in range(start, end))
        self.span = (start, end)


def limit_vocab(params: Any, vocab: int, width: int) -> None:
    """Keep vLLM's sampling of `params` inside a session's vocabulary (a draft's 151,936
    tokens on a target whose rows are padded to 152,064, say): the padding rows banned as
    single-token bad words when they are few, else the vocabulary listed when it is short.
    These are the masks vLLM's rejection sampler applies (a logit bias it ignores under
    speculative decoding). A session that fits neither raises ValueError (it keeps the
    forward pass), as vLLM checks the lists only inside its engine core."""
    if vocab >= width:
        return
    if width - vocab <= VLLM_MAX_BANNED:
        # vLLM fills this from `bad_words` text only when some is given; ids need no tokenizer.
        params._bad_words_token_ids = BannedSpan(vocab, width)
    elif vocab <= VLLM_MAX_TOKEN_LIST:
        params.allowed_token_ids = list(range(vocab))
    else:
        raise ValueError(f"a vocabulary of {vocab} in {width} rows cannot be given to vLLM's sampler")


def _delta() -> Any:
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.DELTA  # each output carries the step's new tokens only


@contextlib.contextmanager
def _environment(**settings: str) -> Iterator[None]:
    """Environment variables set for a while, then as they were (other vLLMs this process
    starts, and the processes it starts, keep their own)."""
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _positions(folder: str) -> int:
    """The positions the model was made for (config.json), or no limit when it does not say."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return int(config.get("max_position_embeddings") or sys.maxsize)


def _engine_args(options: VllmOptions, max_model_len: int, cpu: bool) -> Any:
    """vLLM's engine arguments for the verifier: live sessions (its scheduler), the edge's
    drafts (a proposer of none), prefix caching, full rows of raw logits for the forward path."""
    from vllm.engine.arg_utils import EngineArgs

    from cloud.engine.vllm_scheduler import LiveScheduler, NoDrafts

    graphs = {"compilation_config": {"cudagraph_mode": options.cudagraph_mode}} if options.cudagraph_mode else {}
    return EngineArgs(
        model=options.model,
        dtype=options.dtype,
        seed=options.seed,
        max_model_len=max_model_len,
        max_num_seqs=min(max(options.max_sessions, 1) * 2, 1024),  # live sessions, and a pass's requests
        block_size=options.block_size or (CPU_BLOCK if cpu else None),
        enable_prefix_caching=True,
        tensor_parallel_size=options.tensor_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization,
        kv_cache_memory_bytes=(options.max_kv_bytes // options.tensor_parallel_size) or None,  # per GPU
        enforce_eager=options.enforce_eager,
        load_format=options.load_format,
        max_logprobs=-1,  # full rows: every token's raw logit of a sampled row
        logprobs_mode="raw_logits",  # the model's logits, before vLLM's own processors
        disable_log_stats=True,
        scheduler_cls=f"{LiveScheduler.__module__}.{LiveScheduler.__name__}",
        # vLLM's rejection sampler and its 1 + K batch shapes; the drafts are the edge's.
        speculative_config={
            "method": "custom_class",
            "model": f"{NoDrafts.__module__}.{NoDrafts.__name__}",
            "num_speculative_tokens": options.max_draft_tokens,
        },
        **graphs,
    )


def _start_engine(args: Any, async_scheduling: bool) -> Any:
    """vLLM's engine, its engine core in this process. vLLM turns asynchronous scheduling off
    for a proposer of its own (the edge's drafts come in that slot) and on a CPU; the live
    scheduler keeps a live request's drafts the edge's under it, so it is set back on after
    vLLM's checks when asked for."""
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.abstract import Executor

    config = args.create_engine_config()
    if async_scheduling:
        _schedule_asynchronously(config)
    return LLMEngine(vllm_config=config, executor_class=Executor.get_class(config), log_stats=False, multiprocess_mode=False)


def _schedule_asynchronously(config: Any) -> None:
    """vLLM's config set for asynchronous steps under the live scheduler, with what vLLM's own
    checks set for its asynchronous drafts: no cascade attention (a prefix many requests share,
    on a GPU), which does not yet work with them."""
    from cloud.engine.vllm_scheduler import AsyncLiveScheduler

    config.scheduler_config.async_scheduling = True
    config.scheduler_config.scheduler_cls = f"{AsyncLiveScheduler.__module__}.{AsyncLiveScheduler.__name__}"
    config.model_config.disable_cascade_attn = True


def _set_cpu_threads(threads: int) -> None:
    """The threads of vLLM's CPU kernels, set on vLLM's thread before vLLM starts: OpenMP keeps
    the setting per thread, and vLLM's CPU worker then replaces torch.set_num_threads with a
    no-op, so torch's own binding is called. Threads beyond the cores free for them stall each
    parallel region at its barrier while the serving (gRPC, the streams) holds a core."""
    torch._C.set_num_threads(threads)


def _largest_graph(config: Any) -> int:
    """The most tokens of a step vLLM runs as one full CUDA graph (0: none, as on a CPU or with
    --enforce-eager)."""
    compilation = config.compilation_config
    mode = compilation.cudagraph_mode
    if config.model_config.enforce_eager or mode is None or not mode.has_full_cudagraphs():
        return 0
    return int(compilation.max_cudagraph_capture_size or 0)


def _shutdown(llm: Any, thread: ThreadPoolExecutor, closing: threading.Event) -> None:
    """Stop vLLM's engine core and its thread (at exit too)."""
    closing.set()  # no pump step after this
    try:
        try:
            thread.submit(llm.engine_core.shutdown).result()
        except RuntimeError:  # at exit, Python stopped its threads first
            llm.engine_core.shutdown()
    except Exception:
        log.exception("vLLM did not shut down cleanly")
    thread.shutdown(wait=False)


class _CaughtOutputs:
    """Stands in for the engine core's get_output: hands vLLM's LLMEngine a step's outputs and
    keeps them, so that the live requests' tokens are read from them as they are."""

    def __init__(self, fetch: Callable[[], Any]) -> None:
        self.fetch = fetch
        self.last: Any = None  # the last step's EngineCoreOutputs

    def __call__(self) -> Any:
        self.last = self.fetch()
        return self.last


@dataclass
class LiveRequest:
    """A session's live vLLM request: every token it holds (its prompt and what it sampled,
    as far as its outputs went), and whether vLLM ended it (at the context's end)."""

    request_id: str
    tokens: list[int]
    engine_id: str = ""  # vLLM's own id of it, as its scheduler knows it
    ended: bool = False
    sink: TokenSink | None = None  # where its new tokens go while a stream follows it


@dataclass
class VllmKV:
    """One session as vLLM serves it: its tokens (those whose KV a step computed), the salt
    that keeps its cached blocks its scope's (its own, or its API key's sessions'), and its
    live request once it has one."""

    salt: str = field(default_factory=lambda: uuid.uuid4().hex)
    tokens: list[int] = field(default_factory=list)
    released: bool = False
    params: Any = None  # a live session's vllm.SamplingParams (None: it keeps the forward pass)
    seed: int = 0
    live: LiveRequest | None = None

    def get_seq_length(self) -> int:
        return len(self.tokens)


@dataclass
class _LiveWork:
    """A live step on its way: the tokens its session takes as given, and once decided, the
    tokens it yields (or what failed it)."""

    step: LiveStep
    kv: VllmKV
    base: list[int]
    tokens: list[int] | None = None
    error: Exception | None = None

    @property
    def decided(self) -> bool:
        return self.tokens is not None or self.error is not None


@dataclass(frozen=True)
class _Rows:
    """The requests of one step and where its rows come from."""

    tokens: list[int]  # the session's tokens after this step
    keep: int
    vocab: int  # argmax rows: the argmax is read among these ids; 0: full rows (one request per row)

    @property
    def full(self) -> bool:
        return self.vocab == 0

    @property
    def requests(self) -> int:
        return self.keep if self.full else 1


class VllmEngine:
    """A model served by a VllmRuntime. Several engines may share one runtime (tests do): only
    the engine that owns it stops it on close."""

    name: EngineName = "vllm"
    caches_prefixes = True  # its prefix cache, salted by each session's scope

    def __init__(self, runtime: VllmRuntime, owns_runtime: bool = True) -> None:
        config = runtime.llm.model_config
        self.runtime = runtime
        self.owns_runtime = owns_runtime
        self.logits_width = int(config.get_vocab_size())
        width = torch.empty(0, dtype=config.dtype).element_size()
        layers, heads = config.get_total_num_hidden_layers(), config.get_total_num_kv_heads()
        self.kv_bytes_per_token = int(layers * 2 * heads * config.get_head_size() * width)
        self.parameters = lm.safetensors_parameters(Path(config.model))  # vLLM does not report it
        self.dtype = str(config.dtype).removeprefix("torch.")

    def plan_kv(self, request: KVRequest) -> KVPlan:
        """vLLM holds the KV (sized when it started): the context it serves, and the KV it
        allocated, or the cap asked where smaller. A vLLM that sized its own KV (no bytes given:
        what a GPU had left) sets the cap alone; the default cap is sized for a CPU."""
        if request.layout != "packed":
            raise ConfigError("--engine vllm keeps its own KV: --kv-layout slots is for the transformers engine")
        context = min(request.max_context_tokens, self.runtime.max_context_tokens)
        held = self.kv_bytes_held()
        # Each live session holds whole blocks and room for a round's drafts past its tokens.
        slack = request.max_sessions * (self.runtime.block_size + self.runtime.options.max_draft_tokens + 1)
        usable = max(held - slack * self.kv_bytes_per_token, held // 2)
        return KVPlan(context, min(request.max_kv_bytes, usable) if self.runtime.options.max_kv_bytes else usable)

    def kv_bytes_held(self) -> int:
        return self.runtime.kv_tokens() * self.kv_bytes_per_token

    def kv_tokens(self) -> int:
        """The tokens of KV vLLM allocated."""
        return self.runtime.kv_tokens()

    def failure(self) -> str | None:
        return self.runtime.failure()

    def describe(self) -> dict[str, str]:
        import vllm

        facts = {"engine": self.name, "dtype": self.dtype, "device": self.runtime.device, "vllm": vllm.__version__}
        facts["scheduling"] = "asynchronous" if self.runtime.llm.vllm_config.scheduler_config.async_scheduling else "synchronous"
        if self.runtime.device == "cpu":
            facts["threads"] = str(self.runtime.cpu_threads)
        return facts

    def close(self) -> None:
        if self.owns_runtime:
            self.runtime.close()

    # ---- a session's KV -----------------------------------------------------------------

    def new_kv(self, scope: str = "") -> VllmKV:
        """A session whose cached blocks are its scope's (its API key's sessions share them), or
        its own alone."""
        return VllmKV(salt=scope) if scope else VllmKV()

    def free(self, kv: SessionKV) -> None:
        kv = _own(kv)
        kv.released = True
        kv.tokens = []
        if kv.live is not None:
            self.runtime.call(self.runtime.end_live, kv.live)

    def freed(self, kv: SessionKV) -> bool:
        return _own(kv).released

    def crop(self, kv: SessionKV, length: int) -> None:
        del _own(kv).tokens[length:]

    # ---- live sessions ----------------------------------------------------------------------

    def check_session(self, config: SessionConfig, vocab: int) -> None:
        self._sampling(config, vocab)

    def make_live(self, kv: SessionKV, config: SessionConfig, vocab: int) -> bool:
        """Every session is live: vLLM's rejection sampler verifies its rounds exactly (greedy,
        point drafts as q = 1, sparse drafts with the edge's q as its draft probabilities)."""
        own = _own(kv)
        own.params, own.seed = self._sampling(config, vocab), config.seed
        return True

    def _sampling(self, config: SessionConfig, vocab: int) -> Any:
        """vLLM's sampling of a session; SessionRefused for one it cannot verify exactly (an
        approximate accept mode, settings or a vocabulary vLLM refuses), which is never
        verified by another rule."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError

        if not config.accept_mode.exact:
            raise SessionRefused(
                f"the vllm engine verifies only exact accept modes (greedy, point, sparse), not "
                f"{config.accept_mode.value}: use --accept-mode sparse or point"
            )
        sampling = config.sampling
        try:
            params = SamplingParams(
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                repetition_penalty=sampling.repetition_penalty,
                ignore_eos=True,  # a session ends when the edge closes it
                detokenize=False,
                output_kind=_delta(),
            )
            limit_vocab(params, vocab, self.logits_width)
        except (VLLMValidationError, ValueError) as err:
            raise SessionRefused(f"the vllm engine cannot sample this session: {str(err)[:200]}") from err
        return params

    def is_live(self, kv: SessionKV) -> bool:
        return _own(kv).params is not None

    def run_live(self, steps: Sequence[LiveStep]) -> list[list[int] | Exception]:
        """Each step advanced as far as the tokens its request holds decide it; vLLM steps while
        any is undecided. A session's tokens grow by the step's fed tokens and drafts (its
        rounds crop the rejected ones, as after a forward pass)."""
        works = [_LiveWork(step, kv, kv.tokens + step.fed) for step in steps for kv in [_own(step.kv)]]
        self.runtime.call(self._decide, works)
        for work in works:
            if work.tokens is not None:
                work.kv.tokens = work.base[: len(work.base) - work.step.known] + work.step.drafts
        return [w.tokens if w.tokens is not None else w.error for w in works]  # type: ignore[misc]

    def follow(self, kv: SessionKV, position: int, sink: TokenSink) -> bool:
        live = _own(kv).live
        if live is None:
            return False
        self.runtime.call(self.runtime.follow, live, position, sink)
        return True

    def unfollow(self, kv: SessionKV) -> None:
        live = _own(kv).live
        if live is not None:
            self.runtime.call(self.runtime.stop_following, live)

    def extend(self, kv: SessionKV, tokens: list[int]) -> None:
        _own(kv).tokens.extend(tokens)

    def own_steps(self) -> tuple[int, float]:
        return self.runtime.steps_taken()

    def rows(self, kv: SessionKV, length: int, block: list[int], keep: int) -> torch.Tensor:
        """Full rows from requests of their own under the session's cache salt (its whole
        blocks served by vLLM's prefix cache), as a session that is not live reads them."""
        own = _own(kv)
        scratch = VllmKV(salt=own.salt, tokens=own.tokens[:length])
        return self.forward([scratch], [block], [keep])[0]

    def _decide(self, works: list[_LiveWork]) -> None:
        """On vLLM's thread: advance every work, and step vLLM while any is undecided."""
        stalled = 0
        while True:
            self._settle(works)
            for work in works:
                if not work.decided:
                    self._advance(work)
            undecided = [w for w in works if not w.decided]
            if not undecided:
                return
            if not self.runtime.busy():
                for work in undecided:
                    work.error = VerifierFault("vLLM ended the session's request before its step's tokens")
                return
            before = self._progress(undecided)
            self.runtime.step()
            stalled = 0 if self._progress(undecided) != before else stalled + 1
            if stalled >= MAX_STALLED_STEPS:
                self._give_up(undecided)
                return

    def _settle(self, works: list[_LiveWork]) -> None:
        """Under asynchronous scheduling: the outputs still to come of the works' parked
        requests (a prefill's token, the step a stream took past its stop) come in first, so
        that the rounds among the works are woken together and share one step."""
        runtime = self.runtime
        for _ in range(MAX_STALLED_STEPS):  # a step or two: as many as vLLM keeps in flight
            if not any(w.kv.live is not None and runtime.settling(w.kv.live) for w in works if not w.decided):
                return
            runtime.step()

    def _progress(self, works: list[_LiveWork]) -> list[tuple[int, int]]:
        """How far the works' requests got: their tokens, and the tokens vLLM computed of them."""
        return [(len(w.kv.live.tokens), self.runtime.computed(w.kv.live)) for w in works if w.kv.live is not None]

    def _give_up(self, works: list[_LiveWork]) -> None:
        """Steps vLLM cannot schedule (its KV blocks are held by parked sessions): their
        requests end, and their sessions get new ones on their next step."""
        for work in works:
            if work.kv.live is not None:
                self.runtime.end_live(work.kv.live)
                work.kv.live = None
            work.error = CapacityExceeded("vLLM has no KV blocks free for the session's step", STALLED_RETRY_MS)

    def _advance(self, work: _LiveWork) -> None:
        """Decide the step from the tokens its request holds past the session's, or have vLLM
        make more: start the request (or a new one, when the session's tokens left it), put
        the drafts on it, or let it decode ahead."""
        kv, step, runtime = work.kv, work.step, self.runtime
        if len(step.drafts) > runtime.options.max_draft_tokens:
            work.error = VerifierFault(f"vLLM verifies at most {runtime.options.max_draft_tokens} drafts a step")
            return
        live = kv.live
        if live is None or live.tokens[: len(work.base)] != work.base:
            if live is not None:
                runtime.end_live(live)
            if len(work.base) > runtime.max_context_tokens:
                work.error = VerifierFault("the session's tokens fill the context")
                return
            kv.live = runtime.start_live(work.base, kv.salt, self._seeded(kv, len(work.base)))
            return
        if not step.reads:
            work.tokens = []
            return
        ahead = live.tokens[len(work.base) :]
        matched = shared_prefix(step.drafts, ahead)
        if matched < len(ahead):  # a draft differs from what vLLM sampled there, or all pass and it holds the next
            work.tokens = [*step.drafts[:matched], ahead[matched]]
            self._decode_on(live, step, ahead[matched:])
            return
        drafts, draft_q = step.drafts[matched:], step.draft_q[matched:]
        if live.ended:
            work.error = VerifierFault("vLLM ended the session's request at the context's end")
        elif runtime.parked(live):
            runtime.wake(live, drafts, 1 if drafts else max(step.ahead, 1), step.stops, draft_q)
        elif drafts and runtime.park(live):  # decoding on its own: the drafts go on it from its next step
            runtime.wake(live, drafts, 1, step.stops, draft_q)

    def _decode_on(self, live: LiveRequest, step: LiveStep, held: list[int]) -> None:
        """After a step without drafts read the first of the tokens vLLM `held` past the session:
        let a parked request decode the tokens its session reads next (a stretch, a stream, up
        to a stop token) in the steps to come."""
        more = step.ahead - len(held)
        if step.drafts or more <= 0 or live.ended or step.stops.intersection(held) or not self.runtime.parked(live):
            return
        self.runtime.wake(live, [], more, step.stops)

    def _seeded(self, kv: VllmKV, position: int) -> Any:
        """The session's sampling for a request starting at `position`: seeded from its seed
        and the position, so its requests draw independently."""
        params = kv.params.clone()
        if params.temperature > 0:
            params.seed = (kv.seed + LIVE_SEED_STRIDE * position) % (1 << 63)
        return params

    # ---- one batched pass -----------------------------------------------------------------

    def forward(
        self,
        kvs: Sequence[SessionKV],
        blocks: Sequence[Sequence[int]],
        keeps: Sequence[int],
        argmax_vocab: Sequence[int] = (),
    ) -> list[torch.Tensor]:
        """Every step's requests in flight together; per block its last keeps[i] rows [keep, V]
        (all rows when 0). A session's tokens grow only when the whole pass succeeded."""
        caches = [_own(kv) for kv in kvs]
        vocabs = list(argmax_vocab) or [0] * len(caches)
        steps = [
            _Rows(kv.tokens + list(block), keep or len(block), vocab)
            for kv, block, keep, vocab in zip(caches, blocks, keeps, vocabs, strict=True)
        ]
        asked = list(zip(caches, steps, strict=True))
        requests = [(p, kv.salt, params) for kv, step in asked for p, params in _requests(step)]
        outputs = iter(self._rerun_unset_rows(asked, requests, self.runtime.run(requests)))
        got = [self._rows(step, [next(outputs) for _ in range(step.requests)]) for _, step in asked]
        rows = self._argmax_checked(asked, got)
        for kv, step in zip(caches, steps, strict=True):
            kv.tokens = step.tokens
        return rows

    def _argmax_checked(self, asked: list[tuple[VllmKV, _Rows]], rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """An argmax row holds the argmax among its step's vocabulary when one of its largest
        logits lies inside it (any id outside them is smaller); a step with a row whose
        largest logits are all past it (padded embedding rows) runs again for full rows."""
        redo = [
            i
            for i, ((_, step), got) in enumerate(zip(asked, rows, strict=True))
            if not step.full and not bool(torch.isfinite(got[:, : step.vocab]).any(dim=-1).all())
        ]
        if not redo:
            return rows
        full = [(kv, replace(step, vocab=0)) for kv, step in (asked[i] for i in redo)]
        outputs = iter(self.runtime.run([(p, kv.salt, params) for kv, step in full for p, params in _requests(step)]))
        again = dict(zip(redo, (self._rows(step, [next(outputs) for _ in range(step.keep)]) for _, step in full), strict=True))
        return [again.get(i, got) for i, got in enumerate(rows)]

    def _rerun_unset_rows(self, asked: list[tuple[VllmKV, _Rows]], requests: list[Any], outputs: list[Any]) -> list[Any]:
        """An argmax request whose cache hit covered a kept row (vLLM leaves such rows unset),
        again without reading the cache."""
        again: dict[int, tuple[list[int], str, Any]] = {}
        index = 0
        for kv, step in asked:
            if not step.full and (outputs[index].num_cached_tokens or 0) > len(step.tokens) - step.keep:
                [(prompt, params)] = _requests(step, read_cache=False)
                again[index] = (prompt, kv.salt, params)
            index += step.requests
        if not again:
            return outputs
        fresh = dict(zip(again, self.runtime.run(list(again.values())), strict=True))
        return [fresh.get(i, out) for i, out in enumerate(outputs)]

    def _rows(self, step: _Rows, outputs: list[Any]) -> torch.Tensor:
        rows = torch.full((step.keep, self.logits_width), float("-inf"), dtype=torch.float32)
        if step.full:
            for row, output in zip(rows, outputs, strict=True):
                _fill(row, output.outputs[0].logprobs, 0)
            return rows
        output = outputs[0]
        first = len(step.tokens) - step.keep  # the token whose row is the first kept
        # vLLM's GPU model runner returns the rows of the computed positions only (those the
        # cache served are left out); its CPU runner returns every position's.
        missing = len(step.tokens) - len(output.prompt_logprobs or step.tokens)
        for r in range(step.keep - 1):  # a prompt row: the distribution after token first + r
            _fill(rows[r], output.prompt_logprobs, first + r + 1 - missing, TOP_ROWS)
        _fill(rows[-1], output.outputs[0].logprobs, 0, TOP_ROWS)  # the last row: the sampled one
        return rows


def _requests(step: _Rows, read_cache: bool = True) -> list[tuple[list[int], Any]]:
    """A step's requests: one per kept row (full rows), or one for all of them (argmax rows)."""
    from vllm import SamplingParams

    common: dict[str, Any] = dict(temperature=0.0, max_tokens=1, detokenize=False, flat_logprobs=True)
    # vLLM skips the cache for requests with prompt log-probabilities unless told not to.
    common["skip_reading_prefix_cache"] = not read_cache
    if step.full:
        params = SamplingParams(logprobs=-1, **common)
        n = len(step.tokens)
        return [(step.tokens[: i + 1], params) for i in range(n - step.keep, n)]
    prompt_rows = TOP_ROWS if step.keep > 1 else None
    return [(step.tokens, SamplingParams(logprobs=TOP_ROWS, prompt_logprobs=prompt_rows, **common))]


def _fill(row: torch.Tensor, flat: Any, position: int, top: int = 0) -> None:
    """Write a FlatLogprobs position's (token, raw logit) pairs into a row: all of them, or
    (top > 0) those of the `top` largest only (vLLM adds the prompt's or sampled token's own,
    whatever its rank)."""
    start, end = flat.start_indices[position], flat.end_indices[position]
    ids, values = flat.token_ids[start:end], flat.logprobs[start:end]
    if top:
        kept = [i for i, rank in enumerate(flat.ranks[start:end]) if rank is not None and rank <= top]
        ids, values = [ids[i] for i in kept], [values[i] for i in kept]
    if not ids:
        raise VerifierFault("vLLM returned an empty row of logits")
    row[torch.tensor(ids)] = torch.tensor(values, dtype=torch.float32)


def _own(kv: SessionKV) -> VllmKV:
    if not isinstance(kv, VllmKV):
        raise TypeError(f"the vLLM engine holds no {type(kv).__name__}")
    return kv
