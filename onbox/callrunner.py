"""A worker thread that runs calls one at a time, each with a timeout: every NVML call
(onbox/sources/nvml.py) and every GPU sampling round (onbox/monitors/health.py, onbox/monitors/preflight.py).

Pure threading: callers hand it callables. A call that does not return in time marks the runner
degraded; later calls fail fast until the stuck call comes back, so a hung driver never hangs the
sidecar.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Deque, Optional

logger = logging.getLogger(__name__)


class CallTimeout(Exception):
    """A call did not return in time, or the worker is still stuck in an earlier one."""


class RunnerClosed(Exception):
    """The worker thread was stopped; no more calls can run."""


class _Job:
    __slots__ = ("label", "fn", "background", "started", "done", "abandoned", "result", "error", "finished")

    def __init__(self, label: str, fn: Callable[[], Any], background: bool) -> None:
        self.label = label
        self.fn = fn
        self.background = background
        self.started = False
        self.done = False
        self.abandoned = False
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.finished = threading.Event()


class CallRunner:
    """Runs calls one at a time on one long-lived worker thread, each with a timeout.

    A call that overruns its timeout leaves the worker stuck inside it. Until that call returns, every
    new call fails fast with `CallTimeout` and `degraded_reason` names the stuck call; when it returns,
    the runner recovers by itself. Background calls (event waits) run only when no foreground call has
    been queued or finished within `background_grace_s`, so a long event wait never starves sampling.
    """

    def __init__(self, name: str = "rgt-nvml", background_grace_s: float = 0.01) -> None:
        self._name = name
        self._grace_s = background_grace_s
        self._cond = threading.Condition()
        self._fg: Deque[_Job] = collections.deque()
        self._bg: Deque[_Job] = collections.deque()
        self._last_fg = 0.0
        self._stuck: Optional[_Job] = None
        self._stuck_reason: Optional[str] = None
        self._timeouts = 0
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    @property
    def degraded_reason(self) -> Optional[str]:
        """Why calls are failing fast right now, or None when the worker is free."""
        with self._cond:
            return self._stuck_reason if self._stuck is not None else None

    @property
    def timeout_count(self) -> int:
        """How many calls have overrun their timeout since start (never decreases)."""
        with self._cond:
            return self._timeouts

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()

    def call(self, label: str, fn: Callable[[], Any], timeout_s: float, background: bool = False) -> Any:
        """Run `fn()` on the worker and return its result or raise its exception.

        Raises `CallTimeout` when it does not finish within `timeout_s` (or the worker is stuck), and
        `RunnerClosed` once `stop` was called or before `start`.
        """
        job = _Job(label, fn, background)
        with self._cond:
            if self._stopping or self._thread is None:
                raise RunnerClosed(f"{self._name} worker is not running")
            if self._stuck is not None:
                raise CallTimeout(f"{label} skipped: {self._stuck_reason}")
            (self._bg if background else self._fg).append(job)
            if not background:
                self._last_fg = time.monotonic()
            self._cond.notify_all()
        finished = job.finished.wait(timeout_s)
        with self._cond:
            if not job.done:
                if finished:  # set by stop() for a job that never ran
                    raise RunnerClosed(f"{self._name} worker stopped before {label} ran")
                job.abandoned = True
                if not job.started:
                    raise CallTimeout(f"{label} still queued after {timeout_s:.2f} s")
                self._timeouts += 1
                self._stuck = job
                self._stuck_reason = f"{label} did not return within {timeout_s:.2f} s"
                logger.warning("%s degraded: %s", self._name, self._stuck_reason)
                raise CallTimeout(self._stuck_reason)
        if job.error is not None:
            raise job.error
        return job.result

    def wait_recovered(self, timeout_s: float) -> bool:
        """Wait until no call is stuck (True) or `timeout_s` passed or the runner stopped (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._stuck is not None and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return self._stuck is None

    def stop(self, timeout_s: float) -> bool:
        """Stop the worker; True when its thread ended within `timeout_s`."""
        with self._cond:
            self._stopping = True
            for job in list(self._fg) + list(self._bg):
                job.abandoned = True
                job.finished.set()
            self._fg.clear()
            self._bg.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("%s worker still inside a call at stop; left to exit on its own", self._name)
            return False
        return True

    def _next_job(self) -> Optional[_Job]:
        with self._cond:
            while not self._stopping:
                if self._fg:
                    job = self._fg.popleft()
                elif self._bg:
                    idle = time.monotonic() - self._last_fg
                    if idle < self._grace_s:
                        self._cond.wait(self._grace_s - idle)
                        continue
                    job = self._bg.popleft()
                else:
                    self._cond.wait()
                    continue
                if not job.abandoned:
                    job.started = True
                    return job
            return None

    def _work(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            try:
                job.result = job.fn()
            except BaseException as e:  # handed to the caller, who decides
                job.error = e
            with self._cond:
                job.done = True
                if not job.background:
                    self._last_fg = time.monotonic()
                if self._stuck is job:
                    logger.warning("%s recovered: %s has returned", self._name, job.label)
                    self._stuck = None
                    self._stuck_reason = None
                    self._cond.notify_all()
            job.finished.set()
