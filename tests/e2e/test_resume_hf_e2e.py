"""End to end: a stock HF Trainer run (tests/frameworks/hf_tiny.py, checkpoints as
`out/checkpoint-N/` under the job's cwd) is preempted on one box, pulled, and `rgt resume`d on another
root through the test sshd: the whole checkpoint directory is pushed (rsync), proven by its unit
digest on the box, handed to the Trainer as RGT_RESUME_FROM, and the Trainer goes on from its step.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from controller.store.db import Store
from onbox.custody import manifest
from protocol import Event
from tests.e2e.rgtbox import ONBOX, TEST_ONBOX_ARGS, Rgt
from tests.e2e.test_frameworks_e2e import LINGER, launch_has_cwd, rgt_at
from tests.helpers import REPO, wait_until

pytestmark = pytest.mark.e2e

STEPS = 200
HF = [sys.executable, str(REPO / "tests" / "frameworks" / "hf_tiny.py"), "--steps", str(STEPS),
      "--save-every", "10", "--log-every", "5", "--step-seconds", "0.1"]
MIN_STEP = 20


def stored(run: str, kind: str) -> List[Event]:
    with Store.open() as store:
        return store.events(run, kind_prefix=kind)


def last_json(text: str) -> Dict[str, Any]:
    return dict(json.loads(text.strip().splitlines()[-1]))


def test_a_preempted_hf_run_resumes_elsewhere_from_its_checkpoint_directory(rgt_box: Rgt,
                                                                           tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    if not launch_has_cwd():
        pytest.skip("rgt launch --cwd is not here")
    rgt = rgt_box
    assert rgt.box is not None
    rgt("hosts", "add", "h2", "--ssh", rgt.box.alias, "--onbox", ONBOX, "--root", str(rgt.box.home / "h2"))
    job = tmp_path / "job"
    job.mkdir()
    out = rgt_at(rgt, job, "launch", "box", "--root", str(rgt.root), "--json", "--cwd", str(job),
                 *TEST_ONBOX_ARGS, LINGER, "--", *HF)
    assert out.returncode == 0, out.stderr
    old = last_json(out.stdout)
    run = str(old["run_id"])
    rgt.runs.append(run)
    wait_until(lambda: [e for e in stored(run, "ckpt.saved") if (e.data.get("step") or 0) >= MIN_STEP
                        and e.data.get("kind") == "dir"], 240, f"checkpoint-N, N >= {MIN_STEP}, in the store")
    os.kill(int(old["pid"]), signal.SIGTERM)  # the preemption: rgt did not send it
    wait_until(lambda: stored(run, "job.exited"), 60, "job.exited in the store")
    rgt("pull", run, "--to", str(tmp_path / "pulled"), "--json", timeout_s=300)

    work = rgt.box.home / "h2" / "work"
    work.mkdir(parents=True)
    answer = last_json(rgt("resume", run, "--on", "h2", "--json", "--yes", "--cwd", str(work),
                           *TEST_ONBOX_ARGS, LINGER, timeout_s=300).stdout)
    new, run_dir = str(answer["run_id"]), Path(answer["run_dir"])
    rgt.runs.append(new)
    ck = answer["checkpoint"]
    step = int(ck["step"])
    assert (ck["kind"], answer["source"], answer["resumed_from"]) == ("dir", "local", run)
    assert step >= MIN_STEP
    inside = run_dir / "checkpoints" / f"checkpoint-{step}"
    meta = json.loads((run_dir / "run.json").read_text())
    assert (meta["resume"]["path"], meta["resume"]["kind"], meta["resume"]["sha256"]) == (str(inside), "dir",
                                                                                          ck["sha256"])
    assert meta["resume_from"] == str(inside)
    [rec] = [r for r in manifest.read(run_dir) if r.path == f"checkpoints/checkpoint-{step}"]
    assert rec.kind == "dir" and rec.sha256 == ck["sha256"] and answer["pushed_bytes"] == rec.size
    assert {f.path for f in rec.files} >= {"model.safetensors", "optimizer.pt", "trainer_state.json"}

    done = wait_until(lambda: stored(new, "job.exited"), 300, "the resumed job's exit in the store")
    log = (run_dir / "train.log").read_text(errors="replace")
    assert done[0].data["code"] == 0, log[-2000:]
    # The Trainer went on from `step`: it logged only the steps after it (from zero: STEPS // 5 lines).
    assert log.count("'loss'") == (STEPS - step) // 5, log[-2000:]
    assert json.loads((work / "out" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())[
        "global_step"] == STEPS
    assert stored(new, "train.restarted_from_zero") == []
