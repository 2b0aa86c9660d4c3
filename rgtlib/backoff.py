"""Retry pacing: the watcher's reconnects (jittered, so many do not retry in step) and the sidecar
supervisor's restarts (plain doubling, so its delays are exact)."""
from __future__ import annotations

import random
from typing import Optional


class Backoff:
    """Capped exponential backoff with full jitter, for reconnects.

    Attempt n waits uniform(base/2, min(cap, base * 2**n)) seconds: never less
    than base/2 (no tight loop), never more than cap, and spread out so that
    many watchers do not reconnect in step. Without jitter, attempt n waits exactly
    min(cap, base * 2**n).
    """

    def __init__(self, base_s: float = 0.5, cap_s: float = 30.0, rng: Optional[random.Random] = None,
                 jitter: bool = True) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError("need 0 < base_s <= cap_s")
        self.base_s = base_s
        self.cap_s = cap_s
        self.rng = rng if rng is not None else random.Random()
        self.jitter = jitter
        self.attempts = 0

    def next(self) -> float:
        high = min(self.cap_s, self.base_s * 2.0 ** min(self.attempts, 60))
        self.attempts += 1
        if not self.jitter:
            return high
        low = self.base_s / 2
        return self.rng.uniform(low, max(low, high))

    def reset(self) -> None:
        self.attempts = 0

