"""Does `rgt watch` stay quiet on healthy noisy runs, and wake on every real fault? A soak.

N healthy runs (default 8) train a tiny CPU torch model for --minutes (default 30) with the
noise a real run has: eval pauses (no progress for 5-12 s; the stall floor is 20 s), checkpoint
bursts (three saves back to back, the oldest rotated away by the job), a flapping thermal throttle
from the fake GPU (onbox/sources/fake_gpu.py, thermal_throttle_flapping_long: it flaps for 40
minutes, each episode shorter than the detector's 10 s onset), two link flaps, and dead-man
renewals that always come late (four times the watcher's cadence, on the box's compressed clock,
yet before the T-30 warning: a lease that reaches its warning is material and wakes once per
lease, which the normal-lives suite asserts). Beside them, one extra run per planted fault: a NaN,
an OOM (in a 256 MiB memory cgroup; skipped without one), a stall (the job stops making progress)
and a crash (exit 3), each some way into the soak.

A watcher loop per run calls `rgt watch RUN --json --timeout 60s` again and again, as an agent
would, until the run has ended. An exit 10 on a healthy run is a false wake (target: 0 per
run-hour); a fault run is woken when a watch exits 10 on its fault's kind (target: 100 %).

    .venv/bin/python bench/wake_soak.py [--runs 8] [--minutes 30] [--host local|sshd] [--out FILE]

Host `local` (the default) runs everything on this machine under a throw-away HOME; a link flap
there ends every healthy run's background watcher (the laptop side of the link goes, as when a
laptop sleeps) and `rgt watch` starts it again. With --host sshd the box is the test sshd
(bench/boxrig.py) and a flap stops sshd until each run's watcher recorded link.lost.
Prints a table and writes bench/results/wake_soak.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from boxrig import REPO, BoxRig, write_results

SCALE = 120.0          # the box's dead-man clock: one real second is two box minutes (1 h lease = 30 s)
RENEW_LATE_S = 10.0    # 4x the watcher's cadence (2.5 s at this scale), before the T-30 warning (15 s)
WATCH_TIMEOUT = "60s"
FAULTS = {"nan": ("train.nonfinite",), "oom": ("job.exited", "mem.pressure"), "stall": ("job.stalled",),
          "crash": ("job.exited",)}
ONBOX = ["--onbox-arg=--no-preflight", "--onbox-arg=--sidecar-linger=0s", "--onbox-arg=--serve-arg=--no-kmsg",
         "--onbox-arg=--serve-arg=--heartbeat=5", "--onbox-arg=--stall-floor=20",
         "--onbox-arg=--stall-grace=60", "--onbox-arg=--probe=fake:thermal_throttle_flapping_long",
         "--onbox-arg=--deadman=1h"]

# The job: a tiny CPU torch model, metrics to $RGT_METRICS, atomic checkpoints to $RGT_CKPT_DIR; it
# ends cleanly once $RGT_RUN_DIR/stop exists. Noise and faults by flag (times from its own start).
JOB = r'''
import argparse, json, math, os, random, sys, time
from pathlib import Path
import torch
ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--step-s", type=float, default=0.1)
ap.add_argument("--eval-every-s", type=float, default=0.0)
ap.add_argument("--burst-every-s", type=float, default=0.0)
ap.add_argument("--fault", default="")
ap.add_argument("--fault-at-s", type=float, default=0.0)
ap.add_argument("--cgroup", default="")
a = ap.parse_args()
rng = random.Random(a.seed)
torch.manual_seed(a.seed)
run_dir = Path(os.environ["RGT_RUN_DIR"])
metrics = Path(os.environ.get("RGT_METRICS", "metrics.jsonl"))
ckpts = Path(os.environ.get("RGT_CKPT_DIR", "checkpoints"))
ckpts.mkdir(parents=True, exist_ok=True)
model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.linspace(-1, 1, 256).unsqueeze(1)
y = 3 * x - 1
def log(row):
    with open(metrics, "a") as f:
        f.write(json.dumps(row) + "\n")
def save(name, step):
    path = ckpts / name
    with open(str(path) + ".tmp", "wb") as f:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(str(path) + ".tmp", path)
    saved = sorted(ckpts.glob("*.pt"), key=lambda p: p.stat().st_mtime)
    for old in saved[:-4]:            # the job's own rotation (save_total_limit)
        old.unlink()
t0 = time.time()
next_eval = t0 + a.eval_every_s * rng.uniform(0.5, 1.0) if a.eval_every_s else math.inf
next_burst = t0 + a.burst_every_s * rng.uniform(0.3, 1.0) if a.burst_every_s else math.inf
step, nan, held = 0, False, []
while not (run_dir / "stop").exists():
    step += 1
    now = time.time()
    if a.fault and now - t0 >= a.fault_at_s:
        if a.fault == "nan":
            nan = True
        elif a.fault == "crash":
            print(f"injected crash at step {step}", flush=True)
            sys.exit(3)
        elif a.fault == "stall":
            print(f"injected stall at step {step}", flush=True)
            while not (run_dir / "stop").exists():
                time.sleep(0.5)
            sys.exit(0)
        elif a.fault == "oom":
            print(f"injected OOM at step {step}", flush=True)
            with open(os.path.join(a.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            while True:
                held.append(b"m" * (8 << 20))
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    if nan:
        loss = loss * float("nan")
    loss.backward()
    opt.step()
    if step % 5 == 0:
        value = loss.item()
        log({"step": step, "loss": value if value == value else "nan"})
        print(f"step={step} loss={value:.6f}", flush=True)
    if step % 100 == 0:
        save(f"step{step:07d}.pt", step)
    if now >= next_burst:                 # a checkpoint burst: three saves back to back
        for k in range(3):
            save(f"step{step:07d}-{k}.pt", step)
        next_burst = now + a.burst_every_s * rng.uniform(0.7, 1.3)
    if now >= next_eval:                  # an eval pause: no training progress for a while
        pause = rng.uniform(5.0, 12.0)
        print(f"eval at step {step} ({pause:.1f} s)", flush=True)
        time.sleep(pause)
        log({"step": step, "eval_loss": float(loss.item()) if not nan else "nan"})
        next_eval = time.time() + a.eval_every_s * rng.uniform(0.7, 1.3)
    time.sleep(a.step_s)
print("done", flush=True)
'''


class Rig:
    """Host `local` under a throw-away HOME and RGT_HOME (the dead-man, ~/.rgt, all in it)."""

    host = "local"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.box_home = root / "home"
        self.box_home.mkdir(parents=True)
        self.runs_root = root / "runs"
        self.env = {**os.environ, "HOME": str(self.box_home), "RGT_HOME": str(root / "rgt-home"),
                    "PYTHONPATH": str(REPO), "RGT_DEADMAN_TIMESCALE": f"{SCALE:g}",
                    "RGT_DEADMAN_TICK_S": "0.5", "RGT_DEADMAN_RENEW_S": "1000000"}
        self.rgt = [sys.executable, "-m", "controller.cli.main"]
        self.boxrig: Optional[BoxRig] = None

    def call(self, *args: str, check: bool = True,
             timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.rgt, *args], env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout_s, cwd=REPO)

    def flap(self, runs: List[str]) -> None:
        """The laptop side of the link goes: end each run's background watcher (by the pid its lock
        names); the next `rgt watch` starts it again."""
        os.environ["RGT_HOME"] = self.env["RGT_HOME"]
        from controller.follow import client

        for run in runs:
            client.unfollow(run)


class SshRig(Rig):
    """The test sshd as host `box` (bench/boxrig.py), its dead-man on the compressed clock."""

    host = "box"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.boxrig = BoxRig()
        self.boxrig.box.env.update({"RGT_DEADMAN_TIMESCALE": f"{SCALE:g}", "RGT_DEADMAN_TICK_S": "0.5"})
        self.boxrig.__enter__()
        self.box_home = self.boxrig.box.home
        self.runs_root = self.box_home / "runs"
        self.env = {**self.boxrig.env, "RGT_DEADMAN_RENEW_S": "1000000"}

    def flap(self, runs: List[str]) -> None:
        """sshd goes until every run's watcher recorded link.lost, then comes back."""
        assert self.boxrig is not None
        box = self.boxrig.box
        before = {run: _count_local(self, run, "link.lost") for run in runs}
        box.stop()
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(_count_local(self, r, "link.lost") <= before[r]
                                                      for r in runs):
                time.sleep(0.2)
        finally:
            box.start()


def _count_local(rig: Rig, run: str, kind: str) -> int:
    os.environ["RGT_HOME"] = rig.env["RGT_HOME"]
    from controller.store.db import Store

    with Store.open() as store:
        return len(store.local_events(run, kind_prefix=kind))


class Loop(threading.Thread):
    """`rgt watch RUN --json` again and again until the run has ended; every line kept."""

    def __init__(self, rig: Rig, run: str) -> None:
        super().__init__(name=f"watch-{run}", daemon=True)
        self.rig, self.run_id = rig, run
        self.records: List[Dict[str, Any]] = []
        self.ended = False
        self.proc: Optional[subprocess.Popen[str]] = None

    def run(self) -> None:
        while not self.ended:
            argv = [*self.rig.rgt, "watch", self.run_id, "--timeout", WATCH_TIMEOUT, "--json"]
            self.proc = subprocess.Popen(argv, env=self.rig.env, cwd=REPO, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
            out, _ = self.proc.communicate()
            lines = [ln for ln in out.splitlines() if ln.strip().startswith("{")]
            record: Dict[str, Any] = json.loads(lines[-1]) if lines else {"exit": self.proc.returncode}
            record["exit"] = self.proc.returncode
            record["at"] = time.time()
            self.records.append(record)
            code = self.proc.returncode
            if code == 0 or (code == 10 and record.get("already_reported")):
                self.ended = True    # the run has ended: cleanly, stopped, or badly and told before
            elif code not in (3, 4, 10):
                time.sleep(1.0)      # rgt itself failed (1, 2): kept in the record, and on

    def kill(self) -> None:
        self.ended = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def _kind(record: Dict[str, Any]) -> Optional[str]:
    event = record.get("event")
    return event.get("kind") if isinstance(event, dict) else None


def launch(rig: Rig, job: Path, *args: str) -> Dict[str, Any]:
    out = rig.call("launch", rig.host, "--root", str(rig.runs_root), "--json", *ONBOX, "--",
                   sys.executable, str(job), *args)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def renew_late(rig: Rig, stop: threading.Event, log: List[float]) -> None:
    """Renew every RENEW_LATE_S from the start of the last renewal (a slow call on a loaded box does
    not push the next one past the warning)."""
    due = time.monotonic() + RENEW_LATE_S
    while not stop.wait(max(0.0, due - time.monotonic())):
        due += RENEW_LATE_S
        if rig.call("deadman", rig.host, "renew", "--json", check=False, timeout_s=60).returncode == 0:
            log.append(time.time())


def memory_cgroup() -> Optional[Path]:
    from tests.e2e.cgroups import limit_memory, memory_cgroup_base

    base = memory_cgroup_base()
    if base is None:
        return None
    cg = base / f"rgt-soak-{os.getpid()}"
    cg.mkdir()
    limit_memory(cg)
    return cg


def end_runs(rig: Rig, runs: List[Dict[str, Any]]) -> None:
    """Every run's job, supervisor and sidecar, and every background watcher, ended by pid."""
    os.environ["RGT_HOME"] = rig.env["RGT_HOME"]
    from controller.follow import client
    from onbox.runs import ProcRef, end_process, read_json, run_status, wait_for
    from onbox.stop import stop_run

    for answer in runs:
        run_dir = Path(answer["run_dir"])
        (run_dir / "stop").write_text("")
        if run_status(run_dir).state in ("running", "stopping") and not wait_for(
                lambda d=run_dir: run_status(d).state not in ("running", "stopping"), 20.0):
            stop_run(run_dir, 5.0)
        sup = read_json(run_dir / "rgt" / "supervisor.json") or {}
        for ref in (ProcRef.from_dict(sup), ProcRef.from_dict(sup.get("sidecar"))):
            if ref is not None and not wait_for(lambda r=ref: not r.alive(), 15.0):
                end_process(ref, 5.0)
        client.unfollow(str(answer["run_id"]))
    client.stop_daemon()


def end_deadman(rig: Rig) -> None:
    from onbox.deadman import daemon, lease
    from onbox.runs import wait_for

    rig.call("deadman", rig.host, "disarm", "--json", check=False, timeout_s=60)
    paths = lease.paths_for({"HOME": str(rig.box_home)})
    pid = daemon.daemon_pid(paths)
    if pid is not None and not wait_for(lambda: daemon.daemon_pid(paths) is None, 15.0):
        os.kill(pid, 15)   # the daemon this bench's launches started, by its pid
        wait_for(lambda: daemon.daemon_pid(paths) is None, 10.0)


NOISE = ("gpu.sample", "gpu.throttle", "ckpt.saved", "ckpt.removed", "deadman.expiring", "link.lost",
         "link.restored", "train.progress")


def noise_of(rig: Rig, runs: List[str]) -> Dict[str, Dict[str, int]]:
    """How much of each kind of noise every run's store holds: proof the noise was there."""
    os.environ["RGT_HOME"] = rig.env["RGT_HOME"]
    from controller.store.db import Store

    out: Dict[str, Dict[str, int]] = {}
    with Store.open() as store:
        for run in runs:
            kinds = collections.Counter(e.kind for e in store.events(run))
            kinds.update(e.kind for e in store.local_events(run))
            out[run] = {k: kinds[k] for k in NOISE}
    return out


def summarize(loops: Dict[str, Loop], roles: Dict[str, str], fault_at: Dict[str, float],
              hours: float, noise: Dict[str, Dict[str, int]]) -> Dict[str, Any]:
    rows: List[Dict[str, Any]] = []
    false_wakes = 0
    false_kinds: collections.Counter[str] = collections.Counter()
    woken = 0
    faults = 0
    for run, loop in loops.items():
        role = roles[run]
        exits = collections.Counter(str(r["exit"]) for r in loop.records)
        wakes = [r for r in loop.records if r["exit"] == 10 and not r.get("already_reported")]
        row: Dict[str, Any] = {"run": run, "role": role, "watches": len(loop.records), "exits": dict(exits),
                               "wakes": [_kind(r) for r in wakes], "noise": noise.get(run, {})}
        if role == "healthy":
            false_wakes += len(wakes)
            false_kinds.update(str(_kind(r)) for r in wakes)
            row["false_wakes"] = len(wakes)
        else:
            fault = role.split(":", 1)[1]
            faults += 1
            hit = [r for r in wakes if _kind(r) in FAULTS[fault] and r["at"] >= fault_at[run]]
            row["woken"] = bool(hit)
            row["latency_s"] = round(hit[0]["at"] - fault_at[run], 1) if hit else None
            row["other_wakes"] = [_kind(r) for r in wakes if r not in hit]
            woken += bool(hit)
        rows.append(row)
    healthy = sum(1 for r in roles.values() if r == "healthy")
    run_hours = healthy * hours
    return {"healthy_runs": healthy, "run_hours": round(run_hours, 3), "false_wakes": false_wakes,
            "false_wakes_per_run_hour": round(false_wakes / run_hours, 2) if run_hours else None,
            "false_wake_kinds": dict(false_kinds), "faults_planted": faults, "faults_woken": woken,
            "faults_woken_pct": round(100.0 * woken / faults, 1) if faults else None, "runs": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8, help="healthy noisy runs")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--host", choices=("local", "sshd"), default="local")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/wake_soak.json")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    duration = args.minutes * 60.0
    root = Path(tempfile.mkdtemp(prefix="rgtsoak-", dir="/tmp"))
    rig: Rig = SshRig(root) if args.host == "sshd" else Rig(root)
    job = root / "soak_job.py"
    job.write_text(JOB)
    cgroup = memory_cgroup()
    stop = threading.Event()
    runs: List[Dict[str, Any]] = []
    roles: Dict[str, str] = {}
    fault_at: Dict[str, float] = {}
    loops: Dict[str, Loop] = {}
    renewals: List[float] = []
    flaps: List[float] = []
    started = time.time()
    elapsed = 0.0
    noise: Dict[str, Dict[str, int]] = {}
    try:
        for i in range(args.runs):
            a = launch(rig, job, "--seed", str(i), "--eval-every-s", f"{rng.uniform(40, 70):.0f}",
                       "--burst-every-s", f"{rng.uniform(30, 50):.0f}")
            runs.append(a)
            roles[a["run_id"]] = "healthy"
        for k, fault in enumerate(FAULTS):
            if fault == "oom" and cgroup is None:
                print("oom: skipped (no writable memory cgroup here)", file=sys.stderr)
                continue
            at = duration * (0.25 + 0.1 * k)
            extra = ["--cgroup", str(cgroup)] if fault == "oom" else []
            before = time.time()          # the job starts after this: its fault comes after before + at
            a = launch(rig, job, "--seed", str(100 + k), "--fault", fault, "--fault-at-s", f"{at:.1f}",
                       *extra)
            runs.append(a)
            roles[a["run_id"]] = f"fault:{fault}"
            fault_at[a["run_id"]] = before + at
        started = time.time()            # the soak's clock starts once every run is launched
        for a in runs:
            loops[a["run_id"]] = Loop(rig, a["run_id"])
            loops[a["run_id"]].start()
        renewer = threading.Thread(target=renew_late, args=(rig, stop, renewals), name="renew-late",
                                   daemon=True)
        renewer.start()
        healthy = [a["run_id"] for a in runs if roles[a["run_id"]] == "healthy"]
        for share in (0.35, 0.7):          # two link flaps
            wait = started + duration * share - time.time()
            if wait > 0:
                time.sleep(wait)
            rig.flap(healthy)
            flaps.append(time.time())
        wait = started + duration - time.time()
        if wait > 0:
            time.sleep(wait)
        stop.set()
        for a in runs:                     # the soak is over: every run ends cleanly (the stall too)
            (Path(a["run_dir"]) / "stop").write_text("")
        deadline = time.monotonic() + 180
        for loop in loops.values():
            loop.join(max(1.0, deadline - time.monotonic()))
        elapsed = time.time() - started
        noise = noise_of(rig, list(loops))
    finally:
        stop.set()
        for loop in loops.values():
            loop.kill()
            loop.join(10)
        end_runs(rig, runs)
        end_deadman(rig)
        if rig.boxrig is not None:
            rig.boxrig.runs = [(a["run_id"], Path(a["run_dir"])) for a in runs]
            rig.boxrig.__exit__(None, None, None)
        if cgroup is not None:
            try:
                cgroup.rmdir()
            except OSError as e:
                print(f"could not remove {cgroup}: {e}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
    report = summarize(loops, roles, fault_at, duration / 3600.0, noise)
    report.update({"minutes": args.minutes, "host": args.host, "elapsed_s": round(elapsed, 1),
                   "late_renewals": len(renewals), "link_flaps": len(flaps), "dead_man_scale": SCALE})
    print(f"{'run':<28}{'role':<14}{'watches':>8}  exits            wakes")
    for row in report["runs"]:
        exits = ",".join(f"{k}x{v}" for k, v in sorted(row["exits"].items()))
        wakes = ", ".join(map(str, row["wakes"]))
        print(f"{row['run']:<28}{row['role']:<14}{row['watches']:>8}  {exits:<16} {wakes}")
    healthy_noise: collections.Counter[str] = collections.Counter()
    for row in report["runs"]:
        if row["role"] == "healthy":
            healthy_noise.update(row["noise"])
    report["healthy_noise"] = dict(healthy_noise)
    print("noise on the healthy runs: " + ", ".join(f"{k} {v}" for k, v in healthy_noise.items()))
    print(f"false wakes: {report['false_wakes']} in {report['run_hours']} run-hours = "
          f"{report['false_wakes_per_run_hour']} per run-hour (target 0) {report['false_wake_kinds']}")
    print(f"planted faults woken: {report['faults_woken']}/{report['faults_planted']} = "
          f"{report['faults_woken_pct']} % (target 100 %); late renewals {len(renewals)}, "
          f"link flaps {len(flaps)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    else:
        print(f"wrote {write_results('wake_soak', report)}")
    ok = report["false_wakes"] == 0 and report["faults_woken"] == report["faults_planted"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
