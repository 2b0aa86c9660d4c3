"""`rgt-onbox launch --resume-from FILE --resume-sha256 HEX --resume-step N --resumes RUN`.

Real launches (the wrapper, the supervisor, the sidecar) through the launch tests' Rig: the file is
hashed and refused on a mismatch before anything starts, copied into the run's checkpoint dir when
it lies elsewhere, recorded in the custody manifest, handed to the job as RGT_RESUME_FROM, written
to run.json, and its step seeds the sidecar's restart detector.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest

from onbox.cli.launch import run_launch
from onbox.custody import manifest
from onbox.launch.launcher import EXIT_REFUSED, EXIT_USAGE
from onbox.launch.settings import resume_step, training_config
from onbox.monitors.training import TrainingConfig, TrainingMonitor
from onbox.sidecar.journal import read_all
from tests.helpers import wait_until
from tests.onbox.test_launch import WAIT_GO, Rig, log_line, py

# The job prints what it was told to resume from, writes one metrics line at step $STEP, then waits.
SHOW = ("import json, os\n"
        "print('resume=' + os.environ.get('RGT_RESUME_FROM', '-'), flush=True)\n"
        "with open(os.environ['RGT_METRICS'], 'a') as f:\n"
        "    f.write(json.dumps({'step': int(os.environ.get('STEP', '0')), 'loss': 0.5}) + '\\n')\n"
        + WAIT_GO)


def ckpt(path: Path, payload: bytes = b"weights of step 40\n") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload)
    return hashlib.sha256(payload).hexdigest()


def journal(run_dir: Path, kind: str) -> List[Dict[str, Any]]:
    rgt = run_dir / "rgt"
    return [e for e in read_all(rgt) if e["kind"] == kind] if (rgt / "events.jsonl").exists() else []


def test_a_checkpoint_from_elsewhere_is_copied_in_recorded_and_handed_to_the_job(rig: Rig) -> None:
    source = rig.tmp / "durable" / "step000040.pt"
    sha = ckpt(source)
    res = rig.launch(py(SHOW), run_id="new", resume_from=source, resume_sha256=sha.upper(), resume_step=40,
                     resumes="old-run", environ={**os.environ, "STEP": "45"})
    inside = res.run_dir / "checkpoints" / "step000040.pt"
    assert wait_until(lambda: log_line(res.run_dir, "resume="), 10, "the job's line") == str(inside)
    assert res.resume_from == inside and inside.read_bytes() == source.read_bytes() and source.exists()
    assert not [p for p in inside.parent.iterdir() if p.name != inside.name]  # no temporary left
    records = manifest.read(res.run_dir)
    assert [(r.path, r.sha256, r.step, r.size) for r in records] == [
        ("checkpoints/step000040.pt", sha, 40, inside.stat().st_size)]
    assert records[0].matches(res.run_dir) and manifest.newest_good(res.run_dir) == inside
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["resume"]["path"] == str(inside) and meta["resume"]["sha256"] == sha
    assert (meta["resume"]["step"], meta["resume"]["from_run"], meta["resumes"]) == (40, "old-run", "old-run")
    assert meta["resume"]["copied"] is True and meta["resume_from"] == str(inside)
    # The sidecar judged step 45 against the resume step: progress, and no restart from zero.
    wait_until(lambda: any(e["data"].get("step") == 45 for e in journal(res.run_dir, "train.progress")), 15,
               "train.progress at step 45")
    assert journal(res.run_dir, "train.restarted_from_zero") == []
    rig.go(res.run_dir)
    assert rig.finished(res.run_dir)["code"] == 0


def test_a_job_that_starts_at_zero_after_a_resume_is_a_restart_from_zero(rig: Rig) -> None:
    inside = rig.root / "p" / "active" / "new" / "checkpoints" / "step000040.pt"  # pushed in place
    sha = ckpt(inside)
    res = rig.launch(py(SHOW), run_id="new", resume_from=inside, resume_sha256=sha, resume_step=40,
                     environ={**os.environ, "STEP": "5"})
    found = wait_until(lambda: journal(res.run_dir, "train.restarted_from_zero"), 15, "the restart event")
    assert (found[0]["data"]["last_step"], found[0]["data"]["new_step"]) == (40, 5)
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["resume"]["copied"] is False and meta["resume"]["path"] == str(inside)
    assert [r.path for r in manifest.read(res.run_dir)] == ["checkpoints/step000040.pt"]
    rig.go(res.run_dir)
    rig.finished(res.run_dir)


@pytest.mark.parametrize("where", ["elsewhere", "in place"])
def test_a_sha256_mismatch_is_refused_before_anything_starts(rig: Rig, where: str) -> None:
    run_dir = rig.root / "p" / "active" / "bad"
    source = rig.tmp / "far" / "step000040.pt" if where == "elsewhere" else run_dir / "checkpoints" / "s40.pt"
    ckpt(source, b"damaged bytes\n")
    want = hashlib.sha256(b"the bytes meant\n").hexdigest()
    out, err = io.StringIO(), io.StringIO()
    opts = rig.opts(py("print('ran')"), run_id="bad", resume_from=source, resume_sha256=want, resume_step=40)
    rig.track(run_dir)
    assert run_launch(opts, True, out, err) == EXIT_REFUSED
    assert "error: " in err.getvalue() and f"not the {want} it should have" in err.getvalue()
    assert out.getvalue() == "" and not (run_dir / "rgt" / "job.json").exists()
    assert not (run_dir / "run.json").exists() and manifest.read(run_dir) == []
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert left == ([] if where == "elsewhere" else ["s40.pt"])  # nothing copied, no temporary left


def test_a_name_taken_by_other_bytes_is_not_overwritten(rig: Rig) -> None:
    run_dir = rig.root / "p" / "active" / "taken"
    ckpt(run_dir / "checkpoints" / "step000040.pt", b"the job's own\n")
    sha = ckpt(rig.tmp / "far" / "step000040.pt")
    opts = rig.opts(py("print('ran')"), run_id="taken", resume_from=rig.tmp / "far" / "step000040.pt",
                    resume_sha256=sha)
    rig.track(run_dir)
    err = io.StringIO()
    assert run_launch(opts, False, io.StringIO(), err) == EXIT_REFUSED
    assert "exists and holds other bytes" in err.getvalue()
    assert (run_dir / "checkpoints" / "step000040.pt").read_bytes() == b"the job's own\n"


@pytest.mark.parametrize("kw, says", [
    ({"resume_sha256": None}, "--resume-from needs --resume-sha256"),
    ({"resume_sha256": "abc"}, "is not 64 hex digits"),
    ({"resume_from": "missing.pt"}, "no such file or directory here"),
    ({"resume_from": None}, "which is missing"),
])
def test_resume_options_that_do_not_fit_are_usage_errors(rig: Rig, kw: Dict[str, Any], says: str) -> None:
    source = rig.tmp / "c.pt"
    base: Dict[str, Any] = {"resume_from": source, "resume_sha256": ckpt(source), "resume_step": 3}
    base.update({k: (rig.tmp / v if k == "resume_from" and v else v) for k, v in kw.items()})
    err = io.StringIO()
    assert run_launch(rig.opts(py("print(1)"), run_id="u", **base), False, io.StringIO(), err) == EXIT_USAGE
    assert says in err.getvalue() and not (rig.root / "p" / "active" / "u").exists()


def test_the_detector_seed_comes_from_run_json_and_a_saved_mark_wins(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"resume": {"step": 40, "path": "x", "sha256": "y"}}))
    assert resume_step(tmp_path) == 40 and training_config(tmp_path, {}, None).resume_step == 40
    (tmp_path / "run.json").write_text(json.dumps({"resume": None}))
    assert resume_step(tmp_path) is None
    # a relaunch in place: the step custody recorded for the checkpoint the launcher handed over
    (tmp_path / "rgt").mkdir()
    for step in (20, 60):
        record = manifest.Record(f"out/checkpoint-{step}", 1, "a" * 64, 1, 1, step, "hf", 1.0)
        manifest.append(tmp_path, record)
    (tmp_path / "run.json").write_text(json.dumps({"resume": None,
                                                   "resume_from": str(tmp_path / "out" / "checkpoint-60")}))
    assert resume_step(tmp_path) == 60

    def restarts(run: Path, seed: Any, steps: List[int]) -> List[Any]:
        events: List[Any] = []
        run.mkdir(exist_ok=True)
        with open(run / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)
        mon = TrainingMonitor(TrainingConfig(run_dir=run, resume_step=seed, stall=False),
                              lambda kind, data, sev: events.append((kind, dict(data))))
        mon.start()
        mon.tick()
        mon.close()
        return [d["new_step"] for k, d in events if k == "train.restarted_from_zero"]

    assert restarts(tmp_path / "a", 40, [5, 10]) == [5]
    assert restarts(tmp_path / "b", None, [5, 10]) == []
    assert restarts(tmp_path / "c", 40, [45, 50]) == []
    # A restarted sidecar keeps its saved high-water mark (50 here), whatever the seed says.
    assert restarts(tmp_path / "c", 10, [20]) == [20]
