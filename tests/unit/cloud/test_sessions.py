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
