"""The job's processes that left its process group: torchrun's ranks, daemonized helpers.

`rgt-onbox stop` signals the job's process group. torchrun (torch.distributed.elastic) starts every
rank in a session of its own, so a SIGKILL of the group (the escalation after the grace, or an OOM
kill of torchrun itself) leaves the ranks running, holding the GPU. Every process of the job carries
the environment the launcher gave it, so they are found by RGT_RUN_DIR in /proc/PID/environ (the
wrapper, the supervisor and the sidecar never carry it; each node of a multi-node run has its own).
Reading other users' environ needs their uid or root: what cannot be read is not ours to stop.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, List, Set

PROC = Path("/proc")
MAX_ENVIRON = 1 << 20


def _environ_has(pid: int, wanted: Set[bytes], proc: Path) -> bool:
    try:
        with open(proc / str(pid) / "environ", "rb") as f:
            raw = f.read(MAX_ENVIRON)
    except OSError:
        return False
    return wanted.issubset(raw.split(b"\0"))


def job_processes(run_dir: Path, *, exclude: Iterable[int] = (), proc: Path = PROC) -> List[int]:
    """Live pids whose environment names this run dir (RGT_RUN_DIR), but `exclude`."""
    wanted = {f"RGT_RUN_DIR={run_dir}".encode()}
    skip = set(exclude) | {os.getpid()}
    out: List[int] = []
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            state = (proc / name / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X", b"x") and _environ_has(int(name), wanted, proc):
            out.append(int(name))
    return out


def signal_all(pids: Iterable[int], signum: int,
               kill: Callable[[int, int], None] = os.kill) -> List[int]:
    """Send `signum` to each pid; the pids it reached."""
    sent = []
    for pid in pids:
        try:
            kill(pid, signum)
        except OSError:
            continue
        sent.append(pid)
    return sent


__all__ = ["job_processes", "signal_all"]
