"""Stopping a run's job on this box: `rgt-onbox stop` and the controller's `rgt stop` reach here.

    stop_run(run_dir, grace_s) -> StopResult

stop.json is written before any signal, so the exit is explained as asked for; only the process
group the run recorded (pid + start time, onbox/runs.py's JobRecord) is signalled, then the job's
processes that left the group (onbox/strays.py). A run launched in a Slurm step is stopped through
Slurm (onbox/sources/slurm.py), every node of the step marked first. Linux only (/proc), standard
library only, like onbox/runs.py.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
from pathlib import Path
from typing import IO, Any, Callable, Dict, Optional

from onbox import strays
from onbox.fsutil import write_json_atomic
from onbox.runs import JobRecord, ProcRef, RunPaths, group_members, read_json, run_status, utc_iso, wait_for
from onbox.sources import slurm

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StopResult:
    run_id: str
    run_dir: str
    outcome: str                 # stopped | killed | not_running | refused
    detail: str
    code: Optional[int] = None
    signal: Optional[int] = None
    pgid: Optional[int] = None
    strays: int = 0              # the job's processes outside its group (torchrun ranks) also stopped
    via: str = "signal"          # signal: SIGTERM to the group; "scancel JOB.STEP": through Slurm
    nodes_marked: int = 0        # the other nodes of the Slurm step whose stop.json this stop wrote

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _signal_group(pgid: int, leader: Optional[ProcRef], signum: int,
                  killpg: Callable[[int, int], None]) -> bool:
    """Signal the job's process group if it is still ours; False when nothing was left to signal.

    The group is ours while its leader is our job (pid and start time match) or, once the leader
    has exited, while members remain (a group id is not reused while the group exists).
    """
    if leader is not None and leader.recycled():
        return False
    if (leader is None or not leader.alive()) and not group_members(pgid):
        return False
    try:
        killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def stop_run(run_dir: Path, grace_s: float = 30.0, *, exit_wait_s: float = 10.0,
             killpg: Callable[[int, int], None] = os.killpg,
             scancel: Optional[Callable[[slurm.SlurmJob], bool]] = None) -> StopResult:
    """SIGTERM the job's process group, wait `grace_s`, then SIGKILL what is left.

    stop.json is written first, so the exit is explained. Only the process group of the job this
    run recorded (pid + start time) is ever signalled; never the sidecar, its supervisor, or a
    process that merely reuses a recorded pid. Returns once the wrapper has recorded the exit
    (or `exit_wait_s` after the group is gone).

    A run launched in a Slurm step (run.json's "scheduler" names the job and step) is stopped
    through Slurm: stop.json goes first into this node's run and into every other node stream of
    the same step under this root (so no node reads the SIGTERM as a preemption), then `scancel
    --signal=TERM JOB.STEP` signals the step on every node at once: the step only, never the job,
    so what the batch script does after srun (copying checkpoints off node-local disk) still runs.
    The SIGKILL after `grace_s` stays this node's own. Without scancel, or when it fails, the group
    is signalled here.
    """
    paths = RunPaths(Path(run_dir))
    status = run_status(paths.run_dir)
    result = StopResult(status.run_id, str(paths.run_dir), "not_running", f"run is {status.label}")
    job = JobRecord.read(paths)
    if job is None or job.pgid is None or status.state not in ("running", "stopping"):
        return result
    pgid, leader = job.pgid, job.job
    if leader is not None and leader.recycled():
        result.outcome, result.detail = "refused", f"pid {leader.pid} now belongs to another process"
        return result
    _write_stop(paths, job, grace_s)
    result.pgid = pgid
    step = slurm.from_record((read_json(paths.run_json) or {}).get("scheduler"))
    sent = False
    if step is not None and step.step_id is not None:
        result.nodes_marked = _mark_step_nodes(paths, step, grace_s)
        if (scancel or slurm.scancel_step)(step):
            result.via, sent = f"scancel --signal=TERM {step.job_id}.{step.step_id}", True
    if not sent:
        sent = _signal_group(pgid, leader, signal.SIGTERM, killpg)
    gone = wait_for(lambda: not group_members(pgid), grace_s, 0.1) if sent else True
    result.outcome = "stopped"
    if not gone and _signal_group(pgid, leader, signal.SIGKILL, killpg):
        doc = read_json(paths.stop_json) or {}
        write_json_atomic(paths.stop_json, {**doc, "escalated": True, "killed_at": utc_iso()})
        result.outcome = "killed"
        wait_for(lambda: not group_members(pgid), exit_wait_s, 0.05)
    wait_for(lambda: not job.alive(), exit_wait_s, 0.05)  # the wrapper records the exit, then ends
    result.strays = _stop_strays(paths.run_dir, grace_s if result.outcome == "stopped" else 0.0)
    exit_doc = read_json(paths.exit_json)
    if exit_doc is not None:
        code, sig = exit_doc.get("code"), exit_doc.get("signal")
        result.code = code if isinstance(code, int) else None
        result.signal = sig if isinstance(sig, int) else None
    result.detail = run_status(paths.run_dir).label
    return result


def _write_stop(paths: RunPaths, job: JobRecord, grace_s: float) -> None:
    write_json_atomic(paths.stop_json, {"requested_at": utc_iso(), "grace_s": grace_s,
                                        "by_pid": os.getpid(), "pgid": job.pgid, "attempt": job.attempt,
                                        "escalated": False})


def _mark_step_nodes(paths: RunPaths, step: slurm.SlurmJob, grace_s: float) -> int:
    """Write stop.json into the other running node streams of this Slurm step (siblings of this run
    dir whose run.json names the same group, job and step); how many."""
    group = (read_json(paths.run_json) or {}).get("group")
    if not isinstance(group, str) or not group:
        return 0
    marked = 0
    try:
        siblings = sorted(paths.run_dir.parent.glob(f"{group}.*"))
    except OSError:
        return 0
    for d in siblings:
        other = RunPaths(d)
        if d == paths.run_dir or not other.run_json.is_file():
            continue
        meta = read_json(other.run_json) or {}
        theirs = slurm.from_record(meta.get("scheduler"))
        if meta.get("group") != group or theirs is None or \
                (theirs.job_id, theirs.step_id) != (step.job_id, step.step_id):
            continue
        job = JobRecord.read(other)
        if job is None or job.pgid is None or run_status(d).state not in ("running", "stopping"):
            continue
        try:
            _write_stop(other, job, grace_s)
            marked += 1
        except OSError as e:
            log.warning("could not mark %s stopped: %s", d, e)
    return marked


def _stop_strays(run_dir: Path, grace_s: float) -> int:
    """SIGTERM, then after `grace_s` SIGKILL, the job's processes outside its group (torchrun's
    ranks: see onbox.strays); how many there were."""
    left = strays.job_processes(run_dir)
    if not left:
        return 0
    strays.signal_all(left, signal.SIGTERM)
    if not wait_for(lambda: not strays.job_processes(run_dir), grace_s, 0.1):
        strays.signal_all(strays.job_processes(run_dir), signal.SIGKILL)
        wait_for(lambda: not strays.job_processes(run_dir), 5.0, 0.05)
    return len(left)


def render_stop(result: StopResult, as_json: bool, out: IO[str]) -> None:
    if as_json:
        out.write(json.dumps(result.to_dict()) + "\n")
        return
    verbs = {"stopped": "stopped", "killed": "killed after the grace period", "not_running": "not running",
             "refused": "not stopped"}
    via = f", through {result.via}" if result.via != "signal" else ""
    out.write(f"run {result.run_id}: {verbs.get(result.outcome, result.outcome)} ({result.detail}){via}\n")


__all__ = ["StopResult", "render_stop", "stop_run"]
