"""Watched filesystems: `disk.low` / `disk.ok` for bytes and inodes, with an ETA to full.

One `DiskDetector` per filesystem (the run dir's and each watched path's, deduplicated by device).
Bytes and inodes are judged apart (inodes run out first on filesystems full of small eval files):
`disk.low` warn at >= 90 %, a new `disk.low` critical at >= 97 %, `disk.ok` once under 88 % for the
clear window. The ETA to full comes from a least-squares line through the last `trend_n` readings.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from onbox.detectors.hysteresis import CLEAR, ESCALATE, ONSET, Finding, LevelMachine
from onbox.sources.host import DiskUsage


@dataclasses.dataclass(frozen=True)
class DiskThresholds:
    warn_pct: float = 90.0
    critical_pct: float = 97.0
    clear_pct: float = 88.0
    clear_s: float = 30.0
    trend_n: int = 12          # readings in the ETA fit (2 minutes at the default 10 s poll)


def slope_per_s(points: Sequence[Tuple[float, float]]) -> Optional[float]:
    """Least-squares slope of (t, value) points; None with fewer than 3 points or no time spread."""
    n = len(points)
    if n < 3:
        return None
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var <= 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def eta_to_full_s(points: Sequence[Tuple[float, float]], room: Optional[float]) -> Optional[float]:
    """Seconds until `room` is used up at the fitted rate; None when not filling (or unknown)."""
    rate = slope_per_s(points)
    if rate is None or rate <= 0 or room is None:
        return None
    return round(max(0.0, room) / rate, 1)


class _Resource:
    def __init__(self, name: str, t: DiskThresholds) -> None:
        self.name = name
        self.machine = LevelMachine(t.warn_pct, t.critical_pct, t.clear_pct, t.clear_s)
        self.points: Deque[Tuple[float, float]] = collections.deque(maxlen=t.trend_n)


class DiskDetector:
    """One filesystem; `paths` are the watched paths that live on it."""

    def __init__(self, paths: Sequence[str], t: DiskThresholds = DiskThresholds()) -> None:
        self.paths = list(paths)
        self.t = t
        self.bytes = _Resource("bytes", t)
        self.inodes = _Resource("inodes", t)
        self.last: Optional[DiskUsage] = None

    def update(self, usage: DiskUsage, now: float) -> List[Finding]:
        self.last = usage
        self.bytes.points.append((now, float(usage.used_bytes)))
        if usage.inodes_used is not None:
            self.inodes.points.append((now, float(usage.inodes_used)))
        out: List[Finding] = []
        for res, pct in ((self.bytes, usage.bytes_used_pct), (self.inodes, usage.inodes_used_pct)):
            transition = res.machine.update(pct, now)
            if transition in (ONSET, ESCALATE):
                level = res.machine.level or "warn"
                data = self._data(res, usage, pct)
                data.update({"state": "onset" if transition == ONSET else "escalated", "level": level})
                out.append(Finding("disk.low", data, level))
            elif transition == CLEAR:
                data = self._data(res, usage, pct)
                data["state"] = "cleared"
                out.append(Finding("disk.ok", data, "info"))
        return out

    def _room(self, res: _Resource, usage: DiskUsage) -> Optional[float]:
        return float(usage.avail_bytes) if res is self.bytes else (
            None if usage.inodes_free is None else float(usage.inodes_free))

    def _data(self, res: _Resource, usage: DiskUsage, pct: Optional[float]) -> Dict[str, Any]:
        return {
            "path": usage.path, "paths": self.paths, "resource": res.name,
            "used_pct": None if pct is None else round(pct, 2),
            "total_bytes": usage.total_bytes, "avail_bytes": usage.avail_bytes,
            "inodes_total": usage.inodes_total, "inodes_free": usage.inodes_free,
            "eta_to_full_s": eta_to_full_s(list(res.points), self._room(res, usage)),
        }

    def sample(self) -> Optional[Dict[str, Any]]:
        """This filesystem's line in `disk.sample`; None before the first reading."""
        u = self.last
        if u is None:
            return None
        bp, ip = u.bytes_used_pct, u.inodes_used_pct
        return {
            "path": u.path, "paths": self.paths, "total_bytes": u.total_bytes, "used_bytes": u.used_bytes,
            "avail_bytes": u.avail_bytes, "used_pct": None if bp is None else round(bp, 2),
            "inodes_total": u.inodes_total, "inodes_used": u.inodes_used,
            "inodes_used_pct": None if ip is None else round(ip, 2),
            "eta_to_full_s": eta_to_full_s(list(self.bytes.points), float(u.avail_bytes)),
            "inodes_eta_to_full_s": eta_to_full_s(list(self.inodes.points), self._room(self.inodes, u)),
        }
