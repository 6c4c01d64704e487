"""The vLLM engine in a process of its own (`--vllm-engine-process`; why: docs/operations.md, "Where vLLM runs"): the
same VllmEngine in a child process, reached over pipes (how: docs/architecture.md, "The engine process")."""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from cloud.engine import KVPlan, KVRequest, PromptChunk, SessionKV, TokenSink
from cloud.engine.vllm import LiveEngine, LiveStep, LiveYield
from cloud.engine.vllm_runtime import environment
from shared.errors import ConfigError, VerifierFault
from shared.protocol import SessionConfig

if TYPE_CHECKING:
    from cloud.engine.vllm_runtime import VllmOptions

START_TIMEOUT_S = 1800.0  # vLLM compiles its graphs first: minutes on a GPU
# How long an idle OpenMP thread of the child (vLLM's CPU kernels) spins before it sleeps, unless
# the verifier's environment sets GOMP_SPINCOUNT (why, measured: docs/vllm_overhead.md)
OPENMP_SPINS = "5000"


@dataclass
class KVHandle:
    """A session's KV in the child: its id there, and its length as the child last said (or as
    a crop not sent yet left it)."""

    kv_id: int
    length: int = 0
    scope: str = ""  # whose cached prefixes it may share (Engine.new_kv)
    follow_id: int = 0  # the follow its tokens come back under (0: none)
    cached: int = 0  # of its prompt, the tokens vLLM's prefix cache served (as the child last said)

    def get_seq_length(self) -> int:
        return self.length


class ProcessEngine(LiveEngine):
    """The Engine, answered by a VllmEngine in a child process."""

    def __init__(self, options: VllmOptions) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA and vLLM's threads: never forked
        self._calls, child_calls = context.Pipe()
        self._tokens, child_tokens = context.Pipe(duplex=False)
        self._process = context.Process(target=serve, args=(options, child_calls, child_tokens), name="vllm-engine")
        with environment(GOMP_SPINCOUNT=os.environ.get("GOMP_SPINCOUNT", OPENMP_SPINS)):  # read as torch loads there
            self._process.start()
        child_calls.close()
        child_tokens.close()
        # At exit (a verifier that stops without closing it), the child reads the end of its pipe
        # and stops: multiprocessing waits for it then.
        weakref.finalize(self, self._calls.close)
        self._lock = threading.Lock()  # one call on the pipe at a time
        self._ids = itertools.count(1)
        self._sinks: dict[int, TokenSink] = {}  # by follow id: a late message of an ended follow finds none
        self._crops: dict[int, int] = {}  # crops the child has not been told of, by KV id: sent with the next call
        self._failed: str | None = None
        self._closing = False
        if not self._calls.poll(START_TIMEOUT_S):
            self._stop()
            raise ConfigError(f"vLLM's engine process did not start within {START_TIMEOUT_S:.0f} s")
        self.logits_width, self.kv_bytes_per_token, self.parameters, self.dtype, self._kv_tokens, self._description = (
            self._answer()  # _Child.facts
        )
        self._steps: tuple[int, float] = (0, 0.0)  # the engine's steps and their seconds, as its last message said
        self._reader = threading.Thread(target=self._read_tokens, name="vllm-tokens", daemon=True)
        self._reader.start()

    # ---- the pipe ---------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._failed is not None:
                raise VerifierFault(self._failed)
            crops, self._crops = self._crops, {}
            try:
                self._calls.send((method, args, crops))
            except (OSError, EOFError) as err:
                raise self._died(err) from err
            return self._answer()

    def _answer(self) -> Any:
        try:
            ok, value, steps = self._calls.recv()
        except (OSError, EOFError) as err:
            raise self._died(err) from err
        self._steps = steps
        if not ok:
            raise value
        return value

    def _died(self, err: BaseException) -> VerifierFault:
        if self._failed is None:
            self._failed = f"vLLM's engine process ended ({type(err).__name__})"
        for sink in list(self._sinks.values()):
            sink.fail(VerifierFault(self._failed))
        self._sinks.clear()
        return VerifierFault(self._failed)

    def _read_tokens(self) -> None:
        """Each step's tokens of the followed sessions, to their sinks; a sink the child failed
        (its stream's end) is dropped."""
        while True:
            try:
                items, self._steps = self._tokens.recv()
            except (OSError, EOFError) as err:  # the child has gone: no followed stream waits for it
                if not self._closing:
                    self._died(err)
                return
            for kind, follow_id, payload in items:
                sink = self._sinks.get(follow_id)
                if sink is None:
                    continue
                if kind == "put":
                    sink.put(*payload)
                else:
                    self._sinks.pop(follow_id, None)
                    sink.fail(payload)

    # ---- Engine --------------------------------------------------------------------------------

    def plan_kv(self, request: KVRequest) -> KVPlan:
        return self._call("plan_kv", request)  # type: ignore[no-any-return]

    def kv_bytes_held(self) -> int:
        return self._call("kv_bytes_held")  # type: ignore[no-any-return]

    def kv_tokens(self) -> int:
        return self._kv_tokens

    def new_kv(self, scope: str = "") -> KVHandle:
        return KVHandle(next(self._ids), scope=scope)  # the child makes its KV at the first call of it

    def cached_tokens(self, kv: SessionKV) -> int:
        return _handle(kv).cached

    def free(self, kv: SessionKV) -> None:
        """Its request ends in the child; with the child gone there is nothing left to free."""
        handle = _handle(kv)
        self._sinks.pop(handle.follow_id, None)
        handle.length = -1
        if self.failure() is None:
            with contextlib.suppress(VerifierFault):
                self._call("free", handle.kv_id)

    def freed(self, kv: SessionKV) -> bool:
        return _handle(kv).length < 0

    def crop(self, kv: SessionKV, length: int) -> None:
        """Told to the child with the next call (every round crops its session: one message a
        pass, not one a session)."""
        handle = _handle(kv)
        if length < handle.length:
            handle.length = length
            self._crops[handle.kv_id] = length

    def describe(self) -> dict[str, str]:
        return dict(self._description)

    def failure(self) -> str | None:
        if self._failed is None and not self._process.is_alive():
            self._failed = f"vLLM's engine process ended (exit code {self._process.exitcode})"
        return self._failed

    def close(self) -> None:
        self._closing = True
        if self._failed is None and self._process.is_alive():
            with contextlib.suppress(VerifierFault):
                self._call("close")
        self._stop()

    def _stop(self) -> None:
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        self._calls.close()

    # ---- sessions and their steps --------------------------------------------------------------

    def check_session(self, config: SessionConfig, vocab: int) -> None:
        self._call("check_session", config, vocab)

    def start_session(self, kv: SessionKV, config: SessionConfig, vocab: int) -> None:
        handle = _handle(kv)
        self._call("start_session", handle.kv_id, config, vocab, handle.scope)

    def run_live(self, steps: Sequence[LiveStep]) -> list[LiveYield | PromptChunk | Exception]:
        handles = [_handle(step.kv) for step in steps]
        sent = [replace(step, kv=handle.kv_id) for step, handle in zip(steps, handles, strict=True)]  # type: ignore[arg-type]
        results, kept = self._call("run_live", sent)
        for handle, (length, cached) in zip(handles, kept, strict=True):
            handle.length, handle.cached = length, cached
        return results  # type: ignore[no-any-return]

    def follow(self, kv: SessionKV, position: int, sink: TokenSink) -> bool:
        handle = _handle(kv)
        self._sinks.pop(handle.follow_id, None)
        handle.follow_id = next(self._ids)
        self._sinks[handle.follow_id] = sink
        if self._call("follow", handle.kv_id, position, handle.follow_id):
            return True
        self._sinks.pop(handle.follow_id, None)
        return False

    def unfollow(self, kv: SessionKV) -> None:
        handle = _handle(kv)
        self._call("unfollow", handle.kv_id)
        self._sinks.pop(handle.follow_id, None)

    def extend(self, kv: SessionKV, tokens: list[int]) -> None:
        handle = _handle(kv)
        handle.length = self._call("extend", handle.kv_id, tokens)

    def own_steps(self) -> tuple[int, float]:
        """As of the child's last answer or tokens: read by /metrics on the event loop, which
        never waits for the pipe (a long prefill may hold it)."""
        return self._steps


def _handle(kv: SessionKV) -> KVHandle:
    if not isinstance(kv, KVHandle):
        raise TypeError(f"the vLLM engine process holds no {type(kv).__name__}")
    return kv


# ---- the child ----------------------------------------------------------------------------------


class _Outbox:
    """The followed sessions' tokens on their way to the verifier: what the engine puts during a
    step is queued, and sent as ONE message on vLLM's thread once the step is over (a step's
    tokens of every followed session)."""

    def __init__(self, pipe: Connection, runtime: Any) -> None:
        self.pipe, self.runtime = pipe, runtime
        self._items: list[tuple[str, int, Any]] = []
        self._lock = threading.Lock()

    def sink(self, follow_id: int) -> _PipeSink:
        return _PipeSink(follow_id, self)

    def add(self, kind: str, follow_id: int, payload: Any) -> None:
        with self._lock:
            self._items.append((kind, follow_id, payload))
            first = len(self._items) == 1
        if first:
            self.runtime.soon(self._send)

    def _send(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        with contextlib.suppress(OSError, EOFError):  # the verifier has gone: nobody reads the tokens
            self.pipe.send((items, (self.runtime.steps, self.runtime.step_seconds)))


class _PipeSink:
    """A followed session's sink in the child: its tokens and its end go to the outbox."""

    def __init__(self, follow_id: int, outbox: _Outbox) -> None:
        self.follow_id, self.outbox = follow_id, outbox

    def put(self, tokens: list[int], step_ms: float) -> None:
        self.outbox.add("put", self.follow_id, (tokens, step_ms))

    def fail(self, error: Exception) -> None:
        self.outbox.add("fail", self.follow_id, error)


class _Child:
    """The child's side: a VllmEngine and its sessions' KV by id."""

    def __init__(self, options: VllmOptions, tokens: Connection) -> None:
        from cloud.engine.vllm import VllmEngine
        from cloud.engine.vllm_runtime import VllmRuntime

        self.engine = VllmEngine(VllmRuntime(options))
        self.kvs: dict[int, Any] = {}
        self.outbox = _Outbox(tokens, self.engine.runtime)

    def facts(self) -> tuple[int, int, int, str, int, dict[str, str]]:
        """What the verifier reads of the engine once, in ProcessEngine's order."""
        engine, kv_tokens = self.engine, self.engine.runtime.kv_tokens()
        return engine.logits_width, engine.kv_bytes_per_token, engine.parameters, engine.dtype, kv_tokens, engine.describe()

    def kv(self, kv_id: int, scope: str = "") -> Any:
        kv = self.kvs.get(kv_id)
        if kv is None:
            kv = self.kvs[kv_id] = self.engine.new_kv(scope)
        return kv

    def handlers(self) -> dict[str, Callable[..., Any]]:
        engine = self.engine
        return {
            "plan_kv": engine.plan_kv,
            "kv_bytes_held": engine.kv_bytes_held,
            "free": self.free,
            "extend": self.extend,
            "check_session": engine.check_session,
            "start_session": lambda kv_id, config, vocab, scope: engine.start_session(self.kv(kv_id, scope), config, vocab),
            "follow": lambda kv_id, position, follow_id: engine.follow(self.kv(kv_id), position, self.outbox.sink(follow_id)),
            "unfollow": lambda kv_id: engine.unfollow(self.kv(kv_id)),
            "run_live": self.run_live,
        }

    def extend(self, kv_id: int, tokens: list[int]) -> int:
        kv = self.kv(kv_id)
        self.engine.extend(kv, tokens)
        return int(kv.get_seq_length())

    def crop(self, crops: dict[int, int]) -> None:
        for kv_id, length in crops.items():
            if kv_id in self.kvs:
                self.engine.crop(self.kvs[kv_id], length)

    def free(self, kv_id: int) -> None:
        kv = self.kvs.pop(kv_id, None)
        if kv is not None:
            self.engine.free(kv)

    def run_live(self, steps: list[LiveStep]) -> tuple[Any, list[tuple[int, int]]]:
        """The steps' yields, and each session's length and cached prompt tokens after them."""
        kvs = [self.kv(step.kv) for step in steps]  # type: ignore[arg-type]  # the ids the verifier sent
        results = self.engine.run_live([replace(step, kv=kv) for step, kv in zip(steps, kvs, strict=True)])
        return results, [(kv.get_seq_length(), self.engine.cached_tokens(kv)) for kv in kvs]


def serve(options: VllmOptions, calls: Connection, tokens: Connection) -> None:
    """The child's loop: start the engine, then answer calls until `close` or the verifier goes."""
    logging.basicConfig(level=logging.WARNING)
    try:
        child = _Child(options, tokens)
    except Exception as err:
        refusal = err if isinstance(err, ConfigError) else ConfigError(f"vLLM could not start: {str(err)[:300]}")
        calls.send((False, refusal, (0, 0.0)))
        return
    calls.send((True, child.facts(), (0, 0.0)))
    handlers = child.handlers()
    while True:
        try:
            method, args, crops = calls.recv()
        except (OSError, EOFError):
            break
        if method == "close":
            calls.send((True, None, child.engine.own_steps()))
            break
        try:
            child.crop(crops)
            answer = (True, handlers[method](*args))
        except Exception as err:  # the call's own failure, as the in-process engine raises it
            answer = (False, err)
        try:
            calls.send((*answer, child.engine.own_steps()))
        except Exception as err:  # an answer that does not pickle: the call fails, not the engine
            fault = VerifierFault(f"vLLM's engine process could not answer {method} ({type(err).__name__})")
            calls.send((False, fault, child.engine.own_steps()))
    child.engine.close()
