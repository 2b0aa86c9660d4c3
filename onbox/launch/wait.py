"""`rgt-onbox launch --wait`: stay in the foreground until the job ends, for schedulers.

Slurm ends a step, and Kubernetes a container, when its first process exits, and then kills
what is left. Under `srun` or as a container's command the launcher must therefore outlive the
job: it waits for the job wrapper (its own child), passes SIGTERM/SIGINT on to it (so a
scheduler's stop reaches the job, and the wrapper records a preemption), then waits a little for
the sidecar to journal the exit and to close the run (rgt/run.closed: the last checkpoints hashed,
the final manifest built) before it returns the job's exit status.
"""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any, Dict, List, Optional

from onbox.runs import RunPaths, read_json, wait_for

REPORT_WAIT_S = 15.0  # after the job ends, how long the sidecar gets to journal job.exited
CLOSE_WAIT_S = 180.0  # and then to close the run (rgt/run.closed: onbox/sidecar/closing.py)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Forwarder:
    """Passes SIGTERM/SIGINT/SIGHUP on to the wrapper while installed. Installed before the launch,
    so a stop that comes before the wrapper's pid is known (a pod stopped at once) is kept and
    passed on as soon as it is, instead of killing the launcher with the job left running."""

    def __init__(self) -> None:
        self.pid: Optional[int] = None
        self.pending: List[int] = []
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> Forwarder:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *_exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def target(self, pid: int) -> None:
        self.pid = pid
        pending, self.pending = self.pending, []
        for signum in pending:
            _kill(pid, signum)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.pid is None:
            self.pending.append(signum)
        else:
            _kill(self.pid, signum)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def wait_for_job(run_dir: Path, wrapper_pid: int, *, report_wait_s: float = REPORT_WAIT_S,
                 sidecar: bool = True, forwarder: Optional[Forwarder] = None) -> int:
    """Block until the wrapper (a child of this process) exits; its exit status as a shell sees it.
    `forwarder`: one installed before the launch (onbox/cli/launch.py's run_launch); else one is
    installed here."""
    paths = RunPaths(run_dir)
    with Forwarder() if forwarder is None else contextlib.nullcontext(forwarder) as installed:
        installed.target(wrapper_pid)
        status = _reap(wrapper_pid)
    if sidecar and wait_for(lambda: paths.exit_reported.exists(), report_wait_s, 0.1):
        wait_for(lambda: paths.closed.exists(), CLOSE_WAIT_S, 0.1)
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
