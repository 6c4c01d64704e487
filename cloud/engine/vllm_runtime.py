"""vLLM started and run for the verifier: one vLLM engine and the requests it runs, the sessions' live requests among
them, on one thread of its own where it also steps for followed streams (docs/architecture.md, "vLLM's thread and the
pump"). The engine built on it is cloud/engine/vllm.py."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from cloud.engine import TokenSink
from cloud.engine.vllm_patches import warn_if_untested
from shared.errors import CapacityExceeded, ConfigError, SessionNotFound, VerifierFault
from shared.hardware import usable_cores
from shared.protocol import SparseDistribution

if TYPE_CHECKING:
    from cloud.engine.vllm_scheduler import LiveScheduler
    from shared.grammar import Constraint

log = logging.getLogger("cloud-verifier")
T = TypeVar("T")
CPU_BLOCK = 32  # vLLM's CPU attention wants blocks of a multiple of 32 tokens
MAX_STALLED_STEPS = 8  # vLLM steps in a row that advance none of a pass's requests: it cannot schedule them
# The share of a step's time the pump waits after a call for the next one, at most PUMP_YIELD_MS (why:
# docs/architecture.md, "vLLM's thread and the pump")
PUMP_YIELD, PUMP_YIELD_MS = 0.25, 5.0
STALLED_RETRY_MS = 1000


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
    max_top_k: int = 16  # the target's most likely tokens a round may ask for at each row
    pad_decode: bool = True  # steps of requests decoding on their own padded to K drafts, for vLLM's full CUDA graph
    pad_limit: int = 0  # the most tokens such a step may have (0: vLLM's largest CUDA graph)
    cpu_threads: int = 0  # on a CPU, the threads vLLM's model runs on (0: the cores this process may use)
    async_scheduling: bool = True  # vLLM schedules a step while the one before it runs (no pads then)
    cudagraph_mode: str = ""  # vLLM's CUDA graph mode (FULL: full graphs for steps of any shape); "": vLLM's choice


class VllmRuntime:
    """One vLLM engine (its engine core, in this process) and its requests: the live sessions'."""

    def __init__(self, options: VllmOptions) -> None:
        cpu = not torch.cuda.is_available()
        if not cpu:  # workers of a target over several GPUs: the verifier may have touched CUDA
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # The context, and the one token a request samples; at most the model's positions.
        self.max_context_tokens = min(options.max_context_tokens, _positions(options.model) - 1)
        args = _engine_args(options, self.max_context_tokens + 1, cpu)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm")
        self._called = threading.Event()  # a call waits for vLLM's thread
        self._call_ended = 0.0  # when the last call ended (perf_counter)
        self._step_ms = 0.0  # how long the last step took
        self._ident = self._thread.submit(threading.get_ident).result()
        if cpu:
            self.call(_set_cpu_threads, options.cpu_threads or usable_cores())
        try:
            # The engine core in this process: the verifier wakes and parks live requests in its
            # scheduler between steps. vLLM reads the setting while it builds the engine only.
            with environment(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
                self.llm: Any = self.call(_start_engine, args, options.async_scheduling)
        except Exception as err:  # vLLM's own config errors name the setting that failed
            self._thread.shutdown()
            raise ConfigError(f"vLLM could not start on {options.model}: {str(err)[:300]}") from err
        self.scheduler: LiveScheduler = self.llm.engine_core.engine_core.scheduler
        warn_if_untested()
        self._caught = _CaughtOutputs(self.llm.engine_core.get_output)
        self.llm.engine_core.get_output = self._caught
        if options.pad_decode and not options.async_scheduling:
            self.scheduler.pad_limit = options.pad_limit or _largest_graph(self.llm.vllm_config)
        self.options = options
        self.device = "cpu" if cpu else "cuda"
        self.cpu_threads = self.call(torch.get_num_threads) if cpu else 0  # what vLLM's CPU kernels run on
        self._ids = itertools.count()
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
        self._called.set()
        return self._thread.submit(self._run_call, fn, *args).result()

    def _run_call(self, fn: Callable[..., T], *args: Any) -> T:
        self._called.clear()
        try:
            return fn(*args)
        finally:
            self._call_ended = time.perf_counter()

    def soon(self, fn: Callable[[], None]) -> None:
        """fn() on vLLM's thread after what waits for it now (the step running, a pump step
        queued): without waiting for it."""
        self._thread.submit(fn)

    @property
    def steps(self) -> int:
        """The steps vLLM ran the model in so far (they took `step_seconds`)."""
        return self.scheduler.steps

    # ---- live requests (on vLLM's thread) ----------------------------------------------------

    def start_live(
        self, prompt: list[int], salt: str, params: Any, grammar: Constraint | None = None, start: int = 0
    ) -> LiveRequest:
        """A session's live request: its prefill samples one token, then it parks. Under a
        `grammar` (its tokens from `start` on), every token it samples or verifies is masked."""
        from vllm import TokensPrompt

        from cloud.engine.vllm_scheduler import LIVE_PREFIX

        live = LiveRequest(f"{LIVE_PREFIX}{next(self._ids)}", list(prompt), len(prompt))
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
        if grammar is not None:
            self.scheduler.constrain(live.engine_id, grammar, start)
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
        return live.engine_id in self.scheduler.parked

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
        if live.ended or self.parked(live):
            self.unfollow(live)
            return
        self._followed[live.engine_id] = live
        if not self._pumping:
            self._pumping = True
            self._thread.submit(self._pump)

    def _pump(self) -> None:
        """One step while a followed request decodes on its own, then the next one queued behind
        whatever else waits for vLLM's thread (a pass's rounds take their turn between them);
        just after a call, not before the next call had PUMP_YIELD of a step to come."""
        for live in [live for live in self._followed.values() if self.parked(live)]:
            self.unfollow(live)  # parked since: its stretch is done
        followed = list(self._followed.values())
        if not followed or self._failed is not None or self._closing.is_set():
            self._pumping = False
            return
        wait = self._call_ended + min(PUMP_YIELD * self._step_ms, PUMP_YIELD_MS) / 1000.0 - time.perf_counter()
        if self._called.is_set() or (wait > 0 and self._called.wait(wait)):
            self._thread.submit(self._pump)  # behind the call, whose steps are the streams' too
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

    def cached(self, live: LiveRequest) -> int:
        """The prompt tokens of a live request vLLM's prefix cache served when it was first
        scheduled (0 before, or once it ended)."""
        from cloud.engine.vllm_scheduler import CACHED_TOKENS

        return int(getattr(self.scheduler.requests.get(live.engine_id), CACHED_TOKENS, 0))

    def computed(self, live: LiveRequest) -> int:
        """The tokens of a live request whose KV vLLM computed (0 once it ended)."""
        request = self.scheduler.requests.get(live.engine_id)
        return int(request.num_computed_tokens) if request is not None else 0

    def stepping(self) -> bool:
        """Whether vLLM has a request to step (one decoding on its own, or waking)."""
        return bool(self.scheduler.running) or len(self.scheduler.waiting) > 0

    def busy(self) -> bool:
        """Whether vLLM has a request to step, or a parked request's outputs still to come."""
        return self.stepping() or bool(self.scheduler.settling)

    def step(self) -> None:
        """One step of vLLM: every running request advances; outputs go to their owners (under
        asynchronous scheduling, those of the step before, while this one runs). A step that
        fails leaves vLLM in a state nobody knows: no step runs after it."""
        if self._failed is not None:
            raise VerifierFault(self._failed)
        start = time.perf_counter()
        self._caught.last = None
        try:
            self.llm.step()  # the live requests' outputs come as the engine core gave them (_hand_out)
        except Exception as err:
            self._failed = f"vLLM's engine failed in a step ({type(err).__name__}: {str(err)[:200]})"
            for followed in list(self._followed.values()):
                self.unfollow(followed, VerifierFault(self._failed))
            raise VerifierFault(self._failed) from err
        step_ms = self._step_ms = (time.perf_counter() - start) * 1000.0
        self.step_seconds += step_ms / 1000.0
        self._hand_out(step_ms)

    def _hand_out(self, step_ms: float) -> None:
        """The live requests' new tokens of the step: to their tokens, and to the sinks of those
        a stream follows."""
        for output in self._caught.last.outputs if self._caught.last is not None else ():
            live = self._live.get(output.request_id)
            if live is None or not (output.new_token_ids or output.finished):
                continue
            new = list(output.new_token_ids)  # one token, or more where drafts passed
            if output.new_logprobs is not None:  # a request that asks for each token's top-k
                live.top.update(enumerate(_top_rows(output.new_logprobs, len(new)), start=len(live.tokens)))
            live.tokens.extend(new)
            live.ended = output.finished
            if live.sink is not None:
                live.sink.put(new, step_ms)
            if live.ended:
                self.unfollow(live)

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


@contextlib.contextmanager
def environment(**settings: str) -> Iterator[None]:
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
    drafts (a proposer of none), prefix caching, and the top-k of each sampled row as the
    sampler processed it (temperature, top-k, top-p, penalties) for a session that asks."""
    from vllm.engine.arg_utils import EngineArgs

    from cloud.engine.vllm_patches import NoDrafts
    from cloud.engine.vllm_scheduler import LiveScheduler

    graphs = {"compilation_config": {"cudagraph_mode": options.cudagraph_mode}} if options.cudagraph_mode else {}
    return EngineArgs(
        model=options.model,
        dtype=options.dtype,
        seed=options.seed,
        max_model_len=max_model_len,
        max_num_seqs=min(max(options.max_sessions, 1) * 2, 1024),  # live sessions, and those ending and starting
        block_size=options.block_size or (CPU_BLOCK if cpu else None),
        enable_prefix_caching=True,
        tensor_parallel_size=options.tensor_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization,
        kv_cache_memory_bytes=(options.max_kv_bytes // options.tensor_parallel_size) or None,  # per GPU
        enforce_eager=options.enforce_eager,
        load_format=options.load_format,
        # The distribution each token was drawn or verified from (a round's want_top_k). On a GPU
        # this mode turns off FlashInfer's top-k/top-p sampler, which a seeded request (every
        # sampling session's) does not use anyway.
        max_logprobs=options.max_top_k,
        logprobs_mode="processed_logprobs",
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
    """vLLM's engine, its engine core in this process, asynchronous scheduling set back on after vLLM's checks
    when asked for (docs/architecture.md, "vLLM's thread and the pump")."""
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.abstract import Executor

    config = args.create_engine_config()
    if async_scheduling:
        _schedule_asynchronously(config)
    return LLMEngine(vllm_config=config, executor_class=Executor.get_class(config), log_stats=False, multiprocess_mode=False)


def _schedule_asynchronously(config: Any) -> None:
    """vLLM's config set for asynchronous steps under the live scheduler, with what vLLM's own checks set for its
    asynchronous drafts: no cascade attention (a prefix many requests share, on a GPU), which does not yet work with them."""
    from cloud.engine.vllm_scheduler import AsyncLiveScheduler

    config.scheduler_config.async_scheduling = True
    config.scheduler_config.scheduler_cls = f"{AsyncLiveScheduler.__module__}.{AsyncLiveScheduler.__name__}"
    config.model_config.disable_cascade_attn = True


def _set_cpu_threads(threads: int) -> None:
    """The threads of vLLM's CPU kernels (how many: docs/operations.md, "Threads on a CPU"), set on vLLM's thread
    through torch's own binding (why: docs/architecture.md, "vLLM's thread and the pump")."""
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


@dataclass(frozen=True)
class TopRow:
    """The most likely tokens of one sampled row and their probabilities, highest first."""

    token_ids: list[int]
    probs: list[float]


def _top_rows(logprobs: Any, count: int) -> list[TopRow]:
    """Each new token's top-k from the step's LogprobsLists (its first column is the sampled
    token's own: left out)."""
    ids, values = logprobs.logprob_token_ids[:count, 1:], logprobs.logprobs[:count, 1:]
    return [TopRow(row.tolist(), [math.exp(v) for v in lp.tolist()]) for row, lp in zip(ids, values, strict=True)]


@dataclass
class LiveRequest:
    """A session's live vLLM request: every token it holds (its prompt and what it sampled,
    as far as its outputs went), and whether vLLM ended it (at the context's end)."""

    request_id: str
    tokens: list[int]
    prompt: int = 0  # the tokens it started with
    engine_id: str = ""  # vLLM's own id of it, as its scheduler knows it
    ended: bool = False
    sink: TokenSink | None = None  # where its new tokens go while a stream follows it
    cached: int = 0  # of its prompt, the tokens vLLM's prefix cache served (read once it was scheduled)
    # by position, the top-k of the distribution each token it sampled came from (a request
    # that asks for them; none for the others)
    top: dict[int, TopRow] = field(default_factory=dict)
