"""`--resume-from DIR --resume-sha256 <unit digest>`: a directory checkpoint (HF `checkpoint-N/`) joins
a run as one unit.

The digest is checked against an independent computation here (sha256 of each file, the sorted
"relpath\\0size\\0sha256\\n" lines), so a change of the rule on one side only fails. The unit tests
drive onbox.launch.resume directly on real directories; the launch tests go through the real
launcher, wrapper and sidecar, and one resumes a real transformers.Trainer job from a real
checkpoint-10 made by tests/frameworks/hf_tiny.py.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from onbox.cli.launch import run_launch
from onbox.custody import manifest
from onbox.launch import resume
from onbox.launch.gates import LaunchRefused, LaunchUsageError
from onbox.launch.launcher import EXIT_REFUSED
from tests.helpers import REPO, wait_until
from tests.onbox.test_launch import Rig, log_line, py
from tests.onbox.test_launch_resume import SHOW

HF_TINY = REPO / "tests" / "frameworks" / "hf_tiny.py"
# What an HF save holds (the bytes do not matter here, the layout and the names do).
HF_FILES = {"model.safetensors": b"weights" * 300, "optimizer.pt": b"adam" * 500, "scheduler.pt": b"sched",
            "rng_state.pth": b"rng" * 40, "training_args.bin": b"args" * 9, "config.json": b'{"n_embd": 16}',
            "trainer_state.json": json.dumps({"global_step": 40, "log_history": []}).encode(),
            "sub/shard-00001.bin": b"a shard"}


def digest_of(unit: Path) -> str:
    """The unit digest computed independently of onbox: every regular file that is no temporary name."""
    rows = []
    for path in sorted(unit.rglob("*")):
        rel = path.relative_to(unit).as_posix()
        if path.is_symlink() or not path.is_file() or any(p.startswith(".") or p.endswith(".tmp")
                                                           for p in rel.split("/")):
            continue
        data = path.read_bytes()
        rows.append(f"{rel}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\n")
    return hashlib.sha256("".join(sorted(rows)).encode()).hexdigest()


def hf_dir(where: Path, files: Dict[str, bytes] = HF_FILES) -> Path:
    for rel, data in files.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_bytes(data)
    return where


def request(source: Path, sha: str, step: int = 40) -> resume.Request:
    req = resume.requested(source, sha, step, "old-run")
    assert req is not None
    return req


def listing(path: Path) -> List[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*")) if path.exists() else []


# ---- onbox.launch.resume on real directories -------------------------------------------------------


def test_a_directory_from_elsewhere_is_copied_in_whole_and_recorded_as_one_unit(tmp_path: Path) -> None:
    source = hf_dir(tmp_path / "volume" / "checkpoint-40")
    (source / ".model.safetensors.tmp").write_bytes(b"half written")  # a temporary name: not part of it
    (source / "link.bin").symlink_to(source / "scheduler.pt")       # no symlink is followed or copied
    sha = digest_of(source)
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoints"
    req = request(source, sha.upper(), step=40)
    assert req.kind == manifest.DIR
    taken = resume.take(run_dir, ckpt_dir, req, clock=lambda: 1000.0)

    inside = ckpt_dir / "checkpoint-40"
    assert (taken.path, taken.copied, taken.kind, taken.files, taken.sha256) == (inside, True, "dir", 8, sha)
    assert listing(inside) == sorted([*HF_FILES, "sub"])
    assert all((inside / rel).read_bytes() == data for rel, data in HF_FILES.items())
    assert listing(ckpt_dir) == ["checkpoint-40", *(f"checkpoint-40/{r}" for r in sorted([*HF_FILES, "sub"]))]
    assert digest_of(inside) == sha and (source / ".model.safetensors.tmp").exists()  # the source is kept

    [rec] = manifest.read(run_dir)
    assert (rec.kind, rec.path, rec.sha256, rec.step, rec.format) == ("dir", "checkpoints/checkpoint-40", sha,
                                                                      40, "hf")
    assert rec.size == sum(len(d) for d in HF_FILES.values()) and rec.inode == inside.stat().st_ino
    assert sorted(f.path for f in rec.files) == sorted(HF_FILES)
    assert {f.path: f.sha256 for f in rec.files} == {r: hashlib.sha256(d).hexdigest()
                                                     for r, d in HF_FILES.items()}
    assert rec.matches(run_dir) and manifest.newest_good(run_dir) == inside
    assert taken.record()["kind"] == "dir" and taken.record()["files"] == 8

    again = resume.take(run_dir, ckpt_dir, request(source, sha), clock=lambda: 2000.0)
    assert (again.path, again.copied) == (inside, False) and len(manifest.read(run_dir)) == 1  # once


def test_the_step_comes_from_the_name_else_from_trainer_state(tmp_path: Path) -> None:
    source = hf_dir(tmp_path / "far" / "best-model")
    req = resume.requested(source, digest_of(source), None, None)
    assert req is not None
    taken = resume.take(tmp_path / "run", tmp_path / "run" / "checkpoints", req)
    assert taken.step == 40 and manifest.read(tmp_path / "run")[0].step == 40  # trainer_state's global_step
    named = hf_dir(tmp_path / "far" / "checkpoint-70")
    req = resume.requested(named, digest_of(named), None, None)
    assert req is not None and resume.take(tmp_path / "run", tmp_path / "run" / "checkpoints",
                                                 req).step == 70


def test_a_directory_already_in_the_checkpoint_dir_is_hashed_in_place(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    inside = hf_dir(run_dir / "checkpoints" / "checkpoint-40")
    sha = digest_of(inside)
    taken = resume.take(run_dir, run_dir / "checkpoints", request(inside, sha))
    assert (taken.path, taken.copied) == (inside, False)
    assert [(r.kind, r.path) for r in manifest.read(run_dir)] == [("dir", "checkpoints/checkpoint-40")]
    assert manifest.newest_good(run_dir) == inside


@pytest.mark.parametrize("where", ["elsewhere", "in place"])
def test_a_unit_digest_mismatch_is_refused_and_nothing_is_left(tmp_path: Path, where: str) -> None:
    run_dir = tmp_path / "run"
    source = hf_dir((tmp_path / "far" if where == "elsewhere" else run_dir / "checkpoints") / "checkpoint-40")
    meant = digest_of(source)
    (source / "optimizer.pt").write_bytes(b"damaged in transit")
    with pytest.raises(LaunchRefused, match=f"has the unit digest {digest_of(source)}, not the {meant}"):
        resume.take(run_dir, run_dir / "checkpoints", request(source, meant))
    assert manifest.read(run_dir) == []
    left = listing(run_dir / "checkpoints")
    kept = ["checkpoint-40", *(f"checkpoint-40/{r}" for r in sorted([*HF_FILES, "sub"]))]
    assert left == ([] if where == "elsewhere" else kept)  # no temporary copy left behind
    if where == "in place":
        assert (source / "optimizer.pt").read_bytes() == b"damaged in transit"  # refused, not touched


def test_a_file_missing_from_the_copy_is_a_mismatch(tmp_path: Path) -> None:
    source = hf_dir(tmp_path / "far" / "checkpoint-40")
    meant = digest_of(source)
    (source / "rng_state.pth").unlink()
    with pytest.raises(LaunchRefused, match="not the"):
        resume.take(tmp_path / "run", tmp_path / "run" / "checkpoints", request(source, meant))
    assert listing(tmp_path / "run" / "checkpoints") == []


def test_a_name_taken_by_another_directory_is_not_replaced(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    theirs = hf_dir(run_dir / "checkpoints" / "checkpoint-40", {"model.safetensors": b"the job's own"})
    source = hf_dir(tmp_path / "far" / "checkpoint-40")
    with pytest.raises(LaunchRefused, match="exists and holds other bytes"):
        resume.take(run_dir, run_dir / "checkpoints", request(source, digest_of(source)))
    assert listing(theirs) == ["model.safetensors"] and manifest.read(run_dir) == []


def test_an_empty_directory_or_the_checkpoint_dir_itself_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (tmp_path / "far" / "checkpoint-40").mkdir(parents=True)
    empty = hashlib.sha256(b"").hexdigest()
    with pytest.raises(LaunchRefused, match="holds no finished file"):
        resume.take(run_dir, run_dir / "checkpoints",
                          request(tmp_path / "far" / "checkpoint-40", empty))
    assert listing(run_dir / "checkpoints") == []
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    with pytest.raises(LaunchUsageError, match="is the run's checkpoint dir or holds it"):
        resume.take(run_dir, run_dir / "checkpoints", request(run_dir, empty))
    with pytest.raises(LaunchUsageError, match="no such file or directory here"):
        resume.requested(tmp_path / "nowhere", empty, None, None)


# ---- through the real launcher ---------------------------------------------------------------------


def test_a_launch_hands_the_directory_to_the_job_and_refuses_a_mismatch(rig: Rig) -> None:
    source = hf_dir(rig.tmp / "durable" / "checkpoint-40")
    sha = digest_of(source)
    bad = io.StringIO()
    opts = rig.opts(py("print('ran')"), run_id="bad", resume_from=source,
                    resume_sha256=hashlib.sha256(b"x").hexdigest())
    rig.track(rig.root / "p" / "active" / "bad")
    assert run_launch(opts, False, io.StringIO(), bad) == EXIT_REFUSED
    assert "has the unit digest" in bad.getvalue()
    assert not (rig.root / "p" / "active" / "bad" / "run.json").exists()

    res = rig.launch(py(SHOW), run_id="new", resume_from=source, resume_sha256=sha, resume_step=40,
                     resumes="old-run", environ={**os.environ, "STEP": "45"})
    inside = res.run_dir / "checkpoints" / "checkpoint-40"
    assert wait_until(lambda: log_line(res.run_dir, "resume="), 10, "the job's line") == str(inside)
    meta = json.loads((res.run_dir / "run.json").read_text())
    resumed = meta["resume"]
    assert (resumed["path"], resumed["sha256"], resumed["kind"]) == (str(inside), sha, "dir")
    assert meta["resume_from"] == str(inside) and manifest.newest_good(res.run_dir) == inside
    rig.go(res.run_dir)
    assert rig.finished(res.run_dir)["code"] == 0
    # The sidecar's custody saw the unit the launcher recorded: still one record, nothing suspect.
    assert [(r.kind, r.path) for r in manifest.read(res.run_dir)] == [("dir", "checkpoints/checkpoint-40")]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real HF checkpoint-10 (of a 20-step run saving every 10), made once for this module."""
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("hf-source")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    subprocess.run([sys.executable, str(HF_TINY), "--steps", "20", "--save-every", "10"], cwd=work, env=env,
                   check=True, capture_output=True, timeout=400)
    yield work / "out" / "checkpoint-10"


def test_a_real_hf_trainer_resumes_from_the_pushed_checkpoint_directory(rig: Rig,
                                                                         hf_checkpoint: Path) -> None:
    sha = digest_of(hf_checkpoint)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    command = [sys.executable, str(HF_TINY), "--steps", "20", "--save-every", "10", "--log-every", "5"]
    res = rig.launch(command, run_id="hf", resume_from=hf_checkpoint, resume_sha256=sha, resume_step=10,
                     resumes="old-run", environ=env)
    inside = res.run_dir / "checkpoints" / "checkpoint-10"
    assert res.resume_from == inside and digest_of(inside) == sha
    done = rig.finished(res.run_dir, timeout_s=400)
    log = (res.run_dir / "train.log").read_text(errors="replace")
    assert done["code"] == 0, log[-2000:]
    # It went on from step 10: only checkpoint-20 was saved, and only steps 15 and 20 were logged.
    out = rig.cwd / "out"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-20"], log[-2000:]
    state = json.loads((out / "checkpoint-20" / "trainer_state.json").read_text())
    assert state["global_step"] == 20
    assert log.count("'loss'") == 2, log[-2000:]
    rec = next(r for r in manifest.read(res.run_dir) if r.path == "checkpoints/checkpoint-10")
    assert rec.kind == "dir" and rec.step == 10 and rec.format == "hf" and len(rec.files) == 8
