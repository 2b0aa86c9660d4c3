"""Multi-node identity: which node a launch is, and the stream it gets."""
from __future__ import annotations

import json

import pytest

from onbox.launch.launcher import LaunchUsageError
from onbox.launch.nodes import NodeError, identify, stream_id
from onbox.runs import read_json
from tests.helpers import wait_until
from tests.onbox.test_launch import Rig, py


@pytest.mark.parametrize("environ, expected", [
    ({"SLURM_NODEID": "1", "SLURM_NNODES": "2"}, ("n1", 2)),
    ({"JOB_COMPLETION_INDEX": "3"}, ("n3", None)),
    ({"SKYPILOT_NODE_RANK": "0", "RGT_NODES": "4"}, ("n0", 4)),
    ({"NODE_RANK": "2", "JOB_COMPLETION_INDEX": ""}, ("n2", None)),
])
def test_auto_reads_the_scheduler(environ: dict, expected: tuple) -> None:
    assert identify("auto", environ) == expected


def test_names_are_checked_and_auto_needs_a_scheduler() -> None:
    assert identify("gpu-a", {}) == ("gpu-a", None)
    with pytest.raises(NodeError, match="SLURM_NODEID"):
        identify("auto", {"HOME": "/root"})
    with pytest.raises(NodeError, match="must be"):
        identify("../x", {})
    assert stream_id("run1", "n0") == "run1.n0"


def test_a_node_gets_its_own_stream_and_the_job_sees_the_shared_run_id(rig: Rig) -> None:
    code = ("import json, os\n"
            "open(os.path.join(os.environ['RGT_RUN_DIR'], 'seen.json'), 'w').write(json.dumps("
            "{k: os.environ.get(k) for k in ('RGT_RUN_ID', 'RGT_NODE')}))\n")
    environ = {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "PATH": "/usr/bin:/bin"}
    result = rig.launch(py(code), run_id="big", node="auto", environ=environ)
    assert result.run_dir.name == "big.n1" and (result.group, result.node) == ("big", "n1")
    doc = read_json(result.run_dir / "run.json") or {}
    assert (doc["id"], doc["group"], doc["node"], doc["nodes"]) == ("big.n1", "big", "n1", 2)
    seen = result.run_dir / "seen.json"
    wait_until(seen.exists, 20, "the job to write what it saw")
    assert json.loads(seen.read_text()) == {"RGT_RUN_ID": "big", "RGT_NODE": "n1"}


def test_node_needs_a_run_id(rig: Rig) -> None:
    with pytest.raises(LaunchUsageError, match="--node needs --run-id"):
        rig.launch(py("pass"), node="n0")
