"""examples/slurm/train.sbatch submitted to a test cluster (tests/slurm/cluster.py), and what each
node's run says: the tests and bench/slurm.py share it.

    job = TrainJob(cluster, tmp, "train-x", root, {"n0": {"args": [...]}, "n1": {...}})
    job.submit("--requeue")
    job.wait_sidecars()
    job.events("n0", "job.preempted")

The script is the example, unchanged; its environment names the job (RGT_TRAIN_CMD: the test's
per-node job, tests/e2e/data/node_job.py), the run id, RGT_ROOT and the test's launch options, and
puts an `rgt-onbox` of this checkout first on PATH.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from onbox.runs import read_json, run_status
from onbox.sidecar.journal import read_all
from tests.helpers import REPO, exec_script, wait_until
from tests.slurm.cluster import SlurmCluster

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
NODE_JOB = REPO / "tests" / "e2e" / "data" / "node_job.py"
NODE_JOB_CMD = "rgt-test-node-job"   # NODE_JOB under this python, on PATH (rgt_onbox)
NODES = ("n0", "n1")   # `--node auto` names them from SLURM_NODEID
# A test box's options (tests/e2e/rgtbox.py): fast heartbeats, no pre-flight, no GPU, no linger.
LAUNCH_ARGS = ("--no-preflight --sidecar-linger=0s --probe none --serve-arg=--heartbeat=1 "
               "--serve-arg=--no-kmsg")
# The cluster's nodes shaped like the ones train.sbatch asks for, so its #SBATCH lines stand.
NODE_SHAPE: Dict[str, Any] = {"cpus": 32, "gpus": 8}


def rgt_onbox(bindir: Path) -> Path:
    """An `rgt-onbox` that runs this checkout, as `rgt install` puts one on a node, and beside it
    NODE_JOB_CMD, the per-node job: RGT_TRAIN_CMD is plain words (the script splits it on
    blanks), so the job goes by one name on PATH, wherever this checkout and its Python lie."""
    exec_script(bindir / NODE_JOB_CMD, [sys.executable, str(NODE_JOB)])
    return exec_script(bindir / "rgt-onbox", [sys.executable, "-m", "onbox.cli"])


class TrainJob:
    def __init__(self, cluster: SlurmCluster, tmp: Path, run: str, root: Path,
                 jobs: Mapping[str, Mapping[str, Any]], launch_args: str = LAUNCH_ARGS) -> None:
        self.cluster, self.tmp, self.run, self.root = cluster, tmp, run, root
        bindir = rgt_onbox(tmp / "bin").parent
        self.env = {**cluster.env, "PATH": f"{bindir}:{cluster.env['PATH']}", "PYTHONPATH": str(REPO),
                    "RGT_RUN": run, "RGT_ROOT": str(root), "RGT_DEADMAN": "off",
                    "RGT_TRAIN_CMD": NODE_JOB_CMD, "RGT_LAUNCH_ARGS": launch_args,
                    "NODE_JOB": json.dumps(jobs)}
        self.job_id: Optional[str] = None

    def submit(self, *sbatch_args: str) -> str:
        self.job_id = self.cluster.sbatch(SBATCH, "--chdir", str(self.tmp), *sbatch_args, env=self.env,
                                          cwd=self.tmp)
        return self.job_id

    def output(self) -> str:
        log = self.tmp / f"train-{self.job_id}.out"   # the script's --output=%x-%j.out
        return log.read_text(errors="replace")[-3000:] if log.exists() else "(no output yet)"

    def stream_dir(self, node: str) -> Path:
        found = sorted(self.root.glob(f"*/active/{self.run}.{node}"))
        return found[0] if found else self.root / "missing" / f"{self.run}.{node}"

    def journal(self, node: str) -> List[Dict[str, Any]]:
        try:
            return read_all(self.stream_dir(node) / "rgt")
        except OSError:
            return []

    def events(self, node: str, kind: str) -> List[Dict[str, Any]]:
        return [e for e in self.journal(node) if e["kind"] == kind]

    def sidecar_up(self, node: str, attempt: int = 1) -> bool:
        d = self.stream_dir(node)
        meta = read_json(d / "run.json") or {}
        return meta.get("attempt") == attempt and run_status(d).state == "running" and \
            read_json(d / "rgt" / "endpoints.json") is not None and \
            len(self.events(node, "job.started")) >= attempt

    def wait_sidecars(self, attempt: int = 1, timeout_s: float = 90) -> None:
        for node in NODES:
            wait_until(lambda n=node: self.sidecar_up(n, attempt), timeout_s,
                       f"node {node}'s job and sidecar (attempt {attempt})\n{self.output()}")

    def wait_event(self, node: str, kind: str, count: int = 1, timeout_s: float = 60) -> List[Dict[str, Any]]:
        return wait_until(lambda: len(self.events(node, kind)) >= count and self.events(node, kind),
                          timeout_s, f"{node}'s {kind} #{count}\n{self.output()}")


__all__ = ["LAUNCH_ARGS", "NODES", "NODE_JOB", "NODE_JOB_CMD", "NODE_SHAPE", "SBATCH", "TrainJob",
           "rgt_onbox"]
