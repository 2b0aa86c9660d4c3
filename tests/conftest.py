"""Suite-wide guards: no test may leak a thread or a child process, nor arm this machine's dead-man."""
from __future__ import annotations

import threading
import time
from typing import Iterator

import psutil
import pytest


def _grace_join(threads: set[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    extra = set(threading.enumerate()) - before
    _grace_join(extra, 5.0)
    alive = sorted(t.name for t in extra if t.is_alive())
    assert not alive, f"test leaked threads: {alive}"


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    extra = [p for p in me.children(recursive=True) if p.pid not in before]
    gone, alive = psutil.wait_procs(extra, timeout=5.0)
    for p in alive:  # end what this test started, by pid, then fail it
        p.kill()
    assert not alive, f"test leaked processes: {[(p.pid, p.name()) for p in alive]}"


@pytest.fixture(autouse=True)
def no_deadman_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rgt-onbox launch` arms the box's dead-man (a detached daemon under ~/.rgt) unless told
    not to; tests that launch say so through RGT_DEADMAN, and dead-man tests arm one in a temp HOME."""
    monkeypatch.setenv("RGT_DEADMAN", "off")
