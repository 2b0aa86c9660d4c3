"""Background processes kept to one by a lock file, with their pid beside it (watchers, queue dispatchers)."""
from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


def holder(lock: Path, pid_file: Path) -> Optional[int]:
    """The pid of the process holding `lock`, or None when nobody holds it (or it cannot be read)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return int(pid_file.read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None  # the lock is held but the pid not written yet
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def start(module: str, name: str, lock: Path, pid_file: Path, log_path: Path,
          wait_s: float) -> Optional[int]:
    """Start `python -m MODULE NAME` in its own session (output appended to log_path) and wait
    until it holds `lock`; the pid holding it then. When it ends first (another process won the
    lock, or it failed: its log says which), whoever holds the lock, or None."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, name], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                close_fds=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pid = holder(lock, pid_file)
        if pid == proc.pid or proc.poll() is not None:
            return pid
        time.sleep(0.02)  # waiting on another process's lock: nothing to block on
    log.warning("%s %s (pid %d) has not taken its lock after %gs; see %s",
                module, name, proc.pid, wait_s, log_path)
    return proc.pid
