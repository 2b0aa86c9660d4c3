"""Fault to wake for stock framework jobs (HF Trainer, Lightning, torchrun), and `rgt verify` of an HF pull.

Each trial launches one of tests/frameworks/ with `rgt launch local` in its own working directory,
starts `rgt watch RUN --json`, and has the job inject one fault (--nan-at, --crash-at, --hang-at;
the job writes the fault's wall time to --fault-stamp). Measured:

- wake: from the fault to the watch's exit (exit 10 expected, with the kind named in the table);
- for a hang, also stacks: from the stall verdict (the job.stalled event's ts) to the capture of the
  job's stacks (the event carrying `stacks`: the same event gives 0, a later one its ts difference;
  a `stacks_s` field in the data is added when the sidecar reports its own capture time);
- verify: a healthy HF run with 3 checkpoints (save_total_limit=3) is pulled, then `rgt verify` is
  timed, counting the torch seam children (`controller.verify.safeload`) it started.

    .venv/bin/python bench/frameworks.py [--only hf,lightning,torchrun] [--no-verify]

Prints one table and writes bench/results/frameworks.json. Targets: NaN <= 2 s, crash
<= 10 s, stacks <= 10 s after the stall verdict, one torch child per verification.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

sys.path.insert(0, str(Path(__file__).resolve().parent))

from boxrig import REPO, write_results

FRAMEWORKS = REPO / "tests" / "frameworks"
JOBS: Dict[str, List[str]] = {
    "hf": [sys.executable, str(FRAMEWORKS / "hf_tiny.py"), "--log-every", "2", "--save-every", "1000"],
    "lightning": [sys.executable, str(FRAMEWORKS / "lightning_tiny.py"), "--logger", "csv",
                  "--log-every", "2", "--save-every", "1000"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(FRAMEWORKS / "ddp_tiny.py"), "--log-every", "2"],
}
FAULTS: Dict[str, Dict[str, List[str]]] = {
    "hf": {"nan": ["--nan-at", "20"], "crash": ["--crash-at", "20"], "hang": ["--hang-at", "20"]},
    "lightning": {"nan": ["--nan-at", "20"], "crash": ["--crash-at", "20"], "hang": ["--hang-at", "20"]},
    "torchrun": {"crash": ["--crash-rank", "1", "--crash-at", "20"],
                 "hang": ["--hang-rank", "1", "--hang-at", "20"]},
}
EXPECT = {"nan": "train.nonfinite", "crash": "job.exited", "hang": "job.stalled"}
TARGET_S = {"nan": 2.0, "crash": 10.0, "hang": None}
STACKS_TARGET_S = 10.0
ONBOX = ["--onbox-arg=--no-preflight", "--onbox-arg=--sidecar-linger=5s", "--onbox-arg=--serve-arg=--no-kmsg",
         "--onbox-arg=--serve-arg=--heartbeat=1"]
HANG = ["--onbox-arg=--stall-floor=3", "--onbox-arg=--stall-grace=120"]
WATCH_S = 300


class Rig:
    """`rgt` with its own RGT_HOME under a temp root; every run it launched is stopped at the end."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rgtbench-fw-", dir="/tmp"))
        self.env = {**os.environ, "RGT_HOME": str(self.root / "rgt-home"), "PYTHONPATH": str(REPO)}
        self.rgt = [sys.executable, "-m", "controller.cli.main"]
        self.runs: List[str] = []

    def call(self, *args: str, cwd: Optional[Path] = None, check: bool = True,
             timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.rgt, *args], env=self.env, cwd=cwd or REPO, capture_output=True,
                              text=True, check=check, timeout=timeout_s)

    def launch(self, name: str, command: List[str], extra: List[str]) -> str:
        job = self.root / name
        job.mkdir(parents=True, exist_ok=True)
        help_text = self.call("launch", "--help").stdout
        where = ["--cwd", str(job)] if "--cwd" in help_text else []
        out = self.call("launch", "local", "--root", str(self.root / "runs"), "--json", *where, *ONBOX,
                        *extra, "--", *command, cwd=job)
        run = str(json.loads(out.stdout.strip().splitlines()[-1])["run_id"])
        self.runs.append(run)
        return run

    def events(self, run: str, kind: str) -> List[Any]:
        os.environ["RGT_HOME"] = self.env["RGT_HOME"]
        from controller.store.db import Store

        with Store.open() as store:
            return list(store.events(run, kind_prefix=kind))

    def close(self) -> None:
        for run in self.runs:
            self.call("stop", run, "--grace", "5s", check=False, timeout_s=60)
        os.environ["RGT_HOME"] = self.env["RGT_HOME"]
        from controller.follow import client

        for run in self.runs:
            client.unfollow(run)
        client.stop_daemon()
        _wait_gone(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def _wait_gone(root: Path, timeout_s: float = 30.0) -> None:
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(str(root) in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])):
            return
        time.sleep(0.2)  # a benchmark: polling other processes


def fault_trial(rig: Rig, framework: str, fault: str) -> Dict[str, Any]:
    stamp = rig.root / f"{framework}-{fault}.stamp"
    command = [*JOBS[framework], "--steps", "100000" if fault == "hang" else "400", *FAULTS[framework][fault],
               "--fault-stamp", str(stamp)]
    run = rig.launch(f"{framework}-{fault}", command, HANG if fault == "hang" else [])
    watch = rig.call("watch", run, "--timeout", f"{WATCH_S}s", "--json", check=False, timeout_s=WATCH_S + 30)
    woke = time.time()
    lines = [ln for ln in watch.stdout.splitlines() if ln.startswith("{")]
    record = json.loads(lines[-1]) if lines else {}
    kind = (record.get("event") or {}).get("kind")
    row: Dict[str, Any] = {"framework": framework, "fault": fault, "run": run, "exit": watch.returncode,
                           "kind": kind, "expected": EXPECT[fault], "wake_s": None, "stacks_s": None}
    try:
        row["wake_s"] = round(woke - float(stamp.read_text()), 3)
    except (OSError, ValueError):
        row["note"] = "the job never stamped its fault"
    if fault == "hang":
        row.update(stacks_after_verdict(rig, run))
    return row


def stacks_after_verdict(rig: Rig, run: str) -> Dict[str, Any]:
    stalled = rig.events(run, "job.stalled")
    if not stalled:
        return {"stacks_note": "no job.stalled stored"}
    verdict = stalled[0]
    later = [e for e in rig.events(run, "") if e.seq >= verdict.seq and e.data.get("stacks")]
    if not later:
        return {"verdict": verdict.data.get("verdict"), "stacks_note": "no event carried stacks"}
    first = later[0]
    own = first.data.get("stacks_s")
    gap = first.ts - verdict.ts + (float(own) if isinstance(own, (int, float)) else 0.0)
    stacks = first.data["stacks"]
    return {"verdict": verdict.data.get("verdict"), "stacks_s": round(gap, 3),
            "stack_processes": len(stacks) if isinstance(stacks, (list, dict)) else None}


def verify_trial(rig: Rig) -> Dict[str, Any]:
    command = [sys.executable, str(FRAMEWORKS / "hf_tiny.py"), "--steps", "30", "--save-every", "10",
               "--save-total-limit", "3", "--log-every", "5"]
    run = rig.launch("hf-verify", command, [])
    watch = rig.call("watch", run, "--timeout", f"{WATCH_S}s", "--json", check=False, timeout_s=WATCH_S + 30)
    deadline = time.monotonic() + 60
    while not rig.events(run, "sidecar.stopping") and time.monotonic() < deadline:
        time.sleep(0.2)
    pull = rig.call("pull", run, "--to", str(rig.root / "pulled"), "--json", check=False)
    row: Dict[str, Any] = {"run": run, "watch_exit": watch.returncode, "pull_exit": pull.returncode,
                           "checkpoints": len(rig.events(run, "ckpt.saved"))}
    if pull.returncode != 0:
        row["note"] = f"pull failed: {pull.stderr.strip()[-300:]}"
        return row
    proc = subprocess.Popen([*rig.rgt, "verify", run, "--json"], env=rig.env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: Set[int] = set()
    started = time.monotonic()
    stop = threading.Event()
    count = threading.Thread(target=_count_children, args=(proc.pid, children, stop), daemon=True)
    count.start()
    out, err = proc.communicate(timeout=600)
    row["verify_s"] = round(time.monotonic() - started, 3)
    stop.set()
    count.join(5)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1]) if lines else {}
    row.update(verify_exit=proc.returncode, verify_ok=report.get("ok"), torch_children=len(children),
               files=len(report.get("files") or []))
    if proc.returncode != 0:
        row["note"] = (err.strip() or out.strip())[-300:]
    return row


def _count_children(pid: int, seen: Set[int], stop: threading.Event) -> None:
    import psutil

    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        try:
            for child in parent.children(recursive=True):
                try:
                    if "controller.verify.safeload" in " ".join(child.cmdline()):
                        seen.add(child.pid)
                except psutil.Error:
                    pass
        except psutil.Error:
            return
        stop.wait(0.02)


def _fmt(value: Any) -> str:
    return "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))


def render(rows: List[Dict[str, Any]], verify_row: Optional[Dict[str, Any]]) -> None:
    print(f"{'framework':<10} {'fault':<6} {'exit':>4} {'kind':<16} {'wake s':>7} {'target':>7} "
          f"{'stacks s':>9}  verdict")
    for r in rows:
        target = TARGET_S[r["fault"]]
        why = str(r.get("verdict") or r.get("note") or "")[:60]
        print(f"{r['framework']:<10} {r['fault']:<6} {r['exit']:>4} {str(r['kind']):<16} "
              f"{_fmt(r['wake_s']):>7} {_fmt(target):>7} {_fmt(r.get('stacks_s')):>9}  {why}")
    if verify_row is not None:
        print(f"verify of a pulled HF run ({verify_row.get('checkpoints')} checkpoints, "
              f"{verify_row.get('files', '-')} files): {_fmt(verify_row.get('verify_s'))} s, exit "
              f"{verify_row.get('verify_exit', '-')}, torch children {verify_row.get('torch_children', '-')} "
              f"(target 1) {verify_row.get('note', '')}")
    print(f"targets: NaN <= 2 s, crash <= 10 s, stacks <= {STACKS_TARGET_S:g} s after the stall verdict")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="hf,lightning,torchrun", help="comma-separated frameworks")
    ap.add_argument("--faults", default="nan,crash,hang", help="comma-separated faults")
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args()
    rig = Rig()
    rows: List[Dict[str, Any]] = []
    verify_row: Optional[Dict[str, Any]] = None
    try:
        for framework in args.only.split(","):
            for fault in args.faults.split(","):
                if fault in FAULTS.get(framework, {}):
                    rows.append(fault_trial(rig, framework, fault))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if not args.no_verify:
            verify_row = verify_trial(rig)
    finally:
        rig.close()
    render(rows, verify_row)
    write_results("frameworks", {"faults": rows, "verify": verify_row, "targets": {
        "nan_s": 2.0, "crash_s": 10.0, "stacks_after_verdict_s": STACKS_TARGET_S, "torch_children": 1}})
    good = all(r["exit"] == 10 and r["kind"] == r["expected"] for r in rows)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
