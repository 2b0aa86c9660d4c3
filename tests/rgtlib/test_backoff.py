"""rgtlib.backoff: capped exponential retry pacing, jittered for reconnects, exact for restarts."""
from __future__ import annotations

import random

import pytest

from rgtlib.backoff import Backoff


def test_without_jitter_the_delays_double_to_the_cap_and_reset() -> None:
    b = Backoff(0.5, 4.0, jitter=False)
    assert [b.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    b.reset()
    assert b.next() == 0.5 and b.attempts == 1


def test_with_jitter_each_delay_lies_between_half_the_base_and_its_doubling() -> None:
    b = Backoff(0.5, 30.0, rng=random.Random(7))
    delays = [b.next() for _ in range(80)]  # far past the cap, and past 2**60: no overflow
    for n, delay in enumerate(delays):
        assert 0.25 <= delay <= max(0.25, min(30.0, 0.5 * 2.0 ** n))
    assert len(set(delays)) == len(delays), "jittered: no two alike"


@pytest.mark.parametrize("base, cap", [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_a_nonsense_pace_is_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError):
        Backoff(base, cap)
