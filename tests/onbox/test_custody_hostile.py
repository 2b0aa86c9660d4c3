"""Custody against hostile checkpoints: a save whose judging went wrong is never left out.

A safetensors header nested 100000 deep once raised RecursionError in the custody worker: a
`sidecar.degraded`, no record, no suspect, and a pull (and `rgt verify`) that never heard of the
run's only checkpoint. Now it is a suspect line in rgt/manifest.jsonl with its reason, the run's
verdict names it, a restart does not judge it again, and verifying the pull fails naming it.

Real files, a real inotify observer, the real scheduler, the real pull manifest and the real
controller verification of a pulled copy.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest

from onbox.custody import manifest, pullmanifest, worker
from onbox.custody.monitor import CustodyConfig, CustodyMonitor
from onbox.scheduler import Scheduler
from tests.helpers import Recorder

DEEP = b"[" * 100_000 + b"]" * 100_000
NAME = "checkpoints/step000005.safetensors"


class Harness:
    def __init__(self, monitor: CustodyMonitor, events: Recorder) -> None:
        self.monitor, self.events = monitor, events
        self.run, self.ckpt = monitor.run_dir, monitor.ckpt_dir

    def idle(self) -> None:
        assert self.monitor.wait_idle(10.0), self.monitor.status()


@pytest.fixture
def custody(tmp_path: Path) -> Iterator[Callable[[], Harness]]:
    made: List[Tuple[CustodyMonitor, Scheduler]] = []
    failures: List[str] = []

    def factory() -> Harness:
        events = Recorder()
        monitor = CustodyMonitor(CustodyConfig(run_dir=tmp_path / "run", settle_s=0.05, unit_settle_s=0.3,
                                               hash_rate_bytes_s=None), events)
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


def write_atomic(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def hostile() -> bytes:
    return struct.pack("<Q", len(DEEP)) + DEEP + b"\0" * 16


def pull(run: Path, dest: Path) -> Path:
    """What `rgt pull` leaves: the box's manifest, and exactly the files it lists."""
    doc = pullmanifest.build_manifest(run)
    for f in doc["files"]:
        (dest / f["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run / f["path"], dest / f["path"])
    (dest / "rgt").mkdir(parents=True, exist_ok=True)
    (dest / "rgt" / "PULL_MANIFEST.json").write_text(json.dumps(doc))
    return dest


@pytest.mark.skipif(sys.version_info < (3, 10), reason="this test also runs the laptop's verify, which needs "
                    "Python 3.10+; the Python 3.9 leg checks the box side, the main leg runs it whole")
def test_a_header_that_crashed_custody_is_a_recorded_suspect_and_fails_the_pull(
        custody: Callable[[], Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = custody()
    path = write_atomic(h.ckpt / "step000005.safetensors", hostile())
    data = h.events.wait_for("ckpt.suspect")[0]
    h.idle()
    assert not h.events.of("sidecar.degraded") and not h.events.of("ckpt.saved")
    assert (data["path"], data["code"], data["recorded"]) == (NAME, "bad_structure", True), data
    reason = "safetensors: header nests 100000 levels deep (limit 64): refused without parsing it"
    assert data["reason"] == reason
    [line] = manifest.live_suspects(h.run)
    st = path.stat()
    assert (line.path, line.code, line.reason, line.kind) == (NAME, "bad_structure", reason, "file")
    assert (line.size, line.mtime_ns, line.inode) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert line.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest.read(h.run) == []  # not a record: resume and the gate's view never take it
    assert h.monitor.verdict_reasons() == [f"checkpoint {NAME} is suspect (bad_structure: {reason}) "
                                           "(ckpt.suspect)"]

    h.monitor.close()  # a restarted sidecar reads the line back and does not judge it again
    again = custody()
    again.monitor.sweep_tick()
    again.idle()
    assert not again.events.of("ckpt.suspect") and len(manifest.suspects(h.run)) == 1

    from controller.verify import units as verify_units
    from controller.verify.prove import verify
    monkeypatch.setattr(verify_units, "newest_units", lambda steps: [])
    report = verify(pull(h.run, tmp_path / "pulled"))
    assert not report.ok
    assert report.failures() == [f"{NAME}: identity: the box's custody recorded this checkpoint as suspect "
                                 f"(bad_structure: {reason}), so no pull proves it"]


def test_a_directory_unit_with_a_hostile_file_is_recorded_with_its_files(
        custody: Callable[[], Harness]) -> None:
    h = custody()
    unit = h.ckpt / "checkpoint-7"
    staging = h.ckpt / "tmp-checkpoint-7"
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(hostile())
    (staging / "trainer_state.json").write_text('{"global_step": 7}')
    os.rename(staging, unit)
    data = h.events.wait_for("ckpt.suspect")[0]
    h.idle()
    assert data["path"] == "checkpoints/checkpoint-7" and data["bad"] == ["model.safetensors"], data
    assert "model.safetensors: safetensors: header nests 100000 levels deep" in data["reason"]
    [line] = manifest.live_suspects(h.run)
    assert line.kind == "dir"
    assert sorted(f.path for f in line.files) == ["model.safetensors", "trainer_state.json"]
    assert line.signature() == tuple(sorted((f.path, f.key) for f in line.files))
    assert h.monitor.verdict_reasons()[0].startswith("checkpoint checkpoints/checkpoint-7 is suspect")


def test_hashing_that_raises_leaves_the_unit_in_as_check_failed(custody: Callable[[], Harness],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(worker, "sha256_stream", broken)
    h = custody()
    write_atomic(h.ckpt / "step000009.pt", b"PK\x03\x04 not really")
    data = h.events.wait_for("ckpt.suspect")[0]
    h.idle()
    assert (data["code"], data["path"]) == ("check_failed", "checkpoints/step000009.pt"), data
    assert data["reason"] == "checking it raised OSError: [Errno 5] Input/output error"
    assert h.events.of("sidecar.degraded")  # the worker's boundary still reports itself
    [line] = manifest.live_suspects(h.run)
    assert line.code == "check_failed" and line.sha256 is None


def test_a_suspect_saved_again_and_passing_is_no_longer_live(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "rgt").mkdir(parents=True)
    manifest.append_suspect(run, manifest.Suspect("a.safetensors", "bad_structure", "why", ts=5.0))
    manifest.append_suspect(run, manifest.Suspect("b.pt", "check_failed", "why", ts=5.0))
    record: Dict[str, Any] = {"path": "a.safetensors", "size": 1, "sha256": "a" * 64, "mtime_ns": 1,
                              "inode": 1, "step": 1, "format": "safetensors", "ts": 6.0}
    manifest.append(run, manifest.Record(**record))
    assert [s.path for s in manifest.suspects(run)] == ["a.safetensors", "b.pt"]
    assert [s.path for s in manifest.live_suspects(run)] == ["b.pt"]
    assert [r.path for r in manifest.read(run)] == ["a.safetensors"] and manifest.removals(run) == []
