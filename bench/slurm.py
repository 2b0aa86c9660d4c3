"""The Slurm path's latencies on a real, private two-node cluster (tests/slurm/cluster.py).

Each round submits examples/slurm/train.sbatch unchanged (a tiny CPU job per node, a checkpoint
every 20 steps) with --requeue, follows it with `rgt track local RUN` into a private RGT_HOME, and
times, from the moment of each action:

    submit   -> the first event of both nodes stored in SQLite (sbatch, srun, launcher, sidecar,
                the follower daemon: everything a user waits through)
    requeue  -> job.preempted of both nodes stored (`scontrol requeue`: Slurm's SIGTERM, the
                sidecar's scontrol question, the journal, the follow)
    requeue  -> both nodes' resumed job logged a step past its checkpoint, and that train.progress
                is stored (KillWait, Slurm's requeue delay of cred_expire + 1 s, the scheduler
                pass, the relaunch with RGT_RESUME_FROM, torch's import, `rgt track` again)
    rgt stop -> both nodes' job.exited stored (stop.json on both, scancel --signal=TERM of the step)

Needs root and slurm-wlm + munge (`make system-deps`). Talks only to this machine.

    .venv/bin/python bench/slurm.py [--rounds 3]

Prints one table and writes bench/results/slurm.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from boxrig import write_results  # noqa: E402

T = TypeVar("T")
NODES = ("n0", "n1")
KILL_WAIT = 10


def wait(predicate: Callable[[], Optional[T]], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


class Controller:
    """`rgt` with its own RGT_HOME, and a read of its store."""

    def __init__(self, home: Path, slurm_conf: str) -> None:
        self.env = {**os.environ, "RGT_HOME": str(home), "PYTHONPATH": str(REPO), "SLURM_CONF": slurm_conf}
        os.environ["RGT_HOME"] = str(home)   # Store.open() below reads the same store

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([sys.executable, "-m", "controller.cli.main", *args], env=self.env,
                             capture_output=True, text=True, timeout=180, cwd=REPO)
        if check and out.returncode != 0:
            raise RuntimeError(f"rgt {' '.join(args)} exited {out.returncode}: {out.stderr[-800:]}")
        return out

    def events(self, run: str, kind: str) -> List[Any]:
        from controller.store.db import RunNotFound, Store

        with Store.open() as store:
            try:
                return list(store.events(run, kind_prefix=kind))
            except RunNotFound:
                return []

    def track(self, run: str, root: Path) -> bool:
        out = self("track", "local", run, "--root", str(root), "--json", check=False)
        return out.returncode == 0 and len(json.loads(out.stdout)["streams"]) == len(NODES)


def one_round(cluster: Any, tmp: Path, index: int) -> Dict[str, Any]:
    from onbox.custody import manifest
    from tests.slurm.trainjob import TrainJob

    run, root = f"bench-slurm-{index}", tmp / "runs"
    rgt = Controller(tmp / "home", cluster.env["SLURM_CONF"])
    args = ["--steps", "100000", "--step-seconds", "0.05", "--log-every", "5", "--ckpt-every", "20"]
    job = TrainJob(cluster, tmp, run, root, {n: {"args": args} for n in NODES})
    streams = [f"{run}.{n}" for n in NODES]
    out: Dict[str, Any] = {}
    try:
        t = time.monotonic()
        job_id = job.submit("--requeue")
        wait(lambda: rgt.track(run, root), 120, "both node streams to track")
        wait(lambda: all(rgt.events(s, "") for s in streams), 60, "the first stored events")
        out["submit_to_first_event_s"] = time.monotonic() - t
        wait(lambda: all(manifest.newest_good(job.stream_dir(n)) for n in NODES), 60,
             "a checkpoint on each node")
        t = time.monotonic()
        cluster.run("scontrol", "requeue", job_id)
        wait(lambda: all(rgt.events(s, "job.preempted") for s in streams), 60, "job.preempted stored")
        out["requeue_to_preempted_stored_s"] = time.monotonic() - t
        job.wait_sidecars(attempt=2, timeout_s=180)
        wait(lambda: rgt.track(run, root), 60, "the second attempt to track")

        def resumed(stream: str) -> bool:
            starts = rgt.events(stream, "job.started")
            if len(starts) < 2:
                return False
            progress = [e for e in rgt.events(stream, "train.progress") if e.seq > starts[1].seq]
            return any(isinstance(e.data.get("step"), int) and e.data["step"] > 20 for e in progress)

        wait(lambda: all(resumed(s) for s in streams), 120, "a resumed step stored")
        out["requeue_to_resumed_step_stored_s"] = time.monotonic() - t
        t = time.monotonic()
        rgt("stop", run, "--json")
        wait(lambda: all(len(rgt.events(s, "job.exited")) >= 2 for s in streams), 60, "the stopped exits")
        out["stop_to_exits_stored_s"] = time.monotonic() - t
        from tests.slurm.cluster import FINISHED

        final = cluster.wait_job(job_id, tuple(FINISHED), 60)
        out["slurm_final_state"] = final.get("JobState", "")
    finally:
        from controller.follow.client import stop_daemon

        stop_daemon()
        cluster.run("scancel", "--full", "--user", "root", check=False)
        wait(lambda: not cluster.job_processes(), 60, "the job's processes to end", 0.2)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from tests.slurm.cluster import SlurmCluster, slurm_skip_reason
    from tests.slurm.trainjob import NODE_SHAPE

    reason = slurm_skip_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="rgtslurm-", dir="/tmp"))
    cluster = SlurmCluster(base / "c", **{**NODE_SHAPE, "kill_wait": KILL_WAIT})
    t = time.monotonic()
    cluster.start()
    start_s = time.monotonic() - t
    rounds: List[Dict[str, Any]] = []
    try:
        for i in range(args.rounds):
            rounds.append(one_round(cluster, base / f"r{i}", i))
    finally:
        cluster.stop()
    keys = [k for k in rounds[0] if k.endswith("_s")]
    report: Dict[str, Any] = {
              "cluster_start_s": round(start_s, 2), "kill_wait_s": KILL_WAIT, "rounds": rounds,
              "median_s": {k: round(statistics.median(r[k] for r in rounds), 2) for k in keys},
              "max_s": {k: round(max(r[k] for r in rounds), 2) for k in keys},
              "slurm_final_states": sorted({str(r["slurm_final_state"]) for r in rounds}),
              "cpus": os.cpu_count(), "load": list(os.getloadavg())}
    print(f"Slurm on this machine: two slurmd on 127.0.0.1, KillWait {KILL_WAIT} s, {args.rounds} rounds; "
          f"cluster start {start_s:.2f} s")
    print(f"{'measure':<40} {'median s':>9} {'max s':>7}")
    for k in keys:
        print(f"{k:<40} {report['median_s'][k]:>9.2f} {report['max_s'][k]:>7.2f}")
    print(f"the Slurm job after rgt stop: {', '.join(report['slurm_final_states'])}")
    path = write_results("slurm", report)
    print(f"wrote {path}")
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
