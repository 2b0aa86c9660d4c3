"""Binding anything but 127.0.0.1, or TCP without CURVE, is refused before anything is bound."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import onbox_cmd


@pytest.mark.parametrize("addr", ["0.0.0.0:7000", "*:7000", "10.0.0.5:7000", "[::]:7000", "localhost:7000"])
def test_non_loopback_tcp_is_refused(tmp_path: Path, addr: str) -> None:
    out = subprocess.run(onbox_cmd("serve", "--run-dir", str(tmp_path / "r"), "--tcp", addr,
                                   "--curve-dir", str(tmp_path / "k")),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "127.0.0.1" in out.stderr and "error:" in out.stderr
    assert not (tmp_path / "r" / "rgt" / "endpoints.json").exists()


def test_tcp_requires_curve(tmp_path: Path) -> None:
    out = subprocess.run(onbox_cmd("serve", "--run-dir", str(tmp_path / "r"), "--tcp", "127.0.0.1:7000"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--curve-dir" in out.stderr
