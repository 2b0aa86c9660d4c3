"""`rgt rehearse` for real: scripts/train_tiny.py on CPU torch, under the real launcher and sidecar.

It passes every stage on the well-behaved script and on the stock HF Trainer and Lightning jobs
(which --steps stops with SIGTERM), and fails at "resume" when the HF job ignores RGT_RESUME_FROM.
Every run must leave no process behind and never touch RGT_HOME.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import psutil
import pytest

from tests.helpers import REPO, rgt_cmd, wait_until

pytestmark = pytest.mark.e2e

TRAIN = [sys.executable, str(REPO / "scripts" / "train_tiny.py"), "--ckpt-every", "20", "--log-every", "5",
         "--step-seconds", "0.05"]
RUN_S = 120  # a bound on one rehearsal subprocess; never a sleep
FRAMEWORKS = REPO / "tests" / "frameworks"
# Stock framework jobs (no rgt code), long enough to be killed after the first save and stopped by
# --steps after the relaunch; each start costs ~10 s here.
HF = [sys.executable, str(FRAMEWORKS / "hf_tiny.py"), "--steps", "100000", "--save-every", "10",
      "--log-every", "5", "--step-seconds", "0.15"]  # save_total_limit=2: a save lives >= 3 s
LIGHTNING = [sys.executable, str(FRAMEWORKS / "lightning_tiny.py"), "--logger", "csv", "--steps", "100000",
             "--save-every", "10", "--log-every", "5", "--step-seconds", "0.05"]
FRAMEWORK_S = 300


def rehearse(tmp_path: Path, *args: str, timeout_s: float = RUN_S) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RGT_HOME": str(tmp_path / "state")}
    return subprocess.run(rgt_cmd("rehearse", "--json", "--tmp-dir", str(tmp_path), *args), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def rehearse_framework(tmp_path: Path, command: List[str]) -> subprocess.CompletedProcess[str]:
    """A framework job rehearsed in its own working directory (its default output_dir lands there)."""
    job = tmp_path / "job"
    job.mkdir()
    return rehearse(tmp_path, "--cwd", str(job), "--steps", "25", "--grace", "20s", "--timeout", "4m",
                    "--", *command, timeout_s=FRAMEWORK_S)


def stages(doc: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {s["name"]: s for s in doc["stages"]}


def leftovers(tmp_path: Path) -> List[str]:
    """Processes still running whose command line names this test's directory."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if str(tmp_path) in cmdline:
            found.append(f"{proc.info['pid']}: {cmdline[:200]}")
    return found


def test_the_tiny_script_passes_every_stage(tmp_path: Path) -> None:
    done = rehearse(tmp_path, "--", *TRAIN, "--steps", "60")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["result"] == "pass" and doc["failed_stage"] is None, doc
    by_name = stages(doc)
    assert [s["name"] for s in doc["stages"]] == ["launch", "metrics seen", "checkpoint committed", "resume",
                                                "safe load", "clean exit"]
    assert all(s["status"] == "pass" for s in doc["stages"]), doc["stages"]
    assert "resumed from checkpoints/step0000" in by_name["resume"]["detail"]
    assert "3 checkpoint files pulled and verified (rgt verify)" in by_name["safe load"]["detail"]
    # progress went to stderr as each stage completed; the private root is gone after a pass
    assert "rehearse: resume: pass" in done.stderr
    assert not doc["kept"] and not Path(doc["root"]).exists()
    assert not (tmp_path / "state").exists()  # the controller's store was never opened
    assert leftovers(tmp_path) == []


def test_sigterm_ends_the_rehearsal_and_everything_it_started(tmp_path: Path) -> None:
    env = {**os.environ, "RGT_HOME": str(tmp_path / "state")}
    argv = rgt_cmd("rehearse", "--json", "--tmp-dir", str(tmp_path), "--", *TRAIN, "--steps", "100000")
    with subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            metrics = "rgt-rehearse-*/*/active/*/metrics.jsonl"
            wait_until(lambda: any(p.stat().st_size for p in tmp_path.glob(metrics)), 60, "the first metrics")
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=RUN_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 1, out + err
    doc = json.loads(out)
    failed = stages(doc)[doc["failed_stage"]]
    assert failed["detail"] == "interrupted" and "interrupted (Ctrl-C or SIGTERM)" in doc["notes"]
    assert doc["kept"] and leftovers(tmp_path) == []


@pytest.mark.parametrize("command", [HF, LIGHTNING], ids=["hf-trainer", "lightning"])
def test_a_stock_framework_script_passes_every_stage(tmp_path: Path, command: List[str]) -> None:
    done = rehearse_framework(tmp_path, command)
    doc = json.loads(done.stdout) if done.stdout.strip() else {}
    assert done.returncode == 0 and doc.get("result") == "pass", done.stdout + done.stderr
    by_name = stages(doc)
    assert "resumed from" in by_name["resume"]["detail"], by_name["resume"]
    assert "pulled and verified (rgt verify)" in by_name["safe load"]["detail"], by_name["safe load"]
    assert "(--steps) by SIGTERM" in by_name["clean exit"]["detail"], by_name["clean exit"]
    assert leftovers(tmp_path) == []


def test_an_hf_script_that_ignores_its_resume_fails_at_resume(tmp_path: Path) -> None:
    done = rehearse_framework(tmp_path, [*HF, "--ignore-resume"])
    doc = json.loads(done.stdout) if done.stdout.strip() else {}
    assert done.returncode == 1 and doc.get("failed_stage") == "resume", done.stdout + done.stderr
    by_name = stages(doc)
    assert "under the checkpoint's step" in by_name["resume"]["detail"], by_name["resume"]
    assert by_name["clean exit"]["status"] == "skipped"
    assert by_name["safe load"]["status"] == "pass", by_name["safe load"]  # what was recorded is proven
    # the run directory stays for a look, with the relaunch's record of what it handed over
    run_dir = Path(doc["run_dir"])
    assert doc["kept"] and (run_dir / "train.log").exists()
    assert "checkpoint-" in json.loads((run_dir / "run.json").read_text())["resume_from"]
    assert leftovers(tmp_path) == []
