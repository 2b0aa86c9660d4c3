"""Children rgt starts for a transfer or a session die with it, even when rgt is SIGKILLed: an
rsync left running after `rgt pull` was killed would go on writing where nobody watches."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator, List

import psutil
import pytest

from controller import pidlock
from tests.helpers import wait_until
from tests.sshbox import SshBox, sshbox  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]
BIG = 64 << 20        # at --bwlimit=64 (KiB/s) a transfer of minutes: it is killed long before
DEATH_S = 10.0        # rsync's own cleanup after SIGTERM takes a second or two

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


@pytest.fixture
def big(tmp_path: Path) -> Path:
    f = tmp_path / "big.bin"
    with open(f, "wb") as out:
        out.truncate(BIG)   # sparse: no disk, and rsync still reads (and meters) every byte
    return f


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.NoSuchProcess:   # a short ssh command that ended meanwhile
        return ""


class FakeRgt:
    """A python process running `code` as rgt would; killed with SIGKILL, its children watched."""

    def __init__(self, code: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL)
        self.children: List[psutil.Process] = []

    def rsync_running(self, partial_in: Path) -> bool:
        """True once its rsync runs and has begun writing (every rsync process has started then)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"the rgt stand-in ended early (exit {self.proc.returncode})")
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        if not any(_name(k) == "rsync" for k in kids) or not any(partial_in.iterdir()):
            return False
        self.children = kids
        return True

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def survivors(self) -> List[psutil.Process]:
        _, alive = psutil.wait_procs(self.children, timeout=DEATH_S)
        return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for p in self.children:   # by pid (psutil checks it is still the same process)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture
def fake_rgt() -> Iterator[List[FakeRgt]]:
    made: List[FakeRgt] = []
    yield made
    for f in made:
        f.close()


def kill_mid_transfer(fake_rgt: List[FakeRgt], code: str, dest: Path, *args: str) -> FakeRgt:
    rgt = FakeRgt(code, *args)
    fake_rgt.append(rgt)
    wait_until(lambda: rgt.rsync_running(dest), timeout_s=30, what="rsync under way")
    assert any(_name(p) == "rsync" for p in rgt.children)
    rgt.kill()
    return rgt


def test_an_rsync_started_through_the_ssh_seam_dies_with_a_killed_rgt(
        big: Path, tmp_path: Path, fake_rgt: List[FakeRgt]) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    code = """
        import sys
        from controller.box import ssh
        ssh._execute(["rsync", "--bwlimit=64", "--", sys.argv[1], sys.argv[2] + "/"], timeout_s=600,
                     capture_stdout=False)
    """
    rgt = kill_mid_transfer(fake_rgt, code, dest, str(big), str(dest))
    assert rgt.survivors() == []


@pytest.mark.e2e
def test_a_push_over_ssh_dies_with_a_killed_rgt(big: Path, tmp_path: Path, sshbox: SshBox,  # noqa: F811
                                                fake_rgt: List[FakeRgt]) -> None:
    slow = tmp_path / "slow-rsync"   # the real rsync, slowed (exec: the same pid as the one rgt started)
    slow.write_text('#!/bin/sh\nexec rsync --bwlimit=64 "$@"\n')
    slow.chmod(0o755)
    code = """
        import sys
        from pathlib import Path
        from controller.box.ssh import Ssh
        ssh = Ssh("box", control_dir=Path(sys.argv[1]), config_file=Path(sys.argv[2]), rsync_bin=sys.argv[3])
        ssh.push(Path(sys.argv[4]), "~/pushed/big.bin")
    """
    landing = sshbox.home / "pushed"
    landing.mkdir()
    rgt = kill_mid_transfer(fake_rgt, code, landing, str(tmp_path / "ctl"), str(sshbox.config_file),
                            str(slow), str(big))
    names = sorted(_name(p) for p in rgt.children)
    assert "rsync" in names and "ssh" in names   # rsync and the ssh it rides on
    assert rgt.survivors() == []


def test_the_pull_rsync_dies_with_a_killed_rgt(big: Path, tmp_path: Path, fake_rgt: List[FakeRgt]) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    code = """
        import sys
        from controller.pull import fetch as pull
        meter = pull._Meter(1, 0, 0, lambda progress: None, lambda: 0.0)
        pull.run_rsync(["rsync", "--bwlimit=64", "--", sys.argv[1], sys.argv[2] + "/"], meter)
    """
    rgt = kill_mid_transfer(fake_rgt, code, dest, str(big), str(dest))
    assert rgt.survivors() == []


def test_the_preexec_is_none_where_there_is_no_prctl(monkeypatch: pytest.MonkeyPatch) -> None:
    pidlock._prctl.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        assert pidlock.dies_with_us() is None
    finally:
        pidlock._prctl.cache_clear()
    monkeypatch.undo()
    assert callable(pidlock.dies_with_us())
