"""Memory pressure of the job's cgroup (or the whole box when no cgroup limit applies).

`mem.pressure` at onset (>= 90 % of the limit, warn), once more on escalation (>= 97 %, critical),
and with ``state: "cleared"`` (info) after the use stayed under 85 % for the clear window. A rise of
the cgroup's oom_kill counter while the job lives (a dataloader worker killed, say) is reported as
``reason: "oom_kill"`` (critical), at most once per `oom_repeat_s`; rises in between add up.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from onbox.detectors.hysteresis import CLEAR, ESCALATE, ONSET, Finding, LevelMachine


@dataclasses.dataclass(frozen=True)
class MemThresholds:
    warn_pct: float = 90.0
    critical_pct: float = 97.0
    clear_pct: float = 85.0
    clear_s: float = 30.0
    oom_repeat_s: float = 60.0


@dataclasses.dataclass(frozen=True)
class MemReading:
    """One reading. `scope` is "cgroup" (a limit applies) or "host" (no limit: the whole box)."""

    scope: str
    used_bytes: Optional[int]
    limit_bytes: Optional[int]
    oom_kill: Optional[int] = None
    cgroup: Optional[str] = None

    @property
    def used_pct(self) -> Optional[float]:
        if self.used_bytes is None or not self.limit_bytes:
            return None
        return 100.0 * self.used_bytes / self.limit_bytes


class MemoryDetector:
    def __init__(self, t: MemThresholds = MemThresholds()) -> None:
        self.t = t
        self.machine = LevelMachine(t.warn_pct, t.critical_pct, t.clear_pct, t.clear_s)
        self.oom_base: Optional[int] = None
        self.oom_pending = 0
        self.oom_reported_at: Optional[float] = None

    def update(self, reading: MemReading, now: float,
               extra: Optional[Dict[str, Any]] = None) -> List[Finding]:
        out: List[Finding] = []
        pct = reading.used_pct
        transition = self.machine.update(pct, now)
        if transition is not None:
            data = self._data(reading, extra)
            if transition in (ONSET, ESCALATE):
                level = self.machine.level or "warn"
                data.update({"state": "onset" if transition == ONSET else "escalated", "level": level})
                out.append(Finding("mem.pressure", data, level))
            elif transition == CLEAR:
                data["state"] = "cleared"
                out.append(Finding("mem.ok", data, "info"))
        out.extend(self._oom(reading, now, extra))
        return out

    def _oom(self, reading: MemReading, now: float, extra: Optional[Dict[str, Any]]) -> List[Finding]:
        if reading.oom_kill is None:
            return []
        if self.oom_base is not None and reading.oom_kill > self.oom_base:
            self.oom_pending += reading.oom_kill - self.oom_base
        self.oom_base = reading.oom_kill
        due = self.oom_reported_at is None or now - self.oom_reported_at >= self.t.oom_repeat_s
        if not self.oom_pending or not due:
            return []
        data = self._data(reading, extra)
        data.update({"state": "oom_kill", "reason": "oom_kill", "oom_kill_delta": self.oom_pending,
                     "oom_kill": reading.oom_kill})
        self.oom_pending = 0
        self.oom_reported_at = now
        return [Finding("mem.pressure", data, "critical")]

    @staticmethod
    def _data(reading: MemReading, extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        pct = reading.used_pct
        data: Dict[str, Any] = {
            "scope": reading.scope, "cgroup": reading.cgroup, "used_bytes": reading.used_bytes,
            "limit_bytes": reading.limit_bytes, "used_pct": None if pct is None else round(pct, 2),
        }
        if extra:
            data.update(extra)
        return data
