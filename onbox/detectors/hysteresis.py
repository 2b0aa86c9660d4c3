"""The onset/clear state machine every detector is built on.

A condition is sampled at irregular times. `Hysteresis` turns those samples into at most one onset
and one clear per episode:

- onset: the condition has held for `onset_s`, counted from the first sample that saw it. A break
  shorter than `gap_s` does not end the episode (a flapping condition is still sustained); a break
  of `gap_s` or more starts the count again. `onset_s=0` fires on the first sample that sees it.
- clear: after the onset, the condition has not been seen for `clear_s`. While it flaps the clear
  never comes, so a flapping condition yields exactly one onset and, once it settles, one clear.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

ONSET = "onset"
CLEAR = "clear"


@dataclasses.dataclass(frozen=True)
class Finding:
    """An event a detector decided on: what the monitor hands to `emit(kind, data, sev)`."""

    kind: str
    data: Dict[str, Any]
    sev: Optional[str] = None


class Hysteresis:
    """Onset after `onset_s` sustained (gaps under `gap_s` tolerated), clear after `clear_s` without."""

    def __init__(self, onset_s: float, clear_s: float, gap_s: float = 0.0) -> None:
        if onset_s < 0 or clear_s < 0 or gap_s < 0:
            raise ValueError("hysteresis windows must be >= 0")
        self.onset_s = onset_s
        self.clear_s = clear_s
        self.gap_s = gap_s
        self.active = False
        self.episode_start: Optional[float] = None
        self.last_seen: Optional[float] = None
        self.onset_at: Optional[float] = None

    def update(self, condition: bool, now: float) -> Optional[str]:
        """Feed one sample; returns ONSET, CLEAR or None."""
        if condition:
            if self.episode_start is None:
                self.episode_start = now
            self.last_seen = now
            if not self.active and now - self.episode_start >= self.onset_s:
                self.active = True
                self.onset_at = now
                return ONSET
            return None
        if self.active:
            assert self.last_seen is not None
            if now - self.last_seen >= self.clear_s:
                self._reset()
                return CLEAR
            return None
        if self.last_seen is not None and now - self.last_seen >= self.gap_s:
            self._reset()
        return None

    def held_s(self, now: float) -> float:
        """Seconds since the episode began (0 when there is none)."""
        return 0.0 if self.episode_start is None else max(0.0, now - self.episode_start)

    def _reset(self) -> None:
        self.active = False
        self.episode_start = None
        self.last_seen = None
        self.onset_at = None


ESCALATE = "escalate"


class LevelMachine:
    """A value against warn/critical thresholds: onset, escalation, clear (all with hysteresis).

    Onset at the first sample at or above `warn` (at `critical` directly if it is that high); a later
    sample at or above `critical` escalates once. The level never steps down on its own: it clears
    (to no level) only after the value stayed under `clear_below` for `clear_s`.
    """

    def __init__(self, warn: float, critical: float, clear_below: float, clear_s: float) -> None:
        if not clear_below <= warn <= critical:
            raise ValueError("need clear_below <= warn <= critical")
        self.warn = warn
        self.critical = critical
        self.clear_below = clear_below
        self.clear_s = clear_s
        self.level: Optional[str] = None
        self.last_high: Optional[float] = None
        self.peak: Optional[float] = None

    def update(self, value: Optional[float], now: float) -> Optional[str]:
        """Feed one reading (None: no reading, no change); returns ONSET, ESCALATE, CLEAR or None."""
        if value is None:
            return None
        level = "critical" if value >= self.critical else "warn" if value >= self.warn else None
        if value >= self.clear_below:
            self.last_high = now
        if self.level is None:
            if level is None:
                return None
            self.level, self.peak = level, value
            return ONSET
        self.peak = max(self.peak or value, value)
        if level == "critical" and self.level == "warn":
            self.level = "critical"
            return ESCALATE
        if value < self.clear_below and self.last_high is not None and now - self.last_high >= self.clear_s:
            self.level, self.last_high, self.peak = None, None, None
            return CLEAR
        return None
