"""The follower daemon at scale: its CPU, its memory and the wake latency at 256 runs on 32 hosts.

bench/controller_scale.py measures the daemon against real sidecars launched with `rgt launch`,
which this 2-core machine holds up to about 64 (each real sidecar costs the box 0.75 % of a core).
Here one light process (bench/fleet.py) serves --runs-per-host runs for each of --hosts hosts,
each with a sidecar's sockets, journal and protocol, publishing what a training run's sidecar
publishes at rest (a heartbeat every 30 s, a train.progress every 5 s). Everything on the
controller's side is the real thing: one ssh alias (so one ControlMaster) per host of a
throw-away sshd on 127.0.0.1, two unix-socket forwards per run, the real follower daemon
(started by the first follow, as `rgt launch` starts it) and the real `rgt watch`.

Over --window seconds /proc is read for the daemon and the ssh masters (CPU as % of one core,
RSS and PSS). Then the wake latency: --trials times a run is picked at random, `rgt watch RUN
--timeout 30s --json` is started, and once it has opened the store and settled, the fleet is told
to publish a train.nonfinite for that run; the time from that publish to the watch's exit (10)
is one sample: the tunnel, the daemon, the store and the watch, without a sidecar's own
detection delay (its metrics tail runs every 0.25 s; bench/controller_scale.py includes it).

    .venv/bin/python bench/daemon_scale.py [--hosts 32] [--runs-per-host 8] [--window 60]
                                           [--trials 30] [--quick]

Prints a table and writes bench/results/daemon_scale.json. Targets: the daemon at most 5 % of
one core and 150 MB RSS at 256 runs, wake p99 at most 300 ms. Every process it started is ended
by pid at the end.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from boxrig import BoxRig, write_results
from controller_scale import end_popen, measure, pct, time_wake

TARGET_CPU_PCT = 5.0
TARGET_RSS_MB = 150.0
TARGET_P99_S = 0.3


def start_fleet(rig: BoxRig, hosts: Sequence[str], per_host: int) -> subprocess.Popen[str]:
    runs = [{"run": f"fleet-{h}-{i}", "host": h, "run_dir": str(rig.box.home / h / "fleet" / "active" /
                                                                   f"fleet-{h}-{i}")}
            for i in range(per_host) for h in hosts]
    spec = rig.root / "fleet.json"
    spec.write_text(json.dumps({"runs": runs, "trigger": str(rig.root / "fleet.trigger")}))
    fleet = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fleet.py")), str(spec)],
                             stdout=subprocess.PIPE, text=True)
    assert fleet.stdout is not None and fleet.stdout.readline().strip() == "ready", "the fleet did not start"
    return fleet


def follow_all(rig: BoxRig, hosts: Sequence[str], per_host: int) -> List[str]:
    from controller.follow import client
    from controller.store.db import Store

    os.environ["RGT_HOME"] = str(rig.home)
    os.environ["RGT_SSH_CONFIG"] = rig.env["RGT_SSH_CONFIG"]   # the daemon started here inherits it
    runs: List[str] = []
    with Store.open() as store:
        for i in range(per_host):
            for h in hosts:
                run = f"fleet-{h}-{i}"
                run_dir = rig.box.home / h / "fleet" / "active" / run
                store.upsert_run(run, host="", target=h, run_dir=str(run_dir))
                client.follow(store, run)
                runs.append(run)
    for run in runs:
        if not rig.wait_stored(run, "job.started", timeout_s=120):
            log = (rig.home / "daemon.log").read_text()[-3000:]
            raise RuntimeError(f"{run}: no job.started stored within 120 s; the daemon's log ends:\n{log}")
    return runs


def trigger(rig: BoxRig, run: str) -> float:
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(f"ipc://{rig.root / 'fleet.trigger'}")
    t0 = time.time()
    push.send_string(run)
    push.close()
    ctx.term()
    return t0


def run_bench(rig: BoxRig, args: argparse.Namespace, watches: List[subprocess.Popen[str]],
              fleet_box: List[subprocess.Popen[str]]) -> Dict[str, Any]:
    from controller import paths
    from controller.box.ssh import Ssh
    from controller.follow import client

    hosts = [f"h{i:02d}" for i in range(args.hosts)]
    rig.add_hosts(hosts)
    rig.call("policy", "--default", "--flap-window", "0")
    fleet_box.append(start_fleet(rig, hosts, args.runs_per_host))
    t0 = time.monotonic()
    runs = follow_all(rig, hosts, args.runs_per_host)
    setup_s = time.monotonic() - t0
    print(f"  {len(runs)} runs followed after {setup_s:.0f}s; warm-up {args.warmup:g}s, "
          f"window {args.window:g}s", file=sys.stderr)
    time.sleep(args.warmup)  # a benchmark: let the daemon reach its steady state
    daemon = client.daemon_pid()
    config = Path(rig.env["RGT_SSH_CONFIG"])
    masters = [pid for pid in (Ssh(h, control_dir=paths.state_dir() / "ssh", config_file=config).master_pid()
                               for h in hosts) if pid]
    load = measure({"follower daemon": [daemon] if daemon else [], "ssh masters": masters,
                    "fleet (box side)": [fleet_box[0].pid]}, args.window, daemon)
    order = list(runs)
    random.Random(args.seed).shuffle(order)   # a run woken once is not woken by its next NaN: new runs
    trials = []
    for i in range(args.trials):
        run = order[i % len(order)]
        trials.append(time_wake(rig, [run], run, args.settle, functools.partial(trigger, rig, run), watches))
        print(f"  trial {i + 1}/{args.trials}: {trials[-1]['latency_s']:.3f}s exit {trials[-1]['exit']}",
              file=sys.stderr)
    lat = [t["latency_s"] for t in trials]
    g = load["groups"]
    return {
        "quick": args.quick, "hosts": len(hosts), "runs_per_host": args.runs_per_host, "runs": len(runs),
        "setup_s": round(setup_s, 1), "window_s": args.window, "load": load,
        "daemon_cpu_pct": g["follower daemon"]["cpu_pct"], "daemon_rss_mb": g["follower daemon"]["rss_mb"],
        "daemon_pss_mb": g["follower daemon"]["pss_mb"],
        "ssh_masters_cpu_pct": g["ssh masters"]["cpu_pct"], "ssh_masters_rss_mb": g["ssh masters"]["rss_mb"],
        "wake": {"trials": trials, "ok": sum(t["ok"] for t in trials), "p50_s": round(pct(lat, 0.5), 4),
                 "p95_s": round(pct(lat, 0.95), 4), "p99_s": round(pct(lat, 0.99), 4),
                 "max_s": round(max(lat), 4)},
        "targets": {"daemon_cpu_pct": TARGET_CPU_PCT, "daemon_rss_mb": TARGET_RSS_MB,
                    "wake_p99_s": TARGET_P99_S},
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "loadavg_at_end": list(os.getloadavg()),
    }


def print_table(r: Dict[str, Any]) -> None:
    print(f"{'process group':<20}{'n':>5}{'CPU % core':>12}{'RSS MB':>10}{'PSS MB':>10}")
    for name, g in r["load"]["groups"].items():
        print(f"{name:<20}{g['processes']:>5}{g['cpu_pct']:>12.2f}{g['rss_mb']:>10.1f}{g['pss_mb']:>10.1f}")
    print("\nthe daemon's threads: " + ", ".join(
        f"{t['thread']} {t['wakeups_per_s']:.1f}/s {t['cpu_pct']:.3f}%" for t in r["load"]["daemon_threads"]))
    w = r["wake"]
    rows = [("daemon CPU (% of one core)", f"<= {TARGET_CPU_PCT:g}", f"{r['daemon_cpu_pct']:.2f}",
             r["daemon_cpu_pct"] <= TARGET_CPU_PCT),
            ("daemon RSS (MB)", f"<= {TARGET_RSS_MB:g}", f"{r['daemon_rss_mb']:.1f}",
             r["daemon_rss_mb"] <= TARGET_RSS_MB),
            ("wake p50 (s)", "", f"{w['p50_s']:.3f}", None),
            ("wake p95 (s)", "", f"{w['p95_s']:.3f}", None),
            ("wake p99 (s)", f"<= {TARGET_P99_S:g}", f"{w['p99_s']:.3f}", w["p99_s"] <= TARGET_P99_S),
            ("wake max (s)", "", f"{w['max_s']:.3f}", None)]
    print(f"\n{r['runs']} runs on {r['hosts']} hosts")
    for label, target, value, verdict in rows:
        mark = "" if verdict is None else ("pass" if verdict else "FAIL")
        print(f"{label:<32}{target:>10}{value:>12}  {mark}")
    print(f"wake trials ok (exit 10, train.nonfinite, right run): {w['ok']}/{len(w['trials'])}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--runs-per-host", type=int, default=8)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds from a watch's store open to the NaN")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 hosts x 2 runs, 10 s window, 3 trials")
    args = ap.parse_args(argv)
    if args.quick:
        args.hosts, args.runs_per_host, args.window, args.warmup, args.trials = 2, 2, 10.0, 3.0, 3
    return args


def main() -> int:
    args = parse_args()
    watches: List[subprocess.Popen[str]] = []
    fleet_box: List[subprocess.Popen[str]] = []
    with BoxRig() as rig:
        try:
            report = run_bench(rig, args, watches, fleet_box)
        finally:
            for proc in watches + fleet_box:
                end_popen(proc)
            from controller import paths
            from controller.box.ssh import Ssh
            from controller.follow import client

            os.environ["RGT_HOME"] = str(rig.home)
            client.stop_daemon()
            config = Path(rig.env["RGT_SSH_CONFIG"])
            for i in range(args.hosts):
                Ssh(f"h{i:02d}", control_dir=paths.state_dir() / "ssh", config_file=config).stop_master()
    print_table(report)
    path = write_results("daemon_scale", report)
    print(f"wrote {path}")
    ok = (report["daemon_cpu_pct"] <= TARGET_CPU_PCT and report["daemon_rss_mb"] <= TARGET_RSS_MB
          and report["wake"]["p99_s"] <= TARGET_P99_S)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
