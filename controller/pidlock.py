"""The processes rgt starts: background ones kept to one by a lock file, with their pid beside it
(watchers, queue dispatchers), and children that must not outlive rgt (dies_with_us: rsync, ssh)."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rgtlib import lockfile

log = logging.getLogger(__name__)


def holder(lock: Path, pid_file: Path) -> Optional[int]:
    """The pid of the process holding `lock`, or None when nobody holds it (or it cannot be read)."""
    return lockfile.holder_pid(lock, pid_file)


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


_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


@functools.lru_cache(maxsize=1)
def _prctl() -> Optional[Any]:
    """libc's prctl, looked up once in the parent (never in a forked child); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def dies_with_us() -> Optional[Callable[[], None]]:
    """A Popen preexec_fn that has the child sent SIGTERM when this process dies, even by SIGKILL
    (Linux PR_SET_PDEATHSIG); None where there is no such call.

    For children that serve only this process: a transfer (rsync) or an ssh session left
    running after `rgt pull` is killed would go on writing into a directory nobody watches.
    SIGTERM, not SIGKILL: rsync then keeps what it received. The signal comes when the
    *thread* that started the child ends, so start it from a thread that waits for it.
    A forked grandchild (ssh -f's master) does not inherit it and lives on as designed.
    Should this process die before prctl runs, the child ends itself (its parent changed).
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(255)

    return preexec
