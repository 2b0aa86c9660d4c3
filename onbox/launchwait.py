"""`rgt-onbox launch --wait`: stay in the foreground until the job ends, for schedulers.

Slurm ends a step, and Kubernetes a container, when its first process exits, and then kills
what is left. Under `srun` or as a container's command the launcher must therefore outlive the
job: it waits for the job wrapper (its own child), passes SIGTERM/SIGINT on to it (so a
scheduler's stop reaches the job, and the wrapper records a preemption), then waits a little for
the sidecar to journal the exit before it returns the job's exit status.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Dict, List

from onbox.runs import RunPaths, read_json, wait_for

REPORT_WAIT_S = 15.0  # after the job ends, how long the sidecar gets to journal job.exited


def wait_for_job(run_dir: Path, wrapper_pid: int, *, report_wait_s: float = REPORT_WAIT_S,
                 sidecar: bool = True) -> int:
    """Block until the wrapper (a child of this process) exits; its exit status as a shell sees it."""
    paths = RunPaths(run_dir)
    previous: Dict[signal.Signals, Any] = {}

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.kill(wrapper_pid, signum)
        except OSError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        previous[signum] = signal.signal(signum, forward)
    try:
        status = _reap(wrapper_pid)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if sidecar:
        wait_for(lambda: paths.exit_reported.exists(), report_wait_s, 0.1)
    return _shell_status(status, read_json(paths.exit_json) or {})


def _reap(pid: int) -> int:
    """The raw wait status (waitpid retries after our handlers run), or -1 if it was not our child."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return -1


def _shell_status(status: int, exit_doc: Dict[str, Any]) -> int:
    if status >= 0 and os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if status >= 0 and os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    code, sig = exit_doc.get("code"), exit_doc.get("signal")
    return int(code) if isinstance(code, int) else 128 + int(sig) if isinstance(sig, int) else 1


__all__: List[str] = ["wait_for_job"]
