"""`rgt-onbox follow RUN_DIR`: the sidecar of a run launched with --no-sidecar (a Kubernetes sidecar
container), run for real: a real launch, the real wrapper, supervisor and sidecar processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

from onbox.runs import ProcRef, RunPaths, boot_id, read_json, utc_iso, write_json_atomic
from onbox.sidecar.follow import FRESH_S, FollowUsageError, current_job, resolve_run_dir
from onbox.sidecar.journal import read_all
from tests.helpers import REPO, onbox_cmd, wait_until
from tests.onbox.test_launch import WAIT_GO, Rig, py

FAST = ["--gpu", "none", "--linger", "0", "--serve-arg=--heartbeat=1", "--serve-arg=--no-kmsg"]


class Follow:
    """`rgt-onbox follow` in a child process, its output in a file; ended by pid if a test fails."""

    def __init__(self, tmp: Path) -> None:
        self.log = tmp / "follow.log"
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self, run_dir: Path, *args: str, env: Optional[dict] = None) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(onbox_cmd("follow", str(run_dir), *args), cwd=REPO, stdout=out,
                                         stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
        return self.proc

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def end(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def follow(tmp_path: Path) -> Iterator[Follow]:
    f = Follow(tmp_path)
    try:
        yield f
    finally:
        f.end()


def kinds(run_dir: Path) -> List[str]:
    return [e["kind"] for e in read_all(run_dir / "rgt")]


# ---- waiting, refusing, naming -------------------------------------------------------------------


def test_no_job_within_wait_start_is_a_clear_failure(tmp_path: Path) -> None:
    run_dir = tmp_path / "root" / "p" / "active" / "r1"
    started = time.monotonic()
    done = subprocess.run(onbox_cmd("follow", str(run_dir), "--wait-start", "0.4s"), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert any(line.startswith(f"error: no job started in {run_dir} within 0.4 s") for line in lines)
    assert any(line.startswith("hint: ") and "--no-sidecar" in line for line in lines)
    assert time.monotonic() - started < 30


def test_bad_usage_exits_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_NODEID", "JOB_COMPLETION_INDEX",
                                                            "SKYPILOT_NODE_RANK", "NODE_RANK", "GROUP_RANK")}
    for args, message in ((["--node", "auto"], "error: --node auto found none of"),
                          (["--wait-start", "soon"], "error: 'soon' is not a duration")):
        done = subprocess.run(onbox_cmd("follow", str(tmp_path / "r"), *args), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_node_streams_are_named_as_launch_names_them(tmp_path: Path) -> None:
    base = tmp_path / "p" / "active" / "run"
    assert resolve_run_dir(base, None, {}) == base
    assert resolve_run_dir(base, "auto", {"JOB_COMPLETION_INDEX": "3"}) == base.parent / "run.n3"
    assert resolve_run_dir(base, "n1", {}) == base.parent / "run.n1"
    with pytest.raises(FollowUsageError):
        resolve_run_dir(base, "auto", {})


def test_only_the_current_attempt_is_followed(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    paths.rgt.mkdir(parents=True)
    assert current_job(paths) is None  # nothing launched yet
    me = ProcRef.of(os.getpid())
    assert me is not None
    write_json_atomic(paths.job_json, {"wrapper": me.to_dict(), "started_at": utc_iso()})
    assert current_job(paths, time.time()) == os.getpid()  # a running wrapper
    gone = ProcRef(os.getpid(), (me.start_ticks or 0) + 1, boot_id())  # this pid, another process
    now = time.time()
    write_json_atomic(paths.job_json, {"wrapper": gone.to_dict(), "started_at": utc_iso(now)})
    assert current_job(paths, now) is None  # ended without an exit record: nothing to report
    write_json_atomic(paths.exit_json, {"code": 0})
    assert current_job(paths, now) == os.getpid()  # ended just now, exit not journaled yet
    paths.exit_reported.write_text(json.dumps({"pid": os.getpid()}) + "\n")
    assert current_job(paths, now) is None  # journaled: an earlier attempt
    paths.exit_reported.unlink()
    write_json_atomic(paths.job_json, {"wrapper": gone.to_dict(), "started_at": utc_iso(now - 2 * FRESH_S)})
    assert current_job(paths, now) is None  # a past pod's attempt, about to be retired
    assert current_job(paths) == os.getpid()  # without a start time to compare, it counts


# ---- following a real run -------------------------------------------------------------------------


def test_follow_waits_for_the_launch_then_serves_the_run_to_its_end(rig: Rig, follow: Follow) -> None:
    run_dir = rig.track(rig.root / "p" / "active" / "r1")
    proc = follow.start(run_dir, "--wait-start", "60s", *FAST)
    wait_until(lambda: "waiting for a job" in follow.text(), 30, "follow to wait")
    assert proc.poll() is None and not (run_dir / "rgt" / "events.jsonl").exists()
    result = rig.launch(py(WAIT_GO), run_id="r1", sidecar=False)
    assert result.sidecar_supervisor_pid is None
    wait_until(lambda: "job.started" in kinds(run_dir), 30, "job.started from the followed sidecar")
    sup = read_json(run_dir / "rgt" / "supervisor.json") or {}
    assert sup.get("pid") == proc.pid and sup.get("job_pid") == result.pid  # the supervisor is follow
    rig.go(run_dir)
    assert proc.wait(60) == 0, follow.text()
    names = kinds(run_dir)
    assert names.index("job.started") < names.index("job.exited")
    assert (read_json(run_dir / "rgt" / "job.exit_reported") or {}).get("pid") == result.pid


def test_first_sigterm_still_journals_the_exit_a_second_stops_at_once(rig: Rig, follow: Follow) -> None:
    run_dir = rig.track(rig.root / "p" / "active" / "r2")
    result = rig.launch(py(WAIT_GO), run_id="r2", sidecar=False)
    proc = follow.start(run_dir, "--wait-start", "60s", "--gpu", "none", "--linger", "10m",
                        "--serve-arg=--heartbeat=1", "--serve-arg=--no-kmsg")
    wait_until(lambda: "job.started" in kinds(run_dir), 30, "job.started")
    proc.send_signal(signal.SIGTERM)  # a Pod being deleted: every container gets one at once
    wait_until(lambda: "asked to stop" in follow.text(), 30, "follow to take the signal")
    assert proc.poll() is None  # still serving: the job has not ended
    rig.go(run_dir)  # the job ends (in a Pod: the trainer's SIGTERM)
    assert proc.wait(60) == 0, follow.text()  # no 10 min linger: gone once the exit is journaled
    assert (read_json(run_dir / "rgt" / "job.exit_reported") or {}).get("pid") == result.pid

    run_dir = rig.track(rig.root / "p" / "active" / "r3")
    rig.launch(py(WAIT_GO), run_id="r3", sidecar=False)
    proc = follow.start(run_dir, "--wait-start", "60s", *FAST)
    wait_until(lambda: "job.started" in kinds(run_dir), 30, "job.started")
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: follow.text().count("asked to stop") >= 2, 30, "follow to take the signal")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert "job.exited" not in kinds(run_dir)  # stopped before the job ended: Rig.end stops the job
