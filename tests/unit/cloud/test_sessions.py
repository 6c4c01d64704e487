"""Session store bounds: TTL, count cap with LRU eviction, KV-byte cap."""

import pytest
import torch

from cloud.sessions import Session, SessionLimits, SessionStore
from shared.errors import CapacityExceeded, SessionNotFound
from shared.protocol import SessionConfig


class FakeClock:
    """A settable clock (time is an input here, not a model or the wire)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _session(store: SessionStore, sid: str, tokens: int) -> Session:
    now = store.clock()
    return Session(sid, SessionConfig(), list(range(tokens)), None, torch.Generator(), now, now)  # type: ignore[arg-type]


def test_idle_sessions_expire_after_ttl() -> None:
    clock = FakeClock()
    store = SessionStore(SessionLimits(ttl_s=10), kv_bytes_per_token=1, clock=clock)
    store.add(_session(store, "a", 3))
    clock.now = 9.0
    store.touch(store.get("a"))
    clock.now = 18.0
    assert store.get("a").session_id == "a"  # touched at 9: still alive at 18
    clock.now = 19.5
    with pytest.raises(SessionNotFound):
        store.get("a")


def test_count_cap_evicts_least_recently_used() -> None:
    store = SessionStore(SessionLimits(max_sessions=2), kv_bytes_per_token=1, clock=FakeClock())
    store.add(_session(store, "a", 3))
    store.add(_session(store, "b", 3))
    store.touch(store.get("a"))  # b is now the least recently used
    store.add(_session(store, "c", 3))
    assert {s.session_id for s in store} == {"a", "c"}


def test_kv_cap_evicts_others_but_never_the_session_in_use() -> None:
    store = SessionStore(SessionLimits(max_kv_bytes=100), kv_bytes_per_token=10, clock=FakeClock())
    store.add(_session(store, "a", 5))  # 4 cached positions = 40 bytes
    store.add(_session(store, "b", 5))
    assert store.kv_bytes() == 80
    store.reserve(3, keep="b")  # 30 more bytes: a must go
    assert [s.session_id for s in store] == ["b"]
    with pytest.raises(CapacityExceeded):
        store.reserve(7, keep="b")  # 40 + 70 > 100 and nothing else to evict
    with pytest.raises(CapacityExceeded):
        store.reserve(11)  # larger than the whole cap


def _owned(store: SessionStore, sid: str, tokens: int, owner: str) -> Session:
    session = _session(store, sid, tokens)
    session.owner = owner
    return session


def test_the_global_session_cap_evicts_only_the_new_sessions_own_key(caplog: pytest.LogCaptureFixture) -> None:
    store = SessionStore(SessionLimits(max_sessions=3), kv_bytes_per_token=1, clock=FakeClock())
    for sid, owner in (("a1", "alice"), ("a2", "alice"), ("b1", "bob")):
        store.add(_owned(store, sid, 3, owner))
    with caplog.at_level("INFO", logger="cloud-verifier"):
        store.add(_owned(store, "b2", 3, "bob"))  # the cap: bob's own idle b1 goes, never alice's
    assert {s.session_id for s in store} == {"a1", "a2", "b2"}
    assert store.eviction_totals() == {"session_cap": 1}
    line = next(r.getMessage() for r in caplog.records if "evicted" in r.getMessage())
    assert "key 'bob'" in line and "session_cap" in line and "b1" not in line  # named by its tag
    with store.holding("b2"), pytest.raises(CapacityExceeded) as err:
        store.add(_owned(store, "b3", 3, "bob"))  # bob's only session is busy: refused, alice keeps hers
    assert err.value.retry_after_ms > 0 and "'bob'" in str(err.value)
    with pytest.raises(CapacityExceeded):
        store.add(_owned(store, "c1", 3, "carol"))  # a key with no session at all is refused too
    assert {s.session_id for s in store} == {"a1", "a2", "b2"}


def test_the_global_kv_cap_evicts_only_the_requesting_keys_sessions() -> None:
    store = SessionStore(SessionLimits(max_kv_bytes=100), kv_bytes_per_token=10, clock=FakeClock())
    store.add(_owned(store, "a", 5, "alice"))  # 40 bytes each
    store.add(_owned(store, "b", 5, "bob"))
    with pytest.raises(CapacityExceeded) as err:
        store.reserve(3, keep="b", owner="bob")  # bob's only other room would be alice's session
    assert "no idle session to give up" in str(err.value) and err.value.retry_after_ms > 0
    store.add(_owned(store, "b2", 3, "bob"))  # 20 bytes: 100 in all
    store.reserve(2, keep="b", owner="bob")  # now bob's own idle b2 goes
    assert {s.session_id for s in store} == {"a", "b"} and store.eviction_totals() == {"kv_cap": 1}


def test_idle_sessions_past_their_ttl_count_as_evicted() -> None:
    clock = FakeClock()
    store = SessionStore(SessionLimits(ttl_s=10), kv_bytes_per_token=1, clock=clock)
    store.add(_session(store, "a", 3))
    clock.now = 11.0
    store.expire()
    assert store.eviction_totals() == {"ttl": 1}


class _HeldKV:
    """A session's KV handle as the store reads it: how many positions it holds."""

    def __init__(self, positions: int) -> None:
        self.positions = positions

    def get_seq_length(self) -> int:
        return self.positions


def _recounted(store: SessionStore, owner: str | None) -> int:
    """The KV bytes of `owner`'s sessions and kept prefixes (every key's: None), summed anew."""
    sessions = sum(store.session_bytes(s) for s in store if owner in (None, s.owner))
    return sessions + sum(e.nbytes for e in store.prefixes.entries() if owner in (None, e.owner))


def test_the_bytes_held_follow_every_change_of_the_sessions_and_kept_prefixes() -> None:
    clock = FakeClock()
    limits = SessionLimits(ttl_s=10, max_kv_bytes=400)
    store = SessionStore(limits, kv_bytes_per_token=10, clock=clock, keep_prefixes=True)

    def agrees() -> bool:
        return all(store.kv_bytes(owner) == _recounted(store, owner) for owner in (None, "a", "b", "c"))

    for sid, owner in (("x", "a"), ("y", "a"), ("z", "b"), ("w", "c")):
        now = clock()
        store.add(Session(sid, SessionConfig(), [1, 2, 3], _HeldKV(2), torch.Generator(), now, now, owner=owner, scope=owner))  # type: ignore[arg-type]
    assert agrees() and store.kv_bytes() == 80
    store.extend(store.get("x", "a"), [4, 5, 6])  # a round's commit
    store.plan(store.get("z", "b"), 12)  # a stream's length reserved ahead
    assert agrees() and store.kv_bytes("a") == 70 and store.kv_bytes("b") == 120
    store.retire("y")  # its KV stays as a's kept prefix
    assert agrees() and store.prefixes.nbytes("a") == 20 and len(store) == 3
    store.reserve(20, keep="x", owner="a", scope="a")  # over the cap: its scope's kept prefix goes first
    assert agrees() and store.prefixes.nbytes() == 0 and store.kv_bytes() == 190
    gone = store.get("z", "b")
    store.end_owner("b")  # while a round of z's runs: its commit comes after
    store.extend(gone, [7])
    assert agrees() and store.kv_bytes("b") == 0
    store.touch(store.get("x", "a"))
    clock.now = 10.5  # w expires, x was used at 0 too but is busy
    with store.holding("x"):
        store.expire()
    assert agrees() and [s.session_id for s in store] == ["x"] and store.kv_bytes() == 50
    store.discard("x")
    assert agrees() and store.kv_bytes() == 0
