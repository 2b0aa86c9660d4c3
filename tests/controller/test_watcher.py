"""The watcher's cheap liveness check of the ssh master (the e2e tests cover the watcher whole)."""
from __future__ import annotations

import os
import subprocess
import sys

from controller.watcher import process_alive
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
