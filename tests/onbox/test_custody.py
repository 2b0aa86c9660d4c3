"""Checkpoint custody end to end: real files, a real watchdog observer (inotify here; polling in one
test), real torch.save / safetensors files, the real scheduler running `jobs()`.

Waits are bounded waits on emitted events or on `wait_idle`; settling is made fast with a tiny
`settle_s`, never waited out with a sleep.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import safetensors.numpy

from onbox.custody import manifest
from onbox.custody.check import is_temporary
from onbox.custody.monitor import CustodyConfig, CustodyMonitor
from onbox.errors import ConfigError
from onbox.sources.checkpoints import Change, CheckpointWatcher, fs_type, is_network_fs
from tests.onbox.custodyrig import WAIT_S, Factory, Recorder

# The 3.9 run (make py39) has no torch wheel on this disk; there these modules skip.
torch = pytest.importorskip("torch")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_atomic(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return path


def write_atomic(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def assert_manifest_true(run: Path) -> List[manifest.Record]:
    """Every record in manifest.jsonl describes bytes that hash to its sha256 (when still there)."""
    records = manifest.read(run)
    lines = (run / "rgt" / "manifest.jsonl").read_text().splitlines()
    assert len(lines) == len(records), "a torn or foreign line in the manifest"
    for record in records:
        if record.matches(run) and record.kind == "dir":
            where = run / record.path
            lines = sorted(f"{f.path}\0{f.size}\0{sha256(where / f.path)}\n" for f in record.files)
            assert all(sha256(where / f.path) == f.sha256 for f in record.files), record
            assert hashlib.sha256("".join(lines).encode()).hexdigest() == record.sha256, record
            assert record.size == sum(f.size for f in record.files)
        elif record.matches(run):
            assert sha256(run / record.path) == record.sha256, record
    return records


def state(seed: int, n: int = 16) -> Dict[str, Any]:
    return {"w": torch.full((n, n), float(seed)), "step": seed}


# ---- naming rules -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, temp", [
    ("step1.pt.tmp", True), ("x.partial", True), (".hidden", True), ("a.pt.tmp.1234", True),
    ("tmp-checkpoint-5/model.safetensors", True), ("step1.pt", False), ("checkpoint-5/x.bin", False),
    ("attempt.pt", False),
])
def test_is_temporary(name: str, temp: bool) -> None:
    assert is_temporary(name) is temp


def test_filesystem_type_picks_polling_for_network_mounts(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("overlay / overlay rw 0 0\n"
                      "server:/export /mnt/nfs nfs4 rw 0 0\n"
                      "JuiceFS:fs /root/autodl-fs fuse.juicefs rw 0 0\n"
                      "tmpfs /mnt/nfs/scratch tmpfs rw 0 0\n")
    kinds = {p: fs_type(Path(p), str(mounts)) for p in
             ("/mnt/nfs/run/checkpoints", "/root/autodl-fs/x", "/mnt/nfs/scratch/y", "/root/autodl-tmp")}
    assert kinds == {"/mnt/nfs/run/checkpoints": "nfs4", "/root/autodl-fs/x": "fuse.juicefs",
                     "/mnt/nfs/scratch/y": "tmpfs", "/root/autodl-tmp": "overlay"}
    assert [is_network_fs(k) for k in kinds.values()] == [True, True, False, False]


def test_auto_polls_a_network_filesystem(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"overlay / overlay rw 0 0\nserver:/x {tmp_path} nfs4 rw 0 0\n")
    changes: List[Change] = []
    watchers = [CheckpointWatcher(tmp_path, changes.append, "auto", 0.05, str(mounts)),
                CheckpointWatcher(tmp_path, changes.append, "auto", 0.05, str(tmp_path / "no-mounts"))]
    try:
        for w in watchers:
            w.start()
        assert [w.kind for w in watchers] == ["polling", "inotify"]
        assert "nfs4" in watchers[0].reason
    finally:
        for w in watchers:
            w.stop()
    assert not any(w.alive() for w in watchers)


def test_bad_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        CustodyMonitor(CustodyConfig(tmp_path, observer="fanotify"), Recorder())
    with pytest.raises(ConfigError):
        CustodyMonitor(CustodyConfig(tmp_path, durable_dir=tmp_path / "checkpoints" / "d"), Recorder())


# ---- commits ------------------------------------------------------------------------------------


def test_atomic_save_is_recorded_once(custody: Factory) -> None:
    h = custody()
    (h.ckpt / ".notes").write_text("hidden")
    (h.ckpt / "upload.partial").write_bytes(b"x" * 100)
    (h.ckpt / ".staging").write_bytes(b"y" * 100)
    os.replace(h.ckpt / ".staging", h.ckpt / "renamed.partial")  # a move onto a temporary name
    path = save_atomic(h.ckpt / "step000100.pt", state(1))
    saved = h.events.wait_for("ckpt.saved")
    h.idle()
    assert len(h.events.of("ckpt.saved")) == 1 and not h.events.of("ckpt.suspect")
    data = saved[0]
    assert data["path"] == "checkpoints/step000100.pt" and data["sha256"] == sha256(path)
    assert (data["step"], data["format"], data["check"]) == (100, "torch", "ok")
    assert data["size"] == path.stat().st_size
    assert (data["via"], data["non_atomic"]) == ("rename", False)
    assert manifest.newest_good(h.run) == path
    assert [r.path for r in assert_manifest_true(h.run)] == ["checkpoints/step000100.pt"]
    assert h.commits, "on_commit was not called"


def test_the_job_helper_save_is_committed_by_rename(custody: Factory) -> None:
    from onbox import report

    h = custody()
    first = report.save({"w": torch.ones(4, 4)}, h.ckpt / "model.safetensors", fmt="safetensors", step=12)
    second = report.save(state(13), h.ckpt / "step{step:06d}.pt", step=13)
    h.events.wait_for("ckpt.saved", 2)
    h.idle()
    got = {d["path"]: d for d in h.events.of("ckpt.saved")}
    assert {p: (d["via"], d["step"], d["format"], d["sha256"]) for p, d in got.items()} == {
        "checkpoints/model.safetensors": ("rename", 12, "safetensors", sha256(first)),
        "checkpoints/step000013.pt": ("rename", 13, "torch", sha256(second))}
    assert not h.events.of("ckpt.suspect")


def test_the_job_helper_save_gives_its_step_to_a_name_without_one(custody: Factory,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from onbox import report

    h = custody()
    monkeypatch.setenv("RGT_RUN_DIR", str(h.run))
    (h.run / "rgt").mkdir(parents=True, exist_ok=True)
    first = report.save(state(1), h.ckpt / "latest.pt", step=300)
    h.events.wait_for("ckpt.saved")
    second = report.save(state(2), h.ckpt / "latest.pt", step=360)  # the same name, a new inode
    saved = h.events.wait_for("ckpt.saved", 2)
    h.idle()
    assert [(d["path"], d["step"]) for d in saved] == [("checkpoints/latest.pt", 300),
                                                       ("checkpoints/latest.pt", 360)]
    assert saved[1]["sha256"] == sha256(second) and first == second
    assert [r.step for r in assert_manifest_true(h.run)] == [300, 360]


def test_direct_save_commits_by_close_and_a_rewrite_is_not_atomic(custody: Factory) -> None:
    h = custody()
    path = h.ckpt / "latest.pt"
    torch.save(state(1), path)
    first = h.events.wait_for("ckpt.saved")[0]
    assert (first["via"], first["non_atomic"], first["sha256"]) == ("close", True, sha256(path))
    torch.save(state(2), path)
    h.events.wait_for("ckpt.suspect", code="written_in_place")
    second = h.events.wait_for("ckpt.saved", 2)[1]
    assert second["sha256"] == sha256(path) != first["sha256"]
    h.idle()
    assert len(h.events.of("ckpt.suspect", code="written_in_place")) == 1
    assert [r.sha256 for r in assert_manifest_true(h.run)] == [first["sha256"], second["sha256"]]
    assert manifest.newest_good(h.run) == path


def test_safetensors_step_comes_from_metadata(custody: Factory, tmp_path: Path) -> None:
    h = custody()
    tmp = h.ckpt / "weights.safetensors.tmp"
    safetensors.numpy.save_file({"w": np.ones((8, 8), np.float32)}, str(tmp), metadata={"step": "42"})
    os.replace(tmp, h.ckpt / "weights.safetensors")
    data = h.events.wait_for("ckpt.saved")[0]
    assert (data["format"], data["step"], data["check"]) == ("safetensors", 42, "ok")


def test_rename_from_another_dir_and_a_directory_rename(custody: Factory, tmp_path: Path) -> None:
    h = custody()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save(state(3), elsewhere / "step3.pt")
    os.replace(elsewhere / "step3.pt", h.ckpt / "step3.pt")  # inotify: a bare creation, no write
    staged = h.ckpt / "tmp-checkpoint-5"
    save_atomic(staged / "model.pt", state(5))
    (staged / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    os.rename(staged, h.ckpt / "checkpoint-5")
    h.events.wait_for("ckpt.saved", 2)
    h.idle()
    by_path = {d["path"]: d for d in h.events.of("ckpt.saved")}
    assert set(by_path) == {"checkpoints/step3.pt", "checkpoints/checkpoint-5"}  # one unit, one record
    assert by_path["checkpoints/step3.pt"]["via"] == "rename"
    unit = by_path["checkpoints/checkpoint-5"]
    assert (unit["via"], unit["kind"], unit["step"], unit["files"], unit["format"]) == (
        "rename", "dir", 5, 2, "hf")
    assert not h.events.of("ckpt.suspect")
    assert manifest.newest_good(h.run) == h.ckpt / "checkpoint-5"
    assert_manifest_true(h.run)


def test_polling_observer_sees_commits(custody: Factory) -> None:
    h = custody(observer="polling", poll_interval_s=0.05)
    assert h.monitor.status()["observer"] == "polling"
    path = save_atomic(h.ckpt / "step7.pt", state(7))
    data = h.events.wait_for("ckpt.saved")[0]
    assert data["sha256"] == sha256(path) and data["step"] == 7


# ---- suspects -----------------------------------------------------------------------------------


def test_zero_byte_file_is_suspect(custody: Factory) -> None:
    h = custody()
    (h.ckpt / "step5.pt").write_bytes(b"")
    data = h.events.wait_for("ckpt.suspect")[0]
    h.idle()
    assert (data["code"], data["reason"]) == ("zero_bytes", "zero bytes")
    assert data["path"] == "checkpoints/step5.pt"
    assert h.events.sev_of("ckpt.suspect") == ["warn"]
    assert not h.events.of("ckpt.saved") and manifest.read(h.run) == []


def test_truncated_torch_zip_is_suspect(custody: Factory) -> None:
    h = custody()
    buf = io.BytesIO()
    torch.save(state(9, 64), buf)
    write_atomic(h.ckpt / "step9.pt", buf.getvalue()[: len(buf.getvalue()) // 2])
    data = h.events.wait_for("ckpt.suspect")[0]
    h.idle()
    assert data["code"] == "bad_structure" and "central directory" in data["reason"], data
    assert not h.events.of("ckpt.saved") and manifest.newest_good(h.run) is None


def test_safetensors_with_a_lying_header_is_suspect(custody: Factory, tmp_path: Path) -> None:
    h = custody()
    good = tmp_path / "good.safetensors"
    safetensors.numpy.save_file({"w": np.ones((4, 4), np.float32)}, str(good))
    raw = good.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["w"]["shape"] = [4, 8]  # claims twice the bytes its span holds
    hb = json.dumps(header).encode()
    write_atomic(h.ckpt / "step11.safetensors", struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    data = h.events.wait_for("ckpt.suspect")[0]
    h.idle()
    assert data["code"] == "bad_structure", data
    assert "tensor 'w'" in data["reason"] and "is 128 bytes but its span" in data["reason"]
    assert not h.events.of("ckpt.saved")


def test_a_stale_tmp_is_suspect_once(custody: Factory) -> None:
    h = custody(tmp_max_age_s=600)
    old = h.ckpt / "step12.pt.tmp"
    old.write_bytes(b"half a checkpoint")
    os.utime(old, (time.time() - 700, time.time() - 700))
    (h.ckpt / "step13.pt.tmp").write_bytes(b"being written right now")
    h.monitor.sweep_tick()
    h.monitor.sweep_tick()
    h.idle()
    suspects = h.events.of("ckpt.suspect")
    assert [(d["code"], d["path"]) for d in suspects] == [("tmp_left", "checkpoints/step12.pt.tmp")]
    assert suspects[0]["age_s"] >= 700
    assert not h.events.of("ckpt.saved")


def test_rewrite_while_hashing_is_suspect_then_hashed_again(custody: Factory) -> None:
    h = custody(hash_rate_bytes_s=4 << 20)  # 3 MiB: the worker pauses 0.25 s after each MiB
    path = write_atomic(h.ckpt / "blob-step3.bin", os.urandom(3 << 20))
    deadline = time.monotonic() + WAIT_S
    while not (h.monitor.status()["hashed_bytes"] or 0) >= 1 << 20:
        assert time.monotonic() < deadline, h.monitor.status()
        threading.Event().wait(0.002)
    with open(path, "r+b") as f:  # in place: same inode, new size and mtime
        f.seek(0, os.SEEK_END)
        f.write(b"more bytes")
    h.events.wait_for("ckpt.suspect", code="rewritten_while_hashing")
    saved = h.events.wait_for("ckpt.saved")
    h.idle()
    assert len(h.events.of("ckpt.saved")) == 1 and saved[0]["sha256"] == sha256(path)
    assert saved[0]["size"] == (3 << 20) + 10
    assert_manifest_true(h.run)


# ---- restart, staleness -------------------------------------------------------------------------


def test_a_restart_skips_recorded_files_and_picks_up_new_ones(custody: Factory) -> None:
    first = custody()
    keep = save_atomic(first.ckpt / "step050.pt", state(50))
    changed = save_atomic(first.ckpt / "step100.pt", state(100))
    first.events.wait_for("ckpt.saved", 2)
    first.idle()
    first.monitor.close()
    save_atomic(first.ckpt / "step200.pt", state(200))  # written while no sidecar ran
    with open(changed, "ab") as f:
        f.write(b"appended while nobody watched")
    second = custody()
    second.events.wait_for("ckpt.saved", 2)
    second.idle()
    assert sorted(d["path"] for d in second.events.of("ckpt.saved")) == [
        "checkpoints/step100.pt", "checkpoints/step200.pt"]
    assert len(manifest.read(second.run)) == 4
    assert manifest.newest_good(second.run) is not None and keep.exists()
    assert_manifest_true(second.run)


def test_stale_once_per_onset_and_cleared_by_a_save(custody: Factory) -> None:
    now = [1_000_000.0]
    h = custody(clock=lambda: now[0], stale_after_s=100)
    now[0] += 50
    h.monitor.stale_tick()
    assert not h.events.of("ckpt.stale")
    now[0] += 60
    h.monitor.stale_tick()
    h.monitor.stale_tick()
    assert len(h.events.of("ckpt.stale")) == 1 and h.events.sev_of("ckpt.stale") == ["warn"]
    assert h.monitor.status()["stale"]
    save_atomic(h.ckpt / "step1.pt", state(1))
    h.events.wait_for("ckpt.saved")
    assert not h.monitor.status()["stale"]
    now[0] += 99
    h.monitor.stale_tick()
    assert len(h.events.of("ckpt.stale")) == 1
    now[0] += 2
    h.monitor.stale_tick()
    stale = h.events.of("ckpt.stale")
    assert len(stale) == 2 and stale[1]["last_path"] == "checkpoints/step1.pt"


# ---- durable copies -----------------------------------------------------------------------------


def test_durable_copy_hashes_back(custody: Factory, tmp_path: Path) -> None:
    durable = tmp_path / "autodl-fs" / "run1"
    h = custody(durable_dir=durable)
    path = save_atomic(h.ckpt / "sub" / "step10.pt", state(10))
    data = h.events.wait_for("ckpt.durable")[0]
    h.idle()
    copy = durable / "sub" / "step10.pt"
    assert data["durable_path"] == str(copy) and data["sha256"] == sha256(path) == sha256(copy)
    assert not h.monitor.sync_failed and not h.events.of("ckpt.sync_failed")
    assert sorted(p.name for p in copy.parent.iterdir()) == ["step10.pt"]  # no temporary left


def test_durable_dir_under_a_file_fails_loudly(custody: Factory, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    h = custody(durable_dir=blocker / "durable")
    save_atomic(h.ckpt / "step1.pt", state(1))
    save_atomic(h.ckpt / "step2.pt", state(2))
    failed = h.events.wait_for("ckpt.sync_failed")[0]
    h.events.wait_for("ckpt.saved", 2)
    h.idle()
    assert failed["code"] == "ENOTDIR" and failed["path"] == "checkpoints/step1.pt"
    assert h.events.sev_of("ckpt.sync_failed") == ["critical"]  # one per failing streak
    assert h.monitor.sync_failed and h.monitor.status()["counts"]["sync_failed"] == 2


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, timeout=30)
    return done.returncode == 0


def test_durable_dir_full_fails_loudly(custody: Factory, tmp_path: Path) -> None:
    full = tmp_path / "small-fs"
    if not _mount_tmpfs(full, "64k"):
        pytest.skip("needs root and a mountable tmpfs")
    try:
        h = custody(durable_dir=full)
        save_atomic(h.ckpt / "step1.pt", state(1, 256))  # 256 KiB of floats into 64 KiB
        failed = h.events.wait_for("ckpt.sync_failed")[0]
        h.idle()
        assert failed["code"] == "ENOSPC" and h.monitor.sync_failed
        assert list(full.iterdir()) == []  # the partial copy was removed
        h.monitor.close()
    finally:
        subprocess.run(["umount", str(full)], capture_output=True, timeout=30)


def test_durable_policy_last_copies_only_the_newest_step(custody: Factory, tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "checkpoints"
    save_atomic(ckpt / "step100.pt", state(100))
    save_atomic(ckpt / "step200.pt", state(200))
    durable = tmp_path / "durable"
    h = custody(durable_dir=durable, durable_policy="last")
    h.events.wait_for("ckpt.saved", 2)
    h.events.wait_for("ckpt.durable")
    h.idle()
    assert [d["path"] for d in h.events.of("ckpt.durable")] == ["checkpoints/step200.pt"]
    assert sorted(p.name for p in durable.iterdir()) == ["step200.pt"]
