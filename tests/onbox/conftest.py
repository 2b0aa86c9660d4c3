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
