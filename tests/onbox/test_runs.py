"""Runs on this box from their files and /proc: states, `ps`, finding a run, stop's safety checks."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from onbox.custody import manifest
from onbox.runs import (
    ProcRef,
    RunError,
    journal_tail,
    list_runs,
    newest_checkpoint_of,
    render_ps,
    resolve_run,
    run_status,
)
from onbox.stop import render_stop, stop_run
from tests.helpers import wait_until

SLEEPER = [sys.executable, "-c", "import signal\nwhile True: signal.pause()"]


@pytest.fixture
def sleepers() -> Iterator[List[subprocess.Popen]]:
    """Stand-in jobs: real processes in sessions of their own, ended by pid after the test."""
    procs: List[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def start(procs: List[subprocess.Popen]) -> Tuple[subprocess.Popen, ProcRef]:
    p = subprocess.Popen(SLEEPER, start_new_session=True)
    procs.append(p)
    ref = wait_until(lambda: ProcRef.of(p.pid), 30, "the process in /proc")
    return p, ref


def make_run(root: Path, name: str, *, job: Optional[ProcRef] = None, wrapper: Optional[ProcRef] = None,
             exit_doc: Optional[Dict[str, Any]] = None, stop: bool = False,
             sidecar: Optional[ProcRef] = None, events: Optional[List[bytes]] = None) -> Path:
    project, _, run_id = name.partition("/")
    run_dir = root / project / "active" / run_id
    rgt = run_dir / "rgt"
    rgt.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"id": run_id, "project": project, "attempt": 1,
                                                  "started_at": "2024-06-01T12:00:00+00:00"}))
    if job is not None or wrapper is not None:
        wrapper = wrapper or job
        assert wrapper is not None
        (rgt / "job.json").write_text(json.dumps({
            "wrapper": wrapper.to_dict(), "job": job.to_dict() if job else None,
            "pgid": job.pid if job else None, "attempt": 1}))
    if exit_doc is not None:
        (rgt / "exit.json").write_text(json.dumps(exit_doc))
    if stop:
        (rgt / "stop.json").write_text(json.dumps({"requested_at": "x", "grace_s": 1}))
    if sidecar is not None:
        me = ProcRef.of(os.getpid())
        assert me is not None
        (rgt / "supervisor.json").write_text(json.dumps({**me.to_dict(), "sidecar": sidecar.to_dict()}))
    if events is not None:
        (rgt / "events.jsonl").write_bytes(b"".join(events))
    return run_dir


def event(seq: int, kind: str, ts: float = 1_700_000_000.0) -> bytes:
    return (json.dumps({"v": 1, "run": "r", "host": "h", "seq": seq, "ts": ts, "kind": kind, "sev": "info",
                        "data": {}}, separators=(",", ":")) + "\n").encode()


def dead_ref(procs: List[subprocess.Popen]) -> ProcRef:
    p, ref = start(procs)
    p.kill()
    p.wait(10)
    return ref


def test_states_from_files_and_proc(tmp_path: Path, sleepers: List[subprocess.Popen]) -> None:
    root = tmp_path / "root"
    _, live = start(sleepers)
    _, other = start(sleepers)
    recycled = ProcRef(live.pid, (live.start_ticks or 0) + 1, live.boot_id)
    make_run(root, "p/running", job=live, sidecar=other,
             events=[event(1, "sidecar.started"), event(2, "job.started", 1_700_000_100.0),
                     b'{"v":1,"run":"r","seq":3,"ts":1']),  # a torn last line is not the tail
    make_run(root, "p/stopping", job=live, stop=True)
    make_run(root, "p/exited", job=dead_ref(sleepers), exit_doc={"code": 3, "signal": None},
             sidecar=dead_ref(sleepers))
    make_run(root, "p/killed", job=dead_ref(sleepers), exit_doc={"code": None, "signal": 9}, stop=True)
    make_run(root, "p/failed", wrapper=dead_ref(sleepers),
             exit_doc={"code": 127, "signal": None, "error": "cannot start the command: no such file"})
    make_run(root, "p/vanished", job=dead_ref(sleepers))
    make_run(root, "q/recycled", job=recycled)  # the pid lives, but it is not the process we started
    make_run(root, "q/starting")

    states = {s.run_id: s for s in list_runs(root)}
    assert {k: s.label for k, s in states.items()} == {
        "running": "running", "stopping": "stopping", "exited": "exited code 3",
        "killed": "killed by SIGKILL (stop)", "failed": "failed", "vanished": "vanished",
        "recycled": "vanished", "starting": "starting"}
    running = states["running"]
    assert (running.pid, running.job_pid, running.sidecar_alive) == (live.pid, live.pid, True)
    assert (running.last_seq, running.last_kind, running.last_ts) == (2, "job.started", 1_700_000_100.0)
    assert states["exited"].sidecar_alive is False and states["vanished"].sidecar_alive is None
    assert states["failed"].error and states["failed"].code == 127

    out = io.StringIO()
    render_ps(list_runs(root), root, False, out, now=1_700_000_110.0)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["RUN", "STATE", "PID", "SIDECAR", "SEQ", "LAST", "EVENT"]
    row = next(line for line in lines if line.startswith("p/running "))
    assert row.split() == ["p/running", "running", str(live.pid), "up", "2", "job.started", "10s", "ago"]
    out = io.StringIO()
    render_ps(list_runs(root), root, True, out)
    doc = json.loads(out.getvalue())
    assert doc["root"] == str(root) and len(doc["runs"]) == 8
    assert {r["run_id"]: r["state"] for r in doc["runs"]}["killed"] == "exited"


def test_journal_tail_reads_rotated_files_when_the_current_one_is_empty(tmp_path: Path) -> None:
    rgt = tmp_path / "rgt"
    rgt.mkdir()
    (rgt / "events.000000000001.jsonl").write_bytes(event(1, "a") + event(2, "b"))
    (rgt / "events.jsonl").write_bytes(b"")
    assert journal_tail(rgt) == (2, "b", 1_700_000_000.0)
    big = b"".join(event(n, "x" * 50) for n in range(3, 400))
    (rgt / "events.jsonl").write_bytes(big)
    assert journal_tail(rgt) == (399, "x" * 50, 1_700_000_000.0)


def test_zombie_is_not_alive(sleepers: List[subprocess.Popen]) -> None:
    p, ref = start(sleepers)
    assert ref.alive()
    os.kill(p.pid, signal.SIGKILL)  # not reaped yet: a zombie until wait()
    wait_until(lambda: not ref.alive(), 30, "the zombie to count as gone")
    assert not ref.recycled()


def test_resolve_run(tmp_path: Path) -> None:
    root = tmp_path / "root"
    one = make_run(root, "p/only-here")
    make_run(root, "p/twice")
    make_run(root, "q/twice")
    assert resolve_run(root, "only-here") == one.resolve()
    assert resolve_run(root, "p/only-here") == one.resolve()
    assert resolve_run(root, str(one)) == one.resolve()
    assert resolve_run(root, "q/twice").parent.parent.name == "q"
    with pytest.raises(RunError, match="several projects"):
        resolve_run(root, "twice")
    with pytest.raises(RunError, match="no run"):
        resolve_run(root, "nope")
    for odd in ("p/../p/only-here", "p/only-here\n", "only-here\n", "..", ".", "p/.."):
        with pytest.raises(RunError, match="no run"):
            resolve_run(root, odd)  # the run-id grammar of protocol.ids, on both parts: no '..', no newline
    with pytest.raises(RunError, match="not a run directory"):
        resolve_run(root, str(root / "p"))  # an explicit path that holds no run


def test_a_run_ref_is_a_name_before_it_is_a_folder_of_the_cwd(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A clone in a folder named `rgt` once resolved ".." to its parent (which holds `rgt/`), and a
    word naming a folder of the cwd shadowed the run of that id: refs are names first."""
    root = tmp_path / "root"
    one = make_run(root, "p/only-here")
    make_run(root, "p/twice")
    make_run(root, "q/twice")
    cwd = tmp_path / "work" / "rgt"
    cwd.mkdir(parents=True)
    for shadow in ("twice", "only-here", "elsewhere"):
        (cwd / shadow / "rgt").mkdir(parents=True)
        (cwd / shadow / "run.json").write_text("{}")
    monkeypatch.chdir(cwd)
    with pytest.raises(RunError, match="several projects"):
        resolve_run(root, "twice")
    assert resolve_run(root, "only-here") == one.resolve()
    with pytest.raises(RunError, match="no run"):
        resolve_run(root, "elsewhere")
    for up in ("..", "."):
        with pytest.raises(RunError, match="no run"):
            resolve_run(root, up)
    assert resolve_run(root, "./elsewhere") == (cwd / "elsewhere").resolve()  # explicit: a path
    assert resolve_run(root, "../rgt/twice") == (cwd / "twice").resolve()
    with pytest.raises(RunError, match="not a run directory"):
        resolve_run(root, "../rgt")   # the cwd, written as a path: it holds no run


def test_stop_never_signals_a_recycled_pid(tmp_path: Path, sleepers: List[subprocess.Popen]) -> None:
    victim, ref = start(sleepers)
    recycled = ProcRef(ref.pid, (ref.start_ticks or 0) + 7, ref.boot_id)
    run_dir = make_run(tmp_path / "root", "p/old", job=recycled)
    sent: List[Tuple[int, int]] = []
    result = stop_run(run_dir, 0.2, killpg=lambda pgid, sig: sent.append((pgid, sig)))
    assert result.outcome == "not_running" and sent == []
    assert victim.poll() is None and not (run_dir / "rgt" / "stop.json").exists()


def test_stop_escalates_to_the_recorded_group_only(tmp_path: Path, sleepers: List[subprocess.Popen]) -> None:
    _, ref = start(sleepers)
    run_dir = make_run(tmp_path / "root", "p/live", job=ref)
    sent: List[Tuple[int, int]] = []
    result = stop_run(run_dir, 0.2, exit_wait_s=0.1, killpg=lambda pgid, sig: sent.append((pgid, sig)))
    assert sent == [(ref.pid, signal.SIGTERM), (ref.pid, signal.SIGKILL)]  # the fake ignored both
    assert result.outcome == "killed"
    stop = json.loads((run_dir / "rgt" / "stop.json").read_text())
    assert stop["escalated"] is True and stop["pgid"] == ref.pid and stop["grace_s"] == 0.2
    assert run_status(run_dir).state == "stopping"


def test_newest_checkpoint_prefers_the_manifest_and_sums_a_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    (run_dir / "rgt").mkdir(parents=True)
    (ckpts / "step2").mkdir(parents=True)
    (ckpts / "step1.pt").write_bytes(b"x" * 10)
    (ckpts / "step2" / "shard0").write_bytes(b"x" * 7)
    (ckpts / "step2" / "shard1").write_bytes(b"x" * 5)
    (ckpts / "step3.pt.tmp").write_bytes(b"x" * 100)  # a write in progress is no checkpoint
    for name, t in (("step1.pt", 1000), ("step2", 2000), ("step3.pt.tmp", 3000)):
        os.utime(ckpts / name, (t, t))
    assert newest_checkpoint_of(run_dir) == (ckpts / "step2", 12)
    st = (ckpts / "step1.pt").stat()
    manifest.append(run_dir, manifest.Record("checkpoints/step1.pt", 10, "0" * 64, st.st_mtime_ns,
                                             st.st_ino, 1, "torch", 1.0))
    assert newest_checkpoint_of(run_dir) == (ckpts / "step1.pt", 10)


def slurm_run(root: Path, name: str, node: str, job: ProcRef, step: Dict[str, Any]) -> Path:
    run_dir = make_run(root, f"p/{name}.{node}", job=job)
    meta = json.loads((run_dir / "run.json").read_text())
    meta.update(group=name, node=node, scheduler=step)
    (run_dir / "run.json").write_text(json.dumps(meta))
    return run_dir


def test_a_slurm_step_is_stopped_through_scancel_with_every_node_marked_first(
        tmp_path: Path, sleepers: List[subprocess.Popen]) -> None:
    step = {"name": "slurm", "job_id": "41", "step_id": "0", "restart_count": 0}
    procs = [start(sleepers) for _ in range(4)]
    root = tmp_path / "root"
    mine = slurm_run(root, "train-41", "n0", procs[0][1], step)
    other = slurm_run(root, "train-41", "n1", procs[1][1], step)
    elsewhere = slurm_run(root, "train-41", "n2", procs[2][1], {**step, "step_id": "1"})   # another step
    stranger = make_run(root, "p/train-41x", job=procs[3][1])
    asked: List[Any] = []

    def scancel(job: Any) -> bool:   # Slurm ends the step: SIGTERM to every node's job
        asked.append(job)
        for p, _ in procs[:2]:
            p.terminate()
        return True

    result = stop_run(mine, 5.0, scancel=scancel)
    assert [(j.job_id, j.step_id) for j in asked] == [("41", "0")]
    assert (result.outcome, result.via, result.nodes_marked) == ("stopped", "scancel --signal=TERM 41.0", 1)
    for d in (mine, other):
        assert json.loads((d / "rgt" / "stop.json").read_text())["grace_s"] == 5.0
    assert not (elsewhere / "rgt" / "stop.json").exists() and not (stranger / "rgt" / "stop.json").exists()
    assert procs[2][0].poll() is None and procs[3][0].poll() is None
    out = io.StringIO()
    render_stop(result, False, out)
    assert "through scancel --signal=TERM 41.0" in out.getvalue()


def test_a_failed_scancel_falls_back_to_the_signal(tmp_path: Path, sleepers: List[subprocess.Popen]) -> None:
    _, ref = start(sleepers)
    run_dir = slurm_run(tmp_path / "root", "train-42", "n0", ref,
                        {"name": "slurm", "job_id": "42", "step_id": "0", "restart_count": 0})
    sent: List[Tuple[int, int]] = []
    result = stop_run(run_dir, 0.2, exit_wait_s=0.1, killpg=lambda pgid, sig: sent.append((pgid, sig)),
                      scancel=lambda _job: False)
    assert result.via == "signal" and sent[0] == (ref.pid, signal.SIGTERM)
