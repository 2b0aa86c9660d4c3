"""The close-out (onbox/sidecar/closing.py) over a real CustodyMonitor, real files and a real Journal,
then through the real launch (wrapper, supervisor, sidecar), a SIGKILL in the middle of it included.

Each test waits on events, wait_idle or a marker file, with a deadline; none sleeps to synchronize.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import psutil
import pytest

from onbox.runs import close_state
from onbox.sidecar.closing import MARKER, Closer, closed_marker, journaled_close
from onbox.sidecar.journal import Journal, read_all
from protocol import Event
from tests.helpers import Recorder, wait_until
from tests.onbox.custodyrig import Factory
from tests.onbox.test_launch import Rig, py

WAIT_S = 10.0


def exit_event(seq: int = 7) -> Event:
    return Event(run="run-1", seq=seq, ts=1.0, kind="job.exited", sev="info", host="box",
                 data={"pid": 42, "code": 0, "closing": True, "final_ok": True, "final_reasons": []})


def closer_for(h: Any, events: Recorder, budget_s: float = 30.0) -> Tuple[Closer, threading.Event]:
    stop = threading.Event()

    def emit(kind: str, data: Dict[str, Any], sev: Optional[str] = None) -> None:
        events(kind, data, sev)

    def verdict(data: Dict[str, Any]) -> Tuple[bool, List[str]]:
        return data.get("code") == 0, [] if data.get("code") == 0 else ["code"]

    return Closer(h.run, "box", h.monitor, emit, verdict, stop, lambda: None, budget_s=budget_s), stop


def test_a_unit_on_its_way_from_settling_to_the_queue_is_not_idle(custody: Factory,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """settle_tick takes a quiet unit off _pending and _commit queues it: wait_idle must not say
    idle in between (a close-out there built the final manifest without the last checkpoint)."""
    h = custody()
    entered, release = threading.Event(), threading.Event()
    recorded = h.monitor._recorded

    def slow_recorded(unit: str, sig: Any) -> bool:
        callers = {sys._getframe(n).f_code.co_name for n in (2, 3)}   # comprehensions are frames
        if "_commit" in callers and not release.is_set():
            entered.set()
            release.wait(WAIT_S)
        return recorded(unit, sig)

    monkeypatch.setattr(h.monitor, "_recorded", slow_recorded)
    (h.ckpt / "step000005").mkdir()
    (h.ckpt / "step000005" / "model.bin").write_bytes(b"w" * 4096)
    h.monitor.begin_close()   # commit it after 0.2 s of quiet, as after the job's exit
    assert entered.wait(WAIT_S), "the unit was never committed"
    try:
        assert not h.monitor.wait_idle(0), "idle while a unit was handed from _pending to the queue"
    finally:
        release.set()
    h.idle()
    assert len(h.events.of("ckpt.saved")) == 1


def test_the_close_waits_for_the_last_save_then_names_the_final_manifest(custody: Factory) -> None:
    h = custody()
    (h.ckpt / "step000010").mkdir()
    (h.ckpt / "step000010" / "model.bin").write_bytes(b"m" * (1 << 20))
    events = Recorder()
    closer, _ = closer_for(h, events)
    closer.close(exit_event())
    closed = events.of("run.closed")
    assert len(closed) == 1, events.kinds()
    data = closed[0]
    assert data["final_ok"] is True and data["incomplete"] == [] and data["exit_seq"] == 7, data
    assert "closing" not in data and data["code"] == 0
    assert data["manifest"]["checkpoints"] == 1 and data["manifest"]["path"] == "rgt/PULL_MANIFEST.json", data
    doc = json.loads((h.run / "rgt" / "PULL_MANIFEST.json").read_text())
    assert doc["sha256"] == data["manifest"]["sha256"]
    assert any(f["path"] == "checkpoints/step000010/model.bin" for f in doc["files"]), doc["files"]
    assert h.events.of("ckpt.saved"), "custody never committed the unit"
    assert closed_marker(h.run / "rgt") == {"exit_seq": 7, "seq": None, "incomplete": []}
    assert closer.state["state"] == "closed"


def test_a_close_past_its_budget_names_what_is_pending_and_marks_it_final_later(
        custody: Factory, tmp_path: Path) -> None:
    """A unit still being written when the budget runs out: run.closed names it incomplete, and the
    marker turns final once custody has committed it; nothing is lost."""
    h = custody()
    unit = h.ckpt / "step000020"
    unit.mkdir()
    stop_writing = threading.Event()
    started = threading.Event()

    def writer() -> None:
        with open(unit / "model.bin", "ab") as f:
            while not stop_writing.is_set():
                f.write(b"x" * 4096)
                f.flush()
                started.set()
                stop_writing.wait(0.02)   # the job's own pace: a write every 20 ms

    t = threading.Thread(target=writer)
    t.start()
    events = Recorder()
    try:
        assert started.wait(WAIT_S)
        closer, stop = closer_for(h, events, budget_s=1.5)
        closer.start(exit_event())
        closed = events.wait_for("run.closed")[0]
    finally:
        stop_writing.set()
        t.join(WAIT_S)
    assert [p["path"] for p in closed["incomplete"]] == ["checkpoints/step000020"], closed
    assert "still" in closed["incomplete"][0]["reason"]
    assert events.of("run.closing"), "no progress was reported while the close waited"
    assert json.loads((h.run / "rgt" / "closing.json").read_text())["pending_units"] == 1
    wait_until(lambda: (closed_marker(h.run / "rgt") or {}).get("incomplete") == [], WAIT_S,
               "the marker to turn final once the unit is committed")
    assert h.events.of("ckpt.saved", path="checkpoints/step000020")
    stop.set()
    closer.join(WAIT_S)


def test_journaled_close_reads_the_newest_attempt(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "rgt", "run-1", "box")
    journal.open()

    def append(kind: str, data: Dict[str, Any]) -> int:
        return journal.append(kind, data)[-1][0].seq

    try:
        append("job.started", {"pid": 1})
        first = (append("job.exited", {"code": 1}), append("run.closed", {"code": 1}))
        exited, closed = journaled_close(journal)
        assert exited is not None and closed is not None and (exited.seq, closed.seq) == first
        append("job.started", {"pid": 2})   # a resumed attempt: its close is not done yet
        second = append("job.exited", {"code": 0})
        exited, closed = journaled_close(journal)
        assert exited is not None and exited.seq == second and closed is None
    finally:
        journal.close()
    assert MARKER == "run.closed"


# ---- the real launch: wrapper, supervisor and sidecar ---------------------------------------------

# The job waits for "go", saves step 10 (a file) and waits until custody has recorded it, then in
# its last moments writes step 20 in place (a directory, no framework's last file: custody alone
# would wait 10 s of quiet for it) and rotates step 10 away, and exits 0.
LAST_SAVE = """
import os, shutil, threading
run, ck = os.environ["RGT_RUN_DIR"], os.environ["RGT_CKPT_DIR"]
pause = threading.Event()
while not os.path.exists(os.path.join(run, "go")):
    pause.wait(0.02)
os.makedirs(ck, exist_ok=True)
with open(os.path.join(ck, "step000010.bin"), "wb") as f:
    f.write(b"a" * 4096)
manifest = os.path.join(run, "rgt", "manifest.jsonl")
while "step000010" not in (open(manifest).read() if os.path.exists(manifest) else ""):
    pause.wait(0.02)
os.makedirs(os.path.join(ck, "step000020"))
with open(os.path.join(ck, "step000020", "model.bin"), "wb") as f:
    f.write(b"b" * 8192)
os.remove(os.path.join(ck, "step000010.bin"))
"""

# The job leaves a writer behind (an async checkpoint writer in its own session) that appends to
# step 30 every 20 ms until the test writes "stop-writer": the close-out waits on it.
LEFT_WRITER = """
import os, subprocess, sys
run, ck = os.environ["RGT_RUN_DIR"], os.environ["RGT_CKPT_DIR"]
os.makedirs(os.path.join(ck, "step000030"), exist_ok=True)
code = '''
import os, sys, threading
run, path = sys.argv[1], sys.argv[2]
with open(os.path.join(run, "writer.pid"), "w") as f:
    f.write(str(os.getpid()))
with open(path, "ab") as out:
    while not os.path.exists(os.path.join(run, "stop-writer")):
        out.write(b"c" * 1024)
        out.flush()
        threading.Event().wait(0.02)
'''
subprocess.Popen([sys.executable, "-c", code, run, os.path.join(ck, "step000030", "model.bin")],
                 start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while not os.path.exists(os.path.join(run, "writer.pid")):
    pass
"""


def journal(run_dir: Path) -> List[Dict[str, Any]]:
    return read_all(run_dir / "rgt")


def one(events: List[Dict[str, Any]], kind: str) -> Dict[str, Any]:
    found = [e for e in events if e["kind"] == kind]
    assert len(found) == 1, [(e["seq"], e["kind"]) for e in events]
    return found[0]


def test_the_run_closes_after_the_last_save_of_its_final_moments(rig: Rig) -> None:
    run_dir = rig.launch(py(LAST_SAVE), run_id="last-save").run_dir
    rig.go(run_dir)
    assert rig.finished(run_dir, 120)["code"] == 0
    marker = closed_marker(run_dir / "rgt")
    assert marker is not None and marker["incomplete"] == []
    events = journal(run_dir)
    exited, closed = one(events, "job.exited"), one(events, "run.closed")
    assert exited["data"]["closing"] is True and closed["seq"] > exited["seq"]
    assert (marker["exit_seq"], marker["seq"]) == (exited["seq"], closed["seq"])
    last = one([e for e in events if e["kind"] == "ckpt.saved"
                and e["data"]["path"] == "checkpoints/step000020"], "ckpt.saved")
    removed = one(events, "ckpt.removed")
    assert (removed["data"]["path"], removed["data"]["by"]) == ("checkpoints/step000010.bin", "job")
    assert last["seq"] < closed["seq"] and removed["seq"] < closed["seq"]
    data = closed["data"]
    assert (data["code"], data["final_ok"], data["incomplete"]) == (0, True, [])
    assert data["exit_seq"] == exited["seq"]
    assert closed["sev"] == "info" and "closing" not in data
    doc = json.loads((run_dir / "rgt" / "PULL_MANIFEST.json").read_text())
    assert data["manifest"]["sha256"] == doc["sha256"] and data["manifest"]["checkpoints"] == 1
    [entry] = [f for f in doc["files"] if f["kind"] == "checkpoint"]
    assert entry["path"] == "checkpoints/step000020/model.bin"
    assert entry["sha256"] == hashlib.sha256(b"b" * 8192).hexdigest()


def test_a_sidecar_killed_mid_close_is_restarted_and_closes_once(rig: Rig) -> None:
    run_dir = rig.launch(py(LEFT_WRITER), run_id="killed").run_dir
    writer: Optional[int] = None
    try:
        wait_until(lambda: (run_dir / "writer.pid").exists(), 60, "the writer to start")
        writer = int((run_dir / "writer.pid").read_text())
        closing = run_dir / "rgt" / "closing.json"
        wait_until(closing.exists, 60, "the close-out to report what it waits on")
        assert json.loads(closing.read_text())["pending"][0]["path"] == "checkpoints/step000030"
        first = int((run_dir / "rgt" / "sidecar.pid").read_text())
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: (run_dir / "rgt" / "sidecar.pid").read_text().strip() not in ("", str(first)),
                   60, "the supervisor to start the sidecar again")
        assert closed_marker(run_dir / "rgt") is None
        (run_dir / "stop-writer").write_text("")
        assert rig.finished(run_dir, 120)["code"] == 0
    finally:
        (run_dir / "stop-writer").write_text("")
        if writer is not None and psutil.pid_exists(writer):
            psutil.Process(writer).wait(30)
    events = journal(run_dir)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))   # contiguous: none lost
    assert len([e for e in events if e["kind"] == "sidecar.started"]) == 2
    exited, closed = one(events, "job.exited"), one(events, "run.closed")
    assert closed["seq"] > exited["seq"] and closed["data"]["exit_seq"] == exited["seq"]
    assert closed["data"]["final_ok"] is True and closed["data"]["incomplete"] == []
    doc = json.loads((run_dir / "rgt" / "PULL_MANIFEST.json").read_text())
    ckpts = [f["path"] for f in doc["files"] if f["kind"] == "checkpoint"]
    assert ckpts == ["checkpoints/step000030/model.bin"]
    assert doc["sha256"] == closed["data"]["manifest"]["sha256"]


def test_close_state_says_whether_the_manifest_is_final(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "rgt").mkdir(parents=True)
    assert close_state(run)["state"] == "running"   # no exit yet: a pull is a snapshot
    (run / "rgt" / "exit.json").write_text(json.dumps({"code": 0}))
    unclosed = close_state(run)   # exited, and no supervisor or sidecar is left to close it
    assert (unclosed["state"], unclosed["final"]) == ("unclosed", False)
    assert "no sidecar" in unclosed["reason"]
    (run / "rgt" / "run.closed").write_text(json.dumps({"exit_seq": 7, "seq": 9, "incomplete": [
        {"path": "checkpoints/big", "reason": "still hashing"}]}))
    assert close_state(run)["state"] == "incomplete" and not close_state(run)["final"]
    (run / "rgt" / "run.closed").write_text(json.dumps({"exit_seq": 7, "seq": 9, "incomplete": []}))
    assert close_state(run) == {"state": "closed", "final": True, "incomplete": [], "seq": 9}
