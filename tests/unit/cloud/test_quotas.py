"""A key's token bucket: a call is refused only while the bucket is empty, a long prompt is
admitted once and paid back, and a call admitted on an estimate is settled to what it computed."""

import pytest

from cloud.quotas import TokenRate
from shared.errors import CapacityExceeded
from tests.unit.cloud.test_sessions import FakeClock


def test_a_long_prompt_is_admitted_once_and_paid_back() -> None:
    clock = FakeClock()
    rate = TokenRate(100.0, burst_s=2.0, clock=clock)
    rate.take("alice", 500)  # 200 in the bucket: admitted, 300 in debt
    with pytest.raises(CapacityExceeded) as err:
        rate.take("alice", 1)
    assert err.value.retry_after_ms == 3001
    rate.take("bob", 150)  # another key's bucket is its own
    clock.now = 3.5
    rate.take("alice", 1)


def test_a_call_admitted_on_an_estimate_pays_what_it_computed() -> None:
    clock = FakeClock()
    rate = TokenRate(100.0, burst_s=2.0, clock=clock)
    rate.take("alice", 10)  # admitted as a kept prefix's 10 new tokens...
    rate.settle("alice", 390)  # ...but the prefix was gone: it computed 400
    with pytest.raises(CapacityExceeded):
        rate.take("alice", 1)
    rate.settle("alice", -300)  # served more than estimated: the difference comes back
    rate.take("alice", 1)


def test_settling_without_a_rate_or_a_bucket_does_nothing() -> None:
    TokenRate(0.0).settle("alice", 100)
    rate = TokenRate(100.0, clock=FakeClock())
    rate.settle("alice", 1000)  # no call of hers was admitted: nothing to settle
    rate.take("alice", 1)
