"""How long the end of a run takes: job exit -> run.closed -> `rgt watch` exits, through the SSH tunnel.

A throw-away sshd on 127.0.0.1 plays the box (tests/sshbox.py). Each trial launches one run there
with `rgt launch`; its job waits, a `rgt watch RUN --json` starts, then the job writes a final
checkpoint of --mb MB into $RGT_CKPT_DIR (a directory unit: model.safetensors-sized bytes and a
small config), stamps the wall time and exits. Measured per trial:

- job's last write -> run.closed, and job.exited -> run.closed (box clock = this clock): the
  close-out, which commits and hashes that final save and builds the final manifest;
- run.closed -> the watch process's exit (code 0): the wake through the tunnel and the store;
- close_s: the close-out's own time, as the box measured it (monotonic).

    .venv/bin/python bench/closeout.py [--trials 20] [--mb 100]

Prints a table and writes bench/results/closeout.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from boxrig import BoxRig, write_results

# Waits for <run_dir>/go, then saves the final checkpoint, stamps the time it closed it, exits 0.
JOB = r"""
import os, sys, time
run_dir, mb = os.environ["RGT_RUN_DIR"], int(sys.argv[1])
while not os.path.exists(os.path.join(run_dir, "go")):
    time.sleep(0.05)
unit = os.path.join(os.environ["RGT_CKPT_DIR"], "step000100")
os.makedirs(unit, exist_ok=True)
block = os.urandom(1 << 20)
with open(os.path.join(unit, "model.bin"), "wb") as f:
    for _ in range(mb):
        f.write(block)
with open(os.path.join(unit, "config.json"), "w") as f:
    f.write('{"step": 100}')
print("step 100 loss 0.25", flush=True)
with open(os.path.join(run_dir, "saved_at"), "w") as f:
    f.write(repr(time.time()))
"""


def pct(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def one(rig: BoxRig, mb: int, settle_s: float, linger: str) -> Dict[str, Any]:
    run, run_dir = rig.launch(sys.executable, "-c", JOB, str(mb),
                              onbox_args=(f"--onbox-arg=--sidecar-linger={linger}",))
    watch = subprocess.Popen([*rig.rgt, "watch", run, "--timeout", "300", "--json"], env=rig.env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(settle_s)  # a benchmark, not a test: let the watch start following
    (run_dir / "go").write_text("")
    out, _ = watch.communicate(timeout=300)
    woke_at = time.time()
    record = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    os.environ["RGT_HOME"] = str(rig.home)
    from controller.store.db import Store

    with Store.open() as store:
        exited = store.events(run, kind_prefix="job.exited")[0]
        closed = store.events(run, kind_prefix="run.closed")[0]
    saved_at = float((run_dir / "saved_at").read_text())
    return {"run": run, "watch_exit": watch.returncode, "kind": (record.get("event") or {}).get("kind"),
            "saved_to_closed_s": closed.ts - saved_at, "exited_to_closed_s": closed.ts - exited.ts,
            "closed_to_watch_exit_s": woke_at - closed.ts, "close_s": closed.data.get("close_s"),
            "checkpoints": (closed.data.get("manifest") or {}).get("checkpoints"),
            "incomplete": len(closed.data.get("incomplete") or [])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--mb", type=int, default=100, help="the final save's size")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds between starting a watch and the save (the watch's own start-up)")
    ap.add_argument("--linger", default="0s",
                    help="the sidecar's linger after run.closed (0s: it goes at once, as rgt's tests run it)")
    args = ap.parse_args()
    trials: List[Dict[str, Any]] = []
    with BoxRig() as rig:
        for i in range(args.trials):
            trials.append(one(rig, args.mb, args.settle, args.linger))
            t = trials[-1]
            print(f"  trial {i + 1:>2}: exit {t['watch_exit']} on {t['kind']}, job exit -> closed "
                  f"{t['exited_to_closed_s']:.3f} s, closed -> watch exit "
                  f"{t['closed_to_watch_exit_s']:.3f} s", flush=True)
    figures = {name: [float(t[name]) for t in trials]
               for name in ("saved_to_closed_s", "exited_to_closed_s", "close_s", "closed_to_watch_exit_s")}
    report: Dict[str, Any] = {
        "trials": args.trials, "final_save_mb": args.mb, "sidecar_linger": args.linger,
        "watch_exits": sorted({t["watch_exit"] for t in trials}),
        "wake_kinds": sorted({str(t["kind"]) for t in trials}),
        "incomplete_closes": sum(1 for t in trials if t["incomplete"]),
        **{f"{name[:-2]}_p50_s": round(pct(v, 0.5), 4) for name, v in figures.items()},
        **{f"{name[:-2]}_p99_s": round(pct(v, 0.99), 4) for name, v in figures.items()},
        "runs": trials,
    }
    print(f"\nend of a run, {args.trials} runs, a {args.mb} MB final save, through the ssh tunnel")
    print(f"{'span':<34}{'p50 s':>10}{'p99 s':>10}")
    labels = {"saved_to_closed_s": "job's last write -> run.closed",
              "exited_to_closed_s": "job.exited -> run.closed",
              "close_s": "the close-out (box, monotonic)",
              "closed_to_watch_exit_s": "run.closed -> rgt watch exits"}
    for name, values in figures.items():
        print(f"{labels[name]:<34}{pct(values, 0.5):>10.3f}{pct(values, 0.99):>10.3f}")
    print(f"watch exits {report['watch_exits']} on {report['wake_kinds']}; incomplete closes: "
          f"{report['incomplete_closes']}")
    print(f"wrote {write_results('closeout', report)}")
    return 0 if report["watch_exits"] == [0] and report["wake_kinds"] == ["run.closed"] else 1


if __name__ == "__main__":
    sys.exit(main())
