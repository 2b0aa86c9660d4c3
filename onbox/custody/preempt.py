"""Preemption: a SIGTERM that rgt did not send, recorded by the wrapper and journaled by the sidecar.

A spot reclaim, a Slurm preemption or time limit, or a Kubernetes eviction stops a job with
SIGTERM and, a grace later, SIGKILL. `rgt-onbox stop` writes rgt/stop.json before it signals,
so a SIGTERM that reaches the job wrapper without one came from someone else. The wrapper then
writes rgt/preempt.json (record_preemption) before passing the signal on, and the exit record
says `preempted`.

The sidecar's PreemptWatch sees the file within a tick, first saves what the job may have just
written (a custody sweep hashes a checkpoint saved in the grace window, and each custody record
is fsync'd), then journals `job.preempted` at warn, which the journal fsyncs at once together
with every line before it. A marker keeps a restarted sidecar from reporting it twice.

Under Slurm (run.json's "scheduler", onbox/sources/slurm.py) the watch asks scontrol why the job
is being ended (requeued, cancelled, time_limit, preempted, signalled) and how long until SIGKILL;
the event then carries `reason`, Slurm's `grace_s` (`grace_from` "slurm", else "profile") and
`scheduler`, and the marker keeps the reason for the job.exited that follows (`reason()`).

A silent pause (vast.ai outbids an instance and freezes it, no signal) cannot be seen from the
box; the controller reports it as the link and the heartbeats going away (link.lost,
sidecar.silent).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

from onbox.runs import read_json, utc_iso, write_json_atomic
from onbox.sources import slurm

log = logging.getLogger(__name__)

PREEMPT_FILE = "preempt.json"
REPORTED_FILE = "preempt.reported"
FLUSH_WAIT_S = 2.0   # at most this long for custody to settle before job.preempted is journaled

Emit = Callable[[str, Optional[Mapping[str, Any]], Optional[str]], Any]


def record_preemption(rgt_dir: Path, signum: int, grace_s: Optional[float], job_pid: Optional[int]) -> bool:
    """Called by the job wrapper on SIGTERM/SIGINT: write preempt.json unless this is rgt's own
    stop (stop.json exists) or it was already written. True when this call wrote it."""
    if (rgt_dir / "stop.json").exists() or (rgt_dir / PREEMPT_FILE).exists():
        return False
    doc = {"signal": signum, "at": utc_iso(), "ts": time.time(), "grace_s": grace_s, "pid": job_pid}
    try:
        write_json_atomic(rgt_dir / PREEMPT_FILE, doc)
    except OSError as e:  # a full disk must not keep the signal from reaching the job
        log.warning("could not record the preemption: %s", e)
        return False
    return True


def preemption(rgt_dir: Path) -> Optional[Dict[str, Any]]:
    """The preemption record of this attempt, or None."""
    doc = read_json(rgt_dir / PREEMPT_FILE)
    return doc if isinstance(doc, dict) else None


class PreemptWatch:
    """Journals `job.preempted` once per attempt, after flushing custody (`flush(timeout_s)`)."""

    name = "preempt"
    interval_s = 0.2

    def __init__(self, rgt_dir: Path, emit: Emit, flush: Callable[[float], Any],
                 scheduler: Optional[slurm.SlurmJob] = None, group: Optional[str] = None,
                 ask_slurm: Callable[[slurm.SlurmJob], Optional[Dict[str, Any]]] = slurm.why_stopped) -> None:
        self.rgt_dir = Path(rgt_dir)
        self._emit = emit
        self._flush = flush
        self._scheduler = scheduler
        self._group = group if isinstance(group, str) and group else None   # a multi-node run's id
        self._ask_slurm = ask_slurm
        self._lock = threading.Lock()   # the scheduler's tick and the job's exit (report_now) both run it
        marker = read_json(self.rgt_dir / REPORTED_FILE)
        self._done = (self.rgt_dir / REPORTED_FILE).exists()
        known = marker.get("reason") if isinstance(marker, dict) else None
        self._reason: Optional[str] = known if known in slurm.REASONS else None

    def reason(self) -> Optional[str]:
        """Why the scheduler ended this attempt (slurm.REASONS), once job.preempted said so."""
        return self._reason

    def run(self) -> None:
        with self._lock:
            self._run()

    def report_now(self) -> None:
        """Before job.exited: journal a pending job.preempted first (and learn its reason), so the
        exit comes after it and carries `preempt_reason` however the two threads raced."""
        self.run()

    def _run(self) -> None:
        if self._done:
            return
        doc = preemption(self.rgt_dir)
        if doc is None:
            return
        self._done = True
        try:
            self._flush(FLUSH_WAIT_S)
        except Exception:  # the report matters more than the flush
            log.exception("flushing before job.preempted failed")
        grace = doc.get("grace_s")
        data: Dict[str, Any] = {
            "signal": doc.get("signal"), "at": doc.get("at"), "pid": doc.get("pid"), "grace_s": grace,
            "grace_from": "profile" if grace is not None else None,
            "by": "a SIGTERM rgt did not send (spot reclaim, scheduler, eviction)"}
        data.update(self._slurm_view())
        if self._group:
            data["group"] = self._group   # what `rgt track` takes to follow a requeued run's next attempt
        self._reason = data.get("reason")
        self._emit("job.preempted", data, "warn")
        try:
            fd = os.open(self.rgt_dir / REPORTED_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, (json.dumps({"at": doc.get("at"), "reason": self._reason}) + "\n").encode())
            os.close(fd)
        except OSError as e:
            log.warning("could not write %s: %s", REPORTED_FILE, e)


    def _slurm_view(self) -> Dict[str, Any]:
        if self._scheduler is None:
            return {}
        try:
            seen = self._ask_slurm(self._scheduler)
        except Exception:  # scontrol's answer is a detail; the event is what matters
            log.exception("asking Slurm why the job is ending failed")
            seen = None
        if not seen:
            return {"scheduler": self._scheduler.to_dict()}
        out: Dict[str, Any] = {"reason": seen["reason"], "by": seen["by"],
                               "scheduler": {**self._scheduler.to_dict(), "state": seen["state"],
                                             "restarts": seen["restarts"], "end_time": seen["end_time"]}}
        if seen.get("grace_s") is not None:
            out.update(grace_s=seen["grace_s"], grace_from="slurm")
        return out


__all__ = ["PREEMPT_FILE", "PreemptWatch", "preemption", "record_preemption"]
