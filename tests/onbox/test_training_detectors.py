"""The training detectors: pure state machines fed values and a time; onsets and clears only."""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

from onbox.detectors.hysteresis import Finding
from onbox.detectors.training import (
    GradNormGate,
    LossSpikeDetector,
    MetricZeroDetector,
    NonfiniteDetector,
    ProgressReporter,
    RestartDetector,
    ShortRunDetector,
    SlowDetector,
    StallDetector,
    TrainingThresholds,
    is_grad_norm_name,
    p95,
    plain,
)

T = TrainingThresholds()
NAN, INF = math.nan, math.inf


def states(findings: List[Finding]) -> List[tuple]:
    return [(f.kind, f.data.get("state"), f.sev) for f in findings]


# ---- non-finite -----------------------------------------------------------------------------------


def test_nonfinite_fires_once_per_episode_and_clears_after_finite_values() -> None:
    d = NonfiniteDetector(clear_n=3)
    out = d.update("loss", 0.5, 1, None, "metrics")
    out += d.update("loss", NAN, 2, None, "metrics")
    assert states(out) == [("train.nonfinite", "onset", "critical")]
    assert out[0].data["value"] == "nan" and out[0].data["step"] == 2
    assert d.update("loss", INF, 3, None, "metrics") == []           # same episode
    assert d.update("loss", 0.4, 4, None, "metrics") == []
    assert d.update("loss", 0.4, 5, None, "metrics") == []
    assert d.update("loss", NAN, 6, None, "metrics") == []           # a flap resets the count
    assert [d.update("loss", 0.3, s, None, "metrics") for s in (7, 8)] == [[], []]
    cleared = d.update("loss", 0.3, 9, None, "metrics")
    assert states(cleared) == [("train.nonfinite", "cleared", "info")]
    assert cleared[0].data["nonfinite_values"] == 3 and cleared[0].data["since_step"] == 2
    again = d.update("loss", -INF, 10, None, "metrics")
    assert states(again) == [("train.nonfinite", "onset", "critical")] and again[0].data["value"] == "-inf"


def test_nonfinite_is_per_name_and_a_restored_episode_does_not_fire_again() -> None:
    d = NonfiniteDetector(active=["loss"])
    assert d.update("loss", NAN, 1, None, "log") == []
    assert states(d.update("grad_norm", INF, 1, None, "log")) == [("train.nonfinite", "onset", "critical")]


# ---- stall ----------------------------------------------------------------------------------------


def stall_t(**kw: float) -> TrainingThresholds:
    return dataclasses.replace(T, stall_floor_s=1.0, stall_k=2.0, stall_grace_s=30.0, **kw)


def test_stall_budget_follows_the_runs_own_step_interval() -> None:
    d = StallDetector(stall_t(), now=0.0)
    for i in range(10):
        d.note_step(10.0 + 3 * i, step=i, epoch=None)           # a step every 3 s, last at 37
    assert d.budget_s() == 6.0                                   # max(1, 2 x p95 3 s)
    assert d.check(42.9, gpu_util=95.0) == []
    out = d.check(43.0, gpu_util=95.0)
    assert states(out) == [("job.stalled", "onset", "warn")]
    assert out[0].data["verdict"] == "hung" and out[0].data["phase"] == "training"
    assert out[0].data["step"] == 9 and out[0].data["idle_s"] == 6.0
    assert d.check(50.0, gpu_util=95.0) == []                     # one onset
    back = d.note_step(60.0, step=10, epoch=None)
    assert states(back) == [("job.progressing", "cleared", "info")] and back[0].data["stalled_s"] == 23.0


def test_stall_verdict_is_idle_or_unknown_by_gpu_use() -> None:
    for util, verdict in ((3.0, "idle"), (None, "unknown"), (20.0, "hung")):
        d = StallDetector(stall_t(), now=0.0)
        d.note_step(0.5, 1, None)
        d.note_step(1.0, 2, None)
        assert d.check(2.0, util)[0].data["verdict"] == verdict


def test_until_the_step_interval_is_known_the_grace_applies_and_log_growth_postpones() -> None:
    d = StallDetector(stall_t(), now=0.0)
    assert d.note_step(0.0, 1, None) == [] and d.budget_s() == 30.0     # one step: no interval yet
    d.note_step(0.0, 2, None)                                           # read at the same time: still none
    assert d.budget_s() == 30.0
    assert d.check(29.0, None) == []
    d.note_activity(20.0, "log")                                 # start-up prints
    assert d.check(49.0, None) == []
    out = d.check(50.0, None)
    assert out[0].data["phase"] == "startup" and out[0].data["budget_s"] == 30.0
    assert states(d.note_step(51.0, 3, None)) == [("job.progressing", "cleared", "info")]


def test_once_started_only_a_step_or_checkpoint_clears_a_stall() -> None:
    d = StallDetector(stall_t(), now=0.0)
    d.note_step(0.5, 1, None)
    d.note_step(1.0, 2, None)
    d.note_activity(1.5, "log")
    assert d.check(2.4, None) == []                               # log growth postponed the onset
    assert states(d.check(2.5, None)) == [("job.stalled", "onset", "warn")]
    assert d.note_activity(3.0, "log") == []                      # a timeout warning is not progress
    assert d.stalled
    assert states(d.note_checkpoint(4.0)) == [("job.progressing", "cleared", "info")]


def test_a_disarmed_stall_detector_reports_nothing() -> None:
    d = StallDetector(stall_t(), now=0.0)
    d.note_step(1.0, 1, None)
    d.disarm()
    assert d.check(100.0, None) == [] and d.note_step(101.0, 2, None) == []
    d.rearm(200.0)
    assert not d.started and d.budget_s() == 30.0


def test_p95() -> None:
    assert p95([]) is None
    assert p95([1.0] * 19 + [10.0]) == 1.0
    assert p95([1.0] * 18 + [10.0, 10.0]) == 10.0


# ---- slow -----------------------------------------------------------------------------------------


def test_slow_needs_progress_with_low_gpu_use_sustained_and_clears() -> None:
    t = dataclasses.replace(T, slow_onset_s=10.0, slow_clear_s=5.0)
    d = SlowDetector(t)
    assert d.update(0.0, 5.0, progressing=False, steps_per_s=None) == []   # a stall is not slow
    assert d.update(1.0, None, progressing=True, steps_per_s=2.0) == []    # unknown: no evidence
    out: List[Finding] = []
    for s in range(2, 14):
        out += d.update(float(s), 5.0, progressing=True, steps_per_s=2.0)
    assert states(out) == [("train.slow", "onset", "warn")]
    assert out[0].data["verdict"] == "data-bound" and out[0].data["held_s"] == 10.0
    out = []
    for s in range(14, 22):
        out += d.update(float(s), 90.0, progressing=True, steps_per_s=9.0)
    assert states(out) == [("train.slow", "cleared", "info")]


def test_an_idle_gpu_without_progress_is_not_slow() -> None:
    d = SlowDetector(dataclasses.replace(T, slow_onset_s=10.0))
    assert [f for s in range(100) for f in d.update(float(s), 2.0, False, None)] == []


def test_a_restored_slow_episode_is_not_reported_again() -> None:
    d = SlowDetector(dataclasses.replace(T, slow_onset_s=1.0, slow_clear_s=2.0), active=True)
    assert d.active
    assert d.update(0.0, 5.0, True, None) == [] and d.update(5.0, 5.0, True, None) == []
    assert states(d.update(8.0, 90.0, True, None)) == [("train.slow", "cleared", "info")]


# ---- restart --------------------------------------------------------------------------------------


def test_restart_is_a_step_far_under_the_high_water_mark() -> None:
    d = RestartDetector(T)
    out: List[Finding] = []
    for step in range(10, 160, 10):
        out += d.update(step, step / 300)
    out += d.update(140, 140 / 300)                                  # a small step back: not a restart
    assert out == []
    back = d.update(10, 10 / 300)
    assert states(back) == [("train.restarted_from_zero", None, "warn")]
    assert (back[0].data["last_step"], back[0].data["new_step"]) == (150, 10)
    assert d.update(20, 20 / 300) == []                              # the new attempt's own high water


def test_restart_needs_a_minimum_and_ignores_per_epoch_step_counters() -> None:
    d = RestartDetector(T)
    assert d.update(15, None) == [] and d.update(1, None) == []        # under restart_min_step
    e = RestartDetector(T)
    for epoch in range(3):
        for step in range(0, 100, 10):
            assert e.update(step, float(epoch)) == []                   # step resets each epoch
    f = RestartDetector(T)  # "Epoch 1/3" on its own line, then "step 0 loss ..." lines
    assert f.update(None, 0.0) == [] and f.update(90, None) == []
    assert f.update(None, 1.0) == [] and f.update(0, None) == [] and f.update(10, None) == []
    g = RestartDetector(T)
    assert g.update(None, 2.5) == []
    assert [x.data["new_epoch"] for x in g.update(None, 0.01)] == [0.01]  # epochs only (HF)


def test_restart_from_a_saved_high_water_mark() -> None:
    d = RestartDetector(T, max_step=1000, max_epoch=None)
    assert d.update(1, None)[0].data["last_step"] == 1000


# ---- metric zero ----------------------------------------------------------------------------------


def test_metric_zero_needs_n_evaluations_and_a_falling_loss() -> None:
    d = MetricZeroDetector(T, ["map"])
    for loss in (2.0, 2.0, 2.0):
        d.note_loss(loss)
    assert d.update("map", 0.0, 100, None) == []
    d.note_loss(1.0)
    assert d.update("map", 0.0, 200, None) == []
    d.note_loss(0.5)
    out = d.update("map", 0.0, 300, None)
    assert states(out) == [("train.metric_zero", "onset", "warn")]
    assert out[0].data["evaluations"] == 3 and out[0].data["loss_then"] == 2.0
    assert d.update("map", 0.0, 400, None) == []
    assert states(d.update("map", 0.1, 500, None)) == [("train.metric_zero", "cleared", "info")]
    assert d.update("other", 0.0, 600, None) == []                   # not watched


def test_metric_zero_stays_quiet_while_the_loss_does_not_fall() -> None:
    d = MetricZeroDetector(T, ["acc"])
    out: List[Finding] = []
    for step in range(10):
        d.note_loss(1.0)
        out += d.update("acc", 0.0, step, None)
    assert out == []


# ---- loss spike -----------------------------------------------------------------------------------


def noisy(n: int, base: float = 1.0) -> List[float]:
    return [base + 0.01 * ((i * 7) % 5 - 2) for i in range(n)]


def test_a_spike_fires_once_and_clears_after_calm_values() -> None:
    d = LossSpikeDetector(T, "loss")
    out: List[Finding] = []
    for v in noisy(30):
        out += d.update(v, None, None)
    assert out == []
    out = d.update(3.0, 31, None)
    assert states(out) == [("train.loss_spike", "onset", "warn")] and out[0].data["value"] == 3.0
    out = []
    for v in [2.5, 1.0, 2.8] + noisy(9):
        out += d.update(v, None, None)
    assert out == []                                                   # high values restart the calm count
    cleared = d.update(1.0, 50, None)
    assert states(cleared) == [("train.loss_spike", "cleared", "info")] and cleared[0].data["peak"] == 3.0


def test_a_noisy_run_does_not_flood() -> None:
    d = LossSpikeDetector(T, "loss")
    out: List[Finding] = []
    for i in range(500):
        out += d.update(1.0 + (0.8 if i % 3 == 0 else 0.0), None, None)   # big noise, no spikes
    assert out == []
    e = LossSpikeDetector(T, "loss")
    out = []
    for i, v in enumerate(noisy(300)):
        out += e.update(5.0 if i > 30 and i % 7 == 0 else v, None, None)   # spikes every 7 values
    assert [f.data["state"] for f in out] == ["onset"]                   # one episode


def test_no_spike_before_the_window_fills_or_under_the_relative_floor() -> None:
    d = LossSpikeDetector(T, "loss")
    assert d.update(1.0, None, None) == [] and d.update(100.0, None, None) == []
    e = LossSpikeDetector(T, "loss")
    for _ in range(30):
        e.update(10.0, None, None)
    assert e.update(10.5, None, None) == []                            # 5 %: beyond k sigma (0) but small


# ---- short run, progress ---------------------------------------------------------------------------


def test_short_run_on_a_clean_exit_only() -> None:
    d = ShortRunDetector(T, started_at=1000.0, expected_steps=300, expected_seconds=3600.0)
    d.observe(100)
    assert d.on_job_exit(2000.0, 1) == []                               # a failure: job.exited says it
    out = d.on_job_exit(2000.0, 0)
    assert states(out) == [("train.short_run", None, "warn")]
    assert out[0].data["by"] == "seconds" and out[0].data["fraction"] == 0.278
    assert d.on_job_exit(2000.0, 0) == []                               # once
    ok = ShortRunDetector(T, started_at=0.0, expected_steps=300)
    ok.observe(300)
    assert ok.on_job_exit(10.0, 0) == []
    by_steps = ShortRunDetector(T, started_at=0.0, expected_steps=300)
    by_steps.observe(100)
    assert by_steps.on_job_exit(10.0, 0)[0].data["by"] == "steps"


def test_progress_is_rate_limited_bounded_and_only_when_fresh() -> None:
    t = dataclasses.replace(T, progress_every_s=5.0, progress_max_scalars=3)
    d = ProgressReporter(t, watch=["loss"])
    assert d.due(0.0) == []
    d.observe(0.0, 10, 0.1, {"a": 1.0, "b": 2.0, "c": 3.0, "loss": NAN})
    first = d.due(0.0)
    assert [f.kind for f in first] == ["train.progress"]
    assert first[0].data["scalars"] == {"loss": "nan", "a": 1.0, "b": 2.0}
    d.observe(2.0, 20, 0.2, {})
    assert d.due(4.9) == []
    second = d.due(5.0)
    assert second[0].data["steps_per_s"] == 5.0 and second[0].data["data_age_s"] == 3.0
    assert d.due(20.0) == []                                            # nothing new


def test_plain() -> None:
    got: List[Optional[object]] = [plain(NAN), plain(INF), plain(-INF), plain(1.5)]
    assert got == ["nan", "inf", "-inf", 1.5]


# ---- grad norm gate ---------------------------------------------------------------------------

def test_an_isolated_nonfinite_grad_norm_is_fp16_scaling_not_a_wake() -> None:
    gate = GradNormGate(3)
    losses = [3.9, 3.8, 3.7, 3.6, 3.5]
    grads = [0.9, math.nan, 0.8, math.inf, 0.7]
    prev = None
    for loss, grad in zip(losses, grads):
        assert gate.judge(grad, loss, prev) is None
        prev = loss


def test_a_grad_norm_wakes_when_it_persists_or_the_loss_is_frozen_or_nonfinite() -> None:
    gate = GradNormGate(3)
    assert [gate.judge(math.nan, loss, prev) for loss, prev in ((3.0, 3.1), (2.9, 3.0), (2.8, 2.9))] \
        == [None, None, "persisted"]
    assert GradNormGate(3).judge(math.nan, 0.0, 0.0) == "frozen_loss"   # logging_nan_inf_filter
    assert GradNormGate(3).judge(math.inf, math.nan, 3.0) == "nonfinite_loss"
    assert is_grad_norm_name("train/grad_norm") and not is_grad_norm_name("loss")


def test_a_restart_found_by_the_epoch_resets_the_step_mark_too() -> None:
    d = RestartDetector(T)
    for step in range(5, 65, 5):       # HF: the bar's step and the dict line's epoch fraction
        assert d.update(step, None) == [] and d.update(None, step / 64) == []
    first = d.update(None, 5 / 64)       # the sub-epoch run starts again: its epoch falls first
    assert [f.data["by"] for f in first] == ["epoch"]
    assert d.update(5, None) == [] and d.update(10, None) == []          # one event, not two
