"""Fixtures the controller's tests share."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """RGT_HOME in tmp_path, for every controller test: no test may touch the real state dir.
    A follower daemon that a test's `rgt` command started there is stopped after it (by the pid
    its lock names); the runs it followed were the test's own."""
    state = tmp_path / "state"
    monkeypatch.setenv("RGT_HOME", str(state))
    # Should RGT_HOME ever be ignored, the fallbacks land in tmp_path too, never in ~.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    yield state
    if (state / "daemon.lock").exists():
        from controller.follow.client import stop_daemon

        stop_daemon()
