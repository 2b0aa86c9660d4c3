"""Fixtures for the Slurm tests: one private cluster per test module (tests/slurm/cluster.py).

`slurm_cluster` starts munged, slurmctld and two slurmd (n1, n2) once for the module and ends them
by pid after its last test. `slurm` is the same cluster for one test, which it leaves as it found
it: every job cancelled and every job process gone, so no test sees another's jobs.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.e2e.rgtbox import rgt_box, rgt_local
from tests.helpers import wait_until
from tests.slurm.cluster import SlurmCluster, slurm_skip_reason
from tests.sshbox import sshbox

__all__ = ["rgt_box", "rgt_local", "slurm", "slurm_cluster", "sshbox"]


@pytest.fixture(scope="module")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """The module's cluster. A module sets SLURM_NODE_SHAPE (SlurmCluster's keyword arguments, such
    as {"cpus": 32, "gpus": 8}) for nodes shaped like the ones its jobs ask for."""
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    # A short root: munged's socket lives under it and sun_path holds 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="rgtslurm-", dir="/tmp"))
    cluster = SlurmCluster(root, **getattr(request.module, "SLURM_NODE_SHAPE", {}))
    stopped = False
    try:
        cluster.start()
        yield cluster
        cluster.stop()
        stopped = True
    finally:
        if not stopped:
            cluster.stop()   # after a failure: still end every daemon; keep the logs in root
        else:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    yield slurm_cluster
    slurm_cluster.run("scancel", "--full", "--user", "root", check=False, timeout_s=30)
    wait_until(lambda: not slurm_cluster.jobs_alive() and not slurm_cluster.job_processes(), 60,
               f"the test's jobs to end\n{slurm_cluster.logs()}", interval_s=0.2)
    wait_until(slurm_cluster.all_idle, 60, f"the nodes to be idle again\n{slurm_cluster.logs()}",
               interval_s=0.2)
