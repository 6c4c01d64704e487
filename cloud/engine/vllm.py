"""The vLLM engine: the target in vLLM (`--engine vllm`), which owns the KV as paged,
prefix-cached blocks and batches every request of a pass itself.

A session here is its token list and a cache salt of its own (sessions never share blocks).
Feeding a block is one vLLM request for the session's tokens so far plus the block: the
prefix cache serves the whole blocks it already holds, so only the tail (the session's last
partial block and the new tokens) is computed. Crop shortens the list; free forgets it, and
its blocks age out of vLLM's cache.

Rows come back in one of two ways:
- argmax rows (a step that reads only each row's argmax over a vocabulary: greedy without a
  penalty): ONE request with prompt log-probabilities, whose rows hold the TOP_ROWS largest
  raw logits (the rest -inf). The argmax inside the vocabulary is among them whenever one of
  them lies inside it; a step with a row whose largest logits all lie past it (padded
  embedding rows) runs again for full rows. vLLM leaves the rows of positions its cache
  served unset, so a request whose cache hit reaches a kept row runs again without reading
  the cache.
- full rows (every other step: sampling, penalties): one request per kept row, ending at
  that row, asking for the raw logits of every token of its sampled row. They are the
  model's own logits, so every accept mode reads exact distributions, at the price of one
  request (a full sort of the vocabulary and its transfer) per row.

A Generate stream (cloud_only) is vLLM's own decoding: one request of its max_new_tokens,
decoded and sampled by vLLM with continuous batching beside the rounds; each pass over the
stream reads the next token it decoded (OwnDecoding in cloud/engine/__init__.py).

vLLM's engine core runs in processes of its own (on a CPU: one for the scheduler, one for
the model), started by VllmRuntime and stopped with it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from cloud.engine import EngineName, KVPlan, KVRequest, SessionKV
from shared import lm
from shared.errors import ConfigError, VerifierFault
from shared.protocol import GenerateRequest

log = logging.getLogger("cloud-verifier")
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


class VllmRuntime:
    """One vLLM engine (its engine-core processes) and the requests of one pass at a time.
    A verifier calls it from its model worker alone; engines sharing it (tests) may call from
    several threads, so calls that reach vLLM's client (whose ZeroMQ sockets abort the process
    when two threads use them at once) take turns."""

    def __init__(self, options: VllmOptions) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        cpu = not torch.cuda.is_available()
        if not cpu:  # vLLM forks its engine core unless told not to, and the verifier may have touched CUDA
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # The context, and the one token a request samples; at most the model's positions.
        self.max_context_tokens = min(options.max_context_tokens, _positions(options.model) - 1)
        args = EngineArgs(
            model=options.model,
            dtype=options.dtype,
            seed=options.seed,
            max_model_len=self.max_context_tokens + 1,
            max_num_seqs=min(max(options.max_sessions, 1) * 2, 1024),  # a round's requests, one a row at most
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
        )
        try:
            self.llm: Any = LLMEngine.from_engine_args(args)
        except Exception as err:  # vLLM's own config errors name the setting that failed
            raise ConfigError(f"vLLM could not start on {options.model}: {str(err)[:300]}") from err
        self.options = options
        self.device = "cpu" if cpu else "cuda"
        self._ids = itertools.count()
        self._pending: set[str] = set()  # requests of the pass in flight
        self._done: dict[str, Any] = {}  # their outputs, until the pass takes them
        self._streams: dict[str, Stream] = {}  # requests vLLM decodes on its own (Generate)
        self._turn = threading.RLock()  # one caller of vLLM's client at a time
        self._closer = weakref.finalize(self, _shutdown, self.llm)

    def run(self, requests: Sequence[tuple[list[int], str, Any]], streams: Sequence[tuple[Stream, int]] = ()) -> list[Any]:
        """Each (prompt tokens, cache salt, SamplingParams) as one request, all in flight
        together, until each has finished and each (stream, n) has decoded n tokens (or
        ended); the requests' outputs in order. On failure none of them is left running."""
        with self._turn:
            return self._run(requests, streams)

    def _run(self, requests: Sequence[tuple[list[int], str, Any]], streams: Sequence[tuple[Stream, int]]) -> list[Any]:
        from vllm import TokensPrompt

        ids = [f"r{next(self._ids)}" for _ in requests]
        try:
            for request_id, (prompt, salt, params) in zip(ids, requests, strict=True):
                self._pending.add(request_id)
                self.llm.add_request(request_id, TokensPrompt(prompt_token_ids=prompt, cache_salt=salt), params)
            while any(i in self._pending for i in ids) or any(len(s.tokens) < n and not s.ended for s, n in streams):
                self._step()
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

    def start_stream(self, prompt: list[int], salt: str, params: Any) -> Stream:
        """A request vLLM decodes on its own, its tokens collected as the passes step vLLM."""
        from vllm import TokensPrompt

        stream = Stream(f"s{next(self._ids)}")
        try:
            with self._turn:
                self.llm.add_request(stream.request_id, TokensPrompt(prompt_token_ids=prompt, cache_salt=salt), params)
        except Exception as err:
            raise VerifierFault(f"vLLM could not start the stream ({type(err).__name__})") from err
        self._streams[stream.request_id] = stream
        return stream

    def end_stream(self, stream: Stream) -> None:
        with self._turn:
            if self._streams.pop(stream.request_id, None) is not None and not stream.ended:
                self._abort([stream.request_id])

    def _step(self) -> None:
        for output in self.llm.step():
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.tokens = list(output.outputs[0].token_ids)  # cumulative
                stream.ended = output.finished
            elif output.finished and output.request_id in self._pending:
                self._pending.discard(output.request_id)
                self._done[output.request_id] = output

    def _abort(self, ids: list[str]) -> None:
        self._pending.difference_update(ids)
        try:
            self.llm.abort_request(ids)
        except Exception:
            log.exception("vLLM could not abort the requests of a failed pass")

    def kv_tokens(self) -> int:
        """The tokens of KV vLLM allocated (its engine core reports the blocks once it started)."""
        cache = self.llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size)

    def failure(self) -> str | None:
        """vLLM's client notices its engine-core process dying and then fails every call."""
        dead = getattr(getattr(self.llm.engine_core, "resources", None), "engine_dead", False)
        return "vLLM's engine core died" if dead else None

    def close(self) -> None:
        self._closer()


VLLM_MAX_TOKEN_LIST = 1024  # vLLM's engine core refuses (and dies of) a longer logit_bias or allowed_token_ids
VOCAB_MASK_BIAS = -100.0  # the lowest logit bias vLLM takes: exp(-100) of a row is 0 in float32 sampling


def vocab_limit(vocab: int, width: int) -> dict[str, Any]:
    """SamplingParams that keep vLLM's own decoding inside a session's vocabulary (a draft's
    151,936 tokens on a target whose rows are padded to 152,064, say): the padding rows pushed
    down by a bias when they are few, else the vocabulary listed when it is short. A session
    that fits neither raises ValueError and decodes one pass per token (sampled here), as vLLM
    checks the lists only inside its engine core, where a failure ends every request."""
    if vocab >= width:
        return {}
    if width - vocab <= VLLM_MAX_TOKEN_LIST:
        return {"logit_bias": dict.fromkeys(range(vocab, width), VOCAB_MASK_BIAS)}
    if vocab <= VLLM_MAX_TOKEN_LIST:
        return {"allowed_token_ids": list(range(vocab))}
    raise ValueError(f"a vocabulary of {vocab} in {width} rows cannot be given to vLLM's sampler")


def _positions(folder: str) -> int:
    """The positions the model was made for (config.json), or no limit when it does not say."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return int(config.get("max_position_embeddings") or sys.maxsize)


def _shutdown(llm: Any) -> None:
    """Stop vLLM's engine-core processes (at exit too: a process that leaves them aborts)."""
    try:
        llm.engine_core.shutdown()
    except Exception:
        log.exception("vLLM did not shut down cleanly")


@dataclass
class Stream:
    """A Generate stream vLLM decodes on its own: the tokens it decoded so far."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    ended: bool = False


@dataclass
class OwnDecoding:
    """A session whose passes read vLLM's own decoding: its prompt and sampling."""

    prompt_length: int
    params: Any  # vllm.SamplingParams
    stream: Stream | None = None  # started by the pass that completes the prompt


@dataclass
class VllmKV:
    """One session as vLLM serves it: its tokens, and the salt that keeps its cached blocks
    its own."""

    salt: str = field(default_factory=lambda: uuid.uuid4().hex)
    tokens: list[int] = field(default_factory=list)
    released: bool = False
    own: OwnDecoding | None = None  # a Generate stream vLLM decodes

    def get_seq_length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class _Decoded:
    """A step's token in a stream vLLM decodes: the stream, and the token's index in it."""

    stream: Stream
    index: int


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
        return KVPlan(context, min(request.max_kv_bytes, held) if self.runtime.options.max_kv_bytes else held)

    def kv_bytes_held(self) -> int:
        return self.runtime.kv_tokens() * self.kv_bytes_per_token

    def failure(self) -> str | None:
        return self.runtime.failure()

    def describe(self) -> dict[str, str]:
        import vllm

        return {"engine": self.name, "dtype": self.dtype, "device": self.runtime.device, "vllm": vllm.__version__}

    def close(self) -> None:
        if self.owns_runtime:
            self.runtime.close()

    # ---- a session's KV -----------------------------------------------------------------

    def new_kv(self) -> VllmKV:
        return VllmKV()

    def free(self, kv: SessionKV) -> None:
        kv = _own(kv)
        kv.released = True
        kv.tokens = []
        if kv.own is not None and kv.own.stream is not None:
            self.runtime.end_stream(kv.own.stream)

    def decode_on_its_own(self, kv: SessionKV, req: GenerateRequest, vocab: int) -> None:
        """A Generate stream becomes one vLLM request of req.max_new_tokens, decoded and sampled
        by vLLM (seeded by the session's seed), started by the pass that completes its prompt.
        Settings vLLM does not sample with (a temperature over 2) keep the stream on one pass
        per token, sampled here."""
        from vllm.exceptions import VLLMValidationError

        try:
            params = self._sampling(req, vocab)
        except (VLLMValidationError, ValueError):
            log.debug("vLLM does not sample with %s: one pass per token", req.config.sampling)
            return
        _own(kv).own = OwnDecoding(len(req.prompt_tokens), params)

    def decoding_on_its_own(self, kv: SessionKV) -> bool:
        return _own(kv).own is not None

    def stop_own_decoding(self, kv: SessionKV) -> None:
        kv = _own(kv)
        if kv.own is not None and kv.own.stream is not None:
            self.runtime.end_stream(kv.own.stream)
        kv.own = None

    def _sampling(self, req: GenerateRequest, vocab: int) -> Any:
        from vllm import SamplingParams

        sampling = req.config.sampling
        return SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            repetition_penalty=sampling.repetition_penalty,
            seed=None if sampling.greedy else req.config.seed,
            max_tokens=req.max_new_tokens,
            ignore_eos=True,  # the stream ends at its own stop tokens (closing it ends the request)
            detokenize=False,
            **vocab_limit(vocab, self.logits_width),
        )

    def freed(self, kv: SessionKV) -> bool:
        return _own(kv).released

    def crop(self, kv: SessionKV, length: int) -> None:
        del _own(kv).tokens[length:]

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
        decoded = [self._decoded(kv, step) for kv, step in zip(caches, steps, strict=True)]
        asked = [(kv, step) for kv, step, by_vllm in zip(caches, steps, decoded, strict=True) if by_vllm is None]
        requests = [(p, kv.salt, params) for kv, step in asked for p, params in _requests(step)]
        waits = [(by_vllm.stream, by_vllm.index + 1) for by_vllm in decoded if by_vllm is not None]
        outputs = iter(self._rerun_unset_rows(asked, requests, self.runtime.run(requests, waits)))
        got = [self._rows(step, [next(outputs) for _ in range(step.requests)]) for _, step in asked]
        asked_rows = iter(self._argmax_checked(asked, got))
        rows = [
            self._decoded_row(step, by_vllm) if by_vllm is not None else next(asked_rows)
            for step, by_vllm in zip(steps, decoded, strict=True)
        ]
        for kv, step in zip(caches, steps, strict=True):
            kv.tokens = step.tokens
        return rows

    def _decoded(self, kv: VllmKV, step: _Rows) -> _Decoded | None:
        """Where a step of a stream vLLM decodes finds its token (None: the step is a request
        of its own: not such a stream, or a chunk of its prompt)."""
        own = kv.own
        if own is None or len(step.tokens) < own.prompt_length:
            return None
        if step.keep != 1:
            raise VerifierFault("a stream vLLM decodes reads one row a pass")
        if own.stream is None:
            own.stream = self.runtime.start_stream(step.tokens, kv.salt, own.params)
        return _Decoded(own.stream, len(step.tokens) - own.prompt_length)

    def _decoded_row(self, step: _Rows, decoded: _Decoded) -> torch.Tensor:
        """The row of the token vLLM decoded after the step's tokens: 0 there, -inf elsewhere."""
        stream, index = decoded.stream, decoded.index
        if len(stream.tokens) <= index:
            raise VerifierFault("vLLM ended the stream before its last token")
        if index > 0 and stream.tokens[index - 1] != step.tokens[-1]:
            raise VerifierFault("the stream fed a token vLLM did not decode")
        row = torch.full((1, self.logits_width), float("-inf"), dtype=torch.float32)
        row[0, stream.tokens[index]] = 0.0
        return row

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
