"""Which node of a multi-node run this launch is: `rgt-onbox launch --run-id RUN --node NAME|auto`.

A multi-node run is one logical run (the job sees the same RGT_RUN_ID on every node) with one
sidecar and one journal per node. Each node's stream lives in its own run directory,
`<root>/<project>/active/<RUN>.<NODE>`, so nodes never share a journal even on a shared
filesystem; run.json records `group` (RUN) and `node` (NODE), which is how the controller ties
the streams back together.

`auto` names the node from the launcher the scheduler started:

    SLURM_NODEID          srun --ntasks-per-node=1 (Slurm)         -> n0, n1, ...
    JOB_COMPLETION_INDEX  an Indexed Job (Kubernetes)              -> n0, n1, ...
    SKYPILOT_NODE_RANK    a SkyPilot task with num_nodes > 1       -> n0, n1, ...
    NODE_RANK, GROUP_RANK torchrun / a launcher that sets them     -> n0, n1, ...

and the node count from SLURM_NNODES, SKYPILOT_NUM_NODES, RGT_NODES or WORLD_NODES when one is set.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional, Tuple

INDEX_VARS = ("SLURM_NODEID", "JOB_COMPLETION_INDEX", "SKYPILOT_NODE_RANK", "NODE_RANK", "GROUP_RANK")
COUNT_VARS = ("SLURM_NNODES", "SKYPILOT_NUM_NODES", "RGT_NODES", "WORLD_NODES")
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")


class NodeError(ValueError):
    """--node cannot be worked out; the message says what to pass."""


def identify(node: str, environ: Mapping[str, str]) -> Tuple[str, Optional[int]]:
    """(node name, node count or None) for `--node NAME|auto`."""
    count = next((int(environ[v]) for v in COUNT_VARS if environ.get(v, "").isdigit()), None)
    if node != "auto":
        if not NODE_NAME.match(node):
            raise NodeError(f"--node {node!r} must be 1-32 of A-Z a-z 0-9 _ - (starting alphanumeric)")
        return node, count
    for var in INDEX_VARS:
        value = environ.get(var, "")
        if value.isdigit():
            return f"n{int(value)}", count
    raise NodeError("--node auto found none of " + ", ".join(INDEX_VARS)
                    + ": run it under srun or an Indexed Job, or name the node (--node n0)")


def stream_id(run_id: str, node: str) -> str:
    """The run id of one node's stream: its directory name and its journal's run."""
    return f"{run_id}.{node}"
