"""End to end: a real sidecar process with the scripted GPU, and `rgt-onbox health` here."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from protocol import Event
from protocol.endpoints import Endpoints
from tests.helpers import REPO, Client, SidecarProcess, onbox_cmd, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture
def job() -> Iterator[subprocess.Popen]:
    """A stand-in training job: a child that waits until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def collect(c: Client, until: str, seen: List[Event]) -> Dict[str, List[Event]]:
    """Read live events until one of kind `until` arrived; all of them, by kind."""
    wait_until(lambda: seen.append(c.next_event(10_000)) or seen[-1].kind == until, 30, until)
    by_kind: Dict[str, List[Event]] = {}
    for ev in seen:
        by_kind.setdefault(ev.kind, []).append(ev)
    return by_kind


def test_xid79_scenario_reaches_subscribers_and_a_killed_job_is_reported(
        tmp_path: Path, job: subprocess.Popen) -> None:
    run_dir = tmp_path / "run-gpu"
    sc = SidecarProcess(run_dir, "--gpu", "fake:xid79_on_gpu3", "--gpu-interval", "0.1", "--no-kmsg",
                        "--pid", str(job.pid)).start()
    c = Client(Endpoints.read(run_dir / "rgt"))
    seen: List[Event] = []
    try:
        by_kind = collect(c, "gpu.lost", seen)
        xid, = by_kind["gpu.xid"]
        assert xid.sev == "critical" and xid.data["code"] == 79 and xid.data["fatal"] is True
        assert xid.data["gpu"] == 3 and "re-rent" in xid.data["advice"]
        lost, = by_kind["gpu.lost"]
        assert lost.sev == "critical" and lost.data["gpu"] == 3
        job.kill()
        job.wait(10)
        by_kind = collect(c, "job.exited", seen)
        exited, = by_kind["job.exited"]
        assert exited.data["pid"] == job.pid and exited.data["code"] is None and exited.sev != "info"
        assert len(by_kind["gpu.xid"]) == 1  # one Xid, one report
    finally:
        c.close()
        sc.stop()


def test_health_here_reports_the_gpu_as_unavailable_not_failed(tmp_path: Path) -> None:
    out = subprocess.run(onbox_cmd("health", "--seconds", "0.5", "--json", "--run-dir", str(tmp_path)),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    by_check = {c["check"]: c for c in report["checks"]}
    assert by_check["gpu"]["status"] == "SKIP" and "NVML" in by_check["gpu"]["detail"]
    assert by_check["disk"]["status"] == "PASS" and by_check["memory"]["status"] == "PASS"
    assert report["result"] == "PASS"


def test_health_fails_a_box_with_a_fatal_xid(tmp_path: Path) -> None:
    out = subprocess.run(onbox_cmd("health", "--seconds", "5", "--probe", "fake:xid79_on_gpu3",
                                   "--run-dir", str(tmp_path)),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "FAIL" in out.stdout and "79" in out.stdout and "RESULT: FAIL" in out.stdout
