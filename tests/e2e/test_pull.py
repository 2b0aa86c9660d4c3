"""`rgt pull` end to end: a run on the test sshd box, pulled over the host's ssh master with rsync.

Every pulled file must hash to the manifest; a rerun sends nothing; a pull killed halfway and run
again sends (almost) only what was missing; a box without rsync is a clear error that moves nothing.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

import psutil
import pytest

from controller.teardown import gate as teardown
from controller.verify.prove import verify
from tests.e2e.rgtbox import TEST_ONBOX_ARGS, Rgt
from tests.helpers import REPO, rgt_cmd, wait_until
from tests.sshbox import SshBox

pytestmark = pytest.mark.e2e

# Half of the total lies in the middle of the second file: the kill leaves a half-written file.
BIG_FILES = 3
BIG_FILE_BYTES = 200 * 1000 * 1000 // BIG_FILES


def rgt_argv(*args: str) -> List[str]:
    return rgt_cmd(*args)


def pull(rgt: Rgt, *args: str, check: bool = True) -> Tuple[int, Dict[str, Any], str]:
    """`rgt pull ARGS --json`: (exit code, its JSON answer or {}, stderr)."""
    out = subprocess.run(rgt_argv("pull", *args, "--json"), env=rgt.env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    if check:
        assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return out.returncode, json.loads(lines[-1]) if lines else {}, out.stderr


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree(root: Path) -> Set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def check_pulled(dest: Path) -> Dict[str, Any]:
    """Exactly the manifest and its files, each with its listed size and SHA-256."""
    doc = json.loads((dest / "rgt" / "PULL_MANIFEST.json").read_text())
    assert tree(dest) == {f["path"] for f in doc["files"]} | {"rgt/PULL_MANIFEST.json"}
    for f in doc["files"]:
        assert sha256(dest / f["path"]) == f["sha256"] and (dest / f["path"]).stat().st_size == f["size"]
    return dict(doc)


def saved(rgt: Rgt, run: str) -> List[str]:
    with rgt.store() as s:
        return [str(e.data["path"]) for e in s.events(run, kind_prefix="ckpt.saved")]


def exited(rgt: Rgt, run: str) -> bool:
    with rgt.store() as s:
        return bool(s.events(run, kind_prefix="job.exited"))


def gate(rgt: Rgt, run: str) -> teardown.Gate:
    with rgt.store() as s:
        return teardown.judge(run, teardown.pulled_dir_of(s, run),
                              lambda: teardown.box_view(s, "box", str(rgt.run_dir(run))))


def staged_bytes(staging: Path) -> int:
    total = 0
    for base, _, files in os.walk(staging):
        for name in files:
            if name != ".rgt-staging.json":
                try:
                    total += os.lstat(os.path.join(base, name)).st_size
                except FileNotFoundError:
                    continue
    return total


def test_pull_brings_every_listed_file_and_a_rerun_sends_nothing_again(rgt_box: Rgt, tmp_path: Path) -> None:
    rgt = rgt_box
    run = rgt.launch("--steps", "60", "--ckpt-every", "20", "--step-seconds", "0.005")["run_id"]
    wait_until(lambda: len(saved(rgt, run)) >= 3 and exited(rgt, run), 60, "3 checkpoints and the exit")
    dest = tmp_path / "pulled" / run

    _, first, stderr = pull(rgt, run, "--to", str(dest))
    doc = check_pulled(dest)
    assert sum(1 for f in doc["files"] if f["kind"] == "checkpoint") == 3
    assert first["files"] == len(doc["files"]) and first["bytes"] == doc["total_bytes"]
    assert first["manifest_sha256"] == doc["sha256"] and first["dest"] == str(dest)
    assert first["transferred_bytes"] >= doc["total_bytes"] and first["resumed_bytes"] == 0
    assert not dest.with_name(dest.name + ".partial").exists()
    progress = [json.loads(ln) for ln in stderr.splitlines() if ln.startswith("{")]
    assert progress and progress[-1]["pulled_bytes"] == progress[-1]["total_bytes"] > doc["total_bytes"]
    with rgt.store() as s:
        done = s.local_events(run, kind_prefix="pull.done")
    assert done[-1].data["dest"] == str(dest) and done[-1].data["manifest_sha256"] == doc["sha256"]

    # pull -> verify -> the teardown gate, as a person would go: open once verified.
    report = verify(dest)
    assert report.ok, report.failures()
    assert gate(rgt, run).open

    _, again, _ = pull(rgt, run, "--to", str(dest))
    manifest_size = (dest / "rgt" / "PULL_MANIFEST.json").stat().st_size
    # Only the box's freshly written manifest may travel again; no listed file is resent.
    assert again["rsync"]["files_transferred"] <= 1 and again["transferred_bytes"] <= manifest_size
    assert again["resumed_bytes"] >= doc["total_bytes"] and again["previous"] is None
    check_pulled(dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == [run]  # no staging, no kept earlier pull
    assert gate(rgt, run).code == "not_verified"  # a new pull is not verified until `rgt verify` says so


def test_a_pull_killed_halfway_resumes_resending_at_most_a_tenth(rgt_box: Rgt, tmp_path: Path) -> None:
    rgt = rgt_box
    go = rgt.root / "go-big"
    run = rgt.launch("--steps", "1000000", "--ckpt-every", "1000000", "--step-seconds", "0.01",
                     "--stop-file", str(go))["run_id"]
    ckpts = rgt.run_dir(run) / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    for i in range(BIG_FILES):  # random bytes: nothing for rsync to match by delta
        tmp = ckpts / f"big-{i}.bin.tmp"
        tmp.write_bytes(os.urandom(BIG_FILE_BYTES))
        os.replace(tmp, ckpts / f"big-{i}.bin")
    wait_until(lambda: len(saved(rgt, run)) >= BIG_FILES, 60, "custody to record the big files")
    go.write_text("")
    wait_until(lambda: exited(rgt, run), 60, "the job's exit in the store")
    dest = tmp_path / "pulled"
    staging = tmp_path / "pulled.partial"
    total = BIG_FILES * BIG_FILE_BYTES

    log = tmp_path / "slow-pull.log"
    with open(log, "wb") as err:
        slow = subprocess.Popen(rgt_argv("pull", run, "--to", str(dest), "--bwlimit", "40m"), env=rgt.env,
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        wait_until(lambda: staged_bytes(staging) >= total // 2 or slow.poll() is not None, 60,
                   "half of the bytes in staging", interval_s=0.01)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(slow.pid, signal.SIGKILL)  # the group we started: rgt, rsync and its ssh
        slow.wait(10)
    assert slow.returncode == -signal.SIGKILL, log.read_text()
    at_kill = staged_bytes(staging)
    assert 0.3 * total <= at_kill <= 0.9 * total, at_kill
    sizes = [(staging / "checkpoints" / f"big-{i}.bin") for i in range(BIG_FILES)]
    assert any(0 < p.stat().st_size < BIG_FILE_BYTES for p in sizes if p.exists())  # one half-written
    assert not dest.exists()  # nothing under the final name

    _, res, _ = pull(rgt, run, "--to", str(dest))
    doc = check_pulled(dest)
    missing = doc["total_bytes"] + (dest / "rgt" / "PULL_MANIFEST.json").stat().st_size - at_kill
    resent = res["rsync"]["literal_bytes"] - missing
    assert resent <= 0.10 * total, (res, at_kill)
    assert res["resumed_bytes"] >= at_kill - 0.10 * total
    assert not staging.exists()


def test_a_box_without_rsync_is_a_clear_error_that_moves_nothing(rgt_box: Rgt, sshbox: SshBox,
                                                                   tmp_path: Path) -> None:
    rgt = rgt_box
    run_dir = sshbox.home / "runs" / "p" / "active" / "no-rsync-1"
    (run_dir / "rgt").mkdir(parents=True)
    with rgt.store() as s:
        s.upsert_run("no-rsync-1", host="", target="box", run_dir=str(run_dir))
    # The box's shell finds the usual tools on its PATH, but no rsync (as on many slim images).
    tools = sshbox.home / "bin"
    tools.mkdir()
    for name in ("sh", "bash", "cat", "env", "ls", "mkdir", "python3"):
        found = shutil.which(name)
        if found:
            (tools / name).symlink_to(found)
    (sshbox.home / ".bashrc").write_text(f"export PATH={tools}\n")
    dest = tmp_path / "pulled"

    code, answer, stderr = pull(rgt, "no-rsync-1", "--to", str(dest), check=False)
    assert code == 1 and answer == {}
    assert "error: rsync is not installed on box" in stderr
    assert "hint:" in stderr and "apt-get install -y rsync" in stderr and "scp" in stderr
    assert not dest.exists() and not dest.with_name("pulled.partial").exists()


# The job leaves a writer behind (an async checkpoint writer in its own session) that appends to
# step 10 until the stop file exists: the box's close-out waits on it, and so must the pull.
WRITER = r"""
import os, sys, threading
unit, stop, pidfile = sys.argv[1], sys.argv[2], sys.argv[3]
with open(pidfile, "w") as f:
    f.write(str(os.getpid()))
with open(os.path.join(unit, "model.bin"), "ab") as out:
    while not os.path.exists(stop):
        out.write(b"w" * 1024)
        out.flush()
        threading.Event().wait(0.02)
"""
JOB = r"""
import os, subprocess, sys, threading
unit = os.path.join(os.environ["RGT_CKPT_DIR"], "step000010")
os.makedirs(unit, exist_ok=True)
subprocess.Popen([sys.executable, "-c", sys.argv[1], unit, sys.argv[2], sys.argv[3]], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while not os.path.exists(sys.argv[3]):
    threading.Event().wait(0.01)
"""


def test_a_pull_while_the_box_closes_the_run_waits_for_its_final_manifest(rgt_box: Rgt,
                                                                           tmp_path: Path) -> None:
    """The job exited; the box is still committing its last checkpoint (run.closing). `rgt pull`
    says what is pending and waits; once the close is done it pulls the final manifest, which
    holds that checkpoint whole."""
    rgt = rgt_box
    stop, pidfile = tmp_path / "stop-writing", tmp_path / "writer.pid"
    out = rgt("launch", "box", "--root", str(rgt.root), "--json", *TEST_ONBOX_ARGS, "--",
              sys.executable, "-c", JOB, WRITER, str(stop), str(pidfile))
    run = json.loads(out.stdout.strip().splitlines()[-1])["run_id"]
    rgt.runs.append(run)
    dest = tmp_path / "pulled"
    puller: Optional[subprocess.Popen[str]] = None
    try:
        closing = rgt.run_dir(run) / "rgt" / "closing.json"
        wait_until(closing.exists, 120, "the close-out to wait on the unit")
        puller = subprocess.Popen(rgt_argv("pull", run, "--to", str(dest), "--json", "--wait", "240"),
                                  env=rgt.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        assert puller.stderr is not None
        waiting = None
        for line in puller.stderr:   # one line per box-side wait, every few seconds, until it ends
            if line.startswith("{") and "closing" in json.loads(line):
                waiting = json.loads(line)["closing"]
                break
        assert waiting is not None and waiting["state"] == "closing", puller.communicate(timeout=60)
        assert waiting["pending"] == ["checkpoints/step000010"] and not dest.exists(), waiting
    finally:
        stop.touch()
        if pidfile.exists():
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(int(pidfile.read_text())).wait(60)
    stdout, stderr = puller.communicate(timeout=300)
    assert puller.returncode == 0, stderr
    answer = json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])
    assert answer["final"] is True and answer["close"]["state"] == "closed", answer
    doc = check_pulled(dest)
    [unit] = [f for f in doc["files"] if f["kind"] == "checkpoint"]
    size = (dest / unit["path"]).stat().st_size
    assert unit["path"] == "checkpoints/step000010/model.bin" and size > 0 and size % 1024 == 0, unit
    with rgt.store() as s:
        closed = s.events(run, kind_prefix="run.closed")
    assert closed, "the watcher never stored the run's close"
