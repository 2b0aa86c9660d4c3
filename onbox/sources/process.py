"""Processes through psutil: the job's liveness and tree, GPU holders, and the sidecar's own usage.

The only onbox module (with host.py) that imports psutil. `ProcessView` is the seam the monitor and
the health check use; tests pass an object with the same methods (`ProcessSource`).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import psutil  # noqa: TID251 (the psutil seam)

from onbox.runs import proc_stat  # the one reader of /proc/PID/stat


def pid_alive(pid: int) -> bool:
    """True while pid runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # it exists; we may not look at it


def own_usage() -> Dict[str, Any]:
    """RSS and CPU seconds of this process, for the heartbeat."""
    me = psutil.Process()
    with me.oneshot():
        times = me.cpu_times()
        return {"rss_bytes": me.memory_info().rss, "cpu_s": round(times.user + times.system, 3)}


def proc_state(pid: int, proc: str = "/proc") -> Optional[str]:
    """The state letter of /proc/PID/stat ("R", "S", "T" stopped by a signal, "t" traced...); None
    when the process is gone or unreadable."""
    found = proc_stat(pid, Path(proc))
    return found[0] if found else None


def start_ticks(pid: int, proc: str = "/proc") -> Optional[int]:
    """When the process started, in clock ticks since boot: fixed for its life, unlike a start time
    on the wall clock (psutil's create_time adds /proc/stat's btime, which moves whenever the clock
    is stepped or slewed: 14 s in 10 minutes on a loaded VM here)."""
    found = proc_stat(pid, Path(proc))
    return found[2] if found else None


RANK_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK")


def proc_env(pid: int, keys: Sequence[str] = RANK_KEYS, proc: str = "/proc") -> Dict[str, str]:
    """The values of `keys` in /proc/PID/environ (the env it started with); {} when unreadable."""
    try:
        with open(os.path.join(proc, str(pid), "environ"), "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return {}
    out: Dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        key = name.decode("ascii", "replace")
        if sep and key in keys:
            out[key] = value.decode("utf-8", "replace")[:64]
    return out


def _is_python(p: Any) -> bool:
    try:
        names = [str(p.name())]
        cmd = p.cmdline()
        if cmd:
            names.append(os.path.basename(str(cmd[0])))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(n.startswith(("python", "pypy")) for n in names)


def is_wrapper(pid: int, proc: str = "/proc") -> bool:
    """True when `pid` is rgt's job wrapper (python -m onbox.launch.supervise job)."""
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
            return b"onbox.launch.supervise" in f.read(4096)
    except OSError:
        return False


def python_tree(pid: int) -> List[Tuple[int, int, str]]:
    """(pid, ppid, name) of the Python processes in the tree under `pid` (itself included), by pid."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    out = []
    for p in procs:
        try:
            if _is_python(p) and p.status() != psutil.STATUS_ZOMBIE:
                out.append((int(p.pid), int(p.ppid()), str(p.name())))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class ProcInfo:
    """A live process. `start_ticks` tells a reused pid from the one we watched; `create_time`
    (unix s, on the wall clock, which may be stepped) only when the ticks are not known."""

    pid: int
    create_time: float
    name: Optional[str] = None
    rss_bytes: Optional[int] = None
    start_ticks: Optional[int] = None


class ProcessSource(Protocol):
    def info(self, pid: int) -> Optional[ProcInfo]: ...

    def tree(self, pid: int) -> Set[int]: ...

    def visible(self, pid: int) -> bool: ...

    def holds_gpu(self, pid: int) -> Optional[bool]: ...

    def name(self, pid: int) -> Optional[str]: ...


class ProcessView:
    """`ProcessSource` over psutil and /proc. Every method answers for a vanished pid, never raises."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc

    def info(self, pid: int) -> Optional[ProcInfo]:
        """The process, or None when it is gone or a zombie."""
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                if p.status() == psutil.STATUS_ZOMBIE:
                    return None
                created = float(p.create_time())
                try:
                    rss: Optional[int] = int(p.memory_info().rss)
                    name: Optional[str] = str(p.name())
                except psutil.AccessDenied:
                    rss, name = None, None
            return ProcInfo(pid, created, name, rss, start_ticks(pid, self.proc))
        except psutil.NoSuchProcess:
            return None
        except psutil.AccessDenied:
            return ProcInfo(pid, 0.0)

    def tree(self, pid: int) -> Set[int]:
        """`pid` and all its descendants; empty when it is gone. Walks every process: call rarely."""
        try:
            p = psutil.Process(pid)
            return {pid} | {int(c.pid) for c in p.children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()
        except psutil.AccessDenied:
            return {pid}

    def visible(self, pid: int) -> bool:
        """True when `pid` exists in this PID namespace (NVML may report host pids in a container)."""
        return bool(psutil.pid_exists(pid))

    def holds_gpu(self, pid: int) -> Optional[bool]:
        """True when `pid` has an /dev/nvidia* device open; None when its fds cannot be read."""
        fd_dir = os.path.join(self.proc, str(pid), "fd")
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            return False
        except OSError:
            return None
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)).startswith("/dev/nvidia"):
                    return True
            except OSError:
                continue
        return False

    def name(self, pid: int) -> Optional[str]:
        try:
            return str(psutil.Process(pid).name())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
