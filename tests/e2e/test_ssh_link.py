"""End to end: a run launched over SSH onto the test sshd, followed through link failures.

The box is a real OpenSSH sshd on 127.0.0.1 (tests/sshbox.py); rgt reaches it through one
ControlMaster with unix-socket forwards, exactly as it reaches a rented box.
"""
from __future__ import annotations

import os
import signal
from typing import List

import pytest

from controller import paths
from controller.box.ssh import Ssh
from onbox.sidecar.journal import read_all
from tests.e2e.rgtbox import Rgt
from tests.helpers import wait_until
from tests.sshbox import SshBox

pytestmark = pytest.mark.e2e


def stored_seqs(rgt: Rgt, run: str) -> List[int]:
    with rgt.store() as s:
        return [e.seq for e in s.events(run)]


def local_kinds(rgt: Rgt, run: str) -> List[str]:
    with rgt.store() as s:
        return [e.kind for e in s.local_events(run)]


def master(rgt: Rgt, box: SshBox) -> Ssh:
    return Ssh(box.alias, control_dir=paths.state_dir() / "ssh", config_file=box.config_file)


def test_a_killed_master_and_a_frozen_box_lose_no_event(rgt_box: Rgt, sshbox: SshBox) -> None:
    rgt = rgt_box
    go = rgt.root / "go"
    run = rgt.launch("--steps", "100000", "--log-every", "5", "--ckpt-every", "400",
                     "--step-seconds", "0.005", "--stop-file", str(go))["run_id"]
    wait_until(lambda: len(stored_seqs(rgt, run)) >= 5, 30, "events in the store")

    # 1. The ssh master dies (SIGKILL): link.lost, then the watcher brings it back.
    pid = wait_until(lambda: master(rgt, sshbox).master_pid(), 10, "the ssh master")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: "link.lost" in local_kinds(rgt, run), 10, "link.lost after the kill")
    wait_until(lambda: "link.restored" in local_kinds(rgt, run), 20, "link.restored after the kill")
    after_kill = len(stored_seqs(rgt, run))
    wait_until(lambda: len(stored_seqs(rgt, run)) > after_kill + 3, 20, "events flowing again")

    # 2. The box's side freezes (SIGSTOP its sshd sessions): ServerAlive gives up, rgt reconnects.
    sshbox.freeze()
    try:
        wait_until(lambda: local_kinds(rgt, run).count("link.lost") == 2, 20, "link.lost while frozen")
        wait_until(lambda: local_kinds(rgt, run).count("link.restored") == 2, 30, "link.restored")
    finally:
        sshbox.thaw()
    frozen_at = len(stored_seqs(rgt, run))
    wait_until(lambda: len(stored_seqs(rgt, run)) > frozen_at + 3, 20, "events flowing again")

    # The job ran on through both: end it, then the store must equal the box's journal.
    go.write_text("")
    run_dir = rgt.run_dir(run)
    wait_until(lambda: any(e.kind == "sidecar.stopping" for e in _events(rgt, run)), 60,
               "the sidecar's stop in the store")
    journal = [int(e["seq"]) for e in read_all(run_dir / "rgt")]
    seqs = stored_seqs(rgt, run)
    assert seqs == journal == list(range(1, len(journal) + 1))
    with rgt.store() as s:
        assert s.gaps(run) == []
        lost = [e for e in s.local_events(run) if e.kind == "link.lost"]
    assert all("says nothing about the job" in e.data["note"] for e in lost)
    exited = [e for e in _events(rgt, run) if e.kind == "job.exited"]
    assert exited and exited[0].data["code"] == 0


def _events(rgt: Rgt, run: str) -> list:  # type: ignore[type-arg]
    with rgt.store() as s:
        return s.events(run)


def test_a_changed_host_key_is_refused_with_a_clear_message(rgt_box: Rgt, sshbox: SshBox) -> None:
    rgt = rgt_box
    assert rgt("hosts", "check", "box").returncode == 0
    master(rgt, sshbox).stop_master()
    sshbox.rotate_host_key()
    out = rgt("hosts", "check", "box", check=False)
    assert out.returncode == 1
    assert "host key" in out.stderr.lower() and "changed" in out.stderr.lower(), out.stderr
    assert "ssh-keygen" in out.stderr and " -R " in out.stderr
    out = rgt("launch", "box", "--json", "--", "true", check=False)
    assert out.returncode == 1 and "changed" in out.stderr.lower()
