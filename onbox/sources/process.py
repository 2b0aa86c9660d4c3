"""Processes through psutil: the job's liveness and the sidecar's own usage.

The only onbox module (with host.py) that imports psutil.
"""
from __future__ import annotations

from typing import Any, Dict

import psutil  # noqa: TID251 (the psutil seam)


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
