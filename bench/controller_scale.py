"""One controller following many runs over many hosts: its CPU, its memory and its wake latency.

A throw-away sshd on 127.0.0.1 plays every box (bench/boxrig.py). Each of --hosts host records is
its own ssh alias of that sshd, so the controller keeps one ControlMaster per host, as it would for
separate boxes, and each host has its own run root. On each host --runs-per-host runs are started
with the real `rgt launch` (the first starts the follower daemon; every later one asks it to
follow its run too); the job is a few lines of pure
Python that appends a metrics line every --step-seconds and sleeps. The sidecars use the fake GPU
(--probe) and the default 30 s heartbeat.

Once every run's job.started is stored and a warm-up passed, one `rgt watch --all --from-now` is
started and, over --window seconds, /proc/PID/stat is read at both ends for every controller-side
process: the follower daemon, the ssh masters and that `rgt watch --all` (utime+stime, plus the
children they reaped, e.g. the daemon's `ssh -O check`). CPU is given in % of one core; RSS and PSS are
averaged over samples. The box side (sidecars, job wrappers, jobs, sshd sessions, dead-man daemon)
is measured the same way for context. Per-thread wake-ups (voluntary context switches) and CPU of
the daemon show which loop costs what.

Then the wake latency at that load: --trials times, a run not used before is picked at random,
`rgt watch RUN --timeout 30s --json` is started, and once it has opened the store and settled, a
NaN line is appended to that run's metrics.jsonl on the box; the time from that write to the
watch's exit (code 10, event train.nonfinite) is one sample. One more trial with
`rgt watch --all --from-now`.

    .venv/bin/python bench/controller_scale.py [--hosts 16] [--runs-per-host 4] [--window 60]
                                               [--trials 30] [--quick]

Prints a table and writes bench/results/controller_scale.json ("quick": true in a --quick smoke run).
Targets (at 256 runs on 32 hosts): the daemon at most 5 % of one core and 150 MB RSS, wake p99
at most 300 ms; the ssh masters (one OpenSSH process per host) are shown beside it. Every process
it started is ended by pid at the end, on Ctrl-C and on SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from boxrig import BoxRig, write_results

TARGET_CPU_PCT = 5.0
TARGET_RSS_MB = 150.0
TARGET_P99_S = 0.3
TICK = os.sysconf("SC_CLK_TCK")

JOB = """import json, os, sys, time
metrics, stop = os.environ['RGT_METRICS'], os.path.join(os.environ['RGT_RUN_DIR'], 'stop')
every, step = float(sys.argv[1]), 0
while not os.path.exists(stop):
    step += 1
    with open(metrics, 'a') as f:
        f.write(json.dumps({'step': step, 'loss': round(3.0 / (1.0 + 0.01 * step), 6)}) + '\\n')
    time.sleep(every)
"""

Groups = Dict[str, List[int]]


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# ---- /proc -------------------------------------------------------------------------


def cpu_ticks(pid: int) -> Optional[Tuple[int, int]]:
    """(utime+stime, cutime+cstime) of pid in clock ticks: its own CPU and that of the children
    it reaped (the daemon's `ssh -O check`); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 2:].split()  # rest[0] is field 3 (state); utime is field 14
    return int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14])


def memory_kb(pid: int) -> Tuple[int, int]:
    """(RSS, PSS) of pid in kB; (0, 0) when it is gone."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return rss, pss


def thread_table(pid: int) -> Dict[int, Tuple[str, int, int]]:
    """tid -> (thread name, ns on a CPU (schedstat), voluntary context switches)."""
    out: Dict[int, Tuple[str, int, int]] = {}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return out
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            on_cpu_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        switches = next((int(line.split()[1]) for line in status.splitlines()
                         if line.startswith("voluntary_ctxt_switches:")), 0)
        out[tid] = (name, on_cpu_ns, switches)
    return out


def measure(groups: Groups, window_s: float, daemon_pid: Optional[int]) -> Dict[str, Any]:
    """CPU (% of one core) and mean RSS/PSS per group over window_s; per-thread use of the daemon."""
    pids = sorted({pid for members in groups.values() for pid in members})
    start = {pid: cpu_ticks(pid) for pid in pids}
    threads0 = thread_table(daemon_pid) if daemon_pid else {}
    samples: Dict[int, List[Tuple[int, int]]] = {pid: [] for pid in pids}
    pause = threading.Event()
    t0 = time.monotonic()
    while True:
        for pid in pids:
            samples[pid].append(memory_kb(pid))
        left = window_s - (time.monotonic() - t0)
        if left <= 0:
            break
        pause.wait(min(left, max(1.0, window_s / 6)))
    wall = time.monotonic() - t0
    end = {pid: cpu_ticks(pid) for pid in pids}
    threads1 = thread_table(daemon_pid) if daemon_pid else {}
    out: Dict[str, Any] = {"wall_s": round(wall, 2), "groups": {}}
    for name, members in groups.items():
        both = [(e[0] - b[0], e[1] - b[1]) for b, e in ((start[p], end[p]) for p in members) if b and e]
        own, reaped = sum(d[0] for d in both), sum(d[1] for d in both)
        mean = [sum(s[i] for s in samples[p]) / max(1, len(samples[p])) for p in members for i in (0, 1)]
        out["groups"][name] = {
            "processes": len(members), "gone": sum(1 for p in members if end[p] is None),
            "cpu_pct": round(100.0 * (own + reaped) / TICK / wall, 2),
            "children_cpu_pct": round(100.0 * reaped / TICK / wall, 2),
            "rss_mb": round(sum(mean[0::2]) / 1024, 1), "pss_mb": round(sum(mean[1::2]) / 1024, 1)}
    out["daemon_threads"] = _thread_rates(daemon_pid, threads0, threads1, wall)
    return out


def _thread_rates(pid: Optional[int], before: Dict[int, Tuple[str, int, int]],
                  after: Dict[int, Tuple[str, int, int]], wall: float) -> List[Dict[str, Any]]:
    rows = []
    for tid, (name, ticks, switches) in sorted(after.items()):
        if tid not in before:
            continue
        if tid == pid:
            name = "main"
        elif name == "python":
            name = "thread"   # Python threads keep the process's comm
        rows.append({"thread": name, "tid": tid,
                     "cpu_pct": round(100.0 * (ticks - before[tid][1]) / 1e9 / wall, 4),
                     "wakeups_per_s": round((switches - before[tid][2]) / wall, 1)})
    return rows


# ---- the processes -------------------------------------------------------------------


def controller_groups(rig: BoxRig, hosts: Sequence[str], watch_all: Optional[int]) -> Groups:
    from controller import paths
    from controller.box.ssh import Ssh
    from controller.follow import client

    os.environ["RGT_HOME"] = str(rig.home)
    config = Path(rig.env["RGT_SSH_CONFIG"])
    daemons = sorted({pid for pid in (client.running_pid(run) for run, _ in rig.runs) if pid})
    masters = [pid for pid in (Ssh(h, control_dir=paths.state_dir() / "ssh", config_file=config).master_pid()
                               for h in hosts) if pid]
    groups: Groups = {"follower daemon": daemons, "ssh masters": masters}
    if watch_all is not None:
        groups["rgt watch --all"] = [watch_all]
    return groups


def box_groups(rig: BoxRig) -> Groups:
    import psutil

    dirs = [str(run_dir) for _, run_dir in rig.runs]
    groups: Groups = {name: [] for name in ("sidecars", "job wrappers", "jobs", "sshd sessions",
                                            "dead-man daemon")}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if not any(d in line for d in dirs):
            continue
        if "onbox.launch.supervise job" in line:
            groups["job wrappers"].append(proc.pid)
            groups["jobs"] += [c.pid for c in proc.children(recursive=True)]
        elif "onbox.launch.supervise sidecar" in line or "onbox.cli serve" in line:
            groups["sidecars"].append(proc.pid)
    if rig.box.proc is not None:
        groups["sshd sessions"] = [p.pid for p in psutil.Process(rig.box.proc.pid).children(recursive=True)]
    daemon = deadman_pid(rig)
    if daemon:
        groups["dead-man daemon"] = [daemon]
    return groups


def deadman_pid(rig: BoxRig) -> Optional[int]:
    """The box's dead-man daemon (one for all the host names: they share the box's HOME)."""
    from onbox.deadman.daemon import daemon_pid
    from onbox.deadman.lease import paths_for

    return daemon_pid(paths_for({"HOME": str(rig.box.home)}))


def end_pid(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM pid (a process this bench started, directly or through rgt) and wait; then SIGKILL."""
    import psutil

    try:
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout_s)
    except psutil.TimeoutExpired:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


# ---- setting up -----------------------------------------------------------------------


def launch_all(rig: BoxRig, hosts: Sequence[str], per_host: int, args: argparse.Namespace) -> float:
    rig.add_hosts(hosts)
    rig.call("policy", "--default", "--flap-window", "0")  # a run picked twice wakes twice
    t0 = time.monotonic()
    for _ in range(per_host):
        for host in hosts:
            rig.launch(sys.executable, "-c", JOB, str(args.step_seconds), host=host,
                       root=rig.box.home / host, onbox_args=(f"--onbox-arg=--probe={args.probe}",))
            print(f"  launched {len(rig.runs)}/{len(hosts) * per_host} "
                  f"({time.monotonic() - t0:.0f}s)", file=sys.stderr)
    for run, _ in rig.runs:
        if not rig.wait_stored(run, "job.started", timeout_s=120):
            raise RuntimeError(f"{run}: no job.started stored within 120 s")
    return time.monotonic() - t0


def start_watch(rig: BoxRig, target: Sequence[str], timeout: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*rig.rgt, "watch", *target, "--timeout", timeout, "--json"], env=rig.env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def wait_open(pid: int, path: Path, timeout_s: float = 60.0) -> Optional[float]:
    """Seconds until process pid holds `path` open (the watch opened the store); None if never."""
    t0 = time.monotonic()
    want = str(path)
    while time.monotonic() - t0 < timeout_s:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                        return time.monotonic() - t0
                except OSError:
                    continue
        except OSError:
            return None
        time.sleep(0.01)  # a benchmark polling another process
    return None


# ---- wake latency ----------------------------------------------------------------------


def time_wake(rig: BoxRig, target: Sequence[str], run: str, settle_s: float, cause: Callable[[], float],
              watches: List[subprocess.Popen[str]]) -> Dict[str, Any]:
    """Start `rgt watch TARGET`; once it opened the store and settled, `cause()` makes RUN's NaN
    happen and says when (time.time()); the time from then to the watch's exit is the sample."""
    watch = start_watch(rig, target, "30s")
    watches.append(watch)
    opened = wait_open(watch.pid, rig.home / "rgt.db")
    time.sleep(settle_s)  # a benchmark, not a test: let the watch reach its polling loop
    t0 = cause()
    try:
        out, _ = watch.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        end_pid(watch.pid)
        out = ""
    latency = time.time() - t0
    watches.remove(watch)
    lines = (out or "").strip().splitlines()
    record: Dict[str, Any] = json.loads(lines[-1]) if lines else {}
    event = record.get("event") or {}
    ok = watch.returncode == 10 and event.get("kind") == "train.nonfinite" and record.get("run") == run
    return {"run": run, "latency_s": round(latency, 4), "exit": watch.returncode, "kind": event.get("kind"),
            "woke_run": record.get("run"), "ok": ok,
            "startup_s": None if opened is None else round(opened, 3)}


def wake_trial(rig: BoxRig, target: Sequence[str], run: str, run_dir: Path, settle_s: float,
               watches: List[subprocess.Popen[str]]) -> Dict[str, Any]:
    """A NaN line appended to RUN's metrics on the box: the sidecar's detection is in the sample."""
    def nan_line() -> float:
        with open(run_dir / "metrics.jsonl", "a") as f:
            t0 = time.time()
            f.write(json.dumps({"loss": "nan"}) + "\n")
        return t0

    return time_wake(rig, target, run, settle_s, nan_line, watches)


def wake_trials(rig: BoxRig, args: argparse.Namespace,
                watches: List[subprocess.Popen[str]]) -> Dict[str, Any]:
    rng = random.Random(args.seed)
    order = list(rig.runs)
    rng.shuffle(order)
    spare, pool = order[0], order[1:]   # the --all trial's run: no NaN before it
    single: List[Dict[str, Any]] = []
    for i in range(args.trials):
        run, run_dir = pool[i % len(pool)]
        single.append(wake_trial(rig, [run], run, run_dir, args.settle, watches))
        print(f"  trial {i + 1}/{args.trials}: {single[-1]['latency_s']:.3f}s exit {single[-1]['exit']}",
              file=sys.stderr)
    every = wake_trial(rig, ["--all", "--from-now"], spare[0], spare[1], args.settle_all, watches)
    print(f"  --all trial: {every['latency_s']:.3f}s exit {every['exit']}", file=sys.stderr)
    lat = [t["latency_s"] for t in single]
    return {"trials": single, "all_trial": every, "ok": sum(t["ok"] for t in single),
            "p50_s": round(pct(lat, 0.5), 4), "p95_s": round(pct(lat, 0.95), 4),
            "p99_s": round(pct(lat, 0.99), 4), "max_s": round(max(lat), 4),
            "watch_startup_p50_s": round(pct([t["startup_s"] or 0 for t in single], 0.5), 3)}


# ---- the report --------------------------------------------------------------------------


def totals(load: Dict[str, Any]) -> Dict[str, float]:
    g = load["groups"]
    core = ("follower daemon", "ssh masters")
    box = ("sidecars", "job wrappers", "jobs", "sshd sessions", "dead-man daemon")
    return {
        "controller_cpu_pct": round(sum(g[k]["cpu_pct"] for k in core + ("rgt watch --all",) if k in g), 2),
        "controller_cpu_pct_no_watch_all": round(sum(g[k]["cpu_pct"] for k in core), 2),
        "controller_rss_mb": round(sum(g[k]["rss_mb"] for k in core + ("rgt watch --all",) if k in g), 1),
        "controller_pss_mb": round(sum(g[k]["pss_mb"] for k in core + ("rgt watch --all",) if k in g), 1),
        "box_cpu_pct": round(sum(g[k]["cpu_pct"] for k in box if k in g), 2),
        "daemon_cpu_pct": g["follower daemon"]["cpu_pct"],
        "daemon_rss_mb": g["follower daemon"]["rss_mb"],
    }


def print_table(report: Dict[str, Any]) -> None:
    load, wake, tot = report["load"], report["wake"], report["totals"]
    print(f"{'process group':<20}{'n':>5}{'CPU % core':>12}{'(children)':>12}{'RSS MB':>10}{'PSS MB':>10}")
    for name, g in load["groups"].items():
        print(f"{name:<20}{g['processes']:>5}{g['cpu_pct']:>12.2f}{g['children_cpu_pct']:>12.2f}"
              f"{g['rss_mb']:>10.1f}{g['pss_mb']:>10.1f}")
    print(f"\nthe daemon's threads over {load['wall_s']:.0f}s: " + ", ".join(
        f"{t['thread']} {t['wakeups_per_s']:.1f}/s {t['cpu_pct']:.3f}%" for t in load["daemon_threads"]))
    print(f"\n{report['runs']} runs on {report['hosts']} hosts; "
          f"box side {tot['box_cpu_pct']:.1f} % of a core")
    print(f"{'':<36}{'target':>10}{'measured':>12}  verdict")
    rows = [
        ("daemon CPU (% of one core)", f"<= {TARGET_CPU_PCT:g}", f"{tot['daemon_cpu_pct']:.2f}",
         report["pass_cpu"]),
        ("daemon RSS (MB)", f"<= {TARGET_RSS_MB:g}", f"{tot['daemon_rss_mb']:.1f}", report["pass_rss"]),
        ("controller CPU, all (% of one core)", "", f"{tot['controller_cpu_pct']:.2f}", None),
        ("  without rgt watch --all", "", f"{tot['controller_cpu_pct_no_watch_all']:.2f}", None),
        ("controller RSS / PSS (MB)", "",
         f"{tot['controller_rss_mb']:.0f}/{tot['controller_pss_mb']:.0f}", None),
        ("wake p50 (s)", "", f"{wake['p50_s']:.3f}", None),
        ("wake p95 (s)", "", f"{wake['p95_s']:.3f}", None),
        ("wake p99 (s)", f"<= {TARGET_P99_S:g}", f"{wake['p99_s']:.3f}", report["pass_p99"]),
        ("wake max (s)", "", f"{wake['max_s']:.3f}", None),
        ("wake, rgt watch --all (s)", "", f"{wake['all_trial']['latency_s']:.3f}", None),
    ]
    for label, target, value, verdict in rows:
        mark = "" if verdict is None else ("pass" if verdict else "FAIL")
        print(f"{label:<36}{target:>10}{value:>12}  {mark}")
    print(f"wake trials ok (exit 10, train.nonfinite, right run): {wake['ok']}/{len(wake['trials'])}; "
          f"--all trial ok: {wake['all_trial']['ok']}")


def run_bench(rig: BoxRig, args: argparse.Namespace, hosts: Sequence[str],
              watches: List[subprocess.Popen[str]]) -> Dict[str, Any]:
    setup_s = launch_all(rig, hosts, args.runs_per_host, args)
    watch_all = start_watch(rig, ["--all", "--from-now"], f"{int(args.warmup + args.window + 300)}s")
    watches.append(watch_all)
    wait_open(watch_all.pid, rig.home / "rgt.db")
    print(f"  {len(rig.runs)} runs attached after {setup_s:.0f}s; warm-up {args.warmup:g}s, "
          f"window {args.window:g}s", file=sys.stderr)
    time.sleep(args.warmup)  # a benchmark: let the watch --all and the daemon reach their steady state
    groups = {**controller_groups(rig, hosts, watch_all.pid), **box_groups(rig)}
    daemons = groups["follower daemon"]
    load = measure(groups, args.window, daemons[0] if daemons else None)
    watch_all_exit = watch_all.poll()  # None: nothing material woke it during the window
    end_popen(watch_all)
    watches.remove(watch_all)
    wake = wake_trials(rig, args, watches)
    tot = totals(load)
    load_avg: Optional[List[float]] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "quick": args.quick, "hosts": len(hosts), "runs_per_host": args.runs_per_host, "runs": len(rig.runs),
        "transport": "one loopback sshd, one ssh alias (ControlMaster) and run root per host",
        "probe": args.probe, "step_seconds": args.step_seconds, "setup_s": round(setup_s, 1),
        "warmup_s": args.warmup, "window_s": args.window, "watch_all_exit_in_window": watch_all_exit,
        "load": load, "totals": tot, "wake": wake,
        "targets": {"daemon_cpu_pct": TARGET_CPU_PCT, "daemon_rss_mb": TARGET_RSS_MB,
                    "wake_p99_s": TARGET_P99_S},
        "daemon_pids": daemons,
        "pass_cpu": tot["daemon_cpu_pct"] <= TARGET_CPU_PCT,
        "pass_rss": tot["daemon_rss_mb"] <= TARGET_RSS_MB,
        "pass_p99": wake["p99_s"] <= TARGET_P99_S,
        "python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_at_end": load_avg,
    }


def end_popen(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def leftovers(rig: BoxRig, hosts: Sequence[str]) -> List[Any]:
    """The ssh masters and the box's dead-man daemon (started through rgt, no children of ours)."""
    import psutil

    pids = controller_groups(rig, hosts, None)["ssh masters"]
    daemon = deadman_pid(rig)
    out = []
    for pid in pids + ([daemon] if daemon else []):
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--runs-per-host", type=int, default=4)
    ap.add_argument("--window", type=float, default=60.0, help="measured seconds (default 60)")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds between attach and the window")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds from a watch's store open to the NaN")
    ap.add_argument("--settle-all", type=float, default=3.0, help="the same for the rgt watch --all trial")
    ap.add_argument("--step-seconds", type=float, default=1.5, help="the job's seconds between metrics lines")
    ap.add_argument("--probe", default="fake:healthy_h100x8", help="the sidecars' GPU (fake:SCENARIO|none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 hosts x 2 runs, 10 s window, 3 trials")
    args = ap.parse_args(argv)
    if args.quick:
        args.hosts, args.runs_per_host, args.window, args.warmup, args.trials = 2, 2, 10.0, 3.0, 3
    if args.hosts < 1 or args.runs_per_host < 1 or args.hosts * args.runs_per_host < 2 or args.trials < 1:
        ap.error("need at least 2 runs and 1 trial")
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    hosts = [f"h{i:02d}" for i in range(args.hosts)]
    watches: List[subprocess.Popen[str]] = []
    stray: List[Any] = []
    with BoxRig() as rig:  # SIGTERM -> exit 143 -> everything below unwinds
        try:
            report = run_bench(rig, args, hosts, watches)
        finally:
            for proc in list(watches):
                end_popen(proc)
            stray = leftovers(rig, hosts)
            for _, run_dir in rig.runs:  # every job ends now; the rig then waits for each
                try:
                    (run_dir / "stop").write_text("")
                except OSError:
                    pass
    for proc in stray:  # the box is gone: what still runs is ours to end
        if proc.is_running():
            end_pid(proc.pid)
    print_table(report)
    path = write_results("controller_scale", report)
    print(f"wrote {path}")
    return 0 if report["pass_cpu"] and report["pass_rss"] and report["pass_p99"] else 1


if __name__ == "__main__":
    sys.exit(main())
