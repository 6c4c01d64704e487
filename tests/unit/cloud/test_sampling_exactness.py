"""End to end with tiny real models: the tokens the verifier emits in the exact sampling modes
follow the target's next-token and two-token distributions; the scalar mode measurably does not.
"""

import pytest
import torch
from scipy.stats import chisquare

from bench.tiny_models import random_llama
from cloud.engine.transformers import TransformersEngine
from cloud.verifier import Verifier
from edge.drafting.drafter import Drafter, DrafterConfig
from edge.drafting.ngram import NGramDrafter, NGramStore
from edge.drafting.runtime_transformers import TransformersDraftLM
from shared import lm
from shared.protocol import AcceptMode, GenerateRequest, OpenSessionRequest, SamplingParams, SessionConfig, VerifyRequest
from shared.sampling.verifier_torch import penalized_logits, probs_from_logits
from tests.harness import gguf_lm, padded_steps, vllm_engine
from tests.tiny_models import save_model, tiny_draft, tiny_target

V = 8
PROMPT = [3]
PARAMS = SamplingParams(temperature=1.5)
TRIALS = 2000


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


def _sample_two_tokens(pair, mode: AcceptMode, k: int, drafter=None, engine=None, params=PARAMS) -> torch.Tensor:  # type: ignore[no-untyped-def]
    target, draft = pair
    verifier = Verifier(engine or TransformersEngine(target), "tiny")
    drafter_mode = AcceptMode.POINT if mode is AcceptMode.TOP1 else mode
    drafter = drafter or Drafter(TransformersDraftLM(draft), DrafterConfig(params, drafter_mode, V, draft_top_k=4), seed=123)
    counts = torch.zeros(V * V)
    for trial in range(TRIALS):
        opened = verifier.open_session(OpenSessionRequest(PROMPT, SessionConfig(params, trial, mode, V)))
        committed = list(PROMPT)
        while len(committed) < len(PROMPT) + 2:
            drafter.sync(committed)
            d = drafter.propose(k)
            reply = verifier.verify(VerifyRequest(opened.session_id, len(committed), d.token_ids, d.probs, sparse_draft=d.sparse))
            committed += d.token_ids[: reply.accepted_len] + [reply.next_token]
        verifier.close_session(opened.session_id)
        counts[committed[1] * V + committed[2]] += 1
    return counts


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square with cells of expected count < 5 pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        obs = torch.cat([obs, counts[small].sum()[None]])
        exp = torch.cat([exp, expected[small].sum()[None]])
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("runtime", ["transformers", "llama.cpp"])
@pytest.mark.parametrize(("mode", "k"), [(AcceptMode.SPARSE, 2), (AcceptMode.POINT, 3)])
def test_exact_modes_follow_target(pair, mode: AcceptMode, k: int, runtime: str, tmp_path) -> None:
    joint = _two_token_reference(pair[0])
    draft_lm = gguf_lm(pair[1], tmp_path) if runtime == "llama.cpp" else TransformersDraftLM(pair[1])
    drafter = Drafter(draft_lm, DrafterConfig(PARAMS, mode, V, draft_top_k=4), seed=123)
    counts = _sample_two_tokens(pair, mode, k, drafter)
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
    return target, tiny_draft(target, noise=1.5, seed=9), save_model(target, tmp_path_factory.mktemp("vllm") / "target")


@pytest.mark.vllm
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("mode", "k"), [(AcceptMode.SPARSE, 2), (AcceptMode.POINT, 3)])
def test_exact_modes_follow_target_on_vllm(vllm_pair, mode: AcceptMode, k: int, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    """The same on the vLLM engine, whose sampling rounds read full rows of raw logits (sparse)
    or run vLLM's rejection sampler on a live request (point), stepping synchronously (a CPU's
    way) or asynchronously (a GPU's)."""
    target, draft, folder = vllm_pair
    joint = _two_token_reference(target)
    assert joint.max() < 0.5  # a distribution with room to be wrong in
    counts = _sample_two_tokens((target, draft), mode, k, engine=vllm_engine(folder, async_scheduling))
    first, first_ref = counts.view(V, V).sum(dim=1), joint.view(V, V).sum(dim=1)
    assert _pvalue(counts, joint) > 1e-3 and _pvalue(first, first_ref) > 1e-3
    assert 0.5 * (first / TRIALS - first_ref).abs().sum() < 0.05
    assert 0.5 * (counts / TRIALS - joint).abs().sum() < 0.1


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
    for trial in range(TRIALS):
        chunks = verifier.generate(GenerateRequest(PROMPT, SessionConfig(PARAMS, trial, vocab_size=V), 2))
        first, second = [t for chunk in chunks for t in chunk.tokens]
        counts[first * V + second] += 1
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
