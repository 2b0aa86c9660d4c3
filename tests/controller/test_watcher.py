"""The watcher's cheap liveness check of the ssh master (the e2e tests cover the watcher whole)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from controller.follow.watcher import finished, process_alive
from controller.store.db import Store
from protocol import Event
from tests.helpers import wait_until


def test_process_alive_sees_running_zombie_and_gone_processes() -> None:
    assert process_alive(os.getpid()) is True
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Exited but not reaped yet: a zombie is not a live master.
    wait_until(lambda: open(f"/proc/{child.pid}/stat", "rb").read().rsplit(b")", 1)[1][1:2] == b"Z", 10,
               "the child to become a zombie")
    assert process_alive(child.pid) is False
    child.wait()
    assert process_alive(child.pid) is False


def test_a_run_relaunched_in_place_is_not_finished(tmp_path: Path) -> None:
    def ev(seq: int, kind: str) -> Event:
        return Event(run="r", host="h", seq=seq, ts=float(seq), kind=kind, sev="info", data={})

    with Store.open(tmp_path / "s.db") as store:
        store.apply("r", [ev(1, "sidecar.started"), ev(2, "job.started")], 2)
        assert not finished(store, "r")
        store.apply("r", [ev(3, "job.exited"), ev(4, "sidecar.stopping")], 4)
        assert finished(store, "r")
        store.apply("r", [ev(5, "sidecar.started"), ev(6, "job.started")], 6)  # the same run id again
        assert not finished(store, "r")
