"""End to end: a multi-node run on Slurm, with two sidecars on this machine as two nodes.

examples/slurm/train.sbatch itself runs under bash, with tests/e2e/fakeslurm/srun on PATH (one
copy of its command per node, SLURM_NODEID set), a fake scontrol before any real one (a real
scontrol with no cluster ends the script under set -e) and an `rgt-onbox` that runs this checkout. Each
"node" starts its share of the job (tests/e2e/data/node_job.py: scripts/train_tiny.py with that
node's arguments) and its own sidecar. `rgt track local RUN` then follows both streams, and the
real `rgt` CLI shows what the group verdicts say.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any, Dict, List, Optional, Type

import pytest

from controller.store.db import Store
from onbox.runs import read_json, run_status
from onbox.stop import stop_run
from tests.e2e.rgtbox import Rgt
from tests.helpers import REPO, exec_script, wait_until

pytestmark = pytest.mark.e2e

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
FAKESLURM = REPO / "tests" / "e2e" / "fakeslurm"
NODE_JOB = REPO / "tests" / "e2e" / "data" / "node_job.py"
NODE_JOB_CMD = "rgt-test-node-job"   # NODE_JOB under this python, on PATH (Allocation)
# Options a test box needs (see rgtbox.TEST_ONBOX_ARGS): fast heartbeats, no pre-flight, no GPU.
LAUNCH_ARGS = ("--no-preflight --sidecar-linger=0s --probe none --serve-arg=--heartbeat=1 "
               "--serve-arg=--no-kmsg")
STEPS = ["--steps", "100000", "--step-seconds", "0.05", "--log-every", "5", "--ckpt-every", "100000"]
NODES = ("n0", "n1")


class Allocation:
    """The sbatch script in a fake two-node Slurm allocation; ends what it started, by pid."""

    def __init__(self, tmp: Path, rgt: Rgt, run: str, jobs: Dict[str, Dict[str, Any]],
                 launch_args: str = LAUNCH_ARGS) -> None:
        self.rgt, self.run, self.root = rgt, run, rgt.root
        bindir = tmp / "bin"
        # An rgt-onbox of this checkout, and the job by one name: RGT_TRAIN_CMD is plain words.
        exec_script(bindir / "rgt-onbox", [sys.executable, "-m", "onbox.cli"])
        exec_script(bindir / NODE_JOB_CMD, [sys.executable, str(NODE_JOB)])
        self.env = {**os.environ, "PATH": f"{FAKESLURM}:{bindir}:{os.environ['PATH']}",
                    "PYTHONPATH": str(REPO),
                    "SLURM_JOB_ID": "81234", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "fakenode[0-1]",
                    "RGT_RUN": run, "RGT_ROOT": str(self.root), "RGT_DEADMAN": "off",
                    "RGT_TRAIN_CMD": NODE_JOB_CMD, "RGT_LAUNCH_ARGS": launch_args,
                    "NODE_JOB": json.dumps(jobs)}
        self.log = tmp / "slurm-81234.out"
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def __enter__(self) -> Allocation:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(["bash", str(SBATCH)], env=self.env, cwd=REPO, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        for node in NODES:
            wait_until(functools.partial(self.sidecar_up, node), 60,
                       f"node {node}'s job and sidecar\n{self.output()}")
        return self

    def stream_dir(self, node: str) -> Path:
        found = sorted(self.root.glob(f"*/active/{self.run}.{node}"))
        return found[0] if found else self.root / "missing" / f"{self.run}.{node}"

    def sidecar_up(self, node: str) -> bool:
        d = self.stream_dir(node)
        return run_status(d).state == "running" and read_json(d / "rgt" / "endpoints.json") is not None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def wait(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def __exit__(self, kind: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        for node in NODES:   # `rgt stop` of what still runs: the launchers, srun and bash then end
            if run_status(self.stream_dir(node)).state in ("running", "stopping"):
                stop_run(self.stream_dir(node), 2.0)
        assert self.proc is not None
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the session this test started
            self.proc.wait(10)
            raise AssertionError(f"the sbatch script did not end\n{self.output()}") from exc


def last_step(stream_dir: Path) -> int:
    """The newest step a node's job logged to its metrics.jsonl (0 before any)."""
    try:
        lines = (stream_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):   # the line being written now
            continue
        if isinstance(step, int):
            steps.append(step)
    return max(steps)


def track(rgt: Rgt, run: str) -> Dict[str, Any]:
    answer = json.loads(rgt("track", "local", run, "--root", str(rgt.root), "--json").stdout)
    rgt.runs += [s["run"] for s in answer["streams"]]   # their watchers and sidecars end with the test
    return dict(answer)


def verdicts(run: str, kind: str) -> List[Dict[str, Any]]:
    with Store.open() as store:
        return [e.data for e in store.local_events(run, kind_prefix=kind)]


def test_a_rank_that_fails_while_the_other_waits_is_rank_failed(rgt_local: Rgt, tmp_path: Path) -> None:
    run, stop = "mn-fail", tmp_path / "n1.stop"
    jobs: Dict[str, Dict[str, Any]] = {
        "n0": {"args": [*STEPS, "--hang-at", "20"]},                # waits: no more progress
        "n1": {"args": [*STEPS, "--stop-file", str(stop)], "exit": 1}}       # exits 1 when told
    with Allocation(tmp_path, rgt_local, run, jobs) as alloc:
        answer = track(rgt_local, run)
        assert answer["group"] is True and [s["node"] for s in answer["streams"]] == list(NODES)
        # (a) one stream per node in the store, each with its events, tied to the run
        with Store.open() as store:
            wait_until(lambda: all(store.count_events(f"{run}.{n}") > 0 for n in NODES), 30, "both streams")
            rows = {r["run"]: r for r in store.runs()}
        assert [(rows[f"{run}.{n}"]["group_run"], rows[f"{run}.{n}"]["node"]) for n in NODES] == [
            (run, "n0"), (run, "n1")]
        listed = json.loads(rgt_local("runs", run, "--json").stdout)["runs"]
        assert [r["run"] for r in listed] == [run, f"{run}.n0", f"{run}.n1"]
        # (b) n1 exits 1 while n0 still runs: one job.rank_failed naming n1
        stop.write_text("")
        found = wait_until(lambda: verdicts(run, "job.rank_failed"), 60, f"job.rank_failed\n{alloc.output()}")
        assert (found[0]["node"], found[0]["code"], found[0]["waiting"]) == ("n1", 1, ["n0"])
        woke = rgt_local("watch", run, "--timeout", "60s", "--json", check=False)
        record = json.loads(woke.stdout.strip().splitlines()[-1])
        assert woke.returncode == 10, woke.stdout + woke.stderr
        assert record["event"]["kind"] == "job.rank_failed" and record["event"]["data"]["node"] == "n1"
        status = json.loads(rgt_local("status", run, "--json").stdout)
        assert status["state"] == "rank failed"
        states = [(n["node"], n["state"]) for n in status["nodes"]]
        # n0 waits by SIGSTOPping itself (train_tiny --hang-at): the sidecar names a stopped process at once
    assert states == [("n0", "stalled"), ("n1", "failed (error)")]
    assert alloc.wait() != 0                       # srun passed the worst node's status on
    assert len(verdicts(run, "job.rank_failed")) == 1


def test_every_node_stalled_is_hung_naming_the_node_that_stopped_first(rgt_local: Rgt,
                                                                       tmp_path: Path) -> None:
    run = "mn-hang"
    jobs = {"n0": {"args": [*STEPS, "--hang-at", "240"]},   # stops ~12 s in
            "n1": {"args": [*STEPS, "--hang-at", "40"]}}    # stops ~2 s in: first
    stall = f"{LAUNCH_ARGS} --stall-floor 2 --stall-grace 10"
    with Allocation(tmp_path, rgt_local, run, jobs, launch_args=stall) as alloc:
        track(rgt_local, run)
        # Both jobs at their hang first: on a loaded machine n0 may pause past the 2 s floor before
        # it really hangs, which is a hung verdict that its next step clears (job.progressing).
        for node, at in (("n1", 40), ("n0", 240)):
            wait_until(lambda d=alloc.stream_dir(node), a=at: last_step(d) >= a - 5, 120,
                       f"{node}'s job to reach its hang at step {at}\n{alloc.output()}")
        wait_until(lambda: json.loads(rgt_local("status", run, "--json").stdout)["state"] == "hung", 60,
                   f"the group to be hung\n{alloc.output()}")
        # rgt status judges the nodes itself; the daemon records the verdict on the next job event
        # or group check, so it may come a moment later.
        found = wait_until(lambda: verdicts(run, "job.stalled"), 60, f"the hung verdict\n{alloc.output()}")
        latest = found[-1]
        assert (latest["verdict"], latest["scope"], latest["first_node"]) == ("hung", "all nodes", "n1")
        woke = rgt_local("watch", run, "--timeout", "60s", "--json", check=False)
        record = json.loads(woke.stdout.strip().splitlines()[-1])
        assert woke.returncode == 10 and record["run"] == run, woke.stdout + woke.stderr
        assert record["event"]["data"]["first_node"] == "n1"
        status = json.loads(rgt_local("status", run, "--json").stdout)
        assert status["state"] == "hung" and "n1 stopped first" in status["state_reason"]
        assert [n["state"] for n in status["nodes"]] == ["stalled", "stalled"]
        assert len(verdicts(run, "job.rank_failed")) == 0
