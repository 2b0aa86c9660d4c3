"""A pytest plugin for bench/suite_cpu.py: each xdist worker in a cpu-accounting cgroup of its own.

A cgroup holds every process its members start, detached ones included (the sidecars, the
daemon, sshd's sessions), so the cgroup's CPU counter read around a test is what that test cost
the machine, whatever ran it. Each worker appends one JSON line per test to
$RGT_SUITE_CPU_DIR/<worker>.jsonl: {"id", "cpu_s", "wall_s"}. Needs root and either cgroup v2
or v1's cpuacct controller; without them it records nothing.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any, Iterator, Optional

import pytest

V2 = Path("/sys/fs/cgroup/cgroup.controllers")
V1 = Path("/sys/fs/cgroup/cpuacct")
_cgroup: Optional[Path] = None
_out: Optional[IO[str]] = None


def cgroup_base() -> Optional[Path]:
    """Where a cpu-accounting cgroup can be made here, or None."""
    base = Path("/sys/fs/cgroup") if V2.exists() else V1
    return base if os.access(base, os.W_OK) else None


def _usage_s(cg: Path) -> float:
    if (cg / "cpuacct.usage").exists():
        return int((cg / "cpuacct.usage").read_text()) / 1e9
    stat = dict(line.split() for line in (cg / "cpu.stat").read_text().splitlines())
    return int(stat["usage_usec"]) / 1e6


def pytest_configure(config: pytest.Config) -> None:
    global _cgroup, _out
    worker, out_dir = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("RGT_SUITE_CPU_DIR")
    name = os.environ.get("RGT_SUITE_CPU_CGROUP")
    if not worker or not out_dir or not name or os.geteuid() != 0:
        return
    base = cgroup_base()
    if base is None:
        return
    cg = base / name / worker
    cg.mkdir(parents=True, exist_ok=True)
    (cg / "cgroup.procs").write_text(str(os.getpid()))
    _cgroup, _out = cg, open(Path(out_dir) / f"{worker}.jsonl", "a")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    if _cgroup is None or _out is None:
        yield
        return
    cpu, wall = _usage_s(_cgroup), time.monotonic()
    yield
    _out.write(json.dumps({"id": item.nodeid, "cpu_s": round(_usage_s(_cgroup) - cpu, 3),
                           "wall_s": round(time.monotonic() - wall, 3)}) + "\n")
    _out.flush()
