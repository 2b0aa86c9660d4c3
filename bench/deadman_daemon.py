"""The dead-man daemon's cost: CPU and RSS of the real process, per tick, with 0-100 runs to watch.

For each config (runs N x tick), a fresh temp HOME gets N fabricated run directories under a runs
root (run.json, rgt/job.json and rgt/supervisor.json naming this process, a journal, metrics.jsonl,
train.log, checkpoints/; every third run has exited). `python -m onbox.cli deadman arm --ttl 2h`
arms the lease there and starts the daemon. After a short warm-up this process samples the daemon
with psutil over a window: CPU seconds over wall seconds (psutil's cpu_times, and the finer
/proc/PID/schedstat used when readable), ms of CPU per tick (ticks counted as (window - CPU
seconds) / tick), RSS every 0.25 s. With the default tick it then times
`deadman renew --json` end to end (p50/p99); for every config, the time from the start of
`deadman disarm` to the daemon's exit (the daemon sees a disarm at its next tick). The daemon is
ended by its pid (~/.rgt/deadman.pid) at the end, on Ctrl-C and on SIGTERM.

    .venv/bin/python bench/deadman_daemon.py [--seconds 30] [--runs 0,10,100] [--ticks 10,0.5]

Prints a table and writes bench/results/deadman_daemon.json. Nothing is asserted on timings.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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

from onbox.deadman.daemon import TICK_S, daemon_pid  # noqa: E402
from onbox.deadman.lease import paths_for  # noqa: E402
from onbox.runs import ProcRef  # noqa: E402

ONBOX = [sys.executable, "-m", "onbox.cli", "deadman"]


def pct(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def make_runs(root: Path, count: int) -> None:
    """`count` run dirs the way the launcher leaves them; the "job" is this process (alive)."""
    me = ProcRef.of(os.getpid())
    ref = me.to_dict() if me is not None else {"pid": os.getpid()}
    now = time.time()
    for i in range(count):
        run_dir = root / f"proj{i % 3}" / "active" / f"run-{i:04d}"
        (run_dir / "rgt").mkdir(parents=True)
        (run_dir / "checkpoints").mkdir()
        (run_dir / "run.json").write_text(json.dumps({
            "id": run_dir.name, "project": f"proj{i % 3}", "attempt": 1,
            "metrics": str(run_dir / "metrics.jsonl"), "ckpt_dir": str(run_dir / "checkpoints")}))
        job = {"wrapper": ref, "job": ref, "pgid": os.getpgid(0), "attempt": 1}
        (run_dir / "rgt" / "job.json").write_text(json.dumps(job))
        (run_dir / "rgt" / "supervisor.json").write_text(json.dumps({**ref, "sidecar": ref}))
        events = [{"seq": s, "ts": now, "kind": "sidecar.heartbeat", "data": {}} for s in range(1, 51)]
        (run_dir / "rgt" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n"
                                                       for s in range(1, 201)))
        (run_dir / "train.log").write_text("step 200\n")
        if i % 3 == 2:
            (run_dir / "rgt" / "exit.json").write_text(json.dumps({"code": 0, "signal": None}))


def onbox(env: Dict[str, str], *args: str) -> Dict[str, Any]:
    done = subprocess.run([*ONBOX, *args, "--json"], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True)
    doc: Dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return doc


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def on_cpu_s(pid: int) -> Optional[float]:
    """Seconds on a CPU from /proc/PID/schedstat (ns resolution; cpu_times counts 10 ms ticks)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def sample(proc: psutil.Process, seconds: float) -> Dict[str, Any]:
    pause = threading.Event()
    t0 = time.monotonic()
    c0, s0 = proc.cpu_times(), on_cpu_s(proc.pid)
    rss: List[int] = []
    while time.monotonic() - t0 < seconds:
        rss.append(proc.memory_info().rss)
        pause.wait(0.25)
    c1, s1 = proc.cpu_times(), on_cpu_s(proc.pid)
    wall = time.monotonic() - t0
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    sched = None if s0 is None or s1 is None else s1 - s0
    best = cpu_s if sched is None else sched
    return {"wall_s": round(wall, 2), "cpu_s_psutil": round(cpu_s, 3),
            "cpu_s_schedstat": None if sched is None else round(sched, 5), "cpu_s": round(best, 5),
            "cpu_pct": round(100.0 * best / wall, 3),
            "rss_mb_max": round(max(rss) / 1e6, 1), "rss_mb_mean": round(sum(rss) / len(rss) / 1e6, 1)}


def stop_daemon(env: Dict[str, str], home: Path) -> None:
    """Disarm, then end the daemon by its pid if it still runs."""
    pid = daemon_pid(paths_for({"HOME": str(home)}))
    try:
        onbox(env, "disarm")
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    if pid is None:
        return
    try:
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(10)
    except psutil.TimeoutExpired:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


def one_config(runs: int, tick_s: float, args: argparse.Namespace) -> Dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rgt-deadman-bench-"))
    home, root = tmp / "home", tmp / "runs"
    home.mkdir()
    root.mkdir()
    make_runs(root, runs)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO)}
    env.pop("RGT_DEADMAN_TIMESCALE", None)
    env.pop("RGT_DEADMAN_TICK_S", None)
    if tick_s != TICK_S:
        env["RGT_DEADMAN_TICK_S"] = str(tick_s)
    try:
        armed = onbox(env, "arm", "--ttl", "2h", "--root", str(root))
        pid = daemon_pid(paths_for({"HOME": str(home)}))
        if pid is None or pid != armed["daemon"]["pid"]:
            raise RuntimeError(f"no daemon after arm: {armed['daemon']}")
        proc = psutil.Process(pid)
        threading.Event().wait(args.warmup)
        result: Dict[str, Any] = {"runs": runs, "tick_s": tick_s, "pid": pid, **sample(proc, args.seconds)}
        ticks = (result["wall_s"] - result["cpu_s"]) / tick_s  # each period: the wait plus the tick's work
        result["ticks"] = round(ticks, 1)
        result["ms_per_tick"] = round(1000.0 * result["cpu_s"] / ticks, 3) if ticks >= 0.5 else None
        result["threads"] = proc.num_threads()
        if tick_s == TICK_S and args.renews > 0:
            took: List[float] = []
            for _ in range(args.renews):
                t = time.perf_counter()
                doc = onbox(env, "renew")
                took.append(time.perf_counter() - t)
                if doc["daemon"]["pid"] != pid:
                    raise RuntimeError(f"renew found another daemon: {doc['daemon']}")
            result["renew_ms_p50"] = round(1000 * pct(took, 0.5), 1)
            result["renew_ms_p99"] = round(1000 * pct(took, 0.99), 1)
        t = time.perf_counter()
        onbox(env, "disarm")
        answered = time.perf_counter() - t
        deadline = time.monotonic() + tick_s + 30
        while not gone(proc) and time.monotonic() < deadline:
            time.sleep(0.01)  # a benchmark polling another process
        result["disarm_cmd_s"] = round(answered, 3)
        result["disarm_to_exit_s"] = round(time.perf_counter() - t, 3) if gone(proc) else None
        return result
    finally:
        stop_daemon(env, home)
        shutil.rmtree(tmp, ignore_errors=True)


def print_table(rows: List[Dict[str, Any]]) -> None:
    head = ("runs", "tick s", "ticks", "CPU s", "CPU %", "ms/tick", "RSS max MB", "RSS mean MB",
            "renew p50 ms", "renew p99 ms", "disarm->exit s")
    table = [head]
    for r in rows:
        renew = ("-", "-")
        if "renew_ms_p50" in r:
            renew = (f"{r['renew_ms_p50']:.0f}", f"{r['renew_ms_p99']:.0f}")
        leave = "-" if r["disarm_to_exit_s"] is None else f"{r['disarm_to_exit_s']:.2f}"
        per_tick = "-" if r["ms_per_tick"] is None else f"{r['ms_per_tick']:.3f}"
        table.append((str(r["runs"]), f"{r['tick_s']:g}", f"{r['ticks']:.0f}", f"{r['cpu_s']:.4f}",
                      f"{r['cpu_pct']:.3f}", per_tick, f"{r['rss_mb_max']:.1f}",
                      f"{r['rss_mb_mean']:.1f}", *renew, leave))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="measured window per config (default 30)")
    ap.add_argument("--runs", default="0,10,100", help="run directories per config, comma-separated")
    ap.add_argument("--ticks", default=f"{TICK_S:g},0.5", help="tick seconds per config, comma-separated")
    ap.add_argument("--renews", type=int, default=20, help="timed `deadman renew` calls (default tick only)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds between arm and the window")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "deadman_daemon.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the daemon is ended
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    rows: List[Dict[str, Any]] = []
    for runs in [int(x) for x in args.runs.split(",") if x.strip()]:
        for tick_s in [float(x) for x in args.ticks.split(",") if x.strip()]:
            rows.append(one_config(runs, tick_s, args))
            print(f"  measured runs={runs} tick={tick_s:g}s", file=sys.stderr)
    print_table(rows)
    load: Optional[List[float]] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    report = {"configs": rows, "seconds": args.seconds, "warmup_s": args.warmup, "renews": args.renews,
              "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "loadavg_at_end": load}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}; {os.cpu_count()} cpus, load average {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
