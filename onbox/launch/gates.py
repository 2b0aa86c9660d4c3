"""The gates `rgt-onbox launch` passes before anything starts, and the refusals they give.

- the disk budget: free space for `copies` x the newest checkpoint (this run's, else the project's
  most recent one's) plus a margin, and enough free inodes;
- the pre-flight: `rgt-onbox health` for a few seconds; a FAIL refuses and is kept in
  rgt/preflight.json when the run directory exists.
"""
from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from rgtlib import lockfile
from rgtlib.units import human_bytes

from onbox.errors import OnboxError
from onbox.runs import (
    JobRecord,
    ProcRef,
    RunPaths,
    end_process,
    nearest_existing,
    newest_checkpoint_in,
    newest_checkpoint_of,
    read_json,
    wait_for,
    write_json_atomic,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3
MIN_FREE_INODES = 1024
RETIRE_TIMEOUT_S = 15.0
# Per-attempt records that move to rgt/attempts/<n>/ when a run is launched again.
ATTEMPT_FILES = ("exit.json", "stop.json", "job.json", "job.pid", "preflight.json", "supervisor.json",
                 "supervisor.pid", "job.announced", "job.exit_reported", "preempt.json", "preempt.reported",
                 "run.closed", "closing.json")

Health = Callable[..., int]
Stat = Callable[[str], Any]


class LaunchError(OnboxError):
    """The launch failed; `hint` says what to do. `exit_code` is what the CLI returns."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class LaunchUsageError(LaunchError):
    exit_code = EXIT_USAGE


class LaunchRefused(LaunchError):
    """A gate said no: disk budget, pre-flight FAIL, the run still running, a launch in progress."""

    exit_code = EXIT_REFUSED



# ---- the disk budget gate -----------------------------------------------------------------------


def newest_checkpoint(run_dir: Path, ckpt_dir: Path, existing: bool,
                      siblings: int = 20) -> Optional[Tuple[Path, int]]:
    """This run's newest checkpoint, else the newest of the project's most recent runs that has one."""
    found = newest_checkpoint_of(run_dir, ckpt_dir) if existing else newest_checkpoint_in(ckpt_dir)
    if found is not None:
        return found
    active = run_dir.parent
    try:
        others = sorted((p for p in active.iterdir() if p.is_dir() and p != run_dir),
                        key=lambda p: p.stat().st_mtime, reverse=True)[:siblings]
    except OSError:
        return None
    for other in others:
        found = newest_checkpoint_of(other)
        if found is not None:
            return found
    return None


def check_disk(run_dir: Path, ckpt_dir: Path, existing: bool, copies: float, margin: int,
               stat: Stat = os.statvfs) -> str:
    """Raise LaunchRefused when the disk cannot hold the run; returns a one-line summary."""
    ckpt = newest_checkpoint(run_dir, ckpt_dir, existing)
    ckpt_bytes = ckpt[1] if ckpt else 0
    need = int(copies * ckpt_bytes) + margin
    where = nearest_existing(ckpt_dir)
    st = stat(str(where))
    free = int(st.f_bavail) * int(st.f_frsize)
    basis = (f"{copies:g} x {human_bytes(ckpt_bytes)} (newest checkpoint {ckpt[0]}) + "
             f"{human_bytes(margin)} margin" if ckpt else f"{human_bytes(margin)} margin (no checkpoint yet)")
    hint = "free space (df -h), or set --min-free / --ckpt-copies if you know the run needs less"
    if free < need:
        raise LaunchRefused(f"not enough disk at {where}: {human_bytes(free)} free, need {human_bytes(need)} "
                            f"= {basis}", hint)
    if int(st.f_files) > 0 and int(st.f_favail) < MIN_FREE_INODES:
        raise LaunchRefused(f"out of inodes at {where}: {int(st.f_favail)} free (df -i)",
                            "delete small files (caches, old logs) on that filesystem")
    run_fs = nearest_existing(run_dir)
    if os.stat(run_fs).st_dev != os.stat(where).st_dev:
        st2 = stat(str(run_fs))
        free2 = int(st2.f_bavail) * int(st2.f_frsize)
        if free2 < margin:
            raise LaunchRefused(f"not enough disk at {run_fs}: {human_bytes(free2)} free, need "
                                f"{human_bytes(margin)} for logs and the journal", hint)
    return f"{human_bytes(free)} free at {where}, need {human_bytes(need)}"


# ---- the pre-flight -----------------------------------------------------------------------------


def run_preflight(paths: RunPaths, seconds: float, probe: str, health: Optional[Health]) -> Dict[str, Any]:
    """The health report (dict); raises LaunchRefused on FAIL, saving the report when the run exists."""
    if health is None:
        from onbox.monitors.preflight import run_health
        health = run_health
    buf = io.StringIO()
    try:
        health(None, seconds, True, nearest_existing(paths.run_dir), buf, gpu=probe)
    except OnboxError as e:  # an unknown probe spec
        raise LaunchUsageError(f"pre-flight: {e}") from e
    try:
        report = json.loads(buf.getvalue())
    except ValueError as e:
        raise LaunchError(f"the pre-flight check printed no report: {e}") from e
    if report.get("result") == "FAIL":
        if paths.rgt.is_dir():
            write_json_atomic(paths.preflight_json, report)
        failed = [f"{c.get('check')}{'' if c.get('gpu') is None else ' GPU ' + str(c.get('gpu'))}: "
                  f"{c.get('detail')}" for c in report.get("checks", []) if c.get("status") == "FAIL"]
        raise LaunchRefused("pre-flight FAIL: " + "; ".join(failed),
                            "`rgt-onbox health` shows the whole report; --no-preflight launches anyway")
    return dict(report)


# ---- the run directory: one launch at a time, one attempt after another ---------------------------


def take_lock(paths: RunPaths) -> int:
    fd = lockfile.try_lock(paths.launch_lock)
    if fd is None:
        raise LaunchRefused(f"another launch of {paths.run_dir.name} is in progress")
    return fd


def retire_previous(paths: RunPaths) -> int:
    """Stop the previous attempt's supervisor, file its records under rgt/attempts/<n>/; the new attempt."""
    prev = read_json(paths.run_json) or {}
    sup = read_json(paths.supervisor_json) or {}
    end_process(ProcRef.from_dict(sup), RETIRE_TIMEOUT_S)
    end_process(ProcRef.from_dict(sup.get("sidecar")), RETIRE_TIMEOUT_S)
    done = sorted(int(p.name) for p in paths.attempts.glob("*") if p.name.isdigit()) \
        if paths.attempts.is_dir() else []
    recorded = prev.get("attempt")
    last = max([recorded if isinstance(recorded, int) else 0, *done,
                1 if paths.job_json.exists() or paths.exit_json.exists() else 0])
    present = [name for name in ATTEMPT_FILES if (paths.rgt / name).exists()]
    if present or prev:
        dest = paths.attempts / str(last)
        dest.mkdir(parents=True, exist_ok=True)
        for name in present:
            os.replace(paths.rgt / name, dest / name)
        if paths.run_json.exists():
            shutil.copy2(paths.run_json, dest / "run.json")
    return last + 1


def refuse_if_running(paths: RunPaths) -> None:
    job = JobRecord.read(paths)
    if job is not None and job.alive() and paths.exit_json.exists():
        wait_for(lambda: not job.alive(), 5.0)  # the wrapper is just writing its last log line
    if job is not None and job.alive():
        pid = job.wrapper.pid if job.wrapper else job.job.pid if job.job else "?"
        raise LaunchRefused(f"run {paths.run_dir.name} is still running (pid {pid})",
                            f"stop it first: rgt-onbox stop {paths.run_dir.name}")
