"""Fixtures shared by the onbox tests."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest

from onbox.custody.monitor import CustodyConfig, CustodyMonitor
from onbox.scheduler import Scheduler
from tests.onbox.custodyrig import Factory, Harness, Recorder
from tests.onbox.test_launch import Rig


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """A launch rig whose runs are ended by pid after the test (see Rig.end)."""
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.end()


@pytest.fixture
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a checkpoint that stays missing: the manifest fails closed after 0.2 s, not after looking
    again for 10 s for a removal record that never comes."""
    from onbox.custody import pullmanifest
    monkeypatch.setattr(pullmanifest, "MISSING_GRACE_S", 0.2)


@pytest.fixture
def custody(tmp_path: Path) -> Iterator[Factory]:
    """Start a CustodyMonitor plus a real Scheduler over its jobs; both stopped at the end."""
    made: List[Tuple[CustodyMonitor, Scheduler]] = []
    failures: List[str] = []

    def factory(clock: Callable[[], float] = time.time, **overrides: Any) -> Harness:
        settings: Dict[str, Any] = {"run_dir": tmp_path / "run", "settle_s": 0.05,
                                    "hash_rate_bytes_s": None}
        settings.update(overrides)
        events, commits = Recorder(), []
        monitor = CustodyMonitor(CustodyConfig(**settings), events, clock=clock, on_commit=commits.append)
        monitor.start()
        scheduler = Scheduler(monitor.jobs(), lambda name, e: failures.append(f"{name}: {e!r}"))
        scheduler.start()
        made.append((monitor, scheduler))
        return Harness(monitor, events, commits)

    yield factory
    for monitor, scheduler in made:
        scheduler.stop()
        monitor.close()
    assert not failures, failures
