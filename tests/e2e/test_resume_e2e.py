"""End to end: preempt a run on one box, `rgt resume` it on another, one history in `rgt status`.

Two hosts, h1 and h2, are the test sshd under two run roots. The job is scripts/train_tiny.py (CPU
torch): checkpoints every 20 steps, a metrics line every 5. The preemption is a SIGTERM to the job
wrapper on the box, which rgt did not send.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Dict, List, Sequence

import pytest

from controller.store.db import Store
from onbox.sidecar.journal import read_all
from protocol import Event
from tests.e2e.rgtbox import ONBOX, TEST_ONBOX_ARGS, TRAIN, Rgt
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e

TRAIN_ARGS = ["--steps", "5000", "--ckpt-every", "20", "--log-every", "5", "--step-seconds", "0.02"]
MIN_STEP = 40  # a restart is judged once the high-water step is 20 or more, and 5 < 40 / 2


def add_hosts(rgt: Rgt) -> None:
    assert rgt.box is not None
    for name in ("h1", "h2"):
        rgt("hosts", "add", name, "--ssh", rgt.box.alias, "--onbox", ONBOX,
            "--root", str(rgt.box.home / name))


def last_json(text: str) -> Dict[str, Any]:
    return dict(json.loads(text.strip().splitlines()[-1]))


def stored(run: str, kind: str) -> List[Event]:
    with Store.open() as store:
        return store.events(run, kind_prefix=kind)


def metric_lines(run_dir: Path) -> List[Dict[str, Any]]:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def launch_and_preempt(rgt: Rgt, *extra: str, onbox_args: Sequence[str] = ()) -> Dict[str, Any]:
    """Launch on h1, wait for a checkpoint at MIN_STEP or later in the store, SIGTERM the wrapper,
    wait for job.preempted and the exit in the store."""
    old = last_json(rgt("launch", "h1", "--json", *TEST_ONBOX_ARGS, *onbox_args, "--", *TRAIN, *TRAIN_ARGS,
                        *extra).stdout)
    rgt.runs.append(old["run_id"])
    run = old["run_id"]
    wait_until(lambda: [e for e in stored(run, "ckpt.saved") if e.data["step"] >= MIN_STEP], 90,
               f"a ckpt.saved at step {MIN_STEP} or later in the store")
    os.kill(int(old["pid"]), signal.SIGTERM)
    preempted = wait_until(lambda: stored(run, "job.preempted"), 30, "job.preempted in the store")
    assert preempted[0].data["signal"] == signal.SIGTERM
    exited = wait_until(lambda: stored(run, "job.exited"), 30, "job.exited in the store")
    assert exited[0].data.get("preempted") is True
    return old


def resume_on_h2(rgt: Rgt, run: str, *extra: str) -> Dict[str, Any]:
    # --json needs --yes: resume runs the command the laptop recorded at launch, asked or told to.
    out = rgt("resume", run, "--on", "h2", "--json", "--yes", *TEST_ONBOX_ARGS, *extra, timeout_s=300)
    answer = last_json(out.stdout)
    rgt.runs.append(answer["run_id"])
    assert rgt.box is not None and Path(answer["run_dir"]).parent.parent.parent == rgt.box.home / "h2"
    return answer


def history(rgt: Rgt, run: str) -> List[Dict[str, Any]]:
    return list(last_json(rgt("status", run, "--json").stdout)["history"])


def test_a_preempted_run_resumes_on_another_box_from_its_last_hashed_checkpoint(rgt_box: Rgt,
                                                                               tmp_path: Path) -> None:
    add_hosts(rgt_box)
    old = launch_and_preempt(rgt_box)
    run = old["run_id"]
    rgt_box("pull", run, "--to", str(tmp_path / "pulled"), "--json", timeout_s=300)
    custody = (tmp_path / "pulled" / "rgt" / "manifest.jsonl").read_text().splitlines()
    pulled = [json.loads(line) for line in custody]
    newest = max(pulled, key=lambda r: r["ts"])

    code = tmp_path / "code"
    (code / ".git").mkdir(parents=True)
    (code / "notes.txt").write_text("the code travels with --code")
    assert rgt_box.box is not None
    work = rgt_box.box.home / "h2" / "work"
    answer = resume_on_h2(rgt_box, run, "--code", str(code), "--cwd", str(work))
    new, run_dir = answer["run_id"], Path(answer["run_dir"])
    assert (work / "notes.txt").read_text() == "the code travels with --code" and not (work / ".git").exists()
    assert (answer["resumed_from"], answer["source"], answer["checkpoint"]["sha256"]) == (run, "local",
                                                                                          newest["sha256"])
    step = answer["checkpoint"]["step"]
    assert step == newest["step"] >= MIN_STEP and answer["pushed_bytes"] == newest["size"]
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["resume"]["path"] == str(run_dir / "checkpoints" / f"step{step:06d}.pt")
    resumed = meta["resume"]
    assert (resumed["sha256"], resumed["step"], resumed["from_run"], meta["resumes"]) == (
        newest["sha256"], step, run, run)
    assert meta["command"] == json.loads((tmp_path / "pulled" / "run.json").read_text())["command"]
    assert meta["cwd"] == str(work)

    lines = wait_until(lambda: metric_lines(run_dir)[:3] if len(metric_lines(run_dir)) >= 3 else None, 60,
                       "the resumed job's first metrics lines")
    assert lines[0]["step"] == step + 5 > 0
    # Once the sidecar reported progress past the first line, it has judged that line too.
    first = lines[0]["step"]
    wait_until(lambda: [e for e in stored(new, "train.progress") if e.data.get("step", 0) >= first],
               60, "train.progress of the resumed run in the store")
    assert stored(new, "train.restarted_from_zero") == []
    assert [e for e in read_all(run_dir / "rgt") if e["kind"] == "train.restarted_from_zero"] == []

    for which in (new, run):
        hist = history(rgt_box, which)
        assert [(h["run"], h["host"], h["current"]) for h in hist] == [(run, "h1", which == run),
                                                                         (new, "h2", which == new)]
        assert hist[0]["state"] == "preempted" and hist[0]["last_step"] >= hist[0]["checkpoint_step"] >= step
        assert hist[1]["resumed_from"] == run and hist[1]["first_step"] >= step > 0
    text = rgt_box("status", new).stdout
    assert f"history   {run} (h1, preempted" in text and f"-> {new} (h2, " in text


def test_a_job_that_ignores_the_resume_is_restarted_from_zero(rgt_box: Rgt) -> None:
    """No pull here: the checkpoint's durable copy (--durable-dir on the same disk) is one h2 sees,
    so nothing is pushed; the launcher on h2 verifies it and copies it into the new run."""
    add_hosts(rgt_box)
    assert rgt_box.box is not None
    durable = rgt_box.box.home / "volume"
    old = launch_and_preempt(rgt_box, "--ignore-resume", onbox_args=[f"--onbox-arg=--durable-dir={durable}"])
    run = old["run_id"]
    answer = resume_on_h2(rgt_box, run)
    new, run_dir = answer["run_id"], Path(answer["run_dir"])
    step = answer["checkpoint"]["step"]
    assert (answer["source"], answer["pushed_bytes"]) == ("durable", 0) and step >= MIN_STEP
    assert answer["checkpoint"]["durable"] == str(durable / f"step{step:06d}.pt")
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["resume"]["copied"] is True and meta["resume"]["source"] == answer["checkpoint"]["durable"]

    found = wait_until(lambda: stored(new, "train.restarted_from_zero"), 60, "train.restarted_from_zero")
    assert (found[0].data["last_step"], found[0].data["new_step"]) == (step, 5)
    assert metric_lines(run_dir)[0]["step"] == 5
    assert [h["run"] for h in history(rgt_box, new)] == [run, new]
