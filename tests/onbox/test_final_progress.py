"""The job's last progress is journaled before its exit: a real job under `rgt-onbox launch` (the real
wrapper, supervisor and sidecar), whose last metrics land a moment before it exits, well inside the
5 s that train.progress is otherwise rate-limited to."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from onbox.sidecar.journal import read_all
from tests.helpers import wait_until
from tests.onbox.test_launch import Rig, py

# One line, then (once the test saw its progress) the rest of the run and an exit at once.
JOB = ("import json, os, threading\n"
       "def line(step, loss):\n"
       "    with open(os.environ['RGT_METRICS'], 'a') as f:\n"
       "        f.write(json.dumps({'step': step, 'loss': loss}) + '\\n')\n"
       "line(1, 2.0)\n"
       "go = os.path.join(os.environ['RGT_RUN_DIR'], 'go')\n"
       "while not os.path.exists(go): threading.Event().wait(0.02)\n"
       "for step in range(2, 51): line(step, 2.0 / step)\n")


def journal(run_dir: Path) -> List[Dict[str, Any]]:
    try:
        return read_all(run_dir / "rgt")
    except OSError:
        return []


def progress(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [e["data"] for e in events if e["kind"] == "train.progress"]


def test_the_newest_progress_is_journaled_before_job_exited(rig: Rig) -> None:
    result = rig.launch(py(JOB), run_id="final-progress")
    run_dir = result.run_dir
    first = wait_until(lambda: progress(journal(run_dir)), 20, "the first train.progress")
    assert first[0]["step"] == 1
    rig.go(run_dir)
    assert rig.finished(run_dir)["code"] == 0
    events = wait_until(lambda: (lambda evs: evs if any(e["kind"] == "job.exited" for e in evs) else None)(
        journal(run_dir)), 20, "job.exited in the journal")
    kinds = [e["kind"] for e in events]
    exit_at = kinds.index("job.exited")
    before = progress(events[:exit_at])
    assert before[-1]["step"] == 50, before                      # the step the job ended with
    assert before[-1]["scalars"]["loss"] == 0.04
    assert progress(events[exit_at:]) == []                      # nothing of the run comes after its exit
