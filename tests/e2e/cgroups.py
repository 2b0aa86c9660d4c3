"""A small memory cgroup for the OOM tests and the soak bench: one way to find and limit one."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Optional

import pytest

from tests.helpers import wait_until

LIMIT_BYTES = 256 << 20


def memory_cgroup_base() -> Optional[Path]:
    """A writable cgroup (v2, or v1's memory controller) under this process's own."""
    if os.geteuid() != 0:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
        else:
            continue
        if os.access(base, os.W_OK):
            return base
    return None


def limit_memory(cg: Path, limit_bytes: int = LIMIT_BYTES) -> None:
    """Cap cg at limit_bytes with no swap beyond it (v2 memory.max/swap.max, or v1's limits)."""
    limit = str(limit_bytes)
    if (cg / "memory.max").exists():
        (cg / "memory.max").write_text(limit)
        if (cg / "memory.swap.max").exists():
            (cg / "memory.swap.max").write_text("0")
    else:
        (cg / "memory.limit_in_bytes").write_text(limit)
        if (cg / "memory.memsw.limit_in_bytes").exists():
            (cg / "memory.memsw.limit_in_bytes").write_text(limit)


@contextlib.contextmanager
def small_memory_cgroup(prefix: str) -> Iterator[Path]:
    """An empty cgroup limited to 256 MiB (no swap), removed once empty; skips the test without one."""
    base = memory_cgroup_base()
    if base is None:
        pytest.skip("no writable memory cgroup here (needs root and cgroup v1 memory or v2)")
    cg = base / f"{prefix}-{os.getpid()}"
    cg.mkdir()
    try:
        limit_memory(cg)
        yield cg
    finally:
        wait_until(lambda: not (cg / "cgroup.procs").read_text().strip(), 30, "the cgroup to empty")
        cg.rmdir()
