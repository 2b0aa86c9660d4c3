"""`rgt resume` of a run whose checkpoints are directory units (HF `checkpoint-N/`), against a real store
and real directories: the unit is found in a pull (run-relative, outside the run dir under
rgt/external/, or from the pulled manifests alone), proven by its unit digest, pushed whole and
handed to the launcher with --resume-sha256 <unit digest>. The whole path over ssh with a real HF
job is tests/e2e/test_resume_hf_e2e.py.
"""
from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import Any, Dict, List

import pytest

from controller.box.ssh import LocalShell
from controller.resume import plan as resume
from controller.resume.plan import Options
from controller.store.db import Store
from onbox.custody import units as ckptunits
from protocol import Event
from rgtlib.hashing import unit_digest
from tests.controller.test_resume import RUN, Old, store

__all__ = ["store"]

FILES: Dict[str, bytes] = {"model.safetensors": b"w" * 900, "optimizer.pt": b"o" * 1500,
                           "scheduler.pt": b"s", "rng_state.pth": b"r" * 30, "training_args.bin": b"a" * 7,
                           "trainer_state.json": b'{"global_step": 0}', "sub/shard.bin": b"shard"}
EXTERNAL = "rgt/external/out-1a2b3c4d"


def hf_dir(where: Path, step: int, files: Dict[str, bytes] = FILES) -> Path:
    for rel, data in files.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_bytes(data + str(step).encode())
    return where


def digest(files: Dict[str, bytes], step: int) -> str:
    """The unit digest custody records (rgtlib.hashing.unit_digest) for hf_dir(.., step)."""
    rows = [(rel, len(d) + len(str(step)), hashlib.sha256(d + str(step).encode()).hexdigest())
            for rel, d in files.items()]
    return unit_digest(rows)


def size(step: int) -> int:
    return sum(len(d) + len(str(step)) for d in FILES.values())


def saved(old: Old, path: str, step: int, **extra: Any) -> None:
    """A ckpt.saved event of a directory unit, as custody emits it (its "kind" field is the unit's)."""
    seq = len(old.events) + 1
    data = {"path": path, "size": size(step), "sha256": digest(FILES, step), "step": step, "kind": "dir",
            "files": len(FILES), "format": "hf", **extra}
    old.events.append(Event(run=RUN, host="box1", seq=seq, ts=1.7e9 + seq, kind="ckpt.saved", sev="info",
                            data=data))
    old.store.apply(RUN, old.events[-1:], seq)


def plan(store: Store, **kw: Any) -> resume.Plan:
    return resume.make_plan(store, RUN, "local", Options(**kw))


def test_the_controller_lists_and_digests_a_unit_exactly_as_custody_does(tmp_path: Path) -> None:
    unit = hf_dir(tmp_path / "checkpoint-10", 10)
    (unit / ".optimizer.pt.tmp").write_bytes(b"half")
    (unit / "tmp-part").mkdir()
    (unit / "tmp-part" / "x.bin").write_bytes(b"staged")
    (unit / "alias.bin").symlink_to(unit / "scheduler.pt")
    listed = [rel for rel, _path in resume.unit_files(unit)]
    assert listed == [rel for rel, _key in ckptunits.signature(unit)] == sorted(FILES)
    finder = resume.Finder([], [], lambda path, size: False)
    assert finder.unit_digest(unit) == digest(FILES, 10)


def test_a_directory_unit_is_picked_pushed_whole_and_launched_with_its_unit_digest(
        tmp_path: Path, store: Store) -> None:
    old = Old(tmp_path, store, steps=())
    saved(old, "out/checkpoint-10", 10)
    saved(old, "out/checkpoint-20", 20)
    pulled = old.pull([])
    hf_dir(pulled / "out" / "checkpoint-10", 10)
    newest = hf_dir(pulled / "out" / "checkpoint-20", 20)
    p = plan(store, run_id="next-1")
    assert (p.checkpoint.rel, p.checkpoint.kind, p.checkpoint.step, p.source) == ("out/checkpoint-20", "dir",
                                                                                    20, "local")
    assert p.checkpoint.sha256 == digest(FILES, 20) and p.local_path == str(newest)
    assert p.resume_from == f"{p.root}/p/active/next-1/checkpoints/checkpoint-20" and p.push_bytes == size(20)
    words = shlex.split(resume.launch_line(p, "rgt-onbox", {}).split(" && ", 1)[1])
    at = words.index("--resume-from")
    assert words[at:at + 6] == ["--resume-from", p.resume_from, "--resume-sha256", digest(FILES, 20),
                                "--resume-step", "20"]

    # The push (host local) brings the whole directory, without the temporary names a pull may hold.
    (newest / ".trainer_state.json.partial").write_bytes(b"x")
    LocalShell().push(newest, p.resume_from, excludes=resume.TEMP_EXCLUDES)
    there = Path(p.resume_from)
    assert sorted(r for r, _ in resume.unit_files(there)) == sorted(FILES)
    assert sorted(q.name for q in there.iterdir()) == sorted({r.split("/")[0] for r in FILES})
    assert resume.Finder([], [], lambda path, size: False).unit_digest(there) == digest(FILES, 20)


def test_a_pulled_directory_with_other_bytes_or_a_missing_file_is_skipped(tmp_path: Path,
                                                                           store: Store) -> None:
    old = Old(tmp_path, store, steps=())
    for step in (10, 20, 30):
        saved(old, f"out/checkpoint-{step}", step)
    pulled = old.pull([])
    hf_dir(pulled / "out" / "checkpoint-10", 10)
    (hf_dir(pulled / "out" / "checkpoint-20", 20) / "optimizer.pt").write_bytes(b"other bytes")
    (hf_dir(pulled / "out" / "checkpoint-30", 30) / "rng_state.pth").unlink()
    p = plan(store)
    assert (p.checkpoint.step, p.local_path) == (10, str(pulled / "out" / "checkpoint-10"))
    skipped = [n for n in p.notes if n.startswith("skipped")]
    assert len(skipped) == 2 and all("its files are not the" in n for n in skipped)
    assert any("checkpoint-20" in n for n in skipped) and any("checkpoint-30" in n for n in skipped)


def test_a_unit_outside_the_run_dir_is_found_at_its_pull_path(tmp_path: Path, store: Store) -> None:
    old = Old(tmp_path, store, steps=())
    saved(old, "/home/u/work/out/checkpoint-20", 20, pull_path=f"{EXTERNAL}/checkpoint-20")
    pulled = old.pull([])
    unit = hf_dir(pulled / EXTERNAL / "checkpoint-20", 20)
    p = plan(store, run_id="next-2")
    assert (p.local_path, p.checkpoint.pull_path) == (str(unit), f"{EXTERNAL}/checkpoint-20")
    assert p.resume_from.endswith("/next-2/checkpoints/checkpoint-20")


def pull_manifest(pulled: Path, units: List[str]) -> None:
    files = [{"path": f"{u}/{rel}", "unit": u, "size": 1, "sha256": "0" * 64, "kind": "checkpoint",
              "hashed": "custody", "step": 20} for u in units for rel in FILES]
    (pulled / "rgt").mkdir(exist_ok=True)
    (pulled / "rgt" / "PULL_MANIFEST.json").write_text(json.dumps({"files": files}))


def test_without_events_the_pulled_manifests_name_the_unit(tmp_path: Path, store: Store) -> None:
    old = Old(tmp_path, store, steps=())
    pulled = old.pull([])
    record = {"v": 1, "kind": "dir", "path": "/home/u/work/out/checkpoint-20", "root": "/home/u/work/out",
              "size": size(20), "sha256": digest(FILES, 20), "mtime_ns": 1, "inode": 2, "step": 20,
              "format": "hf", "ts": 1.7e9, "files": []}
    (pulled / "rgt").mkdir()
    (pulled / "rgt" / "manifest.jsonl").write_text(json.dumps(record) + "\n")
    unit = hf_dir(pulled / EXTERNAL / "checkpoint-20", 20)
    pull_manifest(pulled, [f"{EXTERNAL}/checkpoint-20"])
    [ck] = resume.custody(store, RUN, [pulled])
    assert (ck.kind, ck.rel, ck.pull_path) == ("dir", "/home/u/work/out/checkpoint-20", None)
    p = plan(store)
    assert (p.checkpoint.sha256, p.local_path, p.source) == (digest(FILES, 20), str(unit), "local")


def test_checkpoint_given_as_a_local_directory_and_a_durable_directory(tmp_path: Path, store: Store) -> None:
    old = Old(tmp_path, store, steps=())
    saved(old, "out/checkpoint-10", 10)
    saved(old, "out/checkpoint-20", 20)
    old.pull([])
    mine = hf_dir(tmp_path / "kept" / "checkpoint-10", 10)
    p = plan(store, checkpoint=str(mine))
    assert (p.checkpoint.step, p.local_path, p.source) == (10, str(mine), "local")
    (mine / "extra.bin").write_bytes(b"not part of it")
    with pytest.raises(resume.ResumeError, match="is no checkpoint custody hashed"):
        plan(store, checkpoint=str(mine))

    durable = tmp_path / "vol"
    old.doc["durable_dir"] = str(durable)
    old.pull([])
    copy = hf_dir(durable / EXTERNAL / "checkpoint-20", 20)
    old.event("ckpt.durable", path="out/checkpoint-20", durable_path=str(copy), sha256=digest(FILES, 20))
    p = plan(store)
    assert (p.checkpoint.step, p.source, p.resume_from, p.push_bytes) == (20, "durable", str(copy), 0)
