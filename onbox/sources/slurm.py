"""What Slurm says about the job this box runs: its ids, and why a SIGTERM came and how long is left.

    job = from_env(os.environ)                 # None outside a Slurm step
    stop = why_stopped(job, kill_wait_s=...)   # scontrol show job: requeue, cancel, time limit, ...

Slurm ends a job the same way for every reason (SIGTERM to the step's processes, SIGKILL KillWait
seconds later), so the signal alone does not say why. Its controller does, at the moment the signal
goes out, through `scontrol show job -o JOBID`:

    requeued    Restarts went up (scontrol requeue, a preemption in REQUEUE mode): the job runs
                again later; grace KillWait.
    cancelled   COMPLETING or CANCELLED with no restart (scancel): grace KillWait.
    time_limit  TIMEOUT, or RUNNING with EndTime at StartTime + TimeLimit and at most an hour
                away: --signal's warning before the limit; grace = until EndTime, plus KillWait.
    preempted   PREEMPTED, or RUNNING with EndTime pulled in before StartTime + TimeLimit (a
                partition's GraceTime): grace = until EndTime, plus KillWait.
    signalled   anything else (scancel --signal, a kill by hand): grace unknown.

KillWait comes from `scontrol show config`. Times are read as this machine's local time, the way
scontrol prints them. Every value is checked before use: ids are digits, states upper-case words,
and a scontrol that is missing, slow (TIMEOUT_S) or says something else gives None, never an error:
the preemption is journaled either way.

Measured on Slurm 22.05 (tests/slurm): `scontrol requeue` shows COMPLETING with Restarts 1 at
the signal; scancel COMPLETING, then CANCELLED; a partition preemption with GraceTime=5 keeps
RUNNING and moves EndTime to about now + GraceTime + KillWait. A job that exits during that grace
is not requeued: Slurm records it FAILED (or COMPLETED), so a job that wants the requeue must run
on until Slurm ends it. While slurmctld delivers a --signal warning the job shows SIGNALING, a
RUNNING job with its signal on the way (read on a loaded machine): it counts as RUNNING.

Standard library only; Python 3.9.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

TIMEOUT_S = 5.0
# A --signal warning comes at most this long before the time limit (Slurm allows 65535 s; people
# ask for a few minutes). Further out, a SIGTERM while RUNNING is someone's scancel --signal.
WARNING_MAX_S = 3600.0
_DIGITS = re.compile(r"^[0-9]{1,12}$")
_STATE = re.compile(r"^[A-Z_]{1,32}$")
RUNNING = ("RUNNING", "SIGNALING")   # SIGNALING: running, a --signal warning being delivered
_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d$")
_LIMIT = re.compile(r"^(?:(\d{1,5})-)?(\d{1,5})(?::(\d{1,2}))?(?::(\d{1,2}))?$")
REASONS = ("requeued", "cancelled", "time_limit", "preempted", "signalled")
_BY = {
    "requeued": "Slurm requeued the job (scontrol requeue, or a preemption that requeues)",
    "cancelled": "Slurm cancelled the job (scancel)",
    "time_limit": "Slurm's time limit (--time): the job is near or at its end time",
    "preempted": "Slurm preempted the job for another one",
    "signalled": "a SIGTERM through Slurm (scancel --signal, or a kill by hand)",
}

Run = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    job_id: str
    step_id: Optional[str]       # the srun step this process runs in (None in the batch script)
    restart_count: int           # SLURM_RESTART_COUNT: how often the job was requeued before now

    def to_dict(self) -> Dict[str, Any]:
        return {"name": "slurm", "job_id": self.job_id, "step_id": self.step_id,
                "restart_count": self.restart_count}


def from_env(environ: Mapping[str, str]) -> Optional[SlurmJob]:
    """The Slurm job this process runs in (SLURM_JOB_ID, SLURM_STEP_ID, SLURM_RESTART_COUNT), or None."""
    job = environ.get("SLURM_JOB_ID", "")
    if not _DIGITS.match(job):
        return None
    step = environ.get("SLURM_STEP_ID", "")
    restarts = environ.get("SLURM_RESTART_COUNT", "0")
    return SlurmJob(job, step if _DIGITS.match(step) else None,
                    int(restarts) if _DIGITS.match(restarts) else 0)


def from_record(doc: Any) -> Optional[SlurmJob]:
    """A SlurmJob back from run.json's "scheduler" (to_dict), checked again; None if it is not one."""
    if not isinstance(doc, Mapping) or doc.get("name") != "slurm":
        return None
    job, step, restarts = doc.get("job_id"), doc.get("step_id"), doc.get("restart_count")
    if not isinstance(job, str) or not _DIGITS.match(job):
        return None
    return SlurmJob(job, step if isinstance(step, str) and _DIGITS.match(step) else None,
                    restarts if isinstance(restarts, int) and restarts >= 0 else 0)


def fields(text: str) -> Dict[str, str]:
    """`scontrol show ... -o` output: its KEY=VALUE words (a value holding spaces keeps only its
    first word; the keys read here never hold any)."""
    out: Dict[str, str] = {}
    for word in text.split():
        key, eq, value = word.partition("=")
        if eq and key and key not in out:
            out[key] = value
    return out


def parse_time(value: Optional[str]) -> Optional[float]:
    """scontrol's local YYYY-MM-DDTHH:MM:SS as epoch seconds; None for Unknown, None or garbage."""
    if not value or not _TIME.match(value):
        return None
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def parse_limit(value: Optional[str]) -> Optional[float]:
    """A TimeLimit ([D-]HH:MM:SS, MM:SS, or minutes) in seconds; None for UNLIMITED or garbage."""
    m = _LIMIT.match(value or "")
    if not m:
        return None
    days, a, b, c = m.groups()
    if c is not None:
        h, mi, s = int(a), int(b), int(c)
    elif b is not None:
        h, mi, s = (int(a), int(b), 0) if days else (0, int(a), int(b))
    else:
        h, mi, s = (int(a), 0, 0) if days else (0, int(a), 0)
    return float(((int(days or 0) * 24 + h) * 60 + mi) * 60 + s)


def _scontrol(args: List[str], run: Run) -> Optional[str]:
    try:
        out = run(["scontrol", *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def kill_wait(run: Run = subprocess.run) -> Optional[float]:
    """The cluster's KillWait in seconds (scontrol show config), or None."""
    text = _scontrol(["show", "config"], run)
    m = re.search(r"^KillWait\s*=\s*(\d{1,6}) sec", text or "", re.MULTILINE)
    return float(m.group(1)) if m else None


def scancel_step(job: SlurmJob, run: Run = subprocess.run) -> bool:
    """`scancel --signal=TERM JOB.STEP`: Slurm sends SIGTERM to every process of the step on every
    node at once; True when scancel took it. (A bare `scancel JOB.STEP` SIGKILLs a step's processes
    at once, measured on 22.05: no grace, no exit journaled.) The step then ends as its processes
    exit; the job, and what its batch script does next, stay."""
    if job.step_id is None:
        return False
    try:
        out = run(["scancel", "--signal=TERM", f"{job.job_id}.{job.step_id}"], capture_output=True, text=True,
                  timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0


def why_stopped(job: SlurmJob, *, run: Run = subprocess.run, now: Optional[float] = None,
                kill_wait_s: Optional[float] = None) -> Optional[Dict[str, Any]]:
    """Why Slurm is ending `job` now and the seconds until SIGKILL (see the module doc), as
    {"reason", "by", "grace_s", "state", "restarts", "end_time"}; None when scontrol says nothing."""
    text = _scontrol(["show", "job", "-o", job.job_id], run)
    if text is None:
        return None
    wait = kill_wait(run) if kill_wait_s is None else kill_wait_s
    return classify(fields(text), job.restart_count, time.time() if now is None else now, wait)


def classify(f: Mapping[str, str], restarts_before: int, now: float,
             kill_wait_s: Optional[float]) -> Optional[Dict[str, Any]]:
    """The reason for fields of `scontrol show job -o` read at `now` (see the module doc)."""
    state = f.get("JobState", "")
    if not _STATE.match(state):
        return None
    restarts = int(f["Restarts"]) if _DIGITS.match(f.get("Restarts", "")) else None
    end, start = parse_time(f.get("EndTime")), parse_time(f.get("StartTime"))
    limit = parse_limit(f.get("TimeLimit"))
    left = None if end is None else max(0.0, end - now)
    natural_end = start + limit if start is not None and limit is not None else None

    def until_end() -> Optional[float]:
        return None if left is None else left + (kill_wait_s or 0.0)

    if (restarts is not None and restarts > restarts_before) or state.startswith("REQUEUE"):
        reason, grace = "requeued", kill_wait_s
    elif state in ("COMPLETING", "CANCELLED"):
        reason, grace = "cancelled", kill_wait_s
    elif state in ("TIMEOUT", "DEADLINE"):
        reason, grace = "time_limit", kill_wait_s
    elif state == "PREEMPTED":
        reason, grace = "preempted", kill_wait_s
    elif state in RUNNING and left is not None and natural_end is not None and end is not None:
        if end < natural_end - 2.0:
            reason, grace = "preempted", until_end()
        elif left <= WARNING_MAX_S:
            reason, grace = "time_limit", until_end()
        else:
            reason, grace = "signalled", None
    else:
        reason, grace = "signalled", None
    return {"reason": reason, "by": _BY[reason], "grace_s": None if grace is None else round(grace, 1),
            "state": state, "restarts": restarts, "end_time": f.get("EndTime") if end is not None else None}


__all__ = ["REASONS", "SlurmJob", "classify", "fields", "from_env", "from_record", "kill_wait",
           "parse_limit", "parse_time", "scancel_step", "why_stopped"]
