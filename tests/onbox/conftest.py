"""Fixtures shared by the onbox tests."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

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
