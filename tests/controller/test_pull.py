"""controller.pull.fetch through host `local` (the same flow as over ssh, local rsync without -e): what a
staging dir left by an interrupted pull may keep, that an earlier pull is never written in place,
and what is refused. The sshd end to end lives in tests/e2e/test_pull.py."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from controller.pull.fetch import Progress, PullError, pull
from controller.pull.stage import MARKER
from controller.store.db import Store
from onbox.custody import manifest

RUN = "run-l"
SIZE = 300_000


class LocalRun:
    def __init__(self, tmp: Path) -> None:
        self.run_dir = tmp / "box" / "proj" / "active" / RUN
        (self.run_dir / "rgt").mkdir(parents=True)
        (self.run_dir / "checkpoints").mkdir()
        (self.run_dir / "run.json").write_text(json.dumps({"id": RUN}))
        self.dest = tmp / "here" / RUN
        self.staging = tmp / "here" / f"{RUN}.partial"

    def checkpoint(self, step: int, data: bytes) -> str:
        rel = f"checkpoints/step{step:06d}.bin"
        path = self.run_dir / rel
        path.write_bytes(data)
        st = path.stat()
        manifest.append(self.run_dir, manifest.Record(rel, st.st_size, hashlib.sha256(data).hexdigest(),
                                                      st.st_mtime_ns, st.st_ino, step, "other", time.time()))
        return rel

    def pull(self, **kw: object) -> Dict[str, object]:
        with Store.open() as s:
            return pull(s, RUN, self.dest, **kw).to_dict()  # type: ignore[arg-type]


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalRun]:
    monkeypatch.setenv("RGT_HOME", str(tmp_path / "rgt-home"))
    r = LocalRun(tmp_path)
    for step in (1, 2, 3):
        r.checkpoint(step, os.urandom(SIZE))
    with Store.open() as s:
        s.upsert_run(RUN, host="", target="local", run_dir=str(r.run_dir))
    yield r


def listed(dest: Path) -> Dict[str, str]:
    doc = json.loads((dest / "rgt" / "PULL_MANIFEST.json").read_text())
    for f in doc["files"]:
        assert hashlib.sha256((dest / f["path"]).read_bytes()).hexdigest() == f["sha256"], f["path"]
    return {f["path"]: f["sha256"] for f in doc["files"]}


def test_host_local_pulls_with_progress_and_records_the_pull(box: LocalRun) -> None:
    seen: List[Progress] = []
    res = box.pull(on_progress=seen.append)
    assert len(listed(box.dest)) == res["files"] == 5  # 3 checkpoints, run.json, rgt/manifest.jsonl
    assert seen and seen[-1].pulled_bytes == seen[-1].total_bytes and seen[-1].eta_s in (0.0, None)
    assert not box.staging.exists()
    with Store.open() as s:
        ev = s.local_events(RUN, kind_prefix="pull.done")[-1]
    assert ev.data["dest"] == str(box.dest) and ev.data["manifest_sha256"] == res["manifest_sha256"]


def test_staging_keeps_only_what_can_help(box: LocalRun) -> None:
    """A complete file and a true prefix stay; a same-size file with other bytes, a longer one and
    an unlisted one go. The rerun then sends only the missing bytes."""
    box.staging.mkdir(parents=True)
    (box.staging / MARKER).write_text(json.dumps({"run": RUN}))
    (box.staging / "checkpoints").mkdir()
    src = box.run_dir / "checkpoints"
    good, half, wrong, longer = (box.staging / "checkpoints" / f"step00000{i}.bin" for i in (1, 2, 3, 4))
    good.write_bytes((src / "step000001.bin").read_bytes())
    half.write_bytes((src / "step000002.bin").read_bytes()[: SIZE // 2])
    wrong.write_bytes(os.urandom(SIZE))  # the listed size, other bytes: must not be trusted
    box.checkpoint(4, os.urandom(SIZE))
    longer.write_bytes(os.urandom(SIZE + 10))
    (box.staging / "checkpoints" / ".step000005.bin.Xy12Zq").write_bytes(b"rsync leftover")

    res = box.pull()
    listed(box.dest)
    assert res["resumed_bytes"] >= SIZE + SIZE // 2 and res["resumed_bytes"] < 2 * SIZE
    assert not (box.dest / "checkpoints" / ".step000005.bin.Xy12Zq").exists()


def test_an_earlier_pull_is_replaced_whole_and_never_written_in_place(box: LocalRun) -> None:
    box.pull()
    old = box.dest / "checkpoints" / "step000003.bin"
    old_bytes = old.read_bytes()
    inode = old.stat().st_ino
    (box.dest / "rgt" / "PULL_VERIFIED.json").write_text("{}")  # a verification of the old pull
    grown = old_bytes + os.urandom(1000)  # the box rewrote it longer: an append would fit
    box.checkpoint(3, grown)

    res = box.pull()
    assert listed(box.dest)["checkpoints/step000003.bin"] == hashlib.sha256(grown).hexdigest()
    assert res["resumed_bytes"] >= 2 * SIZE  # the two unchanged checkpoints were linked, not resent
    assert not (box.dest / "rgt" / "PULL_VERIFIED.json").exists()  # the new pull is not verified yet
    kept = Path(str(res["previous"]))  # the old pull held bytes the new one does not: kept whole
    assert kept.name.startswith(f"{RUN}.prev-")
    kept_file = kept / "checkpoints" / "step000003.bin"
    assert kept_file.read_bytes() == old_bytes and kept_file.stat().st_ino == inode


def test_what_is_not_ours_is_refused(box: LocalRun) -> None:
    box.staging.mkdir(parents=True)
    (box.staging / "notes.txt").write_text("someone's")
    with pytest.raises(PullError, match="is not rgt's staging dir"):
        box.pull()
    assert (box.staging / "notes.txt").read_text() == "someone's"
    box.staging.joinpath("notes.txt").unlink()
    box.staging.rmdir()
    box.dest.mkdir(parents=True)
    (box.dest / "thesis.tex").write_text("mine")
    with pytest.raises(PullError, match="is not an earlier pull of run-l"):
        box.pull()
    with pytest.raises(PullError, match="is not a rate"):
        box.pull(bwlimit="fast")
    assert (box.dest / "thesis.tex").read_text() == "mine" and not box.staging.exists()
