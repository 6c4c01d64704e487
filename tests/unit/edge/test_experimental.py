"""The experimental extras (edge/experimental/): MC-dropout signals, and the decisions of the
lossy commits. Their end-to-end behaviour (counted, sent later as catch-up) is checked in
tests/integration/test_resilience.py and test_backpressure.py."""

import torch

from edge.drafting.drafter import Draft, Drafter, DrafterConfig
from edge.drafting.gating import GatingThresholds
from edge.drafting.runtime_transformers import TransformersDraftLM
from edge.experimental.accept_unverified import AcceptUnverified
from edge.experimental.local_commit import LocalCommit
from edge.experimental.mc_dropout import mc_dropout_variance
from edge.round.generation import Gating, TimeoutPolicy
from shared.protocol import AcceptMode, SamplingParams
from tests.harness import random_prompt


def test_mc_dropout_variance_grows_with_dropout(draft_model) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(32, generator=gen)
    head = draft_model.get_output_embeddings()
    low = mc_dropout_variance(hidden, head, 3, 16, 0.01, gen)
    high = mc_dropout_variance(hidden, head, 3, 16, 0.5, gen)
    assert 0 <= low < high


def test_a_drafter_with_mc_passes_reports_variance_and_its_cost(draft_model) -> None:
    def drafter(mc_passes: int) -> Drafter:
        config = DrafterConfig(SamplingParams(), AcceptMode.GREEDY, 96, signals=True, mc_passes=mc_passes, mc_dropout_p=0.5)
        d = Drafter(TransformersDraftLM(draft_model, keep_hidden=True), config, seed=1)
        d.sync(random_prompt(4))
        return d

    with_mc, without = drafter(8).propose(4), drafter(0).propose(4)
    assert with_mc.token_ids == without.token_ids  # the passes never change what is drafted
    assert all(s.mc_var > 0 for s in with_mc.signals) and with_mc.mc_ms > 0
    assert all(s.mc_var == 0 for s in without.signals) and without.mc_ms == 0


def _block(n: int) -> Draft:
    return Draft(list(range(10, 10 + n)))


def test_local_commit_takes_only_an_easy_block_nothing_of_which_is_shown() -> None:
    thresholds = GatingThresholds(hard_ratio=0.3)
    assert LocalCommit.when_on(Gating(thresholds)) is None and LocalCommit.when_on(None) is None
    policy = LocalCommit.when_on(Gating(thresholds, local_commit=True))
    assert policy is not None
    assert policy.easy_block(_block(3), 0, 0.3, rule_hit=False) == [10, 11, 12]
    assert policy.easy_block(_block(3), 0, 0.34, rule_hit=False) == []  # too many hard tokens
    assert policy.easy_block(_block(3), 0, 0.0, rule_hit=True) == []  # a rule escalates it
    assert policy.easy_block(_block(3), 1, 0.0, rule_hit=False) == []  # partly on screen already
    assert policy.easy_block(_block(0), 0, 0.0, rule_hit=False) == []


def test_accept_unverified_gives_up_a_round_only_with_a_token_to_make_final() -> None:
    assert AcceptUnverified.when_on(TimeoutPolicy(mode="provisional")) is None
    assert AcceptUnverified.when_on(TimeoutPolicy(mode="strict")) is None
    policy = AcceptUnverified.when_on(TimeoutPolicy(mode="accept-unverified"))
    assert policy is not None
    assert policy.gives_up(_block(2)) and not policy.gives_up(_block(0))
    final, rest = policy.final_token(_block(3))
    assert final == [10] and rest.token_ids == [11, 12]
