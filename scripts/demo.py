"""`make demo`: launch a tiny CPU training job the way it runs on a rented box, and watch it.

Host `local` (this machine, no SSH) takes the same path as a rented box: `rgt launch local`
runs `rgt-onbox launch` (pre-flight, run directory under .demo/root, the job detached with its
supervised sidecar) and starts the follower daemon that keeps the store under .demo/state
current. `rgt watch` then blocks until something material happens: the job goes NaN on purpose
near its end, the watch exits 10 with one JSON line, and a second watch reports the job's exit.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / ".demo"
BIN = Path(sys.executable).parent


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main() -> int:
    env = {**os.environ, "RGT_HOME": str(DEMO / "state"), "RGT_ROOT": str(DEMO / "root")}
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    say(f"rgt launch local: run {run_id} (pre-flight first: no GPU here, so its GPU checks SKIP)")
    launched = subprocess.run(
        [str(BIN / "rgt"), "launch", "local", "--project", "demo", "--run-id", run_id, "--json",
         "--onbox-arg=--preflight-seconds=1", "--onbox-arg=--sidecar-linger=10s",
         "--onbox-arg=--expected-steps=300",
         "--", sys.executable, str(REPO / "scripts" / "train_tiny.py"), "--steps", "300",
         "--ckpt-every", "100", "--nan-at", "290", "--step-seconds", "0.03"],
        env=env, capture_output=True, text=True)
    sys.stderr.write(launched.stderr)
    if launched.returncode != 0:
        print(f"launch refused or failed (exit {launched.returncode})")
        return 1
    info = json.loads(launched.stdout)
    run_dir = Path(info["run_dir"])
    print(f"  run dir  {run_dir.relative_to(REPO)}\n  job pid  {info['pid']} (wrapper), "
          f"follower daemon pid {info['daemon_pid']}")

    say("rgt watch: blocks until something material happens (exit 10), then says what to do")
    woke = subprocess.run([str(BIN / "rgt"), "watch", run_id, "--timeout", "120"], env=env,
                          capture_output=True, text=True)
    sys.stdout.write(woke.stdout)
    sys.stderr.write(woke.stderr)
    print(f"  exit code {woke.returncode}")
    entry = (json.loads(woke.stdout.strip().splitlines()[-1]) if woke.stdout.strip() else {}).get("entry")
    if entry:
        say(f"rgt explain {entry}: the wake names its entry in the symptom catalog")
        subprocess.run([str(BIN / "rgt"), "explain", entry, "--top", "1"], env=env, check=False)
    say("rgt status: one screen")
    subprocess.run([str(BIN / "rgt"), "status", run_id], env=env, check=False)
    say("rgt watch again: the NaN does not wake it twice; the job's end does")
    ended = subprocess.run([str(BIN / "rgt"), "watch", run_id, "--timeout", "120"], env=env)
    print(f"  exit code {ended.returncode} (10: the run ended, but not cleanly: it went NaN)")
    say("the training log ends with")
    print("".join((run_dir / "train.log").read_text().splitlines(keepends=True)[-4:]), end="")
    say("checkpoints the sidecar hashed (rgt/manifest.jsonl)")
    for line in (run_dir / "rgt" / "manifest.jsonl").read_text().splitlines():
        rec = json.loads(line)
        print(f"  {rec['path']:<32} {rec['size']:>6} bytes  sha256 {rec['sha256'][:16]}...")
    say("the evidence, from the store (rgt events RUN --kind train.nonfinite / job.)")
    for kind in ("train.nonfinite", "job."):
        subprocess.run([str(BIN / "rgt"), "events", run_id, "--kind", kind], env=env, check=False)
    say("runs on this box (rgt-onbox ps)")
    subprocess.run([str(BIN / "rgt-onbox"), "ps"], env=env, check=False)
    say("try it yourself")
    print(f"  RGT_HOME=.demo/state .venv/bin/rgt status {run_id} --json")
    print(f"  RGT_HOME=.demo/state .venv/bin/rgt events {run_id} --json")
    print("  .venv/bin/rgt-onbox xids tests/onbox/data/dmesg_plain.log")
    print("  .venv/bin/rgt-onbox health --probe fake:xid79_on_gpu3   # a box to walk away from")
    print('  .venv/bin/rgt explain "loss is nan after switching to fp16"')
    print("  .venv/bin/rgt profile show autodl        # what really stops the meter there")
    print("  .venv/bin/rgt rehearse --steps 60 -- .venv/bin/python scripts/train_tiny.py "
          "--ckpt-every 20 --steps 100")
    return 0 if woke.returncode == 10 and ended.returncode == 10 else 1


if __name__ == "__main__":
    if "--clean" in sys.argv:
        shutil.rmtree(DEMO, ignore_errors=True)
    sys.exit(main())
