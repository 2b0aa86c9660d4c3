"""Background processes kept to one by a lock file, with their pid beside it (watchers, queue dispatchers)."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional


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
