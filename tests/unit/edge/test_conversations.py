"""The conversation cache of `edge-agent serve`: a drafter that begins from the last turn's draft
KV proposes what a fresh one does while feeding only the new tokens; the pool's choice (the most
KV kept, of the request's own caller only), its bound (LRU by bytes) and the draft window's
rule; the lease that keeps a cancelled generation's worker thread off a cache handed on."""

import threading
import time
from dataclasses import dataclass

import pytest

from edge.drafting.conversations import ConversationCache, model_drafter
from edge.drafting.drafter import Drafter, DrafterConfig, DraftKV, DraftLM
from edge.drafting.ngram import HybridDrafter, NGramDrafter, NGramStore
from edge.drafting.runtime_transformers import TransformersDraftLM
from edge.metrics import EdgeMetrics
from edge.serve.engine import DrafterHandedBack, DrafterLease
from shared import lm
from shared.errors import ConfigError, DraftFailed
from shared.protocol import AcceptMode, SamplingParams
from tests.harness import random_prompt

GREEDY = DrafterConfig(SamplingParams(), AcceptMode.GREEDY, 96)


def _rounds(drafter: Drafter, prompt: list[int], rounds: int = 3, k: int = 4) -> tuple[list[list[int]], list[int]]:
    """Greedy rounds as the round loop runs them (2 drafts accepted, the 3rd corrected): the
    drafts, and the conversation they leave."""
    drafts, tokens = [], list(prompt)
    for _ in range(rounds):
        drafter.sync(tokens)
        draft = drafter.propose(k).token_ids
        drafts.append(draft)
        tokens += draft[:2] + [(draft[2] + 1) % 96]
    return drafts, tokens


def test_a_drafter_from_the_last_turns_cache_drafts_as_a_fresh_one(draft_lm: DraftLM) -> None:
    first = random_prompt(11, length=30)
    turn = Drafter(draft_lm, GREEDY, seed=1)
    _, conversation = _rounds(turn, first)
    pool = ConversationCache(1 << 30)
    kv = turn.kv()
    assert kv is not None
    pool.give_back("", first, kv)
    second = conversation + random_prompt(12, length=6)  # the reply and the user's next message
    taken = pool.take("", second, window=0, max_new_tokens=16, context=1024)
    assert taken is not None and len(pool) == 0  # one owner
    reused, fresh = Drafter(draft_lm, GREEDY, 1, taken), Drafter(draft_lm, GREEDY, 1)
    assert _rounds(reused, second)[0] == _rounds(fresh, second)[0]
    # The last turn's KV up to its last committed token (the corrected one was never fed)
    assert reused.reused_tokens == len(conversation) - 1 and reused.prefilled_tokens == len(second) - reused.reused_tokens == 7
    assert fresh.reused_tokens == 0 and fresh.prefilled_tokens == len(second)


def test_a_reused_window_keeps_its_start_and_drafts_from_there(draft_model) -> None:  # type: ignore[no-untyped-def]
    draft_lm = TransformersDraftLM(draft_model)
    windowed = DrafterConfig(SamplingParams(), AcceptMode.GREEDY, 96, window=16)
    first = random_prompt(21, length=40)
    turn = Drafter(draft_lm, windowed, seed=1)
    _, conversation = _rounds(turn, first)
    kv = turn.kv()
    assert kv is not None and kv.start == 24
    second = conversation + random_prompt(22, length=6)
    pool = ConversationCache(1 << 30)
    pool.give_back("", first, kv)
    assert pool.take("", second, window=16, max_new_tokens=16, context=len(second) - 24 + 15) is None  # past the context
    taken = pool.take("", second, window=16, max_new_tokens=16, context=len(second) - 24 + 16)
    assert taken is not None and taken.start == 24
    reused, alone = Drafter(draft_lm, windowed, 1, taken), Drafter(draft_lm, GREEDY, 1)
    assert _rounds(reused, second)[0] == _rounds(alone, second[24:])[0]


@dataclass
class FakeCache:
    length: int
    size: int = 100

    def __len__(self) -> int:
        return self.length

    def nbytes(self) -> int:
        return self.size


def _give(pool: ConversationCache, tokens: list[int], start: int = 0, size: int = 100, caller: str = "") -> None:
    """An entry of `caller`'s holding the KV of tokens[start:] (its prompt: all of tokens)."""
    cached = tokens[start:]
    pool.give_back(caller, tokens, DraftKV(FakeCache(len(cached), size), cached, start))  # type: ignore[arg-type]


def test_take_hands_out_the_entry_that_keeps_most_once() -> None:
    pool = ConversationCache(1 << 20)
    long, short = list(range(40)), list(range(30))
    _give(pool, long)
    _give(pool, short)
    taken = pool.take("", [*long, 99], window=0, max_new_tokens=8, context=1024)
    assert taken is not None and taken.cached == long  # 40 tokens kept, not 30
    taken = pool.take("", [*long, 99], window=0, max_new_tokens=8, context=1024)
    assert taken is not None and taken.cached == short and len(pool) == 0
    assert pool.take("", [*long, 99], window=0, max_new_tokens=8, context=1024) is None


def test_a_caller_takes_only_the_entries_its_own_key_left() -> None:
    """Another caller's exact prompt finds nothing (its reuse would tell it what alice sent);
    alice's next turn finds her entry, whatever bob left meanwhile."""
    pool = ConversationCache(1 << 20)
    alice, bob = list(range(40)), list(range(100, 140))
    _give(pool, alice, caller="alice")
    assert pool.take("bob", [*alice, 99], window=0, max_new_tokens=8, context=1024) is None
    assert pool.take("", [*alice, 99], window=0, max_new_tokens=8, context=1024) is None  # no key is a caller too
    _give(pool, alice, caller="bob")  # bob sends alice's prompt: his own entry, beside hers
    _give(pool, bob, caller="bob")
    taken = pool.take("alice", [*alice, 99], window=0, max_new_tokens=8, context=1024)
    assert taken is not None and taken.cached == alice and len(pool) == 2
    assert pool.take("alice", [*alice, 99], window=0, max_new_tokens=8, context=1024) is None  # bob's copy stays his
    taken = pool.take("bob", [*bob, 99], window=0, max_new_tokens=8, context=1024)
    assert taken is not None and taken.cached == bob


def test_an_entry_that_would_drop_more_than_it_keeps_stays() -> None:
    pool = ConversationCache(1 << 20)
    system, chat = list(range(10)), list(range(100, 140))
    _give(pool, system + chat)  # another conversation sharing only the system prompt
    assert pool.take("", [*system, 7, 7, 7], window=0, max_new_tokens=8, context=1024) is None
    assert pool.take("", [5, 6, 7], window=0, max_new_tokens=8, context=1024) is None  # shares nothing
    assert len(pool) == 1


def test_the_bound_evicts_the_least_recently_handed_back() -> None:
    pool = ConversationCache(250)
    for first in (10, 20, 30):
        _give(pool, list(range(first, first + 5)))
    assert len(pool) == 2 and pool.nbytes == 200
    assert pool.take("", list(range(10, 16)), window=0, max_new_tokens=1, context=64) is None  # evicted
    assert pool.take("", list(range(20, 26)), window=0, max_new_tokens=1, context=64) is not None
    _give(pool, list(range(40, 45)), size=251)  # over the bound alone: dropped
    assert len(pool) == 1 and pool.nbytes == 100


def test_a_cache_that_holds_nothing_or_is_out_of_step_is_not_kept() -> None:
    pool = ConversationCache(1 << 20)
    pool.give_back("", [1, 2, 3], DraftKV(FakeCache(0), [], 0))  # type: ignore[arg-type]
    pool.give_back("", [1, 2, 3], DraftKV(FakeCache(3), [1, 2], 0))  # type: ignore[arg-type]
    assert len(pool) == 0


@pytest.mark.parametrize(
    ("window", "context", "taken"),
    [
        (20, 55, True),  # from its start: 45 prompt tokens + 10 new fit
        (20, 54, False),  # they do not: a fresh window
        (45, 54, True),  # its start is the fresh window's own
        (50, 1024, False),  # the drafter would read less than its window
        (0, 1024, False),  # the whole prompt asked, a window's cache offered
    ],
)
def test_the_draft_window_rule(window: int, context: int, taken: bool) -> None:
    pool = ConversationCache(1 << 20)
    conversation = list(range(50))
    _give(pool, conversation, start=10)
    prompt = conversation + [90, 91, 92, 93, 94]
    kv = pool.take("", prompt, window=window, max_new_tokens=10, context=context)
    assert (kv is not None) == taken
    assert kv is None or kv.start == 10


def test_the_model_drafter_of_each_source(draft_model) -> None:  # type: ignore[no-untyped-def]
    model = Drafter(TransformersDraftLM(draft_model), GREEDY, seed=1)
    ngram = NGramDrafter(NGramStore(3))
    assert model_drafter(model) is model
    assert model_drafter(HybridDrafter(model, ngram)) is model
    assert model_drafter(ngram) is None


def test_mc_dropout_never_begins_from_a_cache(draft_model) -> None:  # type: ignore[no-untyped-def]
    draft_lm = TransformersDraftLM(draft_model, keep_hidden=True)
    config = DrafterConfig(SamplingParams(), AcceptMode.GREEDY, 96, signals=True, mc_passes=4)
    with pytest.raises(ConfigError, match="MC-dropout"):
        Drafter(draft_lm, config, 1, DraftKV(draft_lm.new_cache(0), [], 0))


def test_each_runtime_counts_the_bytes_its_cache_holds(draft_lm: DraftLM, draft_model) -> None:  # type: ignore[no-untyped-def]
    cache = draft_lm.new_cache(0)
    cache.feed(random_prompt(3, length=10))
    per_token = lm.kv_bytes_per_token(draft_model)
    if draft_lm.runtime == "llama.cpp":  # the whole context from the start, in f16
        assert cache.nbytes() == 1024 * per_token // 2
    else:
        assert cache.nbytes() == 10 * per_token


class SlowSource:
    filler_top_k = 0

    def __init__(self) -> None:
        self.started = threading.Event()
        self.calls = 0

    def sync(self, tokens: object) -> None:
        self.started.set()
        time.sleep(0.2)
        self.calls += 1

    def prefill(self) -> None:
        raise DraftFailed("llama_decode returned 1")


def test_a_lease_ends_after_the_call_running_and_refuses_later_ones() -> None:
    source = SlowSource()
    lease = DrafterLease(source)  # type: ignore[arg-type]
    worker = threading.Thread(target=lease.sync, args=([1, 2],))
    worker.start()
    source.started.wait()
    assert lease.end() is source and source.calls == 1  # waited for the call in the worker thread
    with pytest.raises(DrafterHandedBack):
        lease.sync([1, 2, 3])
    worker.join()
    assert source.calls == 1 and not lease.failed


def test_a_lease_whose_call_failed_is_marked() -> None:
    lease = DrafterLease(SlowSource())  # type: ignore[arg-type]
    with pytest.raises(DraftFailed):
        lease.prefill()
    assert lease.failed


def test_the_metrics_count_reuse_and_the_pool() -> None:
    metrics = EdgeMetrics()
    metrics.record_draft_prompt(reused=40, prefilled=7)
    metrics.record_conversation_cache(nbytes=4096, entries=2)
    sample = metrics.registry.get_sample_value
    assert sample("specdec_edge_draft_reused_tokens_total") == 40
    assert sample("specdec_edge_draft_prefilled_tokens_total") == 7
    assert sample("specdec_edge_conversation_cache_bytes") == 4096
    assert sample("specdec_edge_conversation_cache_entries") == 2
