"""examples/slurm/train.sbatch, unchanged, submitted with real sbatch to the private cluster.

The cluster's two nodes are shaped like the ones the script asks for (32 CPUs and 8 GPUs each, as
slurm.conf says; the GPUs are stand-ins), so its #SBATCH lines stand as written. Slurm starts the
script on n1; its `srun --ntasks-per-node=1` starts one `rgt-onbox launch --wait --node auto` per
node, each with its share of a tiny CPU job (tests/e2e/data/node_job.py, scripts/train_tiny.py) and
its own sidecar. Each node's run then has its journal under RGT_ROOT: job.started, then
job.exited with code 0, and the Slurm job COMPLETED.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from onbox.sidecar.journal import read_all
from tests.e2e.test_multinode_e2e import LAUNCH_ARGS, NODE_JOB, NODE_JOB_CMD, NODES, SBATCH
from tests.helpers import REPO, exec_script, wait_until
from tests.slurm.cluster import SlurmCluster

pytestmark = pytest.mark.slurm

SLURM_NODE_SHAPE = {"cpus": 32, "gpus": 8}   # what train.sbatch's #SBATCH lines ask of a node
STEPS = ["--steps", "20", "--step-seconds", "0.02", "--log-every", "5", "--ckpt-every", "100000"]


def journal(stream_dir: Path) -> List[Dict[str, Any]]:
    try:
        return read_all(stream_dir / "rgt")
    except OSError:
        return []


def test_train_sbatch_runs_one_rgt_launch_per_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    run, root = "slurm-train", tmp_path / "runs"
    bindir = tmp_path / "bin"
    # rgt-onbox of this checkout, as `rgt install` puts one on a node; the job by one name on PATH
    # (RGT_TRAIN_CMD is plain words, split on blanks).
    exec_script(bindir / "rgt-onbox", [sys.executable, "-m", "onbox.cli"])
    exec_script(bindir / NODE_JOB_CMD, [sys.executable, str(NODE_JOB)])
    jobs = {node: {"args": STEPS} for node in NODES}
    env = {**slurm.env, "PATH": f"{bindir}:{slurm.env['PATH']}", "PYTHONPATH": str(REPO),
           "RGT_RUN": run, "RGT_ROOT": str(root), "RGT_DEADMAN": "off",
           "RGT_TRAIN_CMD": NODE_JOB_CMD, "RGT_LAUNCH_ARGS": LAUNCH_ARGS,
           "NODE_JOB": json.dumps(jobs)}
    job = slurm.sbatch(SBATCH, "--chdir", str(tmp_path), env=env, cwd=tmp_path)
    log = tmp_path / f"train-{job}.out"   # the script's --output=%x-%j.out

    def output() -> str:
        return log.read_text(errors="replace")[-3000:] if log.exists() else "(no output yet)"

    try:
        info = slurm.wait_job(job, ("COMPLETED",), 120)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- {log.name} ---\n{output()}") from None
    assert (info["NodeList"], info["ExitCode"]) == ("n[1-2]", "0:0"), info
    assert info["TRES"].startswith("cpu=64,") and info["TresPerNode"].endswith("gpu:8"), info
    for node in NODES:
        found = sorted(root.glob(f"*/active/{run}.{node}"))
        assert len(found) == 1, f"{node}: {found}\n{output()}"
        events = wait_until(lambda d=found[0]: [e for e in journal(d) if e["kind"] == "job.exited"]
                            and journal(d), 30, f"{node}'s job.exited\n{output()}")
        kinds = [e["kind"] for e in events]
        assert kinds.index("job.started") < kinds.index("job.exited"), kinds
        exited = next(e for e in events if e["kind"] == "job.exited")
        assert exited["data"]["code"] == 0, exited
