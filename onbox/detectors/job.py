"""The job's end: exited (with the launcher's exit record) or vanished (without one).

Fed one observation per poll: whether the job still runs, the launcher's exit record when one
exists (<run>/rgt/exit.json: ``{"code": int|null, "signal": int|null, "oom_killed": bool,
"preempted": bool}``), and
the cgroup's oom_kill counter. Reports `job.exited` exactly once:

- with the record: its code/signal; `oom_killed` when the record says so, or when the oom_kill
  counter rose since the job was first seen and the job did not exit 0;
- without a record, after `grace_s` (the launcher writes the record just after the job ends):
  ``vanished: true``, code null, and `evidence` (oom counter delta, whether the box rebooted, the
  signal if known). After a reboot the job is gone at once; no grace applies.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional

from onbox.detectors.hysteresis import Finding


@dataclasses.dataclass(frozen=True)
class ExitRecord:
    code: Optional[int]
    signal: Optional[int]
    oom_killed: bool = False
    preempted: bool = False   # the wrapper got a SIGTERM rgt did not send (onbox/preempt.py)
    stop_requested: bool = False  # rgt-onbox stop asked for it (rgt/stop.json)


def parse_exit_record(text: str) -> Optional[ExitRecord]:
    """The launcher's exit.json, or None when it is not one (torn, not an object)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None

    def _int(key: str) -> Optional[int]:
        value = doc.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return ExitRecord(_int("code"), _int("signal"), doc.get("oom_killed") is True,
                      doc.get("preempted") is True, doc.get("stop_requested") is True)


class JobDetector:
    """`job.exited` once, from the launcher's record or as vanished."""

    def __init__(self, pid: int, grace_s: float = 3.0, rebooted: bool = False) -> None:
        self.pid = pid
        self.grace_s = grace_s
        self.rebooted = rebooted
        self.exited = False
        self.oom_base: Optional[int] = None
        self.oom_last: Optional[int] = None
        self.dead_since: Optional[float] = None
        self.last_rss_bytes: Optional[int] = None
        self.children: Optional[int] = None

    def observe_oom(self, oom_kill: Optional[int]) -> None:
        if oom_kill is None:
            return
        if self.oom_base is None or oom_kill < self.oom_base:
            self.oom_base = oom_kill
        self.oom_last = oom_kill

    @property
    def oom_delta(self) -> Optional[int]:
        if self.oom_base is None or self.oom_last is None:
            return None
        return self.oom_last - self.oom_base

    def update(self, now: float, alive: bool, record: Optional[ExitRecord],
               oom_kill: Optional[int] = None, rss_bytes: Optional[int] = None) -> List[Finding]:
        if self.exited:
            return []
        self.observe_oom(oom_kill)
        if alive:
            self.dead_since = None
            if rss_bytes is not None:
                self.last_rss_bytes = rss_bytes
            return []
        if record is not None:
            return self._report(self._from_record(record))
        if self.dead_since is None:
            self.dead_since = now
        if self.rebooted or now - self.dead_since >= self.grace_s:
            return self._report(self._vanished())
        return []

    def _from_record(self, record: ExitRecord) -> Dict[str, Any]:
        delta = self.oom_delta
        oom = record.oom_killed or (bool(delta) and record.code != 0)
        out = {"code": record.code, "signal": record.signal, "oom_killed": oom,
               "vanished": False, "oom_kill_delta": delta}
        if record.preempted:
            out["preempted"] = True
        if record.stop_requested:
            out["stop_requested"] = True
        return out

    def _vanished(self) -> Dict[str, Any]:
        delta = self.oom_delta
        evidence = {"exit_record": False, "oom_kill_delta": delta, "rebooted": self.rebooted,
                    "signal": None}
        return {"code": None, "signal": None, "oom_killed": bool(delta), "vanished": True,
                "evidence": evidence, "oom_kill_delta": delta}

    def _report(self, data: Dict[str, Any]) -> List[Finding]:
        self.exited = True
        data = {"pid": self.pid, **data, "last_rss_bytes": self.last_rss_bytes,
                "children": self.children}
        if data["oom_killed"] or data.get("evidence", {}).get("rebooted"):
            sev = "critical"
        elif data["code"] == 0 and not data["vanished"]:
            sev = "info"
        else:
            sev = "warn"
        return [Finding("job.exited", data, sev)]
