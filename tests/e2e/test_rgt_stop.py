"""`rgt stop RUN` through the sshd box: the job ends, the box and its files stay."""
from __future__ import annotations

import json
from pathlib import Path

from onbox.runs import run_status
from tests.e2e.rgtbox import Rgt
from tests.helpers import wait_until


def test_rgt_stop_ends_the_job_on_the_box_and_keeps_its_files(rgt_box: Rgt) -> None:
    started = rgt_box.launch("--steps", "100000", "--step-seconds", "0.05")
    run, run_dir = started["run_id"], Path(started["run_dir"])
    wait_until(lambda: run_status(run_dir).state == "running", 30, "the job to run")
    out = rgt_box("stop", run, "--grace", "10s", "--json")
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["run"] == run and answer["host"] == "box" and answer["exit"] == 0
    assert answer["outcome"] in ("stopped", "killed")
    assert run_status(run_dir).state not in ("running", "stopping")
    assert (run_dir / "run.json").exists() and (run_dir / "train.log").exists()
    again = json.loads(rgt_box("stop", run, "--json").stdout.strip().splitlines()[-1])
    assert again["outcome"] == "not_running"
