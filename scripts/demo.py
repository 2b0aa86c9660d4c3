"""`make demo`: a tiny CPU training job with its sidecar, events shown live.

Host `local` (this machine, no SSH): a run directory under .demo/, the job
started through a small wrapper that records its exit status, `rgt-onbox
serve` watching it, and `rgt attach` following the sidecar into a store under
.demo/state until the job exits. It grows as launch, watch and pull land.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / ".demo"
BIN = Path(sys.executable).parent

# The job runs behind this wrapper so its exit status lands in rgt/exit.json
# before the wrapper (the pid the sidecar watches) goes away.
WRAPPER = r'''
"$@" > "$RGT_RUN_DIR/train.log" 2>&1
code=$?
printf '{"code": %d, "signal": null, "oom_killed": false}\n' "$code" > "$RGT_RUN_DIR/rgt/exit.json.tmp"
mv "$RGT_RUN_DIR/rgt/exit.json.tmp" "$RGT_RUN_DIR/rgt/exit.json"
exit $code
'''


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main() -> int:
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir = DEMO / "root" / "demo" / "active" / run_id
    state = DEMO / "state"
    (run_dir / "rgt").mkdir(parents=True)
    env = {**os.environ, "RGT_HOME": str(state), "RGT_RUN_ID": run_id, "RGT_RUN_DIR": str(run_dir),
           "RGT_CKPT_DIR": str(run_dir / "checkpoints"), "RGT_METRICS": str(run_dir / "metrics.jsonl"),
           "PYTHONUNBUFFERED": "1"}
    say(f"run {run_id} on host local: {run_dir.relative_to(REPO)}")
    say("pre-flight (rgt-onbox health): no GPU on this machine, so the GPU checks are skipped")
    if subprocess.run([str(BIN / "rgt-onbox"), "health", "--seconds", "1", "--run-dir", str(run_dir)],
                      env=env).returncode != 0:
        print("pre-flight failed: not starting the job")
        return 1
    job = subprocess.Popen(["bash", "-c", WRAPPER, "rgt-job", sys.executable,
                            str(REPO / "scripts" / "train_tiny.py"), "--steps", "300"],
                           env=env, start_new_session=True)
    sidecar = subprocess.Popen([str(BIN / "rgt-onbox"), "serve", "--run-dir", str(run_dir),
                                "--pid", str(job.pid), "--heartbeat", "2", "--log-level", "warning"],
                               env=env, start_new_session=True)
    try:
        say("events, live (rgt attach --until-exit)")
        attached = subprocess.run([str(BIN / "rgt"), "attach", str(run_dir), "--until-exit",
                                   "--timeout", "120"], env=env)
        job.wait(30)
    finally:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(30)
        if job.poll() is None:
            job.terminate()
            job.wait(10)
    say("the training log ends with")
    print("".join((run_dir / "train.log").read_text().splitlines(keepends=True)[-3:]), end="")
    say("checkpoints written by the job")
    for ckpt in sorted((run_dir / "checkpoints").glob("*.pt")):
        print(f"  {ckpt.name}  {ckpt.stat().st_size} bytes")
    say(f"stored events, by kind (rgt events {run_id} --kind job.)")
    subprocess.run([str(BIN / "rgt"), "events", run_id, "--kind", "job."], env=env, check=False)
    say("try it yourself")
    print(f"  RGT_HOME={state.relative_to(REPO)} .venv/bin/rgt events {run_id} --json")
    print("  .venv/bin/rgt-onbox xids tests/onbox/data/dmesg_plain.log")
    return 0 if attached.returncode == 0 and job.returncode == 0 else 1


if __name__ == "__main__":
    if "--clean" in sys.argv:
        shutil.rmtree(DEMO, ignore_errors=True)
    sys.exit(main())
