"""Preemption: a SIGTERM rgt did not send is recorded by the wrapper and journaled by the sidecar;
`rgt-onbox launch --wait` stays until the job ends and passes the signal on."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

from onbox.custody.preempt import PREEMPT_FILE, PreemptWatch, preemption, record_preemption
from onbox.runs import ProcRef, read_json
from onbox.sidecar.journal import read_all
from tests.helpers import REPO, wait_until
from tests.onbox.test_launch import WAIT_GO, Rig, py


def test_record_is_written_once_and_never_for_rgts_own_stop(tmp_path: Path) -> None:
    assert record_preemption(tmp_path, signal.SIGTERM, 5.0, 123)
    first = preemption(tmp_path)
    assert first is not None and (first["signal"], first["grace_s"], first["pid"]) == (15, 5.0, 123)
    assert not record_preemption(tmp_path, signal.SIGTERM, 5.0, 123)  # a second SIGTERM changes nothing
    assert preemption(tmp_path) == first
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "stop.json").write_text("{}")
    assert not record_preemption(stopped, signal.SIGTERM, None, 1)
    assert preemption(stopped) is None


def test_watch_flushes_then_reports_once_across_restarts(tmp_path: Path) -> None:
    calls: List[Tuple[str, Any]] = []

    def emit(kind: str, data: Optional[Mapping[str, Any]], sev: Optional[str]) -> None:
        calls.append((kind, dict(data or {}), sev))

    watch = PreemptWatch(tmp_path, emit, lambda timeout_s: calls.append(("flush", timeout_s)))
    watch.run()
    assert calls == []  # nothing to report yet
    record_preemption(tmp_path, signal.SIGTERM, 30.0, 77)
    watch.run()
    watch.run()
    assert [c[0] for c in calls] == ["flush", "job.preempted"]
    kind, data, sev = calls[1]
    assert sev == "warn" and data["grace_s"] == 30.0 and data["signal"] == 15 and data["pid"] == 77
    again = PreemptWatch(tmp_path, emit, lambda timeout_s: calls.append(("flush", timeout_s)))
    again.run()  # a restarted sidecar: already reported
    assert len(calls) == 2


def kinds(run_dir: Path) -> List[str]:
    return [e["kind"] for e in read_all(run_dir / "rgt")]


def test_sigterm_to_the_wrapper_is_a_preemption_with_its_grace(rig: Rig) -> None:
    result = rig.launch(py(WAIT_GO), preempt_grace_s=5.0)
    wait_until(lambda: "job.started" in kinds(result.run_dir), 20, "job.started")
    os.kill(result.pid, signal.SIGTERM)  # what a spot reclaim or a scheduler does
    doc = rig.finished(result.run_dir)
    assert doc["preempted"] is True and doc["signal"] == signal.SIGTERM and doc["stop_requested"] is False
    assert doc["preempt"]["grace_s"] == 5.0 and doc["preempt_to_exit_s"] >= 0
    events = read_all(result.run_dir / "rgt")
    names = [e["kind"] for e in events]
    assert names.index("job.preempted") < names.index("job.exited")
    preempted = next(e for e in events if e["kind"] == "job.preempted")
    exited = next(e for e in events if e["kind"] == "job.exited")
    assert preempted["sev"] == "warn" and preempted["data"]["grace_s"] == 5.0
    assert exited["data"]["preempted"] is True and exited["data"]["signal"] == signal.SIGTERM


def test_rgts_own_stop_is_not_a_preemption(rig: Rig) -> None:
    from onbox.stop import stop_run

    result = rig.launch(py(WAIT_GO))
    wait_until(lambda: "job.started" in kinds(result.run_dir), 20, "job.started")
    stop_run(result.run_dir, 5.0)
    doc = rig.finished(result.run_dir)
    assert doc["stop_requested"] is True and "preempted" not in doc
    assert not (result.run_dir / "rgt" / PREEMPT_FILE).exists()
    assert "job.preempted" not in kinds(result.run_dir)
    exited = next(e for e in read_all(result.run_dir / "rgt") if e["kind"] == "job.exited")
    assert exited["data"]["stop_requested"] is True and "preempted" not in exited["data"]


def launch_cli(rig: Rig, *command: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "onbox.cli", "launch", "--wait", "--json", "--root", str(rig.root),
            "--project", "p", "--no-preflight", "--probe", "none", "--sidecar-linger", "0",
            "--serve-arg=--heartbeat", "--serve-arg=1", "--", *command]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(argv, cwd=rig.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_wait_returns_the_jobs_status_after_the_sidecar_reported_it(rig: Rig) -> None:
    proc = launch_cli(rig, *py("import sys; sys.exit(7)"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err.decode()
    run_dir = Path(json.loads(out.decode().splitlines()[0])["run_dir"])
    rig.track(run_dir)
    assert (run_dir / "rgt" / "job.exit_reported").exists()  # the exit was journaled before return
    assert "job.exited" in kinds(run_dir)


def test_wait_passes_sigterm_on_and_the_run_records_a_preemption(rig: Rig) -> None:
    proc = launch_cli(rig, *py(WAIT_GO))
    assert proc.stdout is not None
    run_dir = Path(json.loads(proc.stdout.readline().decode())["run_dir"])
    rig.track(run_dir)
    wait_until(lambda: "job.started" in kinds(run_dir), 20, "job.started")
    proc.send_signal(signal.SIGTERM)  # a container runtime stopping the pod
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert (read_json(run_dir / "rgt" / "exit.json") or {}).get("preempted") is True
    assert "job.preempted" in kinds(run_dir)


def test_a_stop_before_the_wrappers_pid_is_known_reaches_it_once_known() -> None:
    from onbox.launch.wait import Forwarder

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with Forwarder() as forwarder:
            os.kill(os.getpid(), signal.SIGTERM)   # the pod is stopped while the launch is still going
            assert forwarder.pending == [signal.SIGTERM]
            forwarder.target(child.pid)
            assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdin is not None
        child.stdin.close()


def test_a_sigterm_to_every_process_of_a_step_still_journals_the_exit(rig: Rig) -> None:
    """What Slurm does when it ends a step (scancel, requeue, the time limit): SIGTERM to every
    process in it, the supervisor and the sidecar too. `launch --wait` starts them with
    --finish-on-term, so they stay until the job's exit is journaled (the 300 s linger dropped)."""
    result = rig.launch(py(WAIT_GO), finish_on_term=True, sidecar_linger_s=300)
    rgt = result.run_dir / "rgt"
    wait_until(lambda: "job.started" in kinds(result.run_dir), 20, "job.started")
    sup = wait_until(lambda: ProcRef.from_dict(read_json(rgt / "supervisor.json")), 20, "the supervisor")
    sidecar = wait_until(lambda: ProcRef.from_dict((read_json(rgt / "supervisor.json") or {}).get("sidecar")),
                         20, "the sidecar")
    job = wait_until(lambda: (read_json(rgt / "job.json") or {}).get("job"), 20, "the job")
    for pid in (sidecar.pid, sup.pid, result.pid):   # the order proctrack may use
        os.kill(pid, signal.SIGTERM)
    # The wrapper passes its SIGTERM on to the job at once: on a busy machine the job may have
    # ended by then, which is the step ending as it should.
    with contextlib.suppress(ProcessLookupError):
        os.kill(job["pid"], signal.SIGTERM)
    doc = rig.finished(result.run_dir, timeout_s=60)
    assert doc["preempted"] is True
    names = kinds(result.run_dir)
    assert names.index("job.preempted") < names.index("job.exited") < names.index("sidecar.stopping"), names
    log = (rgt / "supervisor.log").read_text() if (rgt / "supervisor.log").exists() else ""
    assert "stopping once the job's exit is journaled" in log or "step is ending" in log
