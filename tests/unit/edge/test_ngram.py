"""The n-gram store against a brute-force reference, its backoff and its memory cap."""

import random

import pytest

from edge.drafting.ngram import NGramDrafter, NGramStore
from shared.protocol import SparseDistribution


def _brute_force(tokens: list[int], order: int, context: list[int]) -> tuple[int, int, int] | None:
    """Scan the whole sequence: longest suffix of context seen, its most frequent (latest on
    ties) continuation, and that continuation's count."""
    for n in range(min(order, len(context)), 0, -1):
        suffix = context[len(context) - n :]
        counts: dict[int, int] = {}
        best, best_count = -1, 0
        for i in range(n, len(tokens)):
            if tokens[i - n : i] == suffix:
                counts[tokens[i]] = counts.get(tokens[i], 0) + 1
                if counts[tokens[i]] >= best_count:
                    best, best_count = tokens[i], counts[tokens[i]]
        if counts:
            return best, n, best_count
    return None


@pytest.mark.parametrize("seed", range(5))
def test_predictions_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(300)]
    store = NGramStore(order=4)
    store.add_sequence(tokens)
    for _ in range(50):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 7))]
        got = store.predict(context)
        want = _brute_force(tokens, 4, context)
        assert (None if got is None else (got.token, got.order, int(got.count))) == want


def test_backoff_prefers_the_longest_context() -> None:
    store = NGramStore(order=3)
    store.add_sequence([1, 2, 3, 9] + [7, 3, 5] * 3)  # after "3": mostly 5; after "1 2 3": 9
    assert store.predict([1, 2, 3]).token == 9
    assert store.predict([1, 2, 3]).order == 3
    assert store.predict([8, 8, 3]).token == 5  # unseen longer context: back off to "3"
    assert store.predict([42]) is None


def test_memory_cap_holds_and_evicts_least_recently_updated() -> None:
    store = NGramStore(order=2, max_contexts=10)
    store.add_sequence(list(range(100)))
    assert len(store) == 10
    assert store.predict([98]).token == 99  # recent contexts survive
    assert store.predict([5]) is None  # old ones were evicted


def test_drafter_stops_at_an_unknown_context_and_learns_committed_text() -> None:
    drafter = NGramDrafter(NGramStore(order=3))
    drafter.sync([1, 2, 3, 4, 1, 2])
    draft = drafter.propose(6)
    assert draft.token_ids[:2] == [3, 4] and draft.probs == [1.0] * len(draft)
    drafter.sync([50, 51])  # nothing known about 51
    assert drafter.propose(4).token_ids == []


def test_top_k_filler_teaches_unseen_continuations() -> None:
    drafter = NGramDrafter(NGramStore(order=2), filler_top_k=3)
    drafter.sync([10, 11])
    assert drafter.predict([11]) is None
    drafter.learn([[10, 11]], [SparseDistribution([20, 21, 22], [0.6, 0.3, 0.1])])
    assert drafter.predict([11]).token == 20
    napd = NGramDrafter(NGramStore(order=2), filler_top_k=1)
    napd.learn([[10, 11]], [SparseDistribution([20], [0.6])])
    assert napd.predict([11]) is None  # NAPD: only committed tokens teach it


def test_a_drafter_that_learns_no_filler_asks_for_no_top_k() -> None:
    """The round asks the verifier for `filler_top_k` candidates a position (each a full row
    the target computes): NAPD reads none of them, so it asks for none."""
    assert NGramDrafter(NGramStore(order=2), filler_top_k=1).filler_top_k == 0
    assert NGramDrafter(NGramStore(order=2), filler_top_k=0).filler_top_k == 0
    assert NGramDrafter(NGramStore(order=2), filler_top_k=3).filler_top_k == 3
