"""Accept/reject math: greedy banners, seeded repeatability, and convergence to the target
distribution (exact modes) or measurable deviation (approximate modes)."""

import math

import pytest
import torch
from scipy.stats import chisquare

from cloud.rejection_sampler import RoundDraft, RoundOutcome, accept_batch
from shared.protocol import AcceptMode

V = 6


def accept(
    mode: AcceptMode,
    draft_token_ids: torch.Tensor,
    target: torch.Tensor,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
    sparse_draft: torch.Tensor | None = None,
) -> RoundOutcome:
    """One round on its own (accept_batch with one round); a round that fails raises."""
    outcome = accept_batch([RoundDraft(mode, draft_token_ids, target, generator, draft_probs, sparse_draft)])[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def verify_greedy(drafts: torch.Tensor, logits: torch.Tensor):  # type: ignore[no-untyped-def]
    return accept(AcceptMode.GREEDY, drafts, logits, torch.Generator())


def _logits_with_argmax(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


# ---------------------------------------------------------------- greedy
def test_greedy_perfect_match_gives_bonus() -> None:
    out = verify_greedy(torch.tensor([1, 2, 3]), _logits_with_argmax([1, 2, 3, 4]))
    assert (out.accepted_len, out.next_token, out.bonus) == (3, 4, True)


def test_greedy_early_mismatch_gives_correction() -> None:
    out = verify_greedy(torch.tensor([1, 5, 3]), _logits_with_argmax([1, 2, 3, 4]))
    assert (out.accepted_len, out.next_token, out.bonus) == (1, 2, False)


def test_greedy_first_mismatch_rejects_all() -> None:
    out = verify_greedy(torch.tensor([0, 2]), _logits_with_argmax([1, 2, 3]))
    assert (out.accepted_len, out.next_token, out.bonus) == (0, 1, False)


def test_accept_greedy_reads_logits_and_top1_reads_probabilities() -> None:
    logits = _logits_with_argmax([1, 2, 3])
    gen = torch.Generator().manual_seed(0)
    out = accept(AcceptMode.GREEDY, torch.tensor([1, 5]), logits, gen)
    assert (out.accepted_len, out.next_token, out.bonus) == (1, 2, False)
    out = accept(AcceptMode.TOP1, torch.tensor([1, 2]), torch.softmax(logits * 10, dim=-1), gen)
    assert (out.accepted_len, out.next_token, out.bonus) == (2, 3, True)


def test_accept_refuses_a_mode_without_its_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    for mode in (AcceptMode.SPARSE, AcceptMode.SCALAR, AcceptMode.SHORTCUT):
        with pytest.raises(ValueError):
            accept(mode, torch.tensor([1]), TARGET, gen)


def test_greedy_empty_draft_returns_target_token() -> None:
    out = verify_greedy(torch.tensor([], dtype=torch.long), _logits_with_argmax([4]))
    assert (out.accepted_len, out.next_token, out.bonus) == (0, 4, True)


# ---------------------------------------------------------------- sampling
def _dist(seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5, dim=-1)


TARGET = torch.stack([_dist(1), _dist(2)])  # [2, V]: position 0 and the bonus position
DRAFT = _dist(3)  # the draft distribution q at position 0


def _first_tokens(mode: AcceptMode, trials: int, seed: int = 0) -> torch.Tensor:
    """Emitted token at position 0 over many one-token rounds (k = 1)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    for _ in range(trials):
        if mode is AcceptMode.POINT:
            token = int(DRAFT.argmax())  # a deterministic drafter
        else:
            token = int(torch.multinomial(DRAFT, 1, generator=gen))
        drafts = torch.tensor([token])
        out = accept(mode, drafts, TARGET, gen, draft_probs=DRAFT[token][None], sparse_draft=DRAFT[None])
        counts[token if out.accepted_len else out.next_token] += 1
    return counts


@pytest.mark.parametrize("mode", [AcceptMode.POINT, AcceptMode.SPARSE])
def test_exact_modes_match_target_distribution(mode: AcceptMode) -> None:
    trials = 6000
    counts = _first_tokens(mode, trials)
    assert chisquare(counts.numpy(), (TARGET[0] * trials).numpy()).pvalue > 1e-3
    tv = 0.5 * (counts / trials - TARGET[0]).abs().sum()
    assert tv < 0.03


@pytest.mark.parametrize("mode", [AcceptMode.SCALAR, AcceptMode.SHORTCUT])
def test_approximate_modes_deviate_measurably(mode: AcceptMode) -> None:
    trials = 6000
    counts = _first_tokens(mode, trials)
    assert chisquare(counts.numpy(), (TARGET[0] * trials).numpy()).pvalue < 1e-6
    assert not mode.exact


def test_exact_mode_is_far_from_a_wrong_reference() -> None:
    """The chi-square check above can fail: against q instead of p it does."""
    trials = 6000
    counts = _first_tokens(AcceptMode.SPARSE, trials)
    assert chisquare(counts.numpy(), (DRAFT * trials).numpy()).pvalue < 1e-6


def test_bonus_token_follows_last_position() -> None:
    trials = 4000
    gen = torch.Generator().manual_seed(5)
    target = torch.stack([torch.eye(V)[2], _dist(7)])  # draft token 2 is always accepted
    counts = torch.zeros(V)
    for _ in range(trials):
        out = accept(AcceptMode.SCALAR, torch.tensor([2]), target, gen, draft_probs=torch.tensor([1.0]))
        assert out.bonus and out.accepted_len == 1
        counts[out.next_token] += 1
    assert chisquare(counts.numpy(), (target[1] * trials).numpy()).pvalue > 1e-3


def test_seeded_generator_repeats_exactly() -> None:
    runs = [_first_tokens(AcceptMode.SPARSE, 300, seed=11) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], _first_tokens(AcceptMode.SPARSE, 300, seed=12))


def test_zero_draft_prob_does_not_divide_by_zero() -> None:
    out = accept(AcceptMode.SCALAR, torch.tensor([1]), TARGET, torch.Generator().manual_seed(0), draft_probs=torch.tensor([0.0]))
    assert len(out.accept_probs) == 1 and all(math.isfinite(p) for p in out.accept_probs)


# ---------------------------------------------------------------- batched
def _random_round(seed: int, width: int = V) -> RoundDraft:
    g = torch.Generator().manual_seed(seed)
    mode = list(AcceptMode)[seed % len(AcceptMode)]
    k = seed % 5
    drafts = torch.randint(0, width, (k,), generator=g)
    probs = torch.softmax(torch.randn(k + 1, width, generator=g) * 2, dim=-1)
    target = torch.randn(k + 1, width, generator=g) if mode is AcceptMode.GREEDY else probs
    sparse = torch.softmax(torch.randn(k, width, generator=g), dim=-1)
    q = sparse[torch.arange(k), drafts]
    return RoundDraft(mode, drafts, target, torch.Generator().manual_seed(100 + seed), q, sparse)


def test_a_batch_of_rounds_gives_each_round_its_outcome_alone() -> None:
    """Every mode, k from 0 to 4, two vocabulary widths, batched together: each round's outcome
    and its session's generator afterwards equal the same round accepted on its own."""
    for trial in range(20):
        seeds = [trial * 31 + i for i in range(12)]
        singles = [_random_round(s, V + s % 2) for s in seeds]
        alone = [accept_batch([r])[0] for r in singles]
        batch = [_random_round(s, V + s % 2) for s in seeds]
        together = accept_batch(batch)
        for one, many, single, batched in zip(alone, together, singles, batch, strict=True):
            assert not isinstance(one, Exception) and not isinstance(many, Exception)
            assert (one.accepted_len, one.next_token, one.bonus) == (many.accepted_len, many.next_token, many.bonus)
            assert one.accept_probs == many.accept_probs
            assert torch.equal(single.generator.get_state(), batched.generator.get_state())


def test_a_round_missing_its_inputs_fails_alone() -> None:
    good = _random_round(2)
    bad = RoundDraft(AcceptMode.SCALAR, torch.tensor([1]), TARGET, torch.Generator())  # no q(y)
    ok_alone = accept_batch([_random_round(2)])[0]
    out = accept_batch([bad, good])
    assert isinstance(out[0], ValueError)
    assert not isinstance(out[1], Exception) and not isinstance(ok_alone, Exception)
    assert (out[1].accepted_len, out[1].next_token) == (ok_alone.accepted_len, ok_alone.next_token)
