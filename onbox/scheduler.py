"""Periodic jobs and the one thread that runs them.

A job is a small object with a name, an interval and run(). A job that raises
is logged with its traceback, counted, and reported once per failing streak
through `on_failure`; the scheduler goes on with the other jobs.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Protocol

log = logging.getLogger(__name__)


class PeriodicJob(Protocol):
    name: str
    interval_s: float

    def run(self) -> None: ...


class FunctionJob:
    """A job from a plain callable."""

    def __init__(self, name: str, interval_s: float, fn: Callable[[], None]) -> None:
        self.name = name
        self.interval_s = interval_s
        self._fn = fn

    def run(self) -> None:
        self._fn()


FailureHook = Callable[[str, Optional[BaseException]], None]


class Scheduler:
    """Runs jobs on one thread; `stop()` returns within one wait, never a sleep."""

    def __init__(self, jobs: List[PeriodicJob], on_failure: FailureHook,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._jobs = list(jobs)
        self._on_failure = on_failure
        self._mono = monotonic
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.failures: Dict[str, int] = {}
        self._failing: Dict[str, bool] = {}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rgt-scheduler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        now = self._mono()
        due = {job.name: now + job.interval_s for job in self._jobs}
        while not self._stop.is_set():
            now = self._mono()
            for job in self._jobs:
                if due[job.name] <= now:
                    self._run_one(job)
                    due[job.name] = max(due[job.name] + job.interval_s, self._mono())
            next_due = min(due.values(), default=now + 1.0)
            self._stop.wait(max(0.0, next_due - self._mono()))

    def _run_one(self, job: PeriodicJob) -> None:
        try:
            job.run()
        except Exception as e:  # a job boundary: log, count, report, go on
            log.exception("job %s failed", job.name)
            self.failures[job.name] = self.failures.get(job.name, 0) + 1
            if not self._failing.get(job.name):
                self._failing[job.name] = True
                self._on_failure(job.name, e)
            return
        if self._failing.pop(job.name, False):
            self._on_failure(job.name, None)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
