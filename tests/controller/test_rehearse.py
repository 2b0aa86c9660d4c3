"""`rgt rehearse`, fast: the stage judgements on hand-written run directories, the journal and
metrics readers, ending recorded processes, and the command line (usage, output).

The real rehearsal of scripts/train_tiny.py is tests/e2e/test_rehearse.py.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from click.testing import CliRunner, Result

from controller.cli import main as cli
from controller.cli.rehearse import render_result
from controller.rehearse.checks import (
    Ending,
    Journal,
    Proc,
    Record,
    Stage,
    judge_exit,
    judge_resume,
    judge_safe_load,
    judge_verified,
    named_step,
    newest_per_path,
    read_manifest,
    record_of,
    steps_since,
    unrecorded,
)
from controller.rehearse.run import Rehearsal, RehearseOptions, RehearseResult
from controller.verify.load import LoadResult

SHA_A = "a" * 64


def event(seq: int, kind: str, sev: str = "info", **data: Any) -> Dict[str, Any]:
    return {"v": 1, "run": "rehearsal", "host": "h", "seq": seq, "ts": 1.0 + seq, "kind": kind, "sev": sev,
            "data": data}


def append_lines(path: Path, *objs: Any, raw: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for obj in objs:
            f.write((json.dumps(obj) + "\n").encode())
        f.write(raw)


def save_ckpt(run_dir: Path, rel: str, payload: bytes, step: Optional[int], ts: float) -> Record:
    """A checkpoint file and its custody record, the way onbox/custody/monitor.py writes one."""
    path = run_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload)
    st = path.stat()
    rec = Record(path=rel, size=st.st_size, sha256=hashlib.sha256(payload).hexdigest(),
                 mtime_ns=st.st_mtime_ns, inode=st.st_ino, step=step, ts=ts)
    append_lines(run_dir / "rgt" / "manifest.jsonl", {"v": 1, "format": "torch", **rec.__dict__})
    return rec


# ---- the journal and the metrics ------------------------------------------------------------


def test_the_journal_reads_only_new_complete_events_once(tmp_path: Path) -> None:
    rgt = tmp_path / "rgt"
    journal = Journal(rgt)
    assert journal.poll() == []  # no journal yet
    append_lines(rgt / "events.jsonl", event(1, "sidecar.started"), event(2, "job.started", pid=7),
                 raw=b'{"seq": 3, "kind": "train.pro')
    assert [e["seq"] for e in journal.poll()] == [1, 2]
    append_lines(rgt / "events.jsonl", raw=b'gress", "data": {"step": 5}}\n')
    append_lines(rgt / "events.jsonl", event(2, "job.started", pid=7), raw=b"not json\n")  # ignored
    fresh = journal.poll()
    assert [(e["seq"], e["kind"]) for e in fresh] == [(3, "train.progress")]
    assert journal.first_step() == 5 and journal.first_step(after_seq=3) is None
    assert journal.last_seq == 3 and [e["seq"] for e in journal.of("job.started")] == [2]


def test_the_journal_follows_a_rotation(tmp_path: Path) -> None:
    rgt = tmp_path / "rgt"
    journal = Journal(rgt)
    append_lines(rgt / "events.jsonl", event(1, "sidecar.started"))
    assert len(journal.poll()) == 1
    # the sidecar renames the full file to events.<first seq>.jsonl and starts a new one
    append_lines(rgt / "events.jsonl", event(2, "heartbeat"))
    os.replace(rgt / "events.jsonl", rgt / "events.000000000001.jsonl")
    append_lines(rgt / "events.jsonl", event(3, "ckpt.saved", path="checkpoints/a.pt"))
    assert [e["seq"] for e in journal.poll()] == [2, 3]


def test_steps_since_reads_complete_lines_after_an_offset(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    append_lines(path, {"step": 5, "loss": 1.0}, {"Global_Step": 10.0}, {"loss": 0.5}, {"iter": True})
    steps, offset, lines = steps_since(path, 0)
    assert steps == [5, 10] and lines == 4 and offset == path.stat().st_size
    append_lines(path, {"iteration": 15}, raw=b'{"step": 2')  # the job is mid-line
    assert steps_since(path, offset)[:1] == ([15],)
    assert steps_since(tmp_path / "missing.jsonl", 0) == ([], 0, 0)


# ---- resume ---------------------------------------------------------------------------------


def rec(step: Optional[int], path: str = "checkpoints/step000020.pt") -> Record:
    return Record(path=path, size=1, sha256=SHA_A, mtime_ns=1, inode=1, step=step, ts=1.0)


def test_resume_passes_when_the_first_step_goes_on_from_the_checkpoint() -> None:
    ok, detail = judge_resume("/r/checkpoints/step000020.pt", rec(20), 25, [])
    assert ok and "first step after the relaunch is 25" in detail
    assert judge_resume("/r/c.pt", rec(20), 21, [])[0]


@pytest.mark.parametrize("resume_from, record, first, restarts, words", [
    (None, None, 25, [], "no recorded checkpoint"),
    ("/r/c.pt", rec(20), None, [], "logged no step"),
    ("/r/c.pt", rec(20), 0, [], "started at step 0"),
    ("/r/c.pt", rec(20), 5, [], "5, under the checkpoint's step 20"),
    ("/r/c.pt", rec(None), 5, [event(9, "train.restarted_from_zero", "warn", last_step=35, new_step=5)],
     "restart from zero (step 35 -> 5)"),
])
def test_resume_fails_naming_why(resume_from: Optional[str], record: Optional[Record], first: Optional[int],
                                 restarts: List[Dict[str, Any]], words: str) -> None:
    ok, detail = judge_resume(resume_from, record, first, restarts)
    assert not ok and words in detail


def test_a_checkpoint_without_a_step_is_judged_by_the_step_and_the_sidecar() -> None:
    ok, detail = judge_resume("/r/latest.pt", rec(None, "checkpoints/latest.pt"), 5, [])
    assert ok and "names no step" in detail


def test_the_record_of_a_resume_path_is_its_newest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_ckpt(run, "checkpoints/last.pt", b"one", 20, ts=1.0)
    save_ckpt(run, "checkpoints/last.pt", b"two", 40, ts=2.0)
    found = record_of(run, run / "checkpoints" / "last.pt", read_manifest(run))
    assert found is not None and found.step == 40
    assert record_of(run, Path("checkpoints/other.pt"), read_manifest(run)) is None


# ---- safe load ------------------------------------------------------------------------------


def loads_ok(records: Dict[str, Record]) -> Dict[str, LoadResult]:
    return {rel: LoadResult("ok") for rel in records}


def hashes_of(run: Path, records: Dict[str, Record]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for rel in records:
        data = (run / rel).read_bytes()
        out[rel] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def test_safe_load_passes_when_every_record_hashes_and_loads(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_ckpt(run, "checkpoints/step000020.pt", b"twenty", 20, ts=1.0)
    save_ckpt(run, "checkpoints/step000040.pt", b"forty", 40, ts=2.0)
    (run / "checkpoints" / "step000060.pt.tmp").write_bytes(b"half")   # left by the SIGKILL
    (run / "checkpoints" / ".hidden").write_bytes(b"x")
    records = newest_per_path(read_manifest(run))
    assert unrecorded(run, run / "checkpoints", read_manifest(run)) == []
    ok, detail = judge_safe_load(records, hashes_of(run, records), loads_ok(records), [])
    assert ok and detail.startswith("2 checkpoints hash to the sha256 recorded at write time")


def test_a_checkpoint_saved_again_is_judged_by_its_newest_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_ckpt(run, "checkpoints/step000040.pt", b"first attempt", 40, ts=1.0)
    save_ckpt(run, "checkpoints/step000040.pt", b"after the resume", 40, ts=2.0)
    records = newest_per_path(read_manifest(run))
    assert list(records) == ["checkpoints/step000040.pt"]
    assert judge_safe_load(records, hashes_of(run, records), loads_ok(records), [])[0]


def test_safe_load_fails_on_changed_bytes_an_unrecorded_file_and_a_bad_load(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_ckpt(run, "checkpoints/a.pt", b"aaaa", 1, ts=1.0)
    save_ckpt(run, "checkpoints/b.pt", b"bbbb", 2, ts=2.0)
    save_ckpt(run, "checkpoints/c.pt", b"cccc", 3, ts=3.0)
    (run / "checkpoints" / "a.pt").write_bytes(b"AAAA")               # rewritten after its record
    (run / "checkpoints" / "d.pt").write_bytes(b"never recorded")
    every = read_manifest(run)
    records = newest_per_path(every)
    stray = [r for r in unrecorded(run, run / "checkpoints", every) if r not in records]
    assert stray == ["checkpoints/d.pt"]
    loads = {"checkpoints/b.pt": LoadResult("failed", "weights_only=True refused it: GLOBAL os.system"),
             "checkpoints/c.pt": LoadResult("ok")}
    ok, detail = judge_safe_load(records, hashes_of(run, records), loads, stray)
    assert not ok and detail.startswith("3 of 4 checkpoints fail")
    assert "checkpoints/a.pt: sha256" in detail and "checkpoints/b.pt: does not load safely" in detail
    assert judge_safe_load({}, {}, {}, [])[1] == "no checkpoint was recorded by the sidecar's custody"


# ---- clean exit -----------------------------------------------------------------------------


def exited(ok: bool, *reasons: str) -> Dict[str, Any]:
    return event(20, "job.exited", "info" if ok else "warn", code=0, final_ok=ok, final_reasons=list(reasons))


@pytest.mark.parametrize("end, passes, words", [
    (Ending({"code": 0}, exited(True)), True, "sidecar judged the run ok"),
    (Ending({"code": 0}), True, "did not report the exit"),
    (Ending({"code": 0}, exited(False, "training ended with non-finite loss (train.nonfinite)")), False,
     "judged the run failed: training ended with non-finite loss"),
    (Ending({"code": 3, "signal": None}), False, "ended with code 3"),
    (Ending({"code": None, "signal": 9, "oom_killed": True}), False, "signal 9 (OOM-killed)"),
    (Ending({"code": None, "signal": 15}, stopped_at=40, stop_outcome="stopped"), True,
     "stopped at step 40 (--steps) by SIGTERM: ended with signal 15"),
    (Ending({"code": 0}, stopped_at=40, stop_outcome="stopped"), True, "ended with code 0"),
    (Ending({"code": 143}, stopped_at=40, stop_outcome="stopped"), True, "ended with code 143"),
    (Ending({"code": None, "signal": 9}, stopped_at=40, stop_outcome="killed"), False, "ignored SIGTERM"),
    (Ending({"code": 2}, stopped_at=40, stop_outcome="stopped"), False, "ended with code 2"),
    (Ending(None, timed_out=True), False, "timeout"),
    (Ending(None, stall=event(9, "job.stalled", "warn", verdict="hung", idle_s=31.0)), False,
     "stall (no progress for 31.0 s, verdict hung)"),
])
def test_clean_exit(end: Ending, passes: bool, words: str) -> None:
    ok, detail = judge_exit(end)
    assert ok is passes and words in detail, detail


# ---- stages on a hand-written run directory ---------------------------------------------------


def stepping_clock() -> Any:
    """Each reading is 0.5 s later: a wait with a deadline ends after a few polls, not seconds."""
    ticks = itertools.count()
    return lambda: next(ticks) * 0.5


@pytest.fixture
def rehearsal(tmp_path: Path) -> Iterator[Rehearsal]:
    r = Rehearsal(RehearseOptions(command=["python", "train.py"], timeout_s=60, tmp_dir=tmp_path),
                  clock=stepping_clock())
    (r.run_dir / "rgt").mkdir(parents=True)
    yield r


def test_the_private_root_is_under_the_tmp_dir(rehearsal: Rehearsal, tmp_path: Path) -> None:
    assert rehearsal.root.parent == tmp_path and rehearsal.root.name.startswith("rgt-rehearse-")
    args = rehearsal.launch_args()
    assert args[args.index("--root") + 1] == str(rehearsal.root)
    assert {"--no-preflight", "--no-secrets", "--json"} <= set(args)
    assert args[args.index("--probe") + 1] == "none" and args[-3:] == ["--", "python", "train.py"]


def test_metrics_seen_passes_on_the_sidecars_step(rehearsal: Rehearsal) -> None:
    append_lines(rehearsal.rgt / "events.jsonl", event(1, "job.started", pid=5),
                 event(2, "train.progress", step=5))
    ok, detail = rehearsal.stage_metrics()
    assert ok and "step 5" in detail


def test_metrics_seen_fails_when_the_job_ends_with_stepless_metrics(rehearsal: Rehearsal) -> None:
    append_lines(rehearsal.run_dir / "metrics.jsonl", {"loss": 1.0}, {"loss": 0.5})
    (rehearsal.run_dir / "train.log").write_text("[rgt x] run started\nTraceback: boom\n[rgt y] job exited\n")
    (rehearsal.rgt / "exit.json").write_text(json.dumps({"code": 1, "signal": None}))
    ok, detail = rehearsal.stage_metrics()
    assert not ok
    assert "the job ended (code 1)" in detail and "train.log: Traceback: boom" in detail
    assert "2 lines, none with a step field" in detail


def test_a_stall_fails_the_stage_that_waits(rehearsal: Rehearsal) -> None:
    append_lines(rehearsal.rgt / "events.jsonl",
                 event(1, "job.stalled", "warn", verdict="unknown", idle_s=31.0))
    ok, detail = rehearsal.stage_checkpoint()
    assert not ok and "stall (no progress for 31.0 s" in detail


def test_checkpoint_committed_names_the_suspect_at_the_deadline(tmp_path: Path) -> None:
    r = Rehearsal(RehearseOptions(command=["x"], timeout_s=3, tmp_dir=tmp_path), clock=stepping_clock())
    append_lines(r.rgt / "events.jsonl", event(1, "ckpt.suspect", "warn", path="checkpoints/a.pt",
                                               reason="zero bytes"))
    ok, detail = r.stage_checkpoint()
    assert not ok and "timeout" in detail and "custody suspects checkpoints/a.pt: zero bytes" in detail


def test_the_relaunched_attempt_is_told_apart_from_the_killed_one(rehearsal: Rehearsal) -> None:
    # the killed attempt's sidecar still reports after the kill; only events from the new job.started
    # on are the relaunched attempt's
    append_lines(rehearsal.rgt / "events.jsonl",
                 event(5, "train.progress", step=20), event(6, "job.exited", "warn", pid=100, code=None),
                 event(7, "job.started", pid=200), event(8, "train.progress", step=25),
                 event(9, "job.exited", pid=200, code=0, final_ok=True))
    rehearsal.base_seq, rehearsal.attempt_pid = 4, 200
    rehearsal.journal.poll()
    assert [e["seq"] for e in rehearsal._current("job.exited")] == [9]
    assert rehearsal._first_new_step() == 25


def test_safe_load_stage_on_a_settled_run_dir(rehearsal: Rehearsal) -> None:
    # not torch: the loader calls the file's format unknown, so the stage rests on the hashes
    save_ckpt(rehearsal.run_dir, "checkpoints/state.json", b'{"step": 20}', 20, ts=1.0)
    ok, detail = rehearsal.stage_safe_load()
    assert ok and "1 checkpoint file pulled and verified (rgt verify): identity ok" in detail, detail
    assert (rehearsal.root / "pulled" / "checkpoints" / "state.json").is_file()  # the local pull
    (rehearsal.run_dir / "checkpoints" / "state.json").write_bytes(b'{"step": 21}')
    ok, detail = rehearsal.stage_safe_load()
    assert not ok and "checkpoints/state.json: sha256" in detail and "recorded at write time" in detail


def test_safe_load_makes_the_manifest_again_when_custody_records_during_it(
        rehearsal: Rehearsal, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's last save is recorded while the pull manifest is made (custody waits for a unit
    to be quiet): the copy would hold a longer rgt/manifest.jsonl than listed. The stage sees the
    log change and makes manifest and copy again, and the last save is verified too."""
    save_ckpt(rehearsal.run_dir, "checkpoints/state.json", b'{"step": 20}', 20, ts=1.0)
    onbox = rehearsal._onbox
    calls: List[List[str]] = []

    def manifest_while_custody_records(args: List[str], timeout_s: float) -> Any:
        calls.append(args)
        done = onbox(args, timeout_s)
        if len(calls) == 1:   # the last save, recorded just after the manifest listed the log
            save_ckpt(rehearsal.run_dir, "checkpoints/last.json", b'{"step": 30}', 30, ts=2.0)
        return done
    monkeypatch.setattr(rehearsal, "_onbox", manifest_while_custody_records)
    ok, detail = rehearsal.stage_safe_load()
    assert ok and "2 checkpoint files pulled and verified" in detail, detail
    assert [a[0] for a in calls] == ["manifest", "manifest"]
    assert (rehearsal.root / "pulled" / "checkpoints" / "last.json").is_file()


def test_safe_load_stage_names_a_checkpoint_that_does_not_load(rehearsal: Rehearsal) -> None:
    save_ckpt(rehearsal.run_dir, "checkpoints/step000020.pt", b"PK\x03\x04 not a real zip", 20, ts=1.0)
    ok, detail = rehearsal.stage_safe_load()
    assert not ok and "checkpoints/step000020.pt: safe load:" in detail, detail


def test_judge_verified_reads_the_verifiers_report() -> None:
    ckpt = {"path": "out/checkpoint-20/model.safetensors", "kind": "checkpoint", "identity": "ok",
            "load": "ok"}
    extra = {"path": "out/checkpoint-20/rng_state.pth", "kind": "checkpoint", "identity": "ok",
             "load": "identity only (an include that does not load safely)"}
    good = {"ok": True, "files": [ckpt, extra], "proofs": {"identity": {"status": "passed"},
                                                           "safe_load": {"status": "passed"}}}
    ok, detail = judge_verified(good, [], [])
    assert ok and "2 checkpoint files pulled and verified" in detail and "1 proven by identity only" in detail
    bad = {"ok": False, "files": [{**ckpt, "identity": "size 10, expected 12"}],
           "proofs": {"identity": {"status": "failed", "extra": [{"path": "x.pt", "reason": "extra file"}]}}}
    ok, detail = judge_verified(bad, [], ["checkpoints/stray.pt"])
    assert not ok and detail.startswith("3 problems")
    assert "never recorded by custody" in detail and "identity: size 10" in detail
    assert judge_verified({"ok": True, "files": []}, [], [])[1].endswith("recorded by the sidecar's custody")
    # a verdict failed for a reason the rehearsal does not derive itself: the verifier's own line
    suspect = {"ok": False, "files": [ckpt], "proofs": {"identity": {"status": "passed"}},
               "suspect": [{"path": ckpt["path"], "code": "torn", "reason": "partly written"}]}
    line = f"{ckpt['path']}: identity: the box's custody recorded this checkpoint as suspect (torn: ...)"
    ok, detail = judge_verified(suspect, [], [], [line])
    assert not ok and detail.startswith("1 problem") and "recorded this checkpoint as suspect" in detail
    assert "no reason given" in judge_verified(suspect, [], [])[1]   # only when the verifier gave none


def test_a_directory_checkpoint_is_found_by_its_files_and_its_name_gives_the_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_ckpt(run, "out/checkpoint-20/model.safetensors", b"m", None, ts=1.0)
    save_ckpt(run, "out/checkpoint-20/trainer_state.json", b"{}", 20, ts=2.0)
    found = record_of(run, run / "out" / "checkpoint-20", read_manifest(run))
    assert found is not None and found.step == 20
    assert record_of(run, run / "out" / "checkpoint-2", read_manifest(run)) is None
    assert named_step("/r/out/checkpoint-40") == 40 and named_step("epoch=0-step=60.ckpt") == 60
    assert named_step("step000020.pt") == 20 and named_step("last.ckpt") is None


# ---- ending recorded processes --------------------------------------------------------------


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"],
                            start_new_session=True)


def ticks_of(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return int(raw[raw.rfind(b")") + 2:].split()[19])


def test_end_all_ends_recorded_processes_by_pid_and_start_time(rehearsal: Rehearsal) -> None:
    supervisor, sidecar, stranger = sleeper(), sleeper(), sleeper()
    try:
        old = rehearsal.rgt / "attempts" / "1"
        old.mkdir(parents=True)
        (rehearsal.rgt / "supervisor.json").write_text(json.dumps({
            "pid": supervisor.pid, "start_ticks": ticks_of(supervisor.pid),
            "sidecar": {"pid": sidecar.pid, "start_ticks": ticks_of(sidecar.pid)}}))
        # an old record whose pid now names another process (a wrong start time): never signalled
        (old / "supervisor.json").write_text(json.dumps({"pid": stranger.pid,
                                                         "start_ticks": ticks_of(stranger.pid) + 1}))
        assert Proc(supervisor.pid, ticks_of(supervisor.pid)).alive()
        assert not Proc(stranger.pid, ticks_of(stranger.pid) + 1).alive()
        rehearsal.end_all()
        assert supervisor.wait(5) == -signal.SIGTERM and sidecar.wait(5) == -signal.SIGTERM
        assert stranger.poll() is None
    finally:
        for p in (supervisor, sidecar, stranger):
            if p.poll() is None:
                p.kill()
                p.wait(5)


# ---- the command line -----------------------------------------------------------------------


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def test_usage_errors_exit_2() -> None:
    assert invoke("rehearse").exit_code == 2
    result = invoke("rehearse", "--timeout", "soon", "--", "python", "x.py")
    assert result.exit_code == 2 and "not a duration" in result.stderr
    assert invoke("rehearse", "--steps", "0", "--", "python", "x.py").exit_code == 2


def test_a_command_that_cannot_start_fails_at_launch(tmp_path: Path) -> None:
    result = invoke("rehearse", "--json", "--tmp-dir", str(tmp_path), "--", str(tmp_path / "no-such-program"))
    assert result.exit_code == 1, result.stderr
    doc = json.loads(result.stdout)
    assert doc["result"] == "fail" and doc["failed_stage"] == "launch"
    assert [s["status"] for s in doc["stages"]] == ["fail"] + ["skipped"] * 5
    assert doc["kept"] and Path(doc["root"]).is_dir() and "hint" in doc
    assert "no-such-program not found" in doc["stages"][0]["detail"]  # the launcher names it


def test_the_table_ends_with_the_verdict_and_the_hint(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    stages = [Stage("launch", "pass", 0.3, "started"), Stage("metrics seen", "pass", 2.0, "step 5"),
              Stage("checkpoint committed", "pass", 1.0, "a.pt"),
              Stage("resume", "fail", 3.0, "first step 5, under 20"),
              Stage("safe load", "pass", 1.0, "ok"), Stage("clean exit")]
    render_result(RehearseResult(stages, tmp_path, tmp_path / "run", kept=True))
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["STAGE", "STATUS", "SECONDS", "DETAIL"]
    assert lines[-1] == "rehearse: FAIL at resume: first step 5, under 20"
    assert "hint: at start-up, load $RGT_RESUME_FROM" in err and f"kept: {tmp_path / 'run'}" in err
    render_result(RehearseResult([Stage(s.name, "pass") for s in stages], tmp_path, tmp_path, kept=False))
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "rehearse: PASS" and err == ""
