"""TrainingMonitor over real files in a temp run dir, with injected clocks and GPU use.

Time moves only when a test moves it (`Rig.tick`); the one test on the real scheduler waits on an
event with a deadline.
"""
from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from onbox.errors import ConfigError
from onbox.monitors.training import STATE_FILE, TrainingConfig, TrainingMonitor, load_state
from onbox.scheduler import Scheduler
from tests.helpers import Clock
from tests.helpers import Recorder as BaseRecorder

WAIT_S = 30.0  # a bound on waits for what must happen; a passing test never waits it out


class Recorder(BaseRecorder):
    wait_s = WAIT_S

    def counts(self, telemetry: bool = False) -> Dict[Tuple[str, Any, Optional[str]], int]:
        return dict(collections.Counter((k, d.get("state"), s) for k, d, s in self.events
                                        if telemetry or k != "train.progress"))



class Rig:
    """A monitor on `run`; `tick(dt)` moves both clocks by dt, then runs one tail-and-judge pass."""

    def __init__(self, run: Path, rec: Optional[Recorder] = None, mono: float = 1000.0,
                 **config: Any) -> None:
        self.run = run
        run.mkdir(parents=True, exist_ok=True)
        self.mono, self.wall = Clock(mono), Clock(1.7e9)
        self.util: Optional[float] = None
        self.rec = rec or Recorder()
        config.setdefault("stall_floor_s", 1.0)
        config.setdefault("stall_grace_s", 60.0)
        self.mon = TrainingMonitor(TrainingConfig(run_dir=run, **config), self.rec,
                                   gpu_util=lambda: self.util, clock=self.wall, monotonic=self.mono)

    def metrics(self, **line: Any) -> None:
        with open(self.run / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def log(self, text: str) -> None:
        with open(self.run / "train.log", "a") as f:
            f.write(text)

    def tick(self, dt: float = 0.25, n: int = 1) -> None:
        for _ in range(n):
            self.mono.t += dt
            self.wall.t += dt
            self.mon.tick()


@pytest.fixture
def rigs() -> Any:
    made: List[Rig] = []

    def make(*args: Any, **kwargs: Any) -> Rig:
        rig = Rig(*args, **kwargs)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.mon.close()


def test_the_tail_runs_every_quarter_second_by_default(tmp_path: Path) -> None:
    mon = TrainingMonitor(TrainingConfig(run_dir=tmp_path), Recorder())
    assert [(j.name, j.interval_s) for j in mon.jobs()] == [("train", 0.25)]
    with pytest.raises(ConfigError):
        TrainingMonitor(TrainingConfig(run_dir=tmp_path, log_regex="(bad"), Recorder())


def test_a_nan_loss_is_one_critical_event_on_the_next_tick_and_clears(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run")
    rig.mon.start()
    rig.metrics(step=1, loss=0.5)
    rig.tick()
    rig.metrics(step=2, loss="nan")
    rig.tick()
    assert rig.rec.counts() == {("train.nonfinite", "onset", "critical"): 1}
    data = rig.rec.of("train.nonfinite")[0]
    assert (data["name"], data["value"], data["step"], data["source"]) == ("loss", "nan", 2, "metrics")
    for step in range(3, 6):
        rig.metrics(step=step, loss="inf")
        rig.tick()
    for step in range(6, 9):
        rig.metrics(step=step, loss=0.4)
        rig.tick()
    assert rig.rec.counts() == {("train.nonfinite", "onset", "critical"): 1,
                                ("train.nonfinite", "cleared", "info"): 1}


def test_a_nan_in_a_hugging_face_log_line_is_reported(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run")
    rig.mon.start()
    rig.log("{'loss': 0.9, 'learning_rate': 5e-05, 'epoch': 0.1}\n"
            "{'loss': nan, 'learning_rate': 5e-05, 'epoch': 0.2}\n")
    rig.tick()
    data = rig.rec.of("train.nonfinite")
    assert len(data) == 1 and (data[0]["source"], data[0]["epoch"]) == ("log", 0.2)


def test_a_value_in_both_files_is_judged_once_from_the_first_source(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run")
    rig.mon.start()
    rig.metrics(step=10, loss="nan")
    rig.log("step=10 loss=nan\n")
    rig.tick()
    for step in (1, 2, 3):  # a block-buffered log catching up with older, finite values
        rig.log(f"step={step} loss=0.5\n")
    rig.tick()
    assert rig.rec.counts() == {("train.nonfinite", "onset", "critical"): 1}
    assert rig.rec.of("train.nonfinite")[0]["source"] == "metrics"
    assert rig.mon.status()["nonfinite"] == ["loss"]


def run_steps(rig: Rig, steps: range, every_s: float = 1.0,
              written_after_s: Optional[float] = None) -> None:
    """One step line every `every_s`, read by ticks of every_s/4; with `written_after_s` the file's
    mtime says the line was written that long after the last tick (else the mtime is real time,
    far from the fake wall clock, and the monitor dates the line at the tick that reads it)."""
    for step in steps:
        rig.metrics(step=step, loss=1.0 / step)
        if written_after_s is not None:
            stamp = rig.wall.t + written_after_s
            os.utime(rig.run / "metrics.jsonl", (stamp, stamp))
        rig.tick(every_s / 4, n=4)


def test_a_stall_is_reported_within_three_step_intervals_and_clears(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", stall_floor_s=0.5)
    rig.mon.start()
    rig.util = 97.0
    run_steps(rig, range(1, 11), every_s=0.6, written_after_s=0.1)  # written between ticks
    last_write = rig.mono.t - 0.6 + 0.1
    while not rig.rec.of("job.stalled"):
        rig.tick()
        assert rig.mono.t - last_write <= 3 * 0.6, "no stall within 3 step intervals"
    assert rig.mono.t - last_write <= 2 * 0.6 + 0.15  # k x interval, then at most one tick
    data = rig.rec.of("job.stalled")[0]
    assert (data["verdict"], data["phase"], data["step"]) == ("hung", "training", 10)
    assert data["step_interval_p95_s"] == pytest.approx(0.6)  # not rounded up to the tick
    rig.tick(n=20)
    rig.metrics(step=11, loss=0.1)
    rig.tick()
    assert rig.rec.counts() == {("job.stalled", "onset", "warn"): 1,
                                ("job.progressing", "cleared", "info"): 1}
    assert rig.mon.status()["stalled"] is False


def test_a_skewed_mtime_is_clamped_to_the_span_since_the_last_poll(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", stall_floor_s=0.1)
    rig.mon.start()
    for step, skew in ((1, -50.0), (2, +50.0), (3, -50.0), (4, +50.0)):  # a network FS clock far off
        rig.metrics(step=step)
        stamp = rig.wall.t + skew
        os.utime(rig.run / "metrics.jsonl", (stamp, stamp))
        rig.tick(1.0)
    # each line is dated within its poll's span (1 s), never 50 s off: 1000, 1002, 1002, 1004
    assert list(rig.mon._stall.intervals) == [2.0, 2.0]
    assert rig.mon.status()["data_age_s"] == 0.0


def test_log_growth_and_checkpoints_count_as_life(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", stall_floor_s=2.0)
    rig.mon.start()
    rig.metrics(step=1)
    rig.tick()
    rig.metrics(step=2)
    rig.tick()
    for _ in range(8):  # 8 s without a step, but the log grows and a checkpoint is written
        rig.log("still evaluating\n")
        rig.tick(1.0)
    rig.mon.note_checkpoint()
    rig.tick(1.0)
    assert rig.rec.of("job.stalled") == []
    rig.tick(1.0)
    assert rig.rec.of("job.stalled")[0]["verdict"] == "unknown"
    rig.log("NCCL watchdog: timeout\n")  # text is not progress once steps were seen
    rig.tick()
    assert rig.rec.of("job.progressing") == []
    rig.mon.note_checkpoint()
    assert len(rig.rec.of("job.progressing")) == 1


def test_the_startup_grace_applies_until_the_step_interval_is_known(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", stall_floor_s=1.0, stall_grace_s=30.0)
    rig.mon.start()
    rig.tick(1.0, n=10)
    rig.metrics(step=1)  # the first step (a slow compile, say) leaves the interval unknown
    rig.tick(1.0, n=30)  # read at the first of these ticks: 29 s since
    assert rig.rec.of("job.stalled") == []
    rig.tick(1.0)
    assert rig.rec.of("job.stalled")[0]["phase"] == "startup"


def test_a_stall_with_an_idle_gpu_is_idle_not_slow(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", stall_floor_s=5.0)
    rig.mon.start()
    rig.util = 2.0
    run_steps(rig, range(1, 4))
    rig.tick(1.0, n=300)
    assert rig.rec.counts() == {("job.stalled", "onset", "warn"): 1}
    assert rig.rec.of("job.stalled")[0]["verdict"] == "idle"


def test_progress_with_an_idle_gpu_is_slow_not_a_stall(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", stall_floor_s=5.0)
    rig.mon.start()
    rig.util = 4.0
    run_steps(rig, range(1, 200))
    assert rig.rec.counts() == {("train.slow", "onset", "warn"): 1}
    assert rig.rec.of("train.slow")[0]["steps_per_s"] == 1.0
    assert rig.mon.status()["slow"] is True


def test_a_restart_from_zero_is_caught_across_a_sidecar_restart(tmp_path: Path, rigs: Any) -> None:
    run = tmp_path / "run"
    first = rigs(run)
    first.mon.start()
    for step in range(10, 160, 10):
        first.metrics(step=step, loss=1.0 / step)
    first.metrics(step=160, loss="nan")
    first.tick()
    first.mon.close()
    saved = load_state(run / "rgt" / STATE_FILE)
    assert saved["max_step"] == 160 and saved["active"]["nonfinite"] == ["loss"]
    assert not list((run / "rgt").glob("*.tmp"))
    second = rigs(run, rec=first.rec, mono=50.0)  # a new sidecar process: its own monotonic clock
    second.mon.start()
    assert first.rec.counts() == {("train.nonfinite", "onset", "critical"): 1}  # old lines not judged
    second.metrics(step=10, loss=0.9)               # the relaunched job ignored its checkpoint
    second.tick()
    restart = second.rec.of("train.restarted_from_zero")
    assert [(d["last_step"], d["new_step"]) for d in restart] == [(160, 10)]
    second.metrics(step=20, loss="nan")            # the loss never was finite 3 times: same episode
    second.tick()
    assert len(first.rec.of("train.nonfinite")) == 1


def test_a_new_job_attempt_is_judged_afresh_but_keeps_the_high_water_mark(tmp_path: Path,
                                                                           rigs: Any) -> None:
    run = tmp_path / "run"
    first = rigs(run, job_key="1:100", stall_grace_s=60.0)
    first.mon.start()
    run_steps(first, range(10, 60, 10))
    first.metrics(step=60, loss="nan")
    first.tick()
    assert first.mon.status()["stall_budget_s"] == 2.0  # k x the 1 s step interval
    first.mon.close()
    second = rigs(run, rec=first.rec, job_key="2:200", stall_grace_s=60.0)  # the relaunch's sidecar
    second.mon.start()
    assert second.mon.status()["stall_budget_s"] == 60.0 and second.mon.status()["nonfinite"] == []
    second.metrics(step=5, loss="nan")  # ignored its checkpoint, and NaNs again: both are news
    second.tick()
    assert first.rec.counts() == {("train.nonfinite", "onset", "critical"): 2,
                                  ("train.restarted_from_zero", None, "warn"): 1}
    second.mon.on_job_start()  # a relaunch under the same monitor
    assert second.mon.status()["nonfinite"] == [] and second.mon.status()["stall_budget_s"] == 60.0
    second.metrics(step=6, loss="nan")
    second.tick()
    assert len(first.rec.of("train.nonfinite")) == 3


def test_a_relaunch_from_a_checkpoint_is_judged_against_its_step_not_the_killed_attempts(
        tmp_path: Path, rigs: Any) -> None:
    # killed at step 130 with the newest checkpoint at step 60: going on from 61 loses work, it is not
    # a restart from zero; ignoring the checkpoint (step 1) is.
    run = tmp_path / "run"
    first = rigs(run, job_key="1:100")
    first.mon.start()
    run_steps(first, range(10, 140, 10))
    first.mon.close()
    resumed = rigs(run, rec=first.rec, job_key="2:200", resume_step=60)
    resumed.mon.start()
    resumed.metrics(step=64)
    resumed.tick()
    assert not first.rec.of("train.restarted_from_zero")
    resumed.mon.close()
    ignored = rigs(run, rec=first.rec, job_key="3:300", resume_step=60)
    ignored.mon.start()
    ignored.metrics(step=1)
    ignored.tick()
    assert [(d["last_step"], d["new_step"]) for d in first.rec.of("train.restarted_from_zero")] == [(60, 1)]


def test_a_metrics_file_rewritten_from_scratch_is_a_restart(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run")
    rig.mon.start()
    for step in range(10, 110, 10):
        rig.metrics(step=step)
    rig.tick()
    (rig.run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    rig.tick()
    assert [(d["last_step"], d["new_step"]) for d in rig.rec.of("train.restarted_from_zero")] == [(100, 1)]


def test_without_state_history_is_replayed_and_only_what_still_holds_is_reported(tmp_path: Path,
                                                                                 rigs: Any) -> None:
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "loss": 1.0} for s in range(10, 110, 10)]
    lines[3]["loss"] = "nan"  # an old episode, over by now
    lines[2]["val_loss"] = "nan"  # another, over by now (its last finding is a clear)
    for line in lines[4:7]:
        line["val_loss"] = 0.7
    lines += [{"step": s, "loss": 0.5} for s in (5, 10)] + [{"step": 15, "loss": "nan", "map": 0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rig = rigs(run)
    rig.mon.start()
    assert rig.rec.counts() == {("train.nonfinite", "onset", "critical"): 1,
                                ("train.restarted_from_zero", None, "warn"): 1}
    assert all(d["replayed"] for k, d, _ in rig.rec.events)
    assert rig.rec.of("train.nonfinite")[0]["step"] == 15
    rig.tick()
    assert rig.rec.of("train.progress")[0]["step"] == 15
    assert rig.rec.of("job.stalled") == []


def test_bad_lines_are_counted_and_reported_once(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run")
    rig.mon.start()
    rig.log("{'loss': 0.5, 'epoch': broken}\n")  # a bad dict in the log: reported for the log
    with open(rig.run / "metrics.jsonl", "a") as f:
        f.write('{"step": 1}\ngarbage\n{"step": 2}\n[]\n')
    rig.tick()
    with open(rig.run / "metrics.jsonl", "a") as f:
        f.write("more garbage\n")
    rig.tick()
    bad = {d["source"]: d for d in rig.rec.of("train.bad_metrics")}
    assert sorted(bad) == ["log", "metrics"] and len(rig.rec.of("train.bad_metrics")) == 2
    assert bad["metrics"]["bad_lines"] == 2 and bad["metrics"]["example"] == "garbage"
    assert rig.mon.status()["bad_lines"] == {"metrics": 3, "log": 1, "hfstate": 0, "csv": 0, "tfevents": 0}


def test_progress_telemetry_is_rate_limited(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", progress_every_s=5.0)
    rig.mon.start()
    run_steps(rig, range(1, 21))  # 20 s of one step a second
    progress = rig.rec.of("train.progress")
    assert 4 <= len(progress) <= 5
    assert progress[-1]["scalars"] == {"loss": pytest.approx(1 / 16)} and progress[-1]["steps_per_s"] == 1.0


def test_a_metric_stuck_at_zero_while_the_loss_falls(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", watch=("loss", "mAP"))
    rig.mon.start()
    for step in range(1, 40):
        line: Dict[str, Any] = {"step": step, "loss": 2.0 / step}
        if step % 10 == 0:
            line["mAP"] = 0.0
        rig.metrics(**line)
    rig.tick()
    assert rig.rec.counts() == {("train.metric_zero", "onset", "warn"): 1}
    assert rig.rec.of("train.metric_zero")[0]["step"] == 30


def test_a_watched_name_of_the_jobs_own_is_read_from_its_log_text(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", watch=("loss", "margin"))
    rig.mon.start()
    rig.log("".join(f"step={s} loss={2.0 / s} margin=0.0\n" for s in range(1, 40)))
    rig.tick()
    assert rig.rec.counts() == {("train.metric_zero", "onset", "warn"): 1}


def test_a_short_clean_exit_reads_the_last_lines_first(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run", expected_steps=300)
    rig.mon.start()
    run_steps(rig, range(1, 50))
    rig.metrics(step=100, loss=0.1)  # written just before the exit, not yet read
    rig.mon.on_job_exit(0)
    data = rig.rec.of("train.short_run")
    assert len(data) == 1 and (data[0]["last_step"], data[0]["by"]) == (100, "steps")
    rig.tick(1.0, n=100)
    assert rig.rec.of("job.stalled") == []  # no job: no stall
    assert rig.mon.status()["job_exited"] is True


def test_a_stall_pending_at_exit_ends_without_a_progressing_event(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run")
    rig.mon.start()
    run_steps(rig, range(1, 5))
    rig.tick(1.0, n=3)
    assert len(rig.rec.of("job.stalled")) == 1
    rig.mon.on_job_exit(1)
    rig.metrics(step=5)  # a line flushed late by a dying job
    rig.tick()
    assert rig.rec.of("job.progressing") == [] and rig.rec.of("train.short_run") == []


def test_a_failing_gpu_util_gives_the_verdict_unknown(tmp_path: Path, rigs: Any) -> None:
    rig = rigs(tmp_path / "run")

    def broken() -> Optional[float]:
        raise RuntimeError("nvml went away")

    rig.mon._gpu_util = broken
    rig.mon.start()
    run_steps(rig, range(1, 3))
    rig.tick(1.0, n=3)
    assert rig.rec.of("job.stalled")[0]["verdict"] == "unknown"


def test_a_torn_state_file_is_ignored(tmp_path: Path, rigs: Any) -> None:
    run = tmp_path / "run"
    (run / "rgt").mkdir(parents=True)
    (run / "rgt" / STATE_FILE).write_text('{"v": 1, "max_st')
    (run / "metrics.jsonl").write_text('{"step": 5}\n')
    rig = rigs(run)
    rig.mon.start()
    assert load_state(run / "rgt" / STATE_FILE)["max_step"] == 5


def test_on_the_real_scheduler_a_nan_arrives_without_a_tick_from_the_test(tmp_path: Path) -> None:
    rec = Recorder()
    mon = TrainingMonitor(TrainingConfig(run_dir=tmp_path), rec)
    mon.start()
    scheduler = Scheduler(mon.jobs(), lambda name, error: None)
    scheduler.start()
    try:
        written = time.monotonic()
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write('{"step": 1, "loss": "nan"}\n')
        with rec.cond:
            assert rec.cond.wait_for(lambda: rec.of("train.nonfinite"), timeout=WAIT_S)
        assert time.monotonic() - written < WAIT_S
    finally:
        scheduler.stop()
        mon.close()


# ---- framework signals: grad norm, files under the job's cwd, persistence --------------------------

def hf_line(loss: Any, grad: Any, epoch: float) -> str:
    return f"{{'loss': '{loss}', 'grad_norm': '{grad}', 'learning_rate': '5e-05', 'epoch': '{epoch}'}}\n"


def test_an_isolated_nan_grad_norm_does_not_wake_a_frozen_loss_with_one_does(tmp_path: Path,
                                                                             rigs: Any) -> None:
    rig = rigs(tmp_path / "run")
    rig.mon.start()
    for i, (loss, grad) in enumerate([(3.9, 0.9), (3.8, "nan"), (3.7, 0.8), (3.6, 0.7)]):
        bar = f"\r 10%|█ | {5 * (i + 1)}/60 [00:01<00:02, 14.89it/s]\r"
        rig.log(bar + hf_line(loss, grad, 0.1 * (i + 1)))
        rig.tick()
    assert rig.rec.of("train.nonfinite") == []
    rig.log(hf_line(0, "nan", 0.5) + hf_line(0, "nan", 0.6))  # NaN weights under logging_nan_inf_filter
    rig.tick()
    (onset,) = rig.rec.of("train.nonfinite")
    assert (onset["name"], onset["reason"], onset["step"]) == ("grad_norm", "frozen_loss", 20)
    assert rig.mon.status()["total_steps"] == 60


def test_framework_files_are_judged_once_across_a_sidecar_restart(tmp_path: Path, rigs: Any) -> None:
    cwd = tmp_path / "cwd"
    csv = cwd / "lightning_logs" / "version_0" / "metrics.csv"
    csv.parent.mkdir(parents=True)
    rig = rigs(tmp_path / "run", job_cwd=cwd, scan_s=0.0)
    rig.mon.start()
    csv.write_text("epoch,step,train_loss\n0,4,0.9\n0,9,nan\n")
    rig.tick()
    assert [(d["name"], d["source"], d["step"]) for d in rig.rec.of("train.nonfinite")] == [
        ("train_loss", "csv", 9)]
    rig.mon.close()
    with open(csv, "a") as f:
        f.write("0,14,0.5\n0,19,0.4\n0,24,0.3\n")
    again = rigs(tmp_path / "run", job_cwd=cwd, scan_s=0.0)
    again.mon.start()
    again.tick()
    assert again.rec.of("train.nonfinite", state="onset") == []          # the nan row is not judged again
    assert [d["state"] for d in again.rec.of("train.nonfinite")] == ["cleared"]
    assert again.mon.status()["step"] == 24


def test_a_sub_epoch_restart_is_found_from_trainer_state_global_step(tmp_path: Path, rigs: Any) -> None:
    cwd = tmp_path / "cwd"
    rig = rigs(tmp_path / "run", job_cwd=cwd, scan_s=0.0)
    rig.mon.start()
    for step in (20, 40, 60):
        state = cwd / "out" / f"checkpoint-{step}" / "trainer_state.json"
        state.parent.mkdir(parents=True)
        history = [{"loss": 3.9, "epoch": s / 640, "step": s} for s in range(5, step + 1, 5)]
        state.write_text(json.dumps({"global_step": step, "max_steps": 600, "log_history": history}))
        rig.tick()
    assert rig.rec.of("train.restarted_from_zero") == []
    state = cwd / "out" / "checkpoint-10" / "trainer_state.json"
    state.parent.mkdir(parents=True)
    history = [{"loss": 4.0, "epoch": 0.008, "step": 5}]
    state.write_text(json.dumps({"global_step": 10, "log_history": history}))
    rig.tick()
    (restart,) = rig.rec.of("train.restarted_from_zero")
    assert (restart["last_step"], restart["new_step"], restart["by"]) == (60, 5, "step")
