"""The job's end: exited (with the launcher's exit record) or vanished (without one).

Fed one observation per poll: whether the job still runs, the launcher's exit record when one
exists (<run>/rgt/exit.json: ``{"code": int|null, "signal": int|null, "oom_killed": bool,
"preempted": bool}``), and
the cgroup's oom_kill counter. Reports `job.exited` exactly once:

- with the record: its code/signal; `oom_killed` when the record says so, or when the job did not
  exit 0 and there is evidence that the OOM killer took the job or one of its processes (a torchrun
  rank): the oom_kill counter of one of the job's memory cgroups rose since the job was first seen
  in it (`observe_cgroup`: the job may sit in, or move itself into, a cgroup of its own), or the
  kernel log named one of its pids (`note_kernel_oom`). `oom_limit` then says which limit was hit:
  "job cgroup <path> (memory.max N bytes)", "container cgroup <path> (...)" or "box (global OOM)";
  `oom_evidence` lists what was seen. The wrapper's record stays authoritative for code and signal;
  this only upgrades a plain SIGKILL to an OOM kill;
- without a record, after `grace_s` (the launcher writes the record just after the job ends):
  ``vanished: true``, code null, and `evidence` (oom counter delta, whether the box rebooted, the
  signal if known). After a reboot the job is gone at once; no grace applies.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Tuple

from onbox.detectors.hysteresis import Finding


@dataclasses.dataclass(frozen=True)
class ExitRecord:
    code: Optional[int]
    signal: Optional[int]
    oom_killed: bool = False
    preempted: bool = False   # the wrapper got a SIGTERM rgt did not send (onbox/custody/preempt.py)
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


GLOBAL_OOM = "box (global OOM)"


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
        self.cgroups: Dict[str, List[Any]] = {}       # cgroup -> [first oom_kill, latest, limit text]
        self.kernel_oom: Dict[int, Dict[str, Any]] = {}  # pid -> what the kernel log said of it
        self.main_limit: Optional[str] = None         # the limit of the job's own cgroup, described

    MAX_TRACKED = 64

    def observe_cgroup(self, cgroup: str, oom_kill: Optional[int], limit: Optional[str]) -> None:
        """One reading of a memory cgroup one of the job's processes is in; `limit` describes the
        limit that binds there ("job cgroup /a (memory.max N bytes)"; None: no limit up the tree)."""
        if oom_kill is None:
            return
        seen = self.cgroups.get(cgroup)
        if seen is None:
            if len(self.cgroups) < self.MAX_TRACKED:
                self.cgroups[cgroup] = [oom_kill, oom_kill, limit]
            return
        seen[0] = min(seen[0], oom_kill)
        seen[1] = oom_kill
        seen[2] = limit or seen[2]

    def note_kernel_oom(self, pid: int, name: Optional[str], scope: Optional[str],
                        limit: Optional[str]) -> None:
        """The kernel log says the OOM killer took `pid` (one of the job's processes)."""
        known = self.kernel_oom.setdefault(pid, {"pid": pid})
        if len(self.kernel_oom) > self.MAX_TRACKED:
            self.kernel_oom.pop(pid)
            return
        for key, value in (("name", name), ("scope", scope), ("limit", limit)):
            if value is not None and known.get(key) is None:
                known[key] = value

    def oom_evidence(self) -> Tuple[bool, Optional[str], Dict[str, Any]]:
        """(any evidence, the limit that was hit, the evidence itself)."""
        rose = [(cg, seen) for cg, seen in self.cgroups.items() if seen[1] > seen[0]]
        kernel = list(self.kernel_oom.values())
        limit: Optional[str] = None
        for line in kernel:
            if line.get("limit"):
                limit = str(line["limit"])
                break
            if line.get("scope") == "global":
                limit = GLOBAL_OOM
        if limit is None and rose:
            limit = next((str(seen[2]) for _, seen in rose if seen[2]), GLOBAL_OOM)
        evidence = {"kernel": kernel[:8],
                    "cgroups": [{"cgroup": cg, "oom_kill_delta": seen[1] - seen[0], "limit": seen[2]}
                                for cg, seen in rose][:8]}
        return bool(rose or kernel), limit, evidence

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

    def _oom_fields(self, failed: bool, said: bool) -> Dict[str, Any]:
        seen, limit, evidence = self.oom_evidence()
        oom = said or (failed and (seen or bool(self.oom_delta)))
        if not oom:
            return {"oom_killed": False}
        out: Dict[str, Any] = {"oom_killed": True, "oom_limit": limit or self.main_limit or GLOBAL_OOM}
        if seen:
            out["oom_evidence"] = evidence
            if not said:
                out["oom_upgraded"] = True  # the wrapper saw a plain signal; the evidence says OOM
        return out

    def _from_record(self, record: ExitRecord) -> Dict[str, Any]:
        delta = self.oom_delta
        out = {"code": record.code, "signal": record.signal, "vanished": False, "oom_kill_delta": delta,
               **self._oom_fields(record.code != 0, record.oom_killed)}
        if record.preempted:
            out["preempted"] = True
        if record.stop_requested:
            out["stop_requested"] = True
        return out

    def _vanished(self) -> Dict[str, Any]:
        delta = self.oom_delta
        evidence = {"exit_record": False, "oom_kill_delta": delta, "rebooted": self.rebooted,
                    "signal": None}
        return {"code": None, "signal": None, "vanished": True, "evidence": evidence,
                "oom_kill_delta": delta, **self._oom_fields(True, False)}

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
