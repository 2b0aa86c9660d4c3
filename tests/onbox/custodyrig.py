"""What the `custody` fixture (tests/onbox/conftest.py: a CustodyMonitor with a real Scheduler over
its jobs) hands a test. No torch here: the 3.9 leg runs the close-out's tests with it."""
from __future__ import annotations

from typing import Callable, List, Optional

from onbox.custody.monitor import CustodyMonitor
from tests.helpers import Recorder as BaseRecorder

WAIT_S = 10.0


class Recorder(BaseRecorder):
    def sev_of(self, kind: str) -> List[Optional[str]]:
        return [s for k, _, s in self.events if k == kind]


class Harness:
    def __init__(self, monitor: CustodyMonitor, events: Recorder, commits: List[float]) -> None:
        self.monitor = monitor
        self.events = events
        self.commits = commits
        self.run = monitor.run_dir
        self.ckpt = monitor.ckpt_dir

    def idle(self) -> None:
        assert self.monitor.wait_idle(WAIT_S), self.monitor.status()


Factory = Callable[..., Harness]
