"""cloud-verifier with a timer at each stage a Verify round passes through in the verifier's
process, for a breakdown of where a served round's time goes (docs/vllm_overhead.md).

Runs `cloud-verifier FLAGS` in this process with the stages below wrapped; on SIGUSR1 (or at
exit) it writes OUT_JSON: the median time between consecutive stages over the rounds that passed
through all of them one after the other (run one session at a time, e.g.
`python -m bench.studies.served_rounds --sessions 1`, so that each round's stages are its own),
leaving out the first `SKIP`. Run with `--no-vllm-engine-process` to see the engine's stages
(with vLLM in a child process they happen there).

    python -m bench.studies.stage_timers OUT_JSON -- --engine vllm --model FOLDER [FLAGS...]

The stages, in order: the servicer's Verify is entered (after the interceptors) -> the batcher
takes the step -> the batch is handed to the model worker -> the worker runs the batch -> the
engine decides the batch on vLLM's thread -> vLLM's step starts -> it ends -> the engine has
decided -> the worker has the results -> the event loop has them -> the batcher's caller has its
result -> Verify returns (the reply's serialization and the interceptors follow).
"""

from __future__ import annotations

import functools
import json
import runpy
import signal
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = (
    "verify_entered",
    "batcher_took_it",
    "handed_to_worker",
    "worker_runs_batch",
    "engine_decides",
    "vllm_step_starts",
    "vllm_step_ends",
    "engine_decided",
    "worker_done",
    "loop_has_results",
    "caller_has_result",
    "verify_returns",
)
SKIP = 50  # rounds left out at the start (the first shapes of a batch)


class StageClock:
    """The last time each stage was reached, and each completed round's stage-to-stage times."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.gaps: dict[str, list[float]] = defaultdict(list)

    def mark(self, stage: str) -> None:
        self.last[stage] = time.perf_counter()
        if stage == STAGES[-1] and all(s in self.last for s in STAGES):
            times = [self.last[s] for s in STAGES]
            if all(b >= a for a, b in zip(times, times[1:], strict=False)):  # one round's stages, in order
                for i in range(len(STAGES) - 1):
                    self.gaps[f"{STAGES[i]} -> {STAGES[i + 1]}"].append((times[i + 1] - times[i]) * 1000.0)
                self.gaps["total"].append((times[-1] - times[0]) * 1000.0)

    def medians(self) -> dict[str, Any]:
        return {
            "rounds": len(self.gaps["total"]),
            "median_ms": {k: round(statistics.median(v[SKIP:]), 3) for k, v in self.gaps.items() if len(v) > SKIP},
        }


def _around(owner: Any, name: str, clock: StageClock, before: str, after: str) -> None:
    """owner.name marks `before` when called and `after` when it returns (coroutines too)."""
    inner: Callable[..., Any] = getattr(owner, name)
    if hasattr(inner, "__code__") and inner.__code__.co_flags & 0x80:  # a coroutine function

        @functools.wraps(inner)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            clock.mark(before)
            try:
                return await inner(*args, **kwargs)
            finally:
                clock.mark(after)

        setattr(owner, name, timed_async)
        return

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        clock.mark(before)
        try:
            return inner(*args, **kwargs)
        finally:
            clock.mark(after)

    setattr(owner, name, timed)


def install(clock: StageClock) -> None:
    from cloud.batcher import ForwardBatcher
    from cloud.engine.vllm import VllmEngine
    from cloud.engine.vllm_runtime import VllmRuntime
    from cloud.grpc_server import VerifierServicer
    from cloud.verifier import Verifier
    from cloud.worker import ModelWorker

    _around(VerifierServicer, "Verify", clock, "verify_entered", "verify_returns")
    _around(ForwardBatcher, "submit", clock, "batcher_took_it", "caller_has_result")
    _around(ModelWorker, "run", clock, "handed_to_worker", "loop_has_results")
    _around(Verifier, "run_batch", clock, "worker_runs_batch", "worker_done")
    _around(VllmEngine, "_decide", clock, "engine_decides", "engine_decided")
    _around(VllmRuntime, "step", clock, "vllm_step_starts", "vllm_step_ends")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[1] != "--":
        print(__doc__, file=sys.stderr)  # noqa: T201
        return 2
    out, flags = Path(args[0]), args[2:]
    clock = StageClock()
    install(clock)

    def write(*_: Any) -> None:
        out.write_text(json.dumps(clock.medians(), indent=2) + "\n")

    signal.signal(signal.SIGUSR1, write)
    sys.argv = ["cloud-verifier", *flags]
    try:
        runpy.run_module("cloud", run_name="__main__", alter_sys=True)
    finally:
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
