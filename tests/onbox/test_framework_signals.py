"""Training signals from what frameworks write by default, proven with the real stock jobs.

Each test runs tests/frameworks/hf_tiny.py or lightning_tiny.py as a plain subprocess in a temp cwd,
with a real TrainingMonitor (real clocks) ticking against the live files: train.log (the job's
stdout+stderr), and what the framework writes under the cwd (trainer_state.json, metrics.csv,
event files). Each job takes a few seconds; there are five jobs here.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from onbox.monitors.training import TrainingConfig, TrainingMonitor
from tests.helpers import Recorder

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ROOT / "tests" / "frameworks"
JOB_DEADLINE_S = 240.0

# The jobs import the frameworks, never this module: found, not imported (importorskip would import
# both at collection, ~7 s of CPU in every xdist worker).
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("transformers", "lightning")),
    reason="transformers and lightning are not both installed here")


def job_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    return env


def run_live(run: Path, cwd: Path, job: str, *args: str, rec: Optional[Recorder] = None,
             after_first_output: bool = False, **config: Any) -> Recorder:
    """Run a stock job with a monitor ticking against its live files; the monitor is closed after.
    With `after_first_output` the monitor starts once the job printed (its imports took their time),
    so a short stall grace judges training, not a loaded machine's `import torch`."""
    run.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    rec = rec or Recorder()
    config.setdefault("scan_s", 0.5)
    config.setdefault("progress_every_s", 0.5)
    mon = TrainingMonitor(TrainingConfig(run_dir=run, job_cwd=cwd, **config), rec)
    started = False
    code: Optional[int] = None
    log_size = (run / "train.log").stat().st_size if (run / "train.log").exists() else 0
    with open(run / "train.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, str(FRAMEWORKS / job), *args], cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT, env=job_env())
    try:
        deadline = time.monotonic() + JOB_DEADLINE_S
        while code is None:
            assert time.monotonic() < deadline, f"{job} did not finish within {JOB_DEADLINE_S}s"
            if not started and (not after_first_output or (run / "train.log").stat().st_size > log_size):
                mon.start()
                started = True
            try:
                code = proc.wait(timeout=0.2)   # the pace of the ticks, not a synchronization
            except subprocess.TimeoutExpired:
                if started:
                    mon.tick()
        if not started:
            mon.start()
        mon.tick()
        mon.on_job_exit(code)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        mon.close()
    assert code == 0, (run / "train.log").read_text(errors="replace")[-3000:]
    return rec


def onsets(rec: Recorder, kind: str = "train.nonfinite") -> List[Dict[str, Any]]:
    return rec.of(kind, state="onset") if kind == "train.nonfinite" else rec.of(kind)


def test_hf_healthy_run_then_one_that_ignores_its_checkpoint(tmp_path: Path) -> None:
    run, cwd = tmp_path / "run", tmp_path / "cwd"
    rec = run_live(run, cwd, "hf_tiny.py", stall=True, stall_floor_s=120.0, stall_grace_s=120.0)
    assert onsets(rec) == [] and rec.of("train.restarted_from_zero") == []
    progress = rec.of("train.progress")
    assert progress and progress[-1]["step"] == 60 and progress[-1]["total_steps"] == 60
    assert any(p.get("eta_s") is not None for p in progress)
    assert (cwd / "out" / "checkpoint-60" / "trainer_state.json").is_file()
    second = run_live(run, cwd, "hf_tiny.py", "--ignore-resume", stall=True, stall_floor_s=120.0,
                      stall_grace_s=120.0, job_key="2")
    restarts = second.of("train.restarted_from_zero")
    assert len(restarts) == 1, second.events
    # the Trainer prints the first log line (epoch 0.078) before its bar reaches step 5: the epoch
    # fraction falling is what shows the restart first, in this sub-epoch run
    got = restarts[0]
    assert got["last_step"] == 60 and got["last_epoch"] == pytest.approx(0.9375)
    assert (got["new_step"] or 0) < 30 and (got["new_epoch"] or 0) < 0.4


@pytest.mark.parametrize("logger,source", [("csv", "csv"), ("tensorboard", "tfevents")])
def test_lightning_nan_is_seen_in_its_logger_files(tmp_path: Path, logger: str, source: str) -> None:
    rec = run_live(tmp_path / "run", tmp_path / "cwd", "lightning_tiny.py", "--logger", logger,
                   "--nan-at", "30", "--flush-every", "5", "--step-seconds", "0.02", stall=False)
    found = {d["name"]: d for d in onsets(rec)}
    assert "train_loss" in found, rec.events
    assert found["train_loss"]["source"] == source
    assert found["train_loss"]["step"] is not None and found["train_loss"]["step"] >= 30


def test_a_healthy_lightning_run_with_only_a_rich_bar_is_never_stalled(tmp_path: Path) -> None:
    # Rich prints nothing in a non-TTY until the end: progress comes from metrics.csv alone. Without
    # it the log stays silent for the whole 50 x 0.5 s of training, past the 12 s grace; the floor
    # covers the exit (checkpoint, teardown), which is slow on a loaded machine.
    rec = run_live(tmp_path / "run", tmp_path / "cwd", "lightning_tiny.py", "--logger", "csv",
                   "--steps", "50", "--flush-every", "2", "--step-seconds", "0.5", after_first_output=True,
                   stall=True, stall_floor_s=20.0, stall_grace_s=12.0)
    assert rec.of("job.stalled") == [], rec.events
    steps = [p["step"] for p in rec.of("train.progress") if p["step"] is not None]
    assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] >= 45
    assert onsets(rec) == []
