"""A vast.ai-style pause: the whole box freezes and no signal reaches the job. The box cannot say
so; the controller must, as the heartbeats going away (sidecar.silent), never as a preemption."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import List

from onbox.runs import read_json
from tests.e2e.rgtbox import Rgt
from tests.helpers import wait_until


def frozen_pids(run_dir: Path, wrapper_pid: int) -> List[int]:
    """Everything of the run on the 'box': the wrapper, the job, the supervisor and its sidecar."""
    job = (read_json(run_dir / "rgt" / "job.json") or {}).get("job") or {}
    sup = read_json(run_dir / "rgt" / "supervisor.json") or {}
    pids = [wrapper_pid, job.get("pid"), sup.get("pid"), (sup.get("sidecar") or {}).get("pid")]
    return [int(p) for p in pids if p]


def test_a_silent_pause_wakes_as_heartbeats_gone_and_is_not_a_preemption(rgt_local: Rgt) -> None:
    answer = rgt_local.launch("--steps", "100000", "--step-seconds", "0.05", host="local")
    run, run_dir = answer["run_id"], Path(answer["run_dir"])
    with rgt_local.store() as store:
        wait_until(lambda: len(store.events(run, kind_prefix="heartbeat")) >= 2, 60, "two heartbeats")
    wait_until(lambda: (read_json(run_dir / "rgt" / "supervisor.json") or {}).get("sidecar"), 30,
               "the sidecar's record")
    pids = frozen_pids(run_dir, int(answer["pid"]))
    assert len(pids) == 4
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        out = rgt_local("watch", run, "--timeout", "60s", "--from-now", "--json", check=False)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    record = json.loads(out.stdout)
    assert out.returncode == 10, out.stderr
    assert record["event"]["kind"] == "sidecar.silent" and "paused spot instance" in record["explain"]
    with rgt_local.store() as store:
        assert not store.events(run, kind_prefix="job.preempted")
        assert not store.events(run, kind_prefix="job.exited")
