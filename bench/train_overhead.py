"""Training overhead of the sidecar: the tiny CPU loop's time with and without it.

Runs scripts/train_tiny.py (no pacing, checkpoints every --ckpt-every steps so
custody hashes them) alternately alone and under `rgt-onbox serve --pid` with
the scripted 8-GPU probe, `--pairs` times, interleaved so drift hits both
sides alike. The job reports its own loop time (train_seconds=...). The ratio
is median(with) / median(without); target <= 1.03. Prints a table, writes JSON.

    .venv/bin/python bench/train_overhead.py [--pairs 5] [--steps 20000]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run_job(run_dir: Path, args: argparse.Namespace, with_sidecar: bool) -> float:
    run_dir.mkdir(parents=True)
    env = {**os.environ, "RGT_RUN_DIR": str(run_dir), "RGT_METRICS": str(run_dir / "metrics.jsonl"),
           "RGT_CKPT_DIR": str(run_dir / "checkpoints"), "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen([sys.executable, str(REPO / "scripts" / "train_tiny.py"),
                            "--steps", str(args.steps), "--step-seconds", "0", "--log-every", "10",
                            "--ckpt-every", str(args.ckpt_every)],
                           env=env, stdout=subprocess.PIPE, text=True)
    sidecar: Optional[subprocess.Popen] = None
    if with_sidecar:
        sidecar = subprocess.Popen([str(BIN / "rgt-onbox"), "serve", "--run-dir", str(run_dir), "--pid",
                                    str(job.pid), "--gpu", "fake:healthy_h100x8", "--log-level", "warning"],
                                   env=env)
    out, _ = job.communicate(timeout=600)
    if sidecar is not None:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(30)
    m = re.search(r"train_seconds=([0-9.]+)", out)
    if job.returncode != 0 or not m:
        raise SystemExit(f"the job failed: {out[-500:]}")
    return float(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--ckpt-every", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "train_overhead.json")
    args = ap.parse_args()
    times: Dict[str, List[float]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory(prefix="rgt-train-bench-") as t:
        for i in range(args.pairs):
            order = ["without", "with"] if i % 2 == 0 else ["with", "without"]
            for side in order:
                times[side].append(run_job(Path(t) / f"{side}-{i}", args, side == "with"))
                threading.Event().wait(0.5)  # let the previous processes' exits settle
    without, with_ = statistics.median(times["without"]), statistics.median(times["with"])
    result = {
        "bench": "train_overhead", "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpus": os.cpu_count(),
        "steps": args.steps, "ckpt_every": args.ckpt_every, "pairs": args.pairs, "times_s": times,
        "median_without_s": without, "median_with_s": with_, "ratio": with_ / without, "target_ratio": 1.03,
    }
    result["pass"] = result["ratio"] <= 1.03
    print(f"train overhead: {args.pairs} interleaved pairs of {args.steps} steps "
          f"(ckpt every {args.ckpt_every})")
    print(f"  {'median loop time without sidecar':<36} {without:8.3f} s")
    print(f"  {'median loop time with sidecar':<36} {with_:8.3f} s")
    print(f"  {'ratio (target <= 1.03)':<36} {result['ratio']:8.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
