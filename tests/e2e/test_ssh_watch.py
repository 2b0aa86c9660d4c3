"""End to end: `rgt watch` over the SSH tunnel keeps its exit-code contract.

10 within 2 s of a NaN written on the box, 0 on a clean finish (also one that ended while nobody
followed and its sidecar had gone: read back from the journal), 3 at the timeout, 4 when the
box's sshd stays down past the link budget. The box is the test sshd on 127.0.0.1.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from controller.follow.client import running_pid
from controller.follow.link import process_alive
from onbox.sidecar.journal import read_all
from tests.e2e.rgtbox import Rgt
from tests.helpers import REPO, rgt_cmd, wait_until
from tests.sshbox import SshBox

pytestmark = pytest.mark.e2e


def watch(rgt: Rgt, *args: str, timeout_s: float = 90) -> Tuple[int, Dict[str, Any], float]:
    """Run `rgt watch ARGS --json`; (exit code, its one JSON line, wall time it exited)."""
    out = subprocess.run(rgt_cmd("watch", *args, "--json"), env=rgt.env, cwd=REPO, capture_output=True,
                         text=True, timeout=timeout_s)
    ended = time.time()
    lines: List[str] = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, (out.stdout, out.stderr)
    return out.returncode, json.loads(lines[0]), ended


def metrics_time(run_dir: Path, step: int) -> float:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] == step:
            return float(row["time"])
    raise AssertionError(f"no metrics line for step {step}")


def test_watch_wakes_on_a_nan_then_reports_a_clean_finish(rgt_box: Rgt) -> None:
    rgt = rgt_box
    go = rgt.root / "go-nan"
    answer = rgt.launch("--steps", "100000", "--log-every", "10", "--step-seconds", "0.01",
                        "--nan-at", "200", "--stop-file", str(go))
    run = answer["run_id"]
    # The launch answer names the follower daemon (watcher_pid too, for scripts written before it).
    assert answer["daemon_pid"] == answer["watcher_pid"] == running_pid(run) is not None
    # The daemon dies (SIGKILL, by the pid its lock names): rgt watch starts another, which resumes.
    os.kill(answer["daemon_pid"], signal.SIGKILL)
    wait_until(lambda: running_pid(run) is None, 10, "the daemon's lock to be released")
    code, record, ended = watch(rgt, run, "--timeout", "60")
    assert code == 10, record
    assert record["event"]["kind"] == "train.nonfinite" and record["event"]["data"]["step"] == 200
    assert "nan" in record["explain"].lower() and record["next"].startswith("rgt ")
    # Woken by the NaN, after its line was written: how soon is bench/wake_latency.py's to measure
    # (p99 target 1 s), not a bound here that the suite's own load decides.
    assert ended > metrics_time(rgt.run_dir(run), 200), record

    # The NaN already woke a watch: the next one is not woken by it again, and times out (3).
    code, record, _ = watch(rgt, run, "--timeout", "1.5")
    assert code == 3, record

    go.write_text("")  # the job ends with exit 0, but it went NaN: not a clean finish
    code, record, _ = watch(rgt, run, "--timeout", "60")
    assert code == 10 and record["event"]["kind"] == "run.closed", record
    assert json.loads(rgt("runs", "--json").stdout)["runs"][0]["state"] == "failed"
    assert record["event"]["data"]["final_ok"] is False and "non-finite" in json.dumps(record["event"])


def test_watch_exits_0_on_a_clean_finish(rgt_box: Rgt) -> None:
    rgt = rgt_box
    run = rgt.launch("--steps", "60", "--log-every", "10", "--ckpt-every", "30",
                     "--step-seconds", "0.01")["run_id"]
    code, record, _ = watch(rgt, run, "--timeout", "60")
    assert code == 0, record
    assert record["event"]["kind"] == "run.closed" and record["event"]["data"]["code"] == 0
    runs = {r["run"]: r for r in json.loads(rgt("runs", "--json").stdout)["runs"]}
    assert runs[run]["state"] == "finished" and runs[run]["host"] == "box" and runs[run]["code"] == 0


def test_watch_exits_4_when_the_box_stays_unreachable_past_the_budget(rgt_box: Rgt, sshbox: SshBox) -> None:
    rgt = rgt_box
    go = rgt.root / "go-4"
    run = rgt.launch("--steps", "100000", "--step-seconds", "0.01", "--stop-file", str(go))["run_id"]
    with rgt.store() as s:
        wait_until(lambda: s.cursor(run) > 0, 30, "events in the store")
    sshbox.stop()
    try:
        code, record, _ = watch(rgt, run, "--timeout", "60", "--link-budget", "2s")
    finally:
        sshbox.restart()
    assert code == 4, record
    assert record["link"] == "down" and "nothing about the job" in record["explain"].lower()
    go.write_text("")


def test_a_run_that_ended_while_nobody_followed_ends_here_from_its_journal(rgt_box: Rgt) -> None:
    """The laptop slept through the end: the job exited, its sidecar's linger ran out (0 s here,
    5 min for real) and nothing answers on the sockets; the journal, read over ssh, still ends it."""
    rgt = rgt_box
    go = rgt.root / "go-asleep"
    answer = rgt.launch("--steps", "100000", "--step-seconds", "0.01", "--ckpt-every", "40",
                        "--stop-file", str(go))
    run = answer["run_id"]
    with rgt.store() as s:
        wait_until(lambda: s.cursor(run) > 0, 30, "events in the store")
    os.kill(answer["daemon_pid"], signal.SIGKILL)    # nobody follows from here
    wait_until(lambda: running_pid(run) is None, 10, "the daemon's lock to be released")
    rgt_dir = rgt.run_dir(run) / "rgt"
    sidecar_pid = int(json.loads((rgt_dir / "endpoints.json").read_text())["pid"])
    go.write_text("")
    wait_until(lambda: process_alive(sidecar_pid) is False, 60, "the sidecar to end after the job")
    journaled = [e["kind"] for e in read_all(rgt_dir)]
    assert "job.exited" in journaled and journaled[-1] == "sidecar.stopping", journaled
    code, record, _ = watch(rgt, run, "--timeout", "60")
    assert code == 0, record
    assert record["event"]["kind"] == "run.closed" and record["event"]["data"]["code"] == 0
    with rgt.store() as s:
        assert [e.kind for e in s.events(run)] == journaled and s.gaps(run) == []
    runs = {r["run"]: r for r in json.loads(rgt("runs", "--json").stdout)["runs"]}
    assert runs[run]["state"] == "finished", runs[run]
