"""End to end with tiny real models: the tokens the verifier emits in the exact sampling modes
follow the target's next-token and two-token distributions; the scalar mode measurably does not.
"""

from collections.abc import Iterator
from dataclasses import replace
from typing import TypeVar

import pytest
import torch
from scipy.stats import chisquare

from bench.tiny_models import random_llama
from cloud.batch_step import ForwardStep
from cloud.engine.llamacpp import LlamaCppEngine
from cloud.engine.transformers import TransformersEngine
from cloud.verifier import DecodeStretchStep, Verifier
from edge.drafting.drafter import Draft, Drafter, DrafterConfig
from edge.drafting.ngram import NGramDrafter, NGramStore
from edge.drafting.runtime_transformers import TransformersDraftLM
from shared import lm
from shared.protocol import (
    AcceptMode,
    GenerateRequest,
    OpenSessionRequest,
    SamplingParams,
    SessionConfig,
    VerifyRequest,
    VerifyResult,
)
from shared.sampling.verifier_torch import penalized_logits, probs_from_logits
from tests.harness import gguf_lm, padded_steps, vllm_engine
from tests.tiny_models import save_gguf, save_model, tiny_draft, tiny_target

V = 8
PROMPT = [3]
PARAMS = SamplingParams(temperature=1.5)
CHAT = SamplingParams(temperature=0.7, top_p=0.95)  # what most chat traffic samples with
TRIALS = 2000
VLLM_TRIALS = 4000
GROUP = 32  # sessions whose rounds share one batch
R = TypeVar("R")


@pytest.fixture(scope="module")
def pair():  # type: ignore[no-untyped-def]
    target = tiny_target(seed=4, vocab=V)
    return target, tiny_draft(target, noise=1.5, seed=9)


def _target_probs(model, context: list[int], params: SamplingParams = PARAMS) -> torch.Tensor:  # type: ignore[no-untyped-def]
    logits = lm.forward(model, lm.new_cache(model), context)[-1:]
    return probs_from_logits(penalized_logits(logits, context, [], params, V), params)[0]


def _two_token_reference(target, params: SamplingParams = PARAMS) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """p(t1, t2) = p(t1) p(t2 | t1), flattened to [V * V]."""
    first = _target_probs(target, PROMPT, params)
    rows = [first[t] * _target_probs(target, PROMPT + [t], params) for t in range(V)]
    return torch.stack(rows).flatten()


def _sample_two_tokens(  # type: ignore[no-untyped-def]
    pair, mode: AcceptMode, k: int, drafter=None, engine=None, params=PARAMS, trials=TRIALS, switching=False
) -> torch.Tensor:
    """Per trial a session's first two tokens, from rounds of k drafts; `switching`: a third of
    the sessions switch from a round of drafts to a draft-less round (the target's own token,
    as auto mode's Decode), a third the other way, a third keep to rounds of drafts."""
    target, draft = pair
    verifier = Verifier(engine or TransformersEngine(target), "tiny")
    drafter_mode = AcceptMode.POINT if mode is AcceptMode.TOP1 else mode
    drafter = drafter or Drafter(TransformersDraftLM(draft), DrafterConfig(params, drafter_mode, V, draft_top_k=4), seed=123)

    def plan(trial: int, committed: list[int], replies: list[VerifyResult]) -> int | None:
        made = len(committed) - len(PROMPT)
        if made >= 2:
            return None
        return 0 if switching and (trial % 3, made) in ((1, 1), (2, 0)) else k

    counts = torch.zeros(V * V)
    for committed, _ in _sessions(verifier, drafter, SessionConfig(params, 0, mode, V), trials, plan):
        counts[committed[1] * V + committed[2]] += 1
    return counts


def _later_round_acceptance(  # type: ignore[no-untyped-def]
    pair, engine, params: SamplingParams, trials: int, mode: AcceptMode = AcceptMode.SPARSE, k: int = 3
) -> torch.Tensor:
    """Per trial the drafts a session's second round accepted (its first round, of one draft,
    leaves the session past any token the engine sampled at its prefill)."""
    target, draft = pair
    verifier = Verifier(engine, "tiny")
    drafter = Drafter(TransformersDraftLM(draft), DrafterConfig(params, mode, V, draft_top_k=4), seed=123)

    def plan(trial: int, committed: list[int], replies: list[VerifyResult]) -> int | None:
        return None if len(replies) == 2 else 1 if not replies else k

    accepted = [
        replies[-1].accepted_len for _, replies in _sessions(verifier, drafter, SessionConfig(params, 0, mode, V), trials, plan)
    ]
    return torch.tensor(accepted, dtype=torch.float64)


def _sessions(  # type: ignore[no-untyped-def]
    verifier: Verifier, drafter, config: SessionConfig, trials: int, plan
) -> Iterator[tuple[list[int], list[VerifyResult]]]:
    """One session per trial (seeded by the trial), each session's rounds drafted as `plan(trial,
    committed, replies)` says (its next round's drafts, None: done); the sessions go in groups
    of GROUP whose opens and rounds share batches, as a served verifier's do. Per session its
    tokens and its rounds' replies."""
    for start in range(0, trials, GROUP):
        group = list(range(start, min(start + GROUP, trials)))
        opens = [verifier.begin_open(OpenSessionRequest(PROMPT, replace(config, seed=trial))) for trial in group]
        ids = {trial: opened.session_id for trial, opened in zip(group, _batch(verifier, opens), strict=True)}
        committed = {trial: list(PROMPT) for trial in group}
        replies: dict[int, list[VerifyResult]] = {trial: [] for trial in group}
        while True:
            steps, drafted = [], []
            for trial in group:
                n = plan(trial, committed[trial], replies[trial])
                if n is None:
                    continue
                drafter.sync(committed[trial])
                d = drafter.propose(n) if n else Draft()
                req = VerifyRequest(ids[trial], len(committed[trial]), d.token_ids, d.probs, sparse_draft=d.sparse)
                steps.append(verifier.begin_verify(req))
                drafted.append((trial, d))
            if not steps:
                break
            for (trial, d), reply in zip(drafted, _batch(verifier, steps), strict=True):
                committed[trial] += d.token_ids[: reply.accepted_len] + [reply.next_token]
                replies[trial].append(reply)
        for trial in group:
            verifier.close_session(ids[trial])
            yield committed[trial], replies[trial]


def _batch(verifier: Verifier, steps: list[ForwardStep[R]]) -> list[R]:
    """The steps as one batch of the verifier's (none fails here)."""
    results = verifier.run_batch([(step, 0.0) for step in steps])
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square with cells of expected count < 5 pooled into one; impossible cells (the
    callers check that none was drawn) left out."""
    possible = probs > 0
    counts, probs = counts[possible], probs[possible]
    expected = probs * counts.sum()
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        obs = torch.cat([obs, counts[small].sum()[None]])
        exp = torch.cat([exp, expected[small].sum()[None]])
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize(
    ("runtime", "params"),
    [("transformers", PARAMS), ("transformers", CHAT), ("llama.cpp", CHAT)],
    ids=["transformers-T1.5", "transformers-T0.7-top-p0.95", "llama.cpp-T0.7-top-p0.95"],
)
@pytest.mark.parametrize(("mode", "k"), [(AcceptMode.SPARSE, 2), (AcceptMode.POINT, 3)])
def test_exact_modes_follow_target(pair, mode: AcceptMode, k: int, runtime: str, params: SamplingParams, tmp_path) -> None:
    """On the transformers engine, and on llama.cpp (the draft and the target each in llama.cpp,
    from f32 GGUFs) at a chat's settings."""
    joint = _two_token_reference(pair[0], params)
    if params.top_p < 1.0:
        assert (joint == 0).sum() > 0  # top-p leaves some pairs impossible: a wrong cut shows
    on_llamacpp = runtime == "llama.cpp"
    draft_lm = gguf_lm(pair[1], tmp_path) if on_llamacpp else TransformersDraftLM(pair[1])
    drafter = Drafter(draft_lm, DrafterConfig(params, mode, V, draft_top_k=4), seed=123)
    engine = LlamaCppEngine(save_gguf(pair[0], tmp_path / "target.gguf"), threads=1, batch_tokens=512) if on_llamacpp else None
    counts = _sample_two_tokens(pair, mode, k, drafter, engine=engine, params=params)
    assert counts[joint == 0].sum() == 0
    assert _pvalue(counts, joint) > 1e-3
    first, first_ref = counts.view(V, V).sum(dim=1), joint.view(V, V).sum(dim=1)
    assert _pvalue(first, first_ref) > 1e-3
    # Sampling noise alone gives a TV near 0.02 on 8 cells and 0.05 on 64 at this many trials.
    assert 0.5 * (first / TRIALS - first_ref).abs().sum() < 0.05
    assert 0.5 * (counts / TRIALS - joint).abs().sum() < 0.1


@pytest.mark.parametrize("mode", [AcceptMode.SCALAR, AcceptMode.TOP1])
def test_approximate_modes_are_measurably_off(pair, mode: AcceptMode) -> None:
    joint = _two_token_reference(pair[0])
    counts = _sample_two_tokens(pair, mode, 2)
    assert _pvalue(counts, joint) < 1e-4


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A target of the shape vLLM's CPU attention runs, in one folder (one vLLM for the module),
    and its draft."""
    target = random_llama(4, vocab=V, hidden=128, mlp=256, layers=2, heads=2, kv_heads=1)
    with torch.no_grad():  # logits with some spread: top-p 0.95 at T = 0.7 cuts a fifth of the pairs
        target.lm_head.weight.mul_(2.0)
    return target, tiny_draft(target, noise=1.5, seed=9), save_model(target, tmp_path_factory.mktemp("vllm") / "target")


@pytest.mark.vllm
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("mode", "k"), [(AcceptMode.SPARSE, 2), (AcceptMode.POINT, 3)])
def test_exact_modes_follow_target_on_vllm(vllm_pair, mode: AcceptMode, k: int, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    """The same on the vLLM engine at a chat's settings, every round verified by vLLM's
    rejection sampler on the session's live request (sparse drafts with the edge's q as its
    draft probabilities, point drafts as q = 1), stepping synchronously (a CPU's way: 4,000
    sessions) or asynchronously (a GPU's: 2,000); two thirds of the sessions switch between a
    round of drafts and the target's own token."""
    target, draft, folder = vllm_pair
    joint = _two_token_reference(target, CHAT)
    assert joint.max() < 0.5 and (joint == 0).sum() > 0  # room to be wrong in, and pairs top-p cuts
    engine, trials = vllm_engine(folder, async_scheduling), TRIALS if async_scheduling else VLLM_TRIALS
    counts = _sample_two_tokens((target, draft), mode, k, engine=engine, params=CHAT, trials=trials, switching=True)
    first, first_ref = counts.view(V, V).sum(dim=1), joint.view(V, V).sum(dim=1)
    assert counts[joint == 0].sum() == 0
    assert _pvalue(counts, joint) > 1e-3 and _pvalue(first, first_ref) > 1e-3
    assert 0.5 * (first / trials - first_ref).abs().sum() < 0.05
    assert 0.5 * (counts / trials - joint).abs().sum() < 0.1


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("params", "async_scheduling"), [(PARAMS, False), (CHAT, False), (CHAT, True)], ids=["T1.5", "T0.7-top-p0.95", "async"]
)
def test_sparse_rounds_on_vllm_accept_as_often_as_the_reference(
    vllm_pair, params: SamplingParams, async_scheduling: bool
) -> None:  # type: ignore[no-untyped-def]
    """vLLM's rejection sampler reads the edge's q, stepping synchronously or asynchronously:
    its sparse rounds accept min(1, p/q) of each draft, as the reference engine's do. Without q
    each draft is a point and passes with p(y) alone (the point mode's rule), which on this flat
    target accepts far less."""
    target, draft, folder = vllm_pair
    trials = 500
    reference = _later_round_acceptance((target, draft), TransformersEngine(target), params, trials)
    on_vllm = _later_round_acceptance((target, draft), vllm_engine(folder, async_scheduling), params, trials)
    as_points = _later_round_acceptance((target, draft), TransformersEngine(target), params, trials, AcceptMode.POINT)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.var() / trials + b.var() / trials).sqrt())

    assert abs(float(on_vllm.mean() - reference.mean())) < 4 * error(on_vllm, reference)
    assert float(on_vllm.mean() - as_points.mean()) > 8 * error(on_vllm, as_points)  # the test tells the rules apart


@pytest.mark.vllm
def test_top_k_rounds_on_vllm_follow_target(vllm_pair) -> None:  # type: ignore[no-untyped-def]
    """Point-mode rounds with top-k on the vLLM engine: vLLM's rejection sampler runs in every
    step, one without drafts too, and its top-k must leave such a step alone (on a CPU it
    failed the engine) and constrain the rounds' rows to the target's top-k distribution."""
    target, draft, folder = vllm_pair
    params = SamplingParams(temperature=1.5, top_k=3)
    joint = _two_token_reference(target, params)
    assert (joint == 0).sum() >= V * V // 2  # top-k leaves most pairs impossible
    counts = _sample_two_tokens((target, draft), AcceptMode.POINT, 2, engine=vllm_engine(folder), params=params)
    assert counts[joint == 0].sum() == 0
    assert _pvalue(counts[joint > 0], joint[joint > 0]) > 1e-3
    assert 0.5 * (counts / TRIALS - joint).abs().sum() < 0.1


@pytest.mark.vllm
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_generate_on_vllm_follows_target(vllm_pair, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    """cloud_only on the vLLM engine is vLLM's own sampling, seeded per session."""
    target, _, folder = vllm_pair
    joint = _two_token_reference(target)
    verifier = Verifier(vllm_engine(folder, async_scheduling), "tiny")
    counts = torch.zeros(V * V)
    for start in range(0, TRIALS, GROUP):  # streams whose steps share batches, as Generate calls run them
        requests = [GenerateRequest(PROMPT, SessionConfig(PARAMS, t, vocab_size=V), 2) for t in range(start, start + GROUP)]
        openings = [verifier.as_decode(request).open for request in requests]
        ids = [verifier.sessions.new_id() for _ in openings]
        stretch = DecodeStretchStep(2, reserved=True)
        opens = [verifier.begin_open_decode(o, i, stretch=stretch) for o, i in zip(openings, ids, strict=True)]
        firsts = [first for _, first in _batch(verifier, opens)]
        rounds = [VerifyRequest(i, first.new_base_position, []) for i, first in zip(ids, firsts, strict=True)]
        seconds = _batch(verifier, [verifier.begin_verify(r, "", DecodeStretchStep(1)) for r in rounds])
        for session_id, first, second in zip(ids, firsts, seconds, strict=True):
            verifier.close_session(session_id)
            counts[first.next_token * V + second.next_token] += 1
    assert _pvalue(counts, joint) > 1e-3
    assert 0.5 * (counts / TRIALS - joint).abs().sum() < 0.1


def test_point_mode_with_ngram_drafts_follows_target(pair) -> None:
    """n-gram drafts are deterministic: point mode verifies them exactly."""
    joint = _two_token_reference(pair[0])
    store = NGramStore(order=2)
    store.add_sequence([3, 5, 2, 3, 5, 7, 5, 2])  # the store drafts 5 then 2 after the prompt [3]
    counts = _sample_two_tokens(pair, AcceptMode.POINT, 3, drafter=NGramDrafter(store))
    assert counts.view(V, V).sum(dim=1)[5] > 0
    assert _pvalue(counts, joint) > 1e-3


@pytest.mark.vllm
def test_generate_on_vllm_with_pad_drafts_follows_target(vllm_pair) -> None:  # type: ignore[no-untyped-def]
    """With steps padded to K drafts of the last token (--pad-decode-steps), a stream's second
    token is an accepted pad or the rejection sampler's correction: still the target's."""
    target, _, folder = vllm_pair
    joint = _two_token_reference(target)
    engine = vllm_engine(folder)
    verifier = Verifier(engine, "tiny")
    counts = torch.zeros(V * V)
    with padded_steps(engine) as padded:
        for trial in range(TRIALS):
            chunks = verifier.generate(GenerateRequest(PROMPT, SessionConfig(PARAMS, trial, vocab_size=V), 2))
            first, second = [t for chunk in chunks for t in chunk.tokens][:2]
            counts[first * V + second] += 1
    assert sum(padded) >= TRIALS  # every stream's second step ran with pads
    assert _pvalue(counts, joint) > 1e-3
    assert 0.5 * (counts / TRIALS - joint).abs().sum() < 0.1
