"""`rgt-onbox follow RUN_DIR`: serve a run whose launcher started no sidecar of its own.

The case is a Kubernetes pod: the training container's command is `rgt-onbox launch --wait
--no-sidecar ...`, and a second container, which mounts the same run volume and shares the pod's
process namespace (`shareProcessNamespace: true`, so the job wrapper's pid means the same thing
in both), runs `rgt-onbox follow RUN_DIR`. Follow waits for the launcher's rgt/job.json, then runs
in the foreground the supervisor a plain `rgt-onbox launch` starts detached (onbox/launch/supervise.py
Supervisor: it keeps one `rgt-onbox serve --pid WRAPPER` alive, restarts it when it dies, and ends
`linger_s` after the job's exit was journaled), so the container ends together with the job.

Which job.json is followed: one whose wrapper still runs, or one whose wrapper has ended with an
exit no sidecar has journaled yet (a job quicker than our start: its exit still gets reported).
A record whose exit was journaled already, or that ended unreported more than FRESH_S before follow
started, belongs to an earlier attempt (a pod re-run on the same volume); follow waits until the
launcher retires it and writes the new one.

`--node NAME|auto` follows one node of a multi-node run: RUN_DIR names the logical run
(`<root>/<project>/active/<run>`) and the followed directory is its node stream `<run>.<node>`,
worked out the way `rgt-onbox launch --node` does (onbox/launch/nodes.py: JOB_COMPLETION_INDEX in an
Indexed Job).

Signals: the first SIGTERM/SIGINT before a job appeared ends follow at once; once a job is followed
it only drops the linger, so the sidecar still journals the job's end (a pod being deleted sends
SIGTERM to every container at once, and the job needs its grace to stop); a second one stops now.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from onbox.errors import OnboxError
from onbox.launch.nodes import NodeError, identify, stream_id
from onbox.launch.supervise import Supervisor
from onbox.runs import JobRecord, RunPaths, read_json

log = logging.getLogger(__name__)

POLL_S = 0.25
FRESH_S = 60.0   # a finished, unreported attempt this much older than follow is a past pod's


class FollowError(OnboxError):
    """Nothing to follow (no job within the wait), or the run is served already."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class FollowUsageError(FollowError):
    """Bad arguments: a node that cannot be worked out."""


@dataclasses.dataclass
class FollowResult:
    run_dir: Path
    wrapper_pid: Optional[int]   # None when stopped before any job appeared
    reported: bool               # the job's exit was journaled
    stopped: bool                # a signal ended the wait or the supervisor


def resolve_run_dir(run_dir: Path, node: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Path:
    """RUN_DIR itself, or with `node` its node stream `<RUN_DIR>.<node>` (names as launch --node)."""
    run_dir = Path(run_dir).expanduser()
    if not node:
        return run_dir
    try:
        name, _count = identify(node, os.environ if environ is None else environ)
    except NodeError as e:
        raise FollowUsageError(str(e)) from e
    return run_dir.parent / stream_id(run_dir.name, name)


def _reported_pid(paths: RunPaths) -> Optional[int]:
    doc = read_json(paths.exit_reported)
    pid = doc.get("pid") if doc else None
    if pid is None:
        try:  # the older plain "<pid>" marker
            text = paths.exit_reported.read_text().strip()
        except OSError:
            return None
        pid = int(text) if text.isdigit() else None
    return pid if isinstance(pid, int) else None


def _started_at(paths: RunPaths) -> Optional[float]:
    text = (read_json(paths.job_json) or {}).get("started_at")
    try:
        return datetime.fromisoformat(str(text)).timestamp() if text else None
    except ValueError:
        return None


def current_job(paths: RunPaths, since: Optional[float] = None) -> Optional[int]:
    """The wrapper pid of the attempt to follow, or None (no record yet, or an old attempt's).

    A record whose wrapper has ended counts only when its exit is unreported, it has an exit
    record, and (with `since`, unix seconds) it started after `since` less FRESH_S: an older
    one is a previous pod's, which the launcher is about to retire."""
    try:
        before = paths.job_json.read_bytes()
    except OSError:
        return None
    job = JobRecord.read(paths)
    if job is None or job.wrapper is None:
        return None
    if not job.wrapper.alive():
        if _reported_pid(paths) == job.wrapper.pid or not paths.exit_json.exists():
            return None
        started = _started_at(paths)
        if since is not None and (started is None or started < since - FRESH_S):
            return None
    try:  # the launcher retires job.json before job.exit_reported: read them as one snapshot
        if paths.job_json.read_bytes() != before:
            return None
    except OSError:
        return None
    return job.wrapper.pid


class Follower:
    """Waits for the run's job, then supervises its sidecar in this process (see the module doc)."""

    def __init__(self, run_dir: Path, *, wait_start_s: float, linger_s: float = 60.0,
                 report_timeout_s: float = 120.0, serve_args: Sequence[str] = (),
                 python: str = sys.executable, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.paths = RunPaths(run_dir)
        self.wait_start_s = wait_start_s
        self.linger_s = linger_s
        self.report_timeout_s = report_timeout_s
        self.serve_args = list(serve_args)
        self.python = python
        self._mono = monotonic
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._signals = 0
        self._sup: Optional[Supervisor] = None
        self._since = time.time()

    def signal(self) -> None:
        """SIGTERM/SIGINT: before a job, stop; with one, finish after its exit is journaled; twice, stop."""
        with self._lock:
            self._signals += 1
            sup = self._sup
            if sup is None or self._signals > 1:
                self._stop.set()
                if sup is not None:
                    sup.stop()
                return
            sup.linger_s = 0.0
        log.info("asked to stop: ending once the job's exit is journaled (signal again to stop now)")

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            if self._sup is not None:
                self._sup.stop()

    def wait_for_job(self) -> Optional[int]:
        """The wrapper pid to follow; None when stopped first. Raises FollowError at the deadline."""
        deadline = self._mono() + self.wait_start_s
        logged = False
        while not self._stop.is_set():
            pid = current_job(self.paths, self._since)
            if pid is not None:
                return pid
            if self._mono() >= deadline:
                raise FollowError(
                    f"no job started in {self.paths.run_dir} within {self.wait_start_s:g} s "
                    f"(no current {self.paths.job_json.relative_to(self.paths.run_dir)})",
                    "start the training container's `rgt-onbox launch --no-sidecar` with the same "
                    "--root, --project and --run-id (and --node), or raise --wait-start")
            if not logged:
                log.info("waiting for a job in %s", self.paths.run_dir)
                logged = True
            self._stop.wait(POLL_S)
        return None

    def run(self) -> FollowResult:
        pid = self.wait_for_job()
        if pid is None:
            return FollowResult(self.paths.run_dir, None, False, True)
        log.info("following run %s: job wrapper pid %d", self.paths.run_dir.name, pid)
        sup = Supervisor(self.paths.run_dir, pid, self.serve_args, linger_s=self.linger_s,
                         report_timeout_s=self.report_timeout_s, python=self.python)
        with self._lock:
            self._sup = sup
            if self._signals:
                sup.linger_s = 0.0
            if self._stop.is_set():
                sup.stop()
        if sup.run() != 0:
            raise FollowError(f"another supervisor already serves {self.paths.run_dir}",
                              "launch the job with --no-sidecar when a follow container serves it")
        reported = _reported_pid(self.paths) == pid
        return FollowResult(self.paths.run_dir, pid, reported, self._stop.is_set())


def lower_priority() -> None:
    """+10 CPU nice for this process and the sidecar it starts, as the detached supervisor has."""
    try:
        os.nice(10)
    except OSError as e:
        log.warning("could not lower CPU priority: %s", e)


__all__ = ["FollowError", "FollowResult", "FollowUsageError", "Follower", "current_job", "lower_priority",
           "resolve_run_dir"]
