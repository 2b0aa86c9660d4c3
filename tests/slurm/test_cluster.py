"""The private Slurm cluster itself (tests/slurm/cluster.py): what the rgt tests on it rely on.

Real sbatch, srun, scancel and scontrol against a real slurmctld and two slurmd (n1, n2) on this
machine: a batch job runs and writes its output file, a step spans both nodes with one task per
node, an exit code comes back, scancel ends a running job's processes, and a requeued job runs
again with SLURM_RESTART_COUNT=1.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import List

import psutil
import pytest

from tests.helpers import wait_until
from tests.slurm.cluster import SlurmCluster

pytestmark = pytest.mark.slurm


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def lines(path: Path) -> List[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def test_both_nodes_are_up(slurm: SlurmCluster) -> None:
    assert slurm.node_states() == {"n1": "idle", "n2": "idle"}
    nodes = slurm.run("scontrol", "show", "hostnames", "n[1-2]").stdout.split()
    assert nodes == ["n1", "n2"]


def test_a_batch_job_runs_and_writes_its_output_file(slurm: SlurmCluster, tmp_path: Path) -> None:
    job = slurm.sbatch(script(tmp_path / "hello.sh", 'echo "hello from $SLURM_JOB_ID on $SLURMD_NODENAME"\n'),
                       "--output", str(tmp_path / "out-%j.txt"), "--chdir", str(tmp_path))
    info = slurm.wait_job(job, "COMPLETED", 60)
    assert info["ExitCode"] == "0:0"
    out = tmp_path / f"out-{job}.txt"
    assert wait_until(functools.partial(lines, out), 20, "the job's output") == [
        f"hello from {job} on {info['BatchHost']}"]


def test_an_exit_code_is_the_jobs(slurm: SlurmCluster, tmp_path: Path) -> None:
    job = slurm.sbatch(script(tmp_path / "fail.sh", "exit 3\n"), "--output", "/dev/null",
                       "--chdir", str(tmp_path))
    assert slurm.wait_job(job, "FAILED", 60)["ExitCode"] == "3:0"


def test_srun_runs_one_task_per_node(slurm: SlurmCluster) -> None:
    out = slurm.run("srun", "-N2", "-n2", "--ntasks-per-node=1", "bash", "-c",
                    "echo $SLURM_PROCID $SLURM_NODEID $SLURMD_NODENAME $SLURM_NNODES $SLURM_NTASKS",
                    timeout_s=60).stdout
    assert sorted(out.split("\n")[:-1]) == ["0 0 n1 2 2", "1 1 n2 2 2"]


def test_a_batch_jobs_step_spans_both_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    """As examples/slurm/train.sbatch does it: `srun --ntasks-per-node=1` inside a 2-node job."""
    body = ('scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1 > master.txt\n'
            "srun --ntasks-per-node=1 bash -c 'echo $SLURM_PROCID $SLURM_NODEID > task-$SLURM_PROCID.txt'\n")
    job = slurm.sbatch(script(tmp_path / "step.sh", body), "--nodes=2", "--ntasks-per-node=1",
                       "--output", str(tmp_path / "out.txt"), "--chdir", str(tmp_path))
    info = slurm.wait_job(job, "COMPLETED", 60)
    assert info["NodeList"] == "n[1-2]", info
    assert lines(tmp_path / "master.txt") == ["n1"]
    assert [lines(tmp_path / f"task-{i}.txt") for i in (0, 1)] == [["0 0"], ["1 1"]]


def test_scancel_ends_a_running_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    pids = tmp_path / "pid"
    job = slurm.sbatch(script(tmp_path / "long.sh", f"sleep 300 &\necho $! > {pids}\nwait\n"),
                       "--output", "/dev/null", "--chdir", str(tmp_path))
    slurm.wait_job(job, "RUNNING", 60)
    pid = int(wait_until(functools.partial(lines, pids), 20, "the job's pid")[0])
    assert psutil.pid_exists(pid)
    slurm.run("scancel", job)
    slurm.wait_job(job, "CANCELLED", 60)
    wait_until(lambda: not psutil.pid_exists(pid), 30, "the job's sleep to end")


def test_a_requeued_job_runs_again_with_restart_count_1(slurm: SlurmCluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    body = f'echo "restart=${{SLURM_RESTART_COUNT:-0}} pid=$$" >> {runs}\nsleep 300\n'
    job = slurm.sbatch(script(tmp_path / "requeue.sh", body), "--requeue", "--output", "/dev/null",
                       "--chdir", str(tmp_path))
    slurm.wait_job(job, "RUNNING", 60)
    first = wait_until(functools.partial(lines, runs), 20, "the first run")
    assert first[0].startswith("restart=0 ")
    first_pid = int(first[0].split("pid=")[1])
    slurm.run("scontrol", "requeue", job)
    # Back to pending (briefly), then running again: the requeued job may start once its
    # credentials expire (AuthInfo cred_expire, 10 s here).
    wait_until(lambda: len(lines(runs)) >= 2, 60, f"the job to run again\n{slurm.job(job)}")
    again = lines(runs)
    assert again[1].startswith("restart=1 "), again
    assert not psutil.pid_exists(first_pid)
    info = slurm.wait_job(job, "RUNNING", 20)
    assert info["Restarts"] == "1"
