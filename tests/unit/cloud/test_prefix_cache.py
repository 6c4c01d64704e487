"""Kept prefixes: which entry a new session takes, that scopes never share them, and that the
session store counts them against its caps, drops them before any session, and fairly: a scope
under its share of a cap never loses its kept prefixes to another scope's traffic."""

from dataclasses import dataclass

import pytest
import torch

from cloud.prefix_cache import MAX_NOTES, MAX_NOTES_PER_SCOPE, PrefixCache
from cloud.quotas import KeyLimits
from cloud.sessions import Session, SessionLimits, SessionStore
from shared.errors import CapacityExceeded
from shared.protocol import SessionConfig
from shared.token_ids import shared_prefix
from tests.unit.cloud.test_sessions import FakeClock


@dataclass(eq=False)
class FakeKV:
    """A KV handle of `length` positions (only lengths matter to the store)."""

    length: int
    freed: bool = False

    def get_seq_length(self) -> int:
        return self.length


class Freer:
    def __init__(self) -> None:
        self.freed: list[FakeKV] = []

    def free(self, kv: FakeKV) -> None:  # type: ignore[override]
        kv.freed = True
        self.freed.append(kv)


def _store(clock: FakeClock | None = None, **limits: object) -> tuple[SessionStore, Freer]:
    freer = Freer()
    store = SessionStore(
        SessionLimits(**limits),  # type: ignore[arg-type]
        kv_bytes_per_token=10,
        clock=clock or FakeClock(),
        kv=freer,  # type: ignore[arg-type]
        keep_prefixes=True,
    )
    return store, freer


def _open(store: SessionStore, sid: str, tokens: list[int], owner: str = "", scope: str = "") -> Session:
    """A stored session of key `owner`, in reuse scope `scope` (default: the key's own)."""
    now = store.clock()
    kv = FakeKV(len(tokens) - 1)  # a session's KV holds all its tokens but the last
    scope = scope or f"key:{owner}"
    session = Session(sid, SessionConfig(), list(tokens), kv, torch.Generator(), now, now, owner=owner, scope=scope)  # type: ignore[arg-type]
    store.add(session)
    return session


def test_shared_prefix() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([], [1]) == 0
    assert shared_prefix([1, 2], [1, 2]) == 2


def _taken(cache: PrefixCache, scope: str, prompt: list[int], limit: int) -> tuple[FakeKV, int] | None:
    taken = cache.take(scope, prompt, limit)
    return (taken[0].kv, taken[1]) if taken is not None else None  # type: ignore[return-value]


def test_takes_the_longest_shared_prefix_of_its_own_scope_only() -> None:
    cache = PrefixCache(FakeClock())
    short, long, other_key = FakeKV(3), FakeKV(6), FakeKV(8)
    cache.keep("alice", "key:alice", [1, 2, 3], short, 30)
    cache.keep("alice", "key:alice", [1, 2, 3, 4, 5, 6], long, 60)
    cache.keep("bob", "key:bob", [1, 2, 3, 4, 5, 6, 7, 8], other_key, 80)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert cache.reusable("key:alice", prompt) == 6
    assert _taken(cache, "key:alice", prompt, limit=len(prompt) - 1) == (long, 6)
    assert _taken(cache, "key:alice", prompt, limit=len(prompt) - 1) == (short, 3)  # the next best, once taken
    assert _taken(cache, "key:alice", prompt, limit=len(prompt) - 1) is None  # bob's is never alice's
    assert _taken(cache, "key:carol", prompt, limit=8) is None
    assert len(cache) == 1 and cache.nbytes("bob") == 80 and cache.nbytes("alice") == 0


def test_a_prompt_that_shares_only_a_little_leaves_the_entry_for_its_own_conversation() -> None:
    cache = PrefixCache(FakeClock())
    kv = FakeKV(10)
    cache.keep("", "me", list(range(10)), kv, 100)
    assert _taken(cache, "me", [0, 1, 2, 99, 98, 97], limit=5) is None  # 3 of 10: another conversation
    assert _taken(cache, "me", [0, 1, 2, 3, 4, 5, 99], limit=6) == (kv, 6)  # 6 of 10: this one, edited


def test_the_take_leaves_the_prompts_last_token_to_compute() -> None:
    cache = PrefixCache(FakeClock())
    kv = FakeKV(5)
    cache.keep("", "me", [1, 2, 3, 4, 5], kv, 50)
    assert _taken(cache, "me", [1, 2, 3, 4, 5], limit=4) == (kv, 4)  # the same prompt again: its last row is needed


def test_a_closed_session_is_kept_and_counted_against_the_caps() -> None:
    store, freer = _store(max_kv_bytes=1000)
    _open(store, "a", list(range(11)))  # 10 positions: 100 bytes
    store.remove("a")
    assert len(store) == 0 and len(store.prefixes) == 1
    assert store.kv_bytes() == 100 and not freer.freed
    kept = store.take_prefix("key:", list(range(15)))
    assert kept is not None and kept[1] == 10
    assert store.prefix_totals()[2:] == (0, 0)


def test_kept_prefixes_go_before_any_session_under_the_kv_cap() -> None:
    store, freer = _store(max_kv_bytes=300)
    _open(store, "kept", list(range(11)))
    store.remove("kept")  # kept: 100 bytes
    live = _open(store, "live", list(range(11)))  # 100 bytes, idle
    store.reserve(10, scope="key:")  # 100 more: 300 fits exactly, nothing goes
    assert len(store.prefixes) == 1
    store.reserve(11, scope="key:")  # 110 more: the kept prefix goes, not the idle session
    assert len(store.prefixes) == 0 and freer.freed and store.holds(live)


def test_another_keys_room_takes_a_kept_prefix_of_a_key_over_its_share_but_never_a_session() -> None:
    store, _ = _store(max_kv_bytes=250)
    _open(store, "a", list(range(11)), owner="alice")
    store.remove("a", owner="alice")
    b = _open(store, "b", list(range(11)), owner="alice")
    store.reserve(5, owner="bob", scope="key:bob")  # 50: fits beside both
    store.reserve(6, owner="bob", scope="key:bob")  # 60: alice holds 200, over her share of 125: her kept prefix goes
    assert len(store.prefixes) == 0 and store.holds(b)
    with pytest.raises(CapacityExceeded):
        store.reserve(16, owner="bob", scope="key:bob")  # alice's session is never bob's to evict


def test_a_key_under_its_share_keeps_its_prefixes_whatever_another_key_needs() -> None:
    store, _ = _store(max_kv_bytes=300)
    _open(store, "b", list(range(11)), owner="bob")
    store.remove("b", owner="bob")  # bob's conversation: 100 bytes kept, under his share of 150
    for turn in range(5):  # alice's flood of new prompts: each session's room is her own to make
        _open(store, f"a{turn}", [1000 * turn + i for i in range(11)], owner="alice")
        store.reserve(10, keep=f"a{turn}", owner="alice", scope="key:alice")
        store.remove(f"a{turn}", owner="alice")
        assert store.prefixes.count(scope="key:bob") == 1, turn
    assert store.prefixes.count(scope="key:alice") >= 1
    with pytest.raises(CapacityExceeded):  # bob's prefix is not alice's to take, even when refused
        store.reserve(25, owner="alice", scope="key:alice")
    assert store.prefixes.count(scope="key:bob") == 1


def test_the_largest_holder_over_its_share_loses_first() -> None:
    store, _ = _store(max_kv_bytes=600)
    for owner, n in (("alice", 1), ("bob", 3)):
        for i in range(n):
            _open(store, f"{owner}{i}", [i * 100 + j for j in range(11)], owner=owner)
            store.remove(f"{owner}{i}", owner=owner)
    store.reserve(25, owner="carol", scope="key:carol")  # 400 held, 250 more: 50 over the cap
    assert store.prefixes.count(scope="key:alice") == 1 and store.prefixes.count(scope="key:bob") == 2


def test_a_keys_session_cap_counts_its_kept_prefixes_and_frees_its_own_first() -> None:
    store, _ = _store(per_key=KeyLimits(max_sessions=2))
    _open(store, "a", list(range(5)), owner="alice")
    store.remove("a", owner="alice")
    _open(store, "b", list(range(5)), owner="alice")
    with pytest.raises(CapacityExceeded):  # one session and one kept prefix: both handles of her cap
        _open(store, "c", list(range(5)), owner="alice")
    store.room_for_session("key:alice", "alice")  # what a new session runs first: her kept prefix goes
    _open(store, "c", list(range(5)), owner="alice")
    assert len(store.prefixes) == 0 and len(store) == 2


def test_a_prefix_given_back_is_kept_as_long_as_its_kv_now_is() -> None:
    store, freer = _store()
    _open(store, "a", list(range(11)))
    store.remove("a")
    kept = store.take_prefix("key:", list(range(20)))
    assert kept is not None and len(store.prefixes) == 0
    entry, _ = kept
    entry.kv.length = 6  # type: ignore[attr-defined]  # the refused session had cropped it
    store.give_back(entry)
    assert store.prefixes.entries()[0].tokens == list(range(6)) and store.kv_bytes() == 60 and not freer.freed


def test_a_removed_key_loses_every_session_and_kept_prefix_at_once() -> None:
    store, freer = _store()
    _open(store, "a", list(range(5)), owner="alice")
    store.remove("a", owner="alice")
    busy = _open(store, "b", list(range(5)), owner="alice")
    bob = _open(store, "c", list(range(5)), owner="bob")
    with store.holding("b"):  # a call in flight does not keep it
        assert store.end_owner("alice") == 1
    assert not store.holds(busy) and store.holds(bob) and store.kv_bytes("alice") == 0
    assert len(freer.freed) == 2 and len(store.prefixes) == 0


def test_a_keys_own_kv_cap_counts_its_kept_prefixes() -> None:
    store, _ = _store(max_kv_bytes=10_000, per_key=KeyLimits(max_kv_bytes=150))
    _open(store, "a", list(range(11)), owner="alice")
    store.remove("a", owner="alice")
    assert store.kv_bytes("alice") == 100
    store.reserve(6, owner="alice", scope="key:alice")  # 60 more over alice's 150: her kept prefix goes
    assert len(store.prefixes) == 0


def test_kept_prefixes_give_up_their_handles_for_new_sessions() -> None:
    store, freer = _store(max_sessions=2)
    _open(store, "a", list(range(5)))
    _open(store, "b", list(range(5)))
    store.remove("a")
    store.room_for_session("key:")  # one session and one kept prefix fill the cap: the prefix goes
    assert len(store.prefixes) == 0 and len(freer.freed) == 1


def test_kept_prefixes_expire_with_the_session_ttl() -> None:
    clock = FakeClock()
    store, freer = _store(clock, ttl_s=10)
    _open(store, "a", list(range(5)))
    store.remove("a")
    clock.now = 9.0
    store.expire()
    assert len(store.prefixes) == 1
    clock.now = 10.5
    store.expire()
    assert len(store.prefixes) == 0 and freer.freed


def test_a_session_closed_with_a_call_in_flight_is_not_kept() -> None:
    store, freer = _store()
    _open(store, "a", list(range(5)))
    with store.holding("a"):  # a step of it may still write to its KV
        store.remove("a")
    assert len(store.prefixes) == 0 and freer.freed


def test_nothing_is_kept_when_reuse_is_off() -> None:
    freer = Freer()
    store = SessionStore(SessionLimits(), 10, clock=FakeClock(), kv=freer)  # type: ignore[arg-type]
    _open(store, "a", list(range(5)))
    store.remove("a")
    assert len(store.prefixes) == 0 and freer.freed


def test_notes_of_an_engines_own_cache_estimate_its_reuse_and_are_bounded_per_scope() -> None:
    clock = FakeClock()
    cache = PrefixCache(clock)
    cache.note("alice", "key:alice", [1, 2, 3, 4])
    cache.note("bob", "key:bob", [7, 8, 9])
    assert cache.reusable("key:alice", [1, 2, 3, 9]) == 3  # any shared prefix: the engine's cache serves blocks
    assert cache.reusable("key:alice", [1, 2, 3, 4]) == 3  # never the prompt's last token
    assert cache.reusable("key:bob", [1, 2, 3, 9]) == 0
    assert len(cache) == 0 and cache.take("key:alice", [1, 2, 3, 9], limit=3) is None  # a note holds no KV
    for i in range(MAX_NOTES_PER_SCOPE):
        cache.note("alice", "key:alice", [100 + i])
    assert cache.reusable("key:alice", [1, 2, 3, 9]) == 0  # alice's oldest note went
    assert cache.reusable("key:bob", [7, 8, 9, 1]) == 3  # bob's stays
    for i in range(MAX_NOTES):  # many clients' churn: past the bound of all, the scope with the most loses
        cache.note("", f"client:{i % 20}", [500 + i])
    assert cache.reusable("key:bob", [7, 8, 9, 1]) == 3
    clock.now = 50.0
    cache.forget_notes(kept_before=10.0)
    assert cache.reusable("key:bob", [7, 8, 9, 1]) == 0


def test_a_store_whose_engine_caches_prefixes_notes_closed_sessions_and_frees_their_kv() -> None:
    freer = Freer()
    store = SessionStore(SessionLimits(), 10, clock=FakeClock(), kv=freer, note_prefixes=True)  # type: ignore[arg-type]
    _open(store, "a", list(range(9)))
    store.remove("a")
    assert freer.freed and len(store.prefixes) == 0 and store.kv_bytes() == 0
    assert store.reusable("key:", [*range(8), 50, 51]) == 8
