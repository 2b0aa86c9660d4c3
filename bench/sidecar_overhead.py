"""Sidecar overhead: CPU (% of one core) and RSS of a sidecar watching 8 GPUs and a running job.

A real `Sidecar` (journal, ipc publisher, heartbeat) runs in a child process with the
`HealthMonitor`'s periodic work at its default intervals: GPU sampling every 2 s over the scripted
fake probe for 8 H100s, the job watch every 1 s, the kernel log every 1 s (when readable), disks
every 10 s. The job is a real child process tree doing some CPU work. This process measures the
sidecar with psutil after a short warm-up: CPU seconds over wall seconds, and RSS sampled each
second. Targets: <= 1 % CPU, <= 60 MB RSS. Prints a table, writes JSON.

    .venv/bin/python bench/sidecar_overhead.py [--duration 120] [--gpu fake:healthy_h100x8]

The fake probe costs less than NVML does; on a real box add NVML's own time (about 10 calls per GPU
per round, each a few microseconds to a few milliseconds).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

TARGET_CPU_PCT = 1.0
TARGET_RSS_MB = 60.0

# The job: a main process that burns ~20 % of a core and two idle "dataloader workers".
JOB_CODE = """
import subprocess, sys, threading, time
workers = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
           for _ in range(2)]
pause = threading.Event()
while True:
    end = time.monotonic() + 0.02
    while time.monotonic() < end:
        sum(i * i for i in range(1000))
    pause.wait(0.08)
"""


def run_child(args: argparse.Namespace) -> None:
    """The measured process: a Sidecar with the monitor's jobs in its scheduler, until SIGTERM."""
    import logging

    from onbox.sidecar.server import Sidecar, SidecarConfig

    logging.basicConfig(level=logging.WARNING)
    sidecar = Sidecar(SidecarConfig(run_dir=Path(args.run_dir), heartbeat_s=30.0, job_pid=args.job_pid,
                                    gpu=args.gpu))
    signal.signal(signal.SIGTERM, lambda *_: sidecar.stop())
    sidecar.start()
    try:
        sidecar.serve()
    finally:
        sidecar.close()


def measure(proc: psutil.Process, duration_s: float, warmup_s: float) -> Dict[str, Any]:
    pause = threading.Event()
    pause.wait(warmup_s)
    t0 = time.monotonic()
    c0 = proc.cpu_times()
    rss: List[int] = []
    while time.monotonic() - t0 < duration_s:
        rss.append(proc.memory_info().rss)
        pause.wait(1.0)
    c1 = proc.cpu_times()
    wall = time.monotonic() - t0
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu_s, 3),
        "cpu_pct_of_one_core": round(100.0 * cpu_s / wall, 3),
        "rss_mb_max": round(max(rss) / 1e6, 1),
        "rss_mb_mean": round(sum(rss) / len(rss) / 1e6, 1),
        "threads": proc.num_threads(),
    }


def count_events(run_dir: Path) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for path in sorted((run_dir / "rgt").glob("events*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                kind = json.loads(line)["kind"]
            except (ValueError, KeyError):
                continue
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def run_bench(args: argparse.Namespace) -> Dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rgt-overhead-"))
    run_dir = tmp / "run"
    run_dir.mkdir()
    job = subprocess.Popen([sys.executable, "-c", JOB_CODE], cwd=tmp)
    sidecar: Optional[subprocess.Popen] = None
    try:
        sidecar = subprocess.Popen(
            [sys.executable, __file__, "--child", "--run-dir", str(run_dir), "--job-pid", str(job.pid),
             "--gpu", args.gpu], cwd=REPO)
        result = measure(psutil.Process(sidecar.pid), args.duration, args.warmup)
        job_cpu = psutil.Process(job.pid).cpu_percent(interval=1.0)
    finally:
        if sidecar is not None:
            sidecar.send_signal(signal.SIGTERM)
            sidecar.wait(30)
        for child in psutil.Process(job.pid).children(recursive=True):
            child.kill()
        job.kill()
        job.wait(10)
    result.update({
        "events": count_events(run_dir), "job_cpu_pct": job_cpu, "gpu": args.gpu,
        "duration_s": args.duration, "warmup_s": args.warmup,
        "intervals_s": {"gpu_sample": 2.0, "gpu_report": 30.0, "job_poll": 1.0, "kmsg": 1.0, "disk": 10.0,
                        "heartbeat": 30.0},
        "targets": {"cpu_pct_of_one_core": TARGET_CPU_PCT, "rss_mb": TARGET_RSS_MB},
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
    })
    result["pass"] = (result["cpu_pct_of_one_core"] <= TARGET_CPU_PCT
                      and result["rss_mb_max"] <= TARGET_RSS_MB)
    return result


def print_table(r: Dict[str, Any]) -> None:
    rows = [
        ("metric", "value", "target"),
        ("CPU, % of one core", f"{r['cpu_pct_of_one_core']:.3f}", f"<= {TARGET_CPU_PCT}"),
        ("RSS max, MB", f"{r['rss_mb_max']:.1f}", f"<= {TARGET_RSS_MB:.0f}"),
        ("RSS mean, MB", f"{r['rss_mb_mean']:.1f}", ""),
        ("CPU seconds / wall seconds", f"{r['cpu_s']:.2f} / {r['wall_s']:.0f}", ""),
        ("threads", str(r["threads"]), ""),
        ("events journaled", str(sum(r["events"].values())), ""),
        ("job CPU (the load), %", f"{r['job_cpu_pct']:.0f}", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"result: {'PASS' if r['pass'] else 'OVER TARGET'} ({r['gpu']}, {r['duration_s']:g} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds measured (default 120)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--gpu", default="fake:healthy_h100x8", help="the monitor's gpu setting")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sidecar_overhead.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--job-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return
    result = run_bench(args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
