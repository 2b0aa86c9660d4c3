"""`rgt verify` and the teardown gate over what real frameworks write: a Hugging Face Trainer run
(save_total_limit=2 rotated checkpoint-20 away) and Lightning runs (healthy, and one that went NaN).

The jobs (tests/frameworks/*_tiny.py) run once per session in a temp dir (~10 s each). The pulled
run dir's PULL_MANIFEST.json is built here in the box's shape (protocol.pull's digest, each
checkpoint file's "unit", the top-level "removed"), since the box side of rotation is built apart.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

from controller.teardown import gate as teardown
from controller.verify.prove import verify
from protocol.pull import manifest_digest
from tests.controller.verifykit import MANIFEST, Evil

ROOT = Path(__file__).resolve().parents[2]
FAKE_SHA = "ab" * 32


def _job(tmp: Path, script: str, *args: str) -> Path:
    cwd = tmp / (script + "-".join(args))
    cwd.mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "tests/frameworks" / script), *args], cwd=cwd,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return cwd


@pytest.fixture(scope="session")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    tmp = tmp_path_factory.mktemp("frameworks")
    return {"hf": _job(tmp, "hf_tiny.py"), "lightning": _job(tmp, "lightning_tiny.py"),
            "lightning_nan": _job(tmp, "lightning_tiny.py", "--nan-at", "30")}


def _step(rel: str) -> Optional[int]:
    for part in rel.replace("=", "-").replace(".", "-").split("/"):
        if part.startswith("checkpoint-"):
            return int(part.split("-")[1])
    if "step-" in rel.replace("=", "-"):
        return int(rel.replace("=", "-").split("step-")[1].split("-")[0].split(".")[0])
    return None


def pulled(src: Path, dest: Path, removed: List[Dict[str, Any]]) -> Path:
    """A pulled run dir: the job's files, and a manifest that lists each checkpoint file with its unit."""
    run = dest / "run"
    shutil.copytree(src, run)
    (run / "rgt").mkdir()
    files = []
    for p in sorted(x for x in run.rglob("*") if x.is_file() and "rgt" not in x.relative_to(run).parts):
        rel = p.relative_to(run).as_posix()
        data = p.read_bytes()
        ckpt = "checkpoint-" in rel or rel.endswith(".ckpt")
        entry: Dict[str, Any] = {"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                 "kind": "checkpoint" if ckpt else "include",
                                 "step": _step(rel) if ckpt else None, "hashed": "custody" if ckpt else "now"}
        if ckpt:
            entry["unit"] = rel.rsplit("/", 1)[0] if "checkpoint-" in rel else rel
        files.append(entry)
    doc: Dict[str, Any] = {"schema": "rgt.pull_manifest", "version": 1, "run_id": "run-fw",
                           "created_at": "2026-05-09T12:00:00Z", "host": "box1", "files": files,
                           "total_bytes": sum(f["size"] for f in files), "removed": removed}
    doc["sha256"] = manifest_digest(doc)
    (run / MANIFEST).write_text(json.dumps(doc, indent=1))
    return run


def rewrite_manifest(run: Path) -> None:
    doc = json.loads((run / MANIFEST).read_text())
    for f in doc["files"]:
        data = (run / f["path"]).read_bytes()
        f.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    doc["total_bytes"] = sum(f["size"] for f in doc["files"])
    doc["sha256"] = manifest_digest(doc)
    (run / MANIFEST).write_text(json.dumps(doc, indent=1))


# the box's shape (protocol.pull): the unit the job rotated away, with the unit's sha256
HF_ROTATED = [{"path": "out/checkpoint-20", "sha256": FAKE_SHA, "by": "job", "reason": "save_total_limit",
               "ts": 1.0, "step": 20}]


class Spawns:
    """A Popen that counts the seam children it starts."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, *args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        self.count += 1
        return subprocess.Popen(*args, **kwargs)


def gate_view(run: Path, unrecorded: Optional[List[Dict[str, Any]]] = None,
              removed: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    doc = json.loads((run / MANIFEST).read_text())
    cks = {f["path"]: {"sha256": f["sha256"], "size": f["size"], "step": f["step"], "unit": f.get("unit")}
           for f in doc["files"] if f["kind"] == "checkpoint"}
    gone = doc.get("removed", []) if removed is None else removed
    for r in gone:
        cks[r["path"]] = {"sha256": r["sha256"], "size": 1, "step": 20}
    return {"checkpoints": cks, "missing": [r["path"] for r in gone], "partials": [],
            "unrecorded": unrecorded or [], "removed": gone}


def test_a_healthy_hf_run_verifies_in_one_child_and_opens_the_gate(jobs: Dict[str, Path],
                                                                   tmp_path: Path) -> None:
    assert sorted(p.name for p in (jobs["hf"] / "out").iterdir()) == ["checkpoint-40", "checkpoint-60"]
    run = pulled(jobs["hf"], tmp_path, HF_ROTATED)
    spawns = Spawns()
    report = verify(run, spawn=spawns)
    assert report.ok, report.failures()
    assert spawns.count == 1  # one torch child for both checkpoints' 6 torch files
    methods = {f.path.rsplit("/", 1)[-1]: f.method for f in report.files if "checkpoint-60" in f.path}
    assert methods["model.safetensors"] == "weights"
    assert methods["rng_state.pth"].startswith("safe-load (allow-list: numpy._core.multiarray._reconstruct")
    assert methods["optimizer.pt"] == methods["scheduler.pt"] == "safe-load"
    assert methods["training_args.bin"].startswith("identity only (pickles code: TrainingArguments")
    assert methods["trainer_state.json"] == methods["config.json"] == "identity only (parsed as JSON)"
    assert report.rotated_away == ["out/checkpoint-20"]
    rows = {u["name"]: u for u in report.units}
    assert rows["out/checkpoint-60/"]["newest"] and rows["out/checkpoint-60/"]["weights_finite"] is True
    assert len(rows["out/checkpoint-60/"]["files"]) == 8
    assert rows["out/checkpoint-40/"]["weights_finite"] is None  # not the newest: not checked by default
    gate = teardown.judge("run-fw", run, lambda: gate_view(run))
    assert gate.open, gate.reason
    assert gate.rotated_away == ["out/checkpoint-20"]
    assert "rotated away by the job: out/checkpoint-20" in gate.reason


def test_the_gate_stays_closed_for_unrecorded_files_none_recorded_or_a_foreign_removal(
        jobs: Dict[str, Path], tmp_path: Path) -> None:
    run = pulled(jobs["hf"], tmp_path, HF_ROTATED)
    assert verify(run).ok
    stray = [{"path": "rgt/external/home/u/out2/checkpoint-5/model.safetensors", "size": 19824}]
    gate = teardown.judge("run-fw", run, lambda: gate_view(run, unrecorded=stray))
    assert not gate.open and gate.code == "unrecorded_checkpoint"
    assert "rgt/external/home/u/out2/checkpoint-5/model.safetensors" in gate.reason
    empty = {"checkpoints": {}, "missing": [], "partials": [], "unrecorded": [], "removed": []}
    gate = teardown.judge("run-fw", run, lambda: empty)
    assert not gate.open and gate.code == "no_checkpoint" and "no recorded checkpoint" in gate.reason
    other = [{**HF_ROTATED[0], "by": "other", "reason": "vanished while judged"}]
    gate = teardown.judge("run-fw", run, lambda: gate_view(run, removed=other))
    assert not gate.open and "something other than the job's rotation" in " ".join(gate.problems)


def test_a_removal_by_anything_but_the_job_fails_verify(jobs: Dict[str, Path], tmp_path: Path) -> None:
    run = pulled(jobs["hf"], tmp_path, [{**HF_ROTATED[0], "by": "other", "reason": "truncated"}])
    report = verify(run)
    assert not report.ok and report.rotated_away == []
    assert any("out/checkpoint-20: identity: removed from the box by something other" in ln
               for ln in report.failures())


def test_a_tampered_byte_fails_identity(jobs: Dict[str, Path], tmp_path: Path) -> None:
    run = pulled(jobs["hf"], tmp_path, HF_ROTATED)
    path = run / "out/checkpoint-40/optimizer.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    lines = verify(run).failures()
    assert len(lines) == 1 and lines[0].startswith("out/checkpoint-40/optimizer.pt: identity: sha256 differs")


def test_a_malicious_companion_is_refused_not_loaded(jobs: Dict[str, Path], tmp_path: Path) -> None:
    run = pulled(jobs["hf"], tmp_path, HF_ROTATED)
    marker = tmp_path / "PWNED"
    torch.save({"python": Evil(marker)}, run / "out/checkpoint-60/rng_state.pth")
    rewrite_manifest(run)
    report = verify(run)
    assert [ln.split(": safe_load: ")[0] for ln in report.failures()] == ["out/checkpoint-60/rng_state.pth"]
    assert "weights_only=True refused it" in report.failures()[0] and "system" in report.failures()[0]
    assert not marker.exists()


def test_a_healthy_lightning_run_passes_even_with_check_finite(jobs: Dict[str, Path], tmp_path: Path) -> None:
    run = pulled(jobs["lightning"], tmp_path, [])
    spawns = Spawns()
    report = verify(run, check_finite=True, spawn=spawns)
    assert report.ok, report.failures()
    assert spawns.count == 1
    ckpts = [f for f in report.files if f.path.endswith(".ckpt")]
    assert len(ckpts) == 2 and all(f.method == "weights" and f.nonfinite == 0 for f in ckpts)
    assert teardown.judge("run-fw", run, lambda: gate_view(run)).open


def test_a_lightning_run_that_went_nan_fails_verify_by_default(jobs: Dict[str, Path], tmp_path: Path) -> None:
    run = pulled(jobs["lightning_nan"], tmp_path, [])
    newest = "lightning_logs/version_0/checkpoints/epoch=0-step=40.ckpt"
    assert (run / newest).is_file()
    report = verify(run)
    assert not report.ok and report.nonfinite == [newest]
    (line,) = report.failures()
    assert line.startswith(f"{newest}: safe_load: ") and "non-finite values (NaN/Inf) in state_dict." in line
    assert "callbacks" not in line  # ModelCheckpoint's kth_value = inf there is not weights
    assert not teardown.judge("run-fw", run, lambda: gate_view(run)).open
    allowed = verify(run, allow_nonfinite=True)
    assert allowed.ok and allowed.nonfinite == [newest]
