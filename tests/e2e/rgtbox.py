"""A controller driving a run on the test sshd "box": `rgt` subprocesses with their own state.

Everything a test starts through it is ended at teardown, by pid: the follower daemon
(its lock file names it), the SSH masters, and on the box the job,
its supervisor and sidecar (their records in each run directory name them).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from controller import paths
from controller.box.ssh import Ssh
from controller.follow.client import running_pid, stop_daemon, unfollow
from controller.store.db import Store
from onbox.runs import run_status, wait_for
from onbox.stop import stop_run
from tests.helpers import REPO, end_box_side, rgt_cmd
from tests.sshbox import SshBox

TRAIN = [sys.executable, str(REPO / "scripts" / "train_tiny.py")]
ONBOX = shlex.join([sys.executable, "-m", "onbox.cli"])   # shell text: the path may hold spaces
# Fast heartbeats, no kernel log, no pre-flight, a sidecar that ends with its job, no dead-man
# (a test that wants one arms it itself).
TEST_ONBOX_ARGS = ["--onbox-arg=--no-preflight", "--onbox-arg=--sidecar-linger=0s",
                   "--onbox-arg=--deadman=off", "--onbox-arg=--serve-arg=--heartbeat=1",
                   "--onbox-arg=--serve-arg=--no-kmsg"]


class Rgt:
    """`rgt` run as a person would, against one box, with RGT_HOME under the test's tmp dir."""

    def __init__(self, tmp: Path, box: Optional[SshBox], monkeypatch: pytest.MonkeyPatch) -> None:
        self.home = tmp / "rgt-home"
        self.box = box
        self.env = {**os.environ, "RGT_HOME": str(self.home), "RGT_SSH_ALIVE_INTERVAL": "1",
                    "RGT_SSH_ALIVE_COUNT": "2", "PYTHONPATH": str(REPO)}
        if box is not None:
            self.env["RGT_SSH_CONFIG"] = str(box.config_file)
            monkeypatch.setenv("RGT_SSH_CONFIG", str(box.config_file))
            self.root = box.home / "runs"
        else:
            self.root = tmp / "runs"
        monkeypatch.setenv("RGT_HOME", str(self.home))
        self.runs: List[str] = []

    def __call__(self, *args: str, timeout_s: float = 120,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(rgt_cmd(*args), env=self.env, cwd=REPO, capture_output=True, text=True,
                             timeout=timeout_s)
        if check and out.returncode != 0:
            raise AssertionError(f"rgt {' '.join(args)} exited {out.returncode}:\n{out.stderr}")
        return out

    def add_box(self) -> None:
        assert self.box is not None
        self("hosts", "add", "box", "--ssh", self.box.alias, "--onbox", ONBOX)

    def launch(self, *train_args: str, host: str = "box") -> Dict[str, Any]:
        out = self("launch", host, "--root", str(self.root), "--json", *TEST_ONBOX_ARGS, "--",
                   *TRAIN, *train_args)
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        self.runs.append(answer["run_id"])
        return dict(answer)

    def store(self) -> Store:
        return Store.open()

    def run_dir(self, run: str) -> Path:
        with self.store() as s:
            return Path(s.run(run)["run_dir"])

    def end(self) -> None:
        for run in self.runs:
            unfollow(run)
            wait_for(lambda r=run: running_pid(r) is None, 10.0)
            run_dir = self.run_dir(run)
            if run_status(run_dir).state in ("running", "stopping"):
                stop_run(run_dir, 2.0)
            end_box_side(run_dir)
        stop_daemon()
        if self.box is not None:
            Ssh(self.box.alias, control_dir=paths.state_dir() / "ssh",
                config_file=self.box.config_file).stop_master()


@pytest.fixture
def rgt_box(sshbox: SshBox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rgt]:
    r = Rgt(tmp_path, sshbox, monkeypatch)
    r.add_box()
    try:
        yield r
    finally:
        r.end()


@pytest.fixture
def rgt_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rgt]:
    """The same controller for host `local` (no SSH)."""
    r = Rgt(tmp_path, None, monkeypatch)
    try:
        yield r
    finally:
        r.end()
