"""`make demo`: launch a tiny CPU training job the way it runs on a rented box, and watch it.

Host `local` (this machine, no SSH): `rgt-onbox launch` runs the pre-flight, makes the run
directory under .demo/root, starts the job detached with its supervised sidecar, and returns;
`rgt attach` follows the sidecar into a store under .demo/state until the job exits. The job
goes NaN on purpose near its end, so the demo shows a material event being caught. It grows as
watch, pull and verify land.
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
    say(f"launch run {run_id} on host local (pre-flight first: no GPU here, so its GPU checks SKIP)")
    launched = subprocess.run(
        [str(BIN / "rgt-onbox"), "launch", "--project", "demo", "--run-id", run_id, "--json",
         "--preflight-seconds", "1", "--sidecar-linger", "10s", "--expected-steps", "300",
         "--", sys.executable, str(REPO / "scripts" / "train_tiny.py"), "--steps", "300",
         "--ckpt-every", "100", "--nan-at", "290"],
        env=env, capture_output=True, text=True)
    sys.stderr.write(launched.stderr)
    if launched.returncode != 0:
        print(f"launch refused or failed (exit {launched.returncode})")
        return 1
    info = json.loads(launched.stdout)
    run_dir = Path(info["run_dir"])
    print(f"  run dir  {run_dir.relative_to(REPO)}\n  job pid  {info['pid']} (wrapper)")

    say("events, live (rgt attach --until-exit)")
    attached = subprocess.run([str(BIN / "rgt"), "attach", str(run_dir), "--until-exit",
                               "--timeout", "120"], env=env)
    say("the training log ends with")
    print("".join((run_dir / "train.log").read_text().splitlines(keepends=True)[-4:]), end="")
    say("checkpoints the sidecar hashed (rgt/manifest.jsonl)")
    for line in (run_dir / "rgt" / "manifest.jsonl").read_text().splitlines():
        rec = json.loads(line)
        print(f"  {rec['path']:<32} {rec['size']:>6} bytes  sha256 {rec['sha256'][:16]}...")
    say("what matters, from the store (rgt events RUN --kind train.nonfinite / job.)")
    for kind in ("train.nonfinite", "job."):
        subprocess.run([str(BIN / "rgt"), "events", run_id, "--kind", kind], env=env, check=False)
    say("runs on this box (rgt-onbox ps)")
    subprocess.run([str(BIN / "rgt-onbox"), "ps"], env=env, check=False)
    say("try it yourself")
    print(f"  RGT_HOME=.demo/state .venv/bin/rgt events {run_id} --json")
    print("  .venv/bin/rgt-onbox xids tests/onbox/data/dmesg_plain.log")
    print("  .venv/bin/rgt-onbox health --probe fake:xid79_on_gpu3   # a box to walk away from")
    return 0 if attached.returncode == 0 else 1


if __name__ == "__main__":
    if "--clean" in sys.argv:
        shutil.rmtree(DEMO, ignore_errors=True)
    sys.exit(main())
