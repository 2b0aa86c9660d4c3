"""Transport benchmark: publish -> store latency and sustained events/s into SQLite.

A real `rgt-onbox serve` process publishes synthetic events over its ipc
sockets; a Subscriber in this process stores them. Emission starts 1 s after
the sidecar, once the subscriber has connected, so the figures are for the
live path (a catch-up replay after a reconnect is another measurement). Latency is measured from
the event's journal timestamp (taken just before publish) to the moment the
store transaction holding it committed. Prints a table, writes JSON.

    .venv/bin/python bench/transport.py [--events 1000] [--burst 30000]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from controller.follow.subscriber import Subscriber  # noqa: E402
from controller.store.db import Store  # noqa: E402
from protocol import Event  # noqa: E402
from protocol.endpoints import Endpoints  # noqa: E402


def start_sidecar(run_dir: Path, count: int, rate: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "onbox.cli", "serve", "--run-dir", str(run_dir), "--heartbeat", "3600",
         "--synthetic", str(count), "--synthetic-rate", str(rate), "--synthetic-delay", "1.0",
         "--log-level", "warning"],
        cwd=REPO)
    deadline = time.monotonic() + 20
    while not (run_dir / "rgt" / "endpoints.json").exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("sidecar did not start")
        threading.Event().wait(0.02)
    return proc


def follow(run_dir: Path, db: Path, total: int) -> Dict[str, List[float]]:
    """Store `total` events; return per-event latency and (commit time, n) points."""
    latencies: List[float] = []
    commits: List[float] = []
    done = threading.Event()
    stored = [0]

    def hook(events: Sequence[Event]) -> None:
        now = time.time()
        for ev in events:
            if ev.kind == "synthetic.tick":
                latencies.append(now - ev.ts)
        commits.append(time.monotonic())
        stored[0] = events[-1].seq
        if stored[0] >= total:
            done.set()

    with Store.open(db) as store:
        sub = Subscriber(store, Endpoints.read(run_dir / "rgt"), on_events=hook)
        sub.run_until(threading.Event(), until=done.is_set)
    return {"latency_s": latencies, "commit_mono": commits}


def pct(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_phase(tmp: Path, name: str, count: int, rate: float) -> Dict[str, List[float]]:
    run_dir = tmp / name
    proc = start_sidecar(run_dir, count, rate)
    try:
        return follow(run_dir, tmp / f"{name}.db", count)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1000, help="events for the latency phase")
    ap.add_argument("--rate", type=float, default=500.0, help="events/s in the latency phase")
    ap.add_argument("--burst", type=int, default=30000, help="events for the throughput phase")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "transport.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rgt-bench-") as t:
        tmp = Path(t)
        lat = run_phase(tmp, "latency", args.events + 1, args.rate)["latency_s"]
        burst = run_phase(tmp, "burst", args.burst, 0.0)
    commits = burst["commit_mono"]
    elapsed = commits[-1] - commits[0] if len(commits) > 1 else float("nan")
    n_burst = len(burst["latency_s"])
    result = {
        "bench": "transport", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "transport": "ipc (unix sockets), no tunnel",
        "latency_events": len(lat), "latency_rate_hz": args.rate,
        "latency_p50_ms": pct(lat, 50) * 1000, "latency_p99_ms": pct(lat, 99) * 1000,
        "latency_max_ms": max(lat) * 1000, "latency_mean_ms": statistics.fmean(lat) * 1000,
        "burst_events": n_burst, "burst_store_events_per_s": n_burst / elapsed if elapsed else None,
        "targets": {"latency_p99_ms": 5.0, "events_per_s": 5000},
    }
    result["pass"] = (result["latency_p99_ms"] <= 5.0 and (result["burst_store_events_per_s"] or 0) >= 5000)
    rows = [
        ("publish->store p50", f"{result['latency_p50_ms']:.2f} ms", ""),
        ("publish->store p99", f"{result['latency_p99_ms']:.2f} ms", "<= 5 ms"),
        ("publish->store max", f"{result['latency_max_ms']:.2f} ms", ""),
        ("sustained into SQLite", f"{result['burst_store_events_per_s']:.0f} events/s", ">= 5000/s"),
    ]
    print(f"transport bench: {len(lat)} events at {args.rate:g}/s, then a burst of {n_burst}")
    for name, value, target in rows:
        print(f"  {name:<24} {value:>18}   {target}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
