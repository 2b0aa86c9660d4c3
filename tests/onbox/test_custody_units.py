"""Checkpoint units end to end: directory units, rotation, the places a job really writes.

Real files, a real inotify observer, the real scheduler over `jobs()`, and the REAL stock framework
jobs (tests/frameworks/hf_tiny.py, lightning_tiny.py) run in a temporary cwd outside the run dir,
so custody must find their places on its own. Waits are bounded waits on events or `wait_idle`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

from onbox import hints
from onbox.custody import gateview, manifest, pullmanifest
from onbox.custody.monitor import CustodyConfig, CustodyMonitor
from onbox.scheduler import Scheduler
from protocol.pull import check_manifest
from rgtlib.hashing import unit_digest
from tests.helpers import REPO, Recorder, wait_until

torch = pytest.importorskip("torch")

WAIT_S = 60.0  # bounded waits; generous, so a loaded CI machine is slow, not failing
JOB_S = 300.0


class Harness:
    def __init__(self, monitor: CustodyMonitor, events: Recorder) -> None:
        self.monitor = monitor
        self.events = events
        self.run = monitor.run_dir
        self.ckpt = monitor.ckpt_dir

    def idle(self, timeout_s: float = WAIT_S) -> None:
        assert self.monitor.wait_idle(timeout_s), self.monitor.status()


Factory = Callable[..., Harness]


@pytest.fixture
def custody(tmp_path: Path) -> Iterator[Factory]:
    made: List[Tuple[CustodyMonitor, Scheduler]] = []
    failures: List[str] = []

    def factory(**overrides: Any) -> Harness:
        settings: Dict[str, Any] = {"run_dir": tmp_path / "run", "settle_s": 0.05, "unit_settle_s": 0.3,
                                    "locate_s": 0.1, "hash_rate_bytes_s": None}
        settings.update(overrides)
        events = Recorder()
        events.wait_s = WAIT_S
        monitor = CustodyMonitor(CustodyConfig(**settings), events)
        monitor.start()
        scheduler = Scheduler(monitor.jobs(), lambda name, e: failures.append(f"{name}: {e!r}"))
        scheduler.start()
        made.append((monitor, scheduler))
        return Harness(monitor, events)

    yield factory
    for monitor, scheduler in made:
        scheduler.stop()
        monitor.close()
    assert not failures, failures


@pytest.fixture
def procs() -> Iterator[List[subprocess.Popen]]:
    started: List[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def run_job(procs: List[subprocess.Popen], script: str, cwd: Path, *args: str,
            env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    p = subprocess.Popen([sys.executable, str(REPO / "tests" / "frameworks" / script), *args], cwd=cwd,
                         env={**clean, "PYTHONPATH": str(REPO), **(env or {})},
                         stdout=open(cwd / f"{script}.log", "ab"), stderr=subprocess.STDOUT)
    procs.append(p)
    return p


def finish(p: subprocess.Popen, cwd: Path) -> None:
    try:
        rc = p.wait(JOB_S)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    logs = "".join(f.read_text(errors="replace")[-3000:] for f in cwd.glob("*.log"))
    assert rc == 0, logs


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


NAMES = ("model.pt", "optimizer.pt", "rng_state.pth")


def save_dir(unit: Path, seed: int, names: Tuple[str, ...] = NAMES) -> None:
    """A directory save the way HF makes one: each file written in place, trainer_state.json last."""
    unit.mkdir(parents=True, exist_ok=True)
    for name in names:
        torch.save({"w": torch.full((8, 8), float(seed)), "name": name}, unit / name)
    (unit / "trainer_state.json").write_text(json.dumps({"global_step": seed, "log_history": []}))


# ---- the real frameworks ------------------------------------------------------------------------


def test_hf_trainer_rotation_resume_and_rerun(custody: Factory, procs: List[subprocess.Popen],
                                              tmp_path: Path) -> None:
    cwd = tmp_path / "job"
    job = run_job(procs, "hf_tiny.py", cwd, "--steps", "40", "--save-every", "10", "--log-every", "10",
                  "--save-total-limit", "2", "--step-seconds", "0.1")  # a save lives >= 2 s
    h = custody(job_cwd=cwd, job_pid=job.pid)
    finish(job, cwd)
    out = cwd / "out"
    h.events.wait_for("ckpt.removed", 2)
    h.idle()
    saved = [d["path"] for d in h.events.of("ckpt.saved")]
    assert sorted(saved) == sorted(str(out / f"checkpoint-{n}") for n in (10, 20, 30, 40)), saved
    assert all(d["kind"] == "dir" and d["files"] == 8 and d["format"] == "hf"
               for d in h.events.of("ckpt.saved"))
    assert [d["step"] for d in h.events.of("ckpt.saved")] == [10, 20, 30, 40]
    removed = h.events.of("ckpt.removed")
    assert [(d["path"], d["by"]) for d in removed] == [(str(out / "checkpoint-10"), "job"),
                                                       (str(out / "checkpoint-20"), "job")]
    assert [sev for kind, _, sev in h.events.events if kind == "ckpt.removed"] == [None, None]
    assert not h.events.of("ckpt.suspect")
    assert [(d["path"], d["how"]) for d in h.events.of("ckpt.location")] == [(str(out), "trainer_state")]
    assert manifest.newest_good(h.run) == out / "checkpoint-40"
    assert [r.by for r in manifest.removals(h.run)] == ["job", "job"]

    # The pull lists the two units left, file by file, under their stable in-pull place; the
    # rotated ones are "removed", not missing.
    doc = pullmanifest.build_manifest(h.run)
    check_manifest(doc)
    assert pullmanifest.check_files(h.run, doc) == []  # what the close-out re-checks, links and all
    assert len(pullmanifest.build_manifest(h.run, extra_includes=["**"])["files"]) == len(doc["files"]) + 1
    units = sorted({e["unit"] for e in doc["files"] if e["kind"] == "checkpoint"})
    assert [u.rsplit("/", 1)[1] for u in units] == ["checkpoint-30", "checkpoint-40"]
    assert all(u.startswith("rgt/external/out-") for u in units)
    for e in doc["files"]:
        if e["kind"] == "checkpoint":
            assert e["hashed"] == "custody" and sha(h.run / e["path"]) == e["sha256"]
    assert sorted(r["path"].rsplit("/", 1)[1] for r in doc["removed"]) == ["checkpoint-10", "checkpoint-20"]
    view = gateview.gate_view(h.run)
    assert view["missing"] == [] and view["unrecorded"] == [] and view["partials"] == []
    assert {v["unit"] for v in view["checkpoints"].values()} == set(units)

    # A restart resumes from checkpoint-30 (a directory, as HF wants) and saves checkpoint-40 again
    # into the existing directory: one suspect and one new record for that save, not one per file.
    again = run_job(procs, "hf_tiny.py", cwd, "--steps", "40", "--save-every", "10", "--log-every", "10",
                    env={"RGT_RESUME_FROM": str(out / "checkpoint-30")})
    h.monitor.config.job_pid = again.pid
    finish(again, cwd)
    h.events.wait_for("ckpt.saved", 5)
    h.idle()
    suspects = h.events.of("ckpt.suspect")
    assert [(d["path"], d["code"]) for d in suspects] == [(str(out / "checkpoint-40"), "written_in_place")]
    assert [d["path"] for d in h.events.of("ckpt.saved")][4:] == [str(out / "checkpoint-40")]
    assert len(h.events.of("ckpt.removed")) == 2
    assert manifest.newest_good(h.run) == out / "checkpoint-40"
    check_manifest(pullmanifest.build_manifest(h.run))


def test_lightning_save_top_k(custody: Factory, procs: List[subprocess.Popen], tmp_path: Path) -> None:
    cwd = tmp_path / "job"
    job = run_job(procs, "lightning_tiny.py", cwd, "--steps", "40", "--save-every", "10", "--log-every", "5",
                  "--step-seconds", "0.1")  # each checkpoint lives >= 1 s before its rotation
    h = custody(job_cwd=cwd, job_pid=job.pid)
    finish(job, cwd)
    where = cwd / "lightning_logs" / "version_0" / "checkpoints"
    left = sorted(p.name for p in where.iterdir())
    assert len(left) == 2, left
    wait_until(lambda: len(h.events.of("ckpt.saved")) + len(h.events.of("ckpt.removed")) >= 6, WAIT_S,
               "4 saves and 2 removals")
    h.idle()
    saved = [d["path"] for d in h.events.of("ckpt.saved")]
    assert len(saved) == len(set(saved)) == 4 and all(s.endswith(".ckpt") for s in saved), saved
    assert sorted(d["step"] for d in h.events.of("ckpt.saved")) == [10, 20, 30, 40]
    removed = h.events.of("ckpt.removed")
    assert len(removed) == 2 and all(d["by"] == "job" for d in removed), removed
    assert sorted(Path(p).name for p in saved if p not in {d["path"] for d in removed}) == left
    assert not h.events.of("ckpt.suspect")
    assert [(d["path"], d["how"]) for d in h.events.of("ckpt.location")] == [(str(where), "lightning")]
    newest = max((r for r in manifest.read(h.run) if Path(r.path).name in left), key=lambda r: r.ts)
    assert manifest.newest_good(h.run) == Path(newest.path) and newest.path.endswith(".ckpt")
    doc = pullmanifest.build_manifest(h.run)
    assert len([e for e in doc["files"] if e["kind"] == "checkpoint"]) == 2 and len(doc["removed"]) == 2


# ---- directory units on real files --------------------------------------------------------------


def test_a_rerun_into_a_recorded_directory_is_one_suspect_and_one_save(custody: Factory) -> None:
    h = custody()
    unit = h.ckpt / "checkpoint-50"
    save_dir(unit, 50, names=tuple(f"shard{i}.pt" for i in range(19)))
    first = h.events.wait_for("ckpt.saved")[0]
    h.idle()
    assert (first["path"], first["files"], first["step"], first["via"]) == (
        "checkpoints/checkpoint-50", 20, 50, "close")
    save_dir(unit, 51, names=tuple(f"shard{i}.pt" for i in range(19)))  # every file rewritten in place
    h.events.wait_for("ckpt.saved", 2)
    h.idle()
    assert [(d["path"], d["code"]) for d in h.events.of("ckpt.suspect")] == [
        ("checkpoints/checkpoint-50", "written_in_place")]
    assert len(h.events.of("ckpt.saved")) == 2
    records = manifest.read(h.run)
    assert [r.kind for r in records] == ["dir", "dir"] and records[1].matches(h.run)
    assert not records[0].matches(h.run)
    assert {f.path: f.sha256 for f in records[1].files}["shard3.pt"] == sha(unit / "shard3.pt")
    assert manifest.newest_good(h.run) == unit


def test_a_unit_without_a_known_last_file_commits_once_quiet_and_temp_names_are_ignored(
        custody: Factory) -> None:
    h = custody()
    unit = h.ckpt / "global_step7"
    unit.mkdir()
    torch.save({"w": torch.ones(4)}, unit / "mp_rank_00_model_states.pt")
    (unit / "zero.pt.tmp").write_bytes(b"half")
    torch.save({"w": torch.zeros(4)}, unit / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    saved = h.events.wait_for("ckpt.saved")[0]
    h.idle()
    assert (saved["path"], saved["files"], saved["step"], saved["format"]) == (
        "checkpoints/global_step7", 2, 7, "deepspeed")
    rec = manifest.read(h.run)[0]
    assert sorted(f.path for f in rec.files) == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                 "mp_rank_00_model_states.pt"]
    assert rec.sha256 == unit_digest((f.path, f.size, f.sha256) for f in rec.files)


def test_a_hint_commits_a_unit_at_once(custody: Factory, tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "rgt").mkdir(parents=True)
    out = tmp_path / "job" / "out"
    h = custody(unit_settle_s=3600, quiet_max_s=3600)  # only the hint can commit "mysave"
    assert hints.write("output_dir", str(out), framework="hf", run_dir=str(run))  # not made yet
    save_dir(out / "mysave", 12)
    assert hints.write("checkpoint", str(out / "mysave"), step=12, framework="hf", run_dir=str(run))
    saved = h.events.wait_for("ckpt.saved")[0]
    assert (saved["path"], saved["via"], saved["kind"]) == (str(out / "mysave"), "hint", "dir")
    assert saved["pull_path"].startswith("rgt/external/out-")
    assert os.readlink(h.run / saved["pull_path"].rsplit("/", 1)[0]) == str(out)
    assert h.events.of("ckpt.location")[0]["how"] == "hint"


def test_removal_when_the_job_is_not_running_or_of_some_files_is_by_other(custody: Factory,
                                                                         tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    h = custody(job_pid=dead.pid)
    save_dir(h.ckpt / "checkpoint-1", 1)
    save_dir(h.ckpt / "checkpoint-2", 2)
    h.events.wait_for("ckpt.saved", 2)
    h.idle()
    shutil.rmtree(h.ckpt / "checkpoint-1")
    (h.ckpt / "checkpoint-2" / "optimizer.pt").unlink()
    h.events.wait_for("ckpt.removed", 2)
    h.idle()
    got = {d["path"]: d for d in h.events.of("ckpt.removed")}
    assert {p: d["by"] for p, d in got.items()} == {"checkpoints/checkpoint-1": "other",
                                                    "checkpoints/checkpoint-2": "other"}
    assert "not running" in got["checkpoints/checkpoint-1"]["reason"]
    assert "optimizer.pt" in got["checkpoints/checkpoint-2"]["reason"]
    assert [sev for kind, _, sev in h.events.events if kind == "ckpt.removed"] == ["warn", "warn"]
    h.monitor.sweep_tick()
    h.idle()
    assert len(h.events.of("ckpt.saved")) == 2  # what is left of checkpoint-2 stays suspect
    assert manifest.newest_good(h.run) is None
    with pytest.raises(pullmanifest.ManifestError, match="missing"):
        pullmanifest.build_manifest(h.run)
    view = gateview.gate_view(h.run)
    assert "checkpoints/checkpoint-2/optimizer.pt" in view["missing"]
    assert {r["by"] for r in view["removed"]} == {"other"}


def test_a_rotation_seen_only_after_the_exit_is_the_jobs_when_it_came_before_exit_json(
        custody: Factory) -> None:
    """Under load the watcher may report a rotation after the wrapper reaped the job. The polling
    observer never comes round here (an hour), so custody learns of each removal only when a pull
    asks (`judge_missing`), with the job already dead: the directory's mtime against exit.json's
    says which came first. On today's code both were by "other", and a pull failed closed."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    h = custody(job_pid=dead.pid, observer="polling", poll_interval_s=3600.0, sweep_s=3600.0)
    save_dir(h.ckpt / "checkpoint-1", 1)
    save_dir(h.ckpt / "checkpoint-2", 2)
    h.monitor.sweep_tick()
    h.events.wait_for("ckpt.saved", 2)
    h.idle()
    exit_json = h.run / "rgt" / "exit.json"
    shutil.rmtree(h.ckpt / "checkpoint-1")   # the job's rotation, then its exit
    exit_json.write_text(json.dumps({"code": 0}))
    assert h.monitor.judge_missing(WAIT_S)
    shutil.rmtree(h.ckpt / "checkpoint-2")   # after the exit: by someone else...
    ended = exit_json.stat().st_mtime_ns
    os.utime(h.ckpt, ns=(ended, ended + 1))   # ...however close to it the clock puts it
    assert h.monitor.judge_missing(WAIT_S)
    got = {d["path"]: d for d in h.events.of("ckpt.removed")}
    assert {p: d["by"] for p, d in got.items()} == {"checkpoints/checkpoint-1": "job",
                                                    "checkpoints/checkpoint-2": "other"}
    assert "seen after it exited" in got["checkpoints/checkpoint-1"]["reason"]
    with pytest.raises(pullmanifest.ManifestError, match="checkpoints/checkpoint-2"):
        pullmanifest.build_manifest(h.run)
    assert [r.path for r in manifest.removals(h.run) if r.by == "job"] == ["checkpoints/checkpoint-1"]


def test_a_large_file_the_job_writes_elsewhere_is_found_from_proc(
        custody: Factory, procs: List[subprocess.Popen], tmp_path: Path) -> None:
    where = tmp_path / "scratch" / "saves"
    where.mkdir(parents=True)
    code = ("import sys, time\nf = open(sys.argv[1], 'wb')\nf.write(b'x' * (2 << 20))\nf.flush()\n"
            "print('ready', flush=True)\nsys.stdin.read()\n")
    job = subprocess.Popen([sys.executable, "-c", code, str(where / "weights.bin")], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE)
    procs.append(job)
    assert job.stdout is not None and job.stdout.readline() == b"ready\n"
    h = custody(job_pid=job.pid)
    loc = h.events.wait_for("ckpt.location")[0]
    assert (loc["path"], loc["how"], loc["watched"]) == (str(where), "open_for_write", True)
    assert job.stdin is not None
    job.stdin.close()
    job.wait(30)
    h.monitor.sweep_tick()
    saved = h.events.wait_for("ckpt.saved")[0]
    assert saved["path"] == str(where / "weights.bin")
    assert json.loads((h.run / "rgt" / "ckpt_locations.json").read_text())["places"] == [
        {"path": str(where), "how": "open_for_write"}]


def test_gate_view_names_checkpoints_written_outside_every_watched_place(tmp_path: Path) -> None:
    run, cwd = tmp_path / "run", tmp_path / "code"
    (run / "rgt").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (cwd / "pretrained").mkdir(parents=True)
    (cwd / "pretrained" / "base.safetensors").write_bytes(b"b" * 64)
    old = time.time() - 3600
    os.utime(cwd / "pretrained" / "base.safetensors", (old, old))  # there before the run: not its output
    (run / "run.json").write_text(json.dumps({"id": "r", "cwd": str(cwd),
                                              "started_at": "2000-01-01T00:00:00+00:00"}))
    meta = json.loads((run / "run.json").read_text())
    meta["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(old + 60))
    (run / "run.json").write_text(json.dumps(meta))
    (cwd / "my_saves" / "checkpoint-3").mkdir(parents=True)
    (cwd / "my_saves" / "checkpoint-3" / "trainer_state.json").write_text("{}")
    (cwd / "model_final.pt").write_bytes(b"m" * 100)
    (cwd / "notes.txt").write_text("not a checkpoint")
    view = gateview.gate_view(run)
    assert view["unrecorded"] == [
        {"path": str(cwd / "model_final.pt"), "size": 100, "reason": "outside_watch"},
        {"path": str(cwd / "my_saves" / "checkpoint-3" / "trainer_state.json"), "size": 2,
         "reason": "outside_watch"}]


# ---- the manifest format ------------------------------------------------------------------------


def test_manifest_reads_old_lines_dir_records_and_removals(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "rgt").mkdir(parents=True)
    (run / "a.pt").write_bytes(b"a")
    st = (run / "a.pt").stat()
    old = {"v": 1, "path": "a.pt", "size": 1, "sha256": "aa" * 32, "mtime_ns": st.st_mtime_ns,
           "inode": st.st_ino, "step": 1, "format": "torch", "ts": 1.0}
    (run / "rgt" / "manifest.jsonl").write_text(json.dumps(old) + "\n{torn\n")
    save_dir(run / "out" / "checkpoint-2", 2, names=("model.pt",))
    files = []
    for p in sorted((run / "out" / "checkpoint-2").iterdir()):
        s = p.stat()
        files.append(manifest.UnitFile(p.name, s.st_size, sha(p), s.st_mtime_ns, s.st_ino))
    rec = manifest.Record("out/checkpoint-2", sum(f.size for f in files),
                          unit_digest((f.path, f.size, f.sha256) for f in files),
                          max(f.mtime_ns for f in files), 0, 2, "hf", 2.0, kind="dir", files=tuple(files))
    manifest.append(run, rec)
    assert [r.path for r in manifest.read(run)] == ["a.pt", "out/checkpoint-2"]
    assert manifest.read(run)[1] == rec and manifest.read(run)[0].kind == "file"
    assert manifest.newest_good(run) == run / "out" / "checkpoint-2"
    manifest.append_removal(run, manifest.Removal("out/checkpoint-2", rec.sha256, "job", "rotated", 3.0))
    assert len(manifest.read(run)) == 2 and [r.by for r in manifest.removals(run)] == ["job"]
    assert manifest.newest_good(run) == run / "a.pt"
    torch.save({"w": torch.ones(1)}, run / "out" / "checkpoint-2" / "model.pt")
    assert not rec.matches(run)


def test_nan_weights_in_a_new_checkpoint_wake_once_and_clear_on_a_finite_one(custody: Factory) -> None:
    st = pytest.importorskip("safetensors.torch")
    h = custody()

    def save(step: int, value: float) -> None:
        unit = h.ckpt / f"tmp-checkpoint-{step}"
        unit.mkdir(parents=True)
        st.save_file({"w": torch.full((16, 16), value)}, str(unit / "model.safetensors"))
        (unit / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        os.rename(unit, h.ckpt / f"checkpoint-{step}")

    save(10, 1.0)
    h.events.wait_for("ckpt.saved", 1)
    save(20, float("nan"))
    [onset] = h.events.wait_for("train.nonfinite", 1)
    assert (onset["state"], onset["name"], onset["step"], onset["tensors"]) == (
        "onset", "checkpoint weights", 20, ["w"])
    assert onset["source"] == "checkpoint checkpoints/checkpoint-20/model.safetensors"
    save(30, float("nan"))                       # still NaN: no second wake
    h.events.wait_for("ckpt.saved", 3)
    save(40, 2.0)
    cleared = h.events.wait_for("train.nonfinite", 2)[1]
    assert (cleared["state"], cleared["step"]) == ("cleared", 40)
    h.idle()
    assert len(h.events.of("train.nonfinite")) == 2


def test_a_pull_manifest_built_during_a_rotation_waits_for_its_record(custody: Factory) -> None:
    h = custody(settle_s=1.0, job_pid=os.getpid())   # the job is alive: a whole unit gone is its rotation
    for step in (10, 20):
        save_dir(h.ckpt / f"checkpoint-{step}", step)
    h.events.wait_for("ckpt.saved", 2)
    h.idle()
    shutil.rmtree(h.ckpt / "checkpoint-10")
    doc = pullmanifest.build_manifest(h.run)           # at once: custody is still judging the deletion
    assert [r["path"] for r in doc["removed"]] == ["checkpoints/checkpoint-10"]
    assert {e["unit"] for e in doc["files"] if e["kind"] == "checkpoint"} == {"checkpoints/checkpoint-20"}


def test_the_sidecars_manifest_has_custody_judge_a_deletion_its_watcher_missed(custody: Factory) -> None:
    h = custody(settle_s=0.2, sweep_s=3600.0, job_pid=os.getpid())
    for step in (10, 20):
        save_dir(h.ckpt / f"checkpoint-{step}", step)
    h.events.wait_for("ckpt.saved", 2)
    h.idle()
    for place in h.monitor._places.values():          # the watcher falls silent (a loaded box, far behind)
        place.watcher.stop()
    shutil.rmtree(h.ckpt / "checkpoint-10")
    doc = pullmanifest.build_manifest(h.run, judge_missing=h.monitor.judge_missing)
    removed = doc["removed"]
    assert [(r["path"], r["by"]) for r in removed] == [("checkpoints/checkpoint-10", "job")]
    assert {e["unit"] for e in doc["files"] if e["kind"] == "checkpoint"} == {"checkpoints/checkpoint-20"}


def test_deletions_seen_before_the_sidecar_stops_are_recorded_at_close(custody: Factory) -> None:
    h = custody(settle_s=3600.0, job_pid=os.getpid())  # a deletion would be judged an hour later
    save_dir(h.ckpt / "checkpoint-10", 10)
    h.events.wait_for("ckpt.saved", 1)                 # trainer_state.json closed: a short quiet commits
    h.idle()
    shutil.rmtree(h.ckpt / "checkpoint-10")
    wait_until(lambda: not h.monitor.wait_idle(0.0), WAIT_S, "custody to see the deletion")
    assert manifest.removals(h.run) == []
    h.monitor.close()                                  # the sidecar stops
    [removal] = manifest.removals(h.run)
    assert (removal.path, removal.by) == ("checkpoints/checkpoint-10", "job")
