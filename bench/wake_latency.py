"""How fast `rgt watch` wakes on a NaN written on the box, through the SSH tunnel.

A throw-away sshd on 127.0.0.1 plays the box (tests/sshbox.py). One run is launched there with
`rgt launch`; its job only waits. Each trial starts `rgt watch RUN --json`, lets it settle, appends a
NaN line to the run's metrics.jsonl on the box, and measures the time from that write to the watch
process's exit (code 10). A finite line then clears the condition for the next trial.

Next to it: what people run today, a loop that polls the box over SSH every 90 s. Its latency is
the wait for the next poll (uniform over the period) plus one real poll, measured here as a fresh
`ssh box tail -n 1 metrics.jsonl`.

    .venv/bin/python bench/wake_latency.py [--trials 50] [--poll-period 90]

Prints a table and writes bench/results/wake_latency.json. Target: p99 <= 1 s.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from boxrig import BoxRig, write_results

WAIT_JOB = "import os, time\nwhile not os.path.exists(os.environ['RGT_RUN_DIR'] + '/stop'): time.sleep(0.2)\n"


def pct(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--poll-period", type=float, default=90.0)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds between starting a watch and the NaN")
    args = ap.parse_args()
    with BoxRig() as rig:
        run, run_dir = rig.launch(sys.executable, "-c", WAIT_JOB)
        rig.call("policy", run, "--flap-window", "0")
        metrics = run_dir / "metrics.jsonl"
        latencies: List[float] = []
        codes: List[int] = []
        for i in range(args.trials):
            watch = subprocess.Popen([*rig.rgt, "watch", run, "--timeout", "60", "--json"], env=rig.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            time.sleep(args.settle)  # a benchmark, not a test: let the watch start polling
            step = 10 * (2 * i + 1)
            with open(metrics, "a") as f:
                t0 = time.time()
                f.write(json.dumps({"step": step, "loss": "nan"}) + "\n")
            watch.wait(timeout=60)
            latencies.append(time.time() - t0)
            codes.append(watch.returncode)
            with open(metrics, "a") as f:  # clear it (3 finite values in a row), so the next NaN is new
                for k in range(1, 4):
                    f.write(json.dumps({"step": step + k, "loss": 0.5}) + "\n")
            rig.wait_stored(run, "train.nonfinite", 2 * (i + 1))
        polls: List[float] = []
        for _ in range(5):
            t = time.monotonic()
            subprocess.run(["ssh", "-F", str(rig.box.config_file), "-o", "ControlPath=none", rig.box.alias,
                            f"tail -n 1 {shlex.quote(str(metrics))}"],
                           capture_output=True, check=True, timeout=30)
            polls.append(time.monotonic() - t)
        poll_cost = statistics.median(polls)
        rng = random.Random(0)
        loop = [rng.uniform(0, args.poll_period) + poll_cost for _ in range(10_000)]
        report: Dict[str, Any] = {
            "trials": args.trials, "exit_codes": sorted(set(codes)),
            "watch_p50_s": round(pct(latencies, 0.5), 4), "watch_p99_s": round(pct(latencies, 0.99), 4),
            "watch_max_s": round(max(latencies), 4),
            "poll_period_s": args.poll_period, "poll_cost_s": round(poll_cost, 4),
            "poll_p50_s": round(pct(loop, 0.5), 2), "poll_p99_s": round(pct(loop, 0.99), 2),
        }
        report["ratio_p50"] = round(report["poll_p50_s"] / max(report["watch_p50_s"], 1e-6), 1)
        report["ratio_p99"] = round(report["poll_p99_s"] / max(report["watch_p99_s"], 1e-6), 1)
        print(f"{'':<28}{'p50':>10}{'p99':>10}")
        w50, w99 = report["watch_p50_s"], report["watch_p99_s"]
        print(f"{'rgt watch through the tunnel':<28}{w50:>9.3f}s{w99:>9.3f}s")
        print(f"{'90 s ssh poll loop':<28}{report['poll_p50_s']:>9.1f}s{report['poll_p99_s']:>9.1f}s")
        print(f"ratio (poll / watch): p50 {report['ratio_p50']}x, p99 {report['ratio_p99']}x; "
              f"exit codes {report['exit_codes']}; target p99 <= 1 s")
        write_results("wake_latency", report)
        return 0 if report["exit_codes"] == [10] else 1


if __name__ == "__main__":
    sys.exit(main())
