"""One node's share of the test's multi-node job: scripts/train_tiny.py with this node's arguments.

The e2e test runs examples/slurm/train.sbatch with RGT_TRAIN_CMD naming a script that runs
this file (train.sbatch splits RGT_TRAIN_CMD on blanks; a path may hold one), and sets
NODE_JOB to a JSON object {node: {"args": [train_tiny arguments], "exit": N}}; the node is
RGT_NODE, which `rgt-onbox launch --node auto` sets. A train_tiny failure exits 1, the way a rank
dies on an uncaught Python exception; "exit" is the code to end with once train_tiny finished
cleanly (with --stop-file, a rank that fails when the test says so).
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[3] / "scripts" / "train_tiny.py"


def main() -> int:
    node = os.environ.get("RGT_NODE", "")
    spec = json.loads(os.environ.get("NODE_JOB", "{}")).get(node, {})
    args = [str(a) for a in spec.get("args", [])]
    print(f"node {node}: train_tiny {' '.join(args)}", flush=True)
    sys.argv = [str(TRAIN), *args]
    try:
        runpy.run_path(str(TRAIN), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            return 1
    code = int(spec.get("exit", 0))
    if code:
        print(f"node {node}: failing with exit code {code}, as told", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
