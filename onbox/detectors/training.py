"""Training-signal detectors: non-finite values, stalls, slow runs, restarts, zero metrics, spikes.

Each is a small state machine fed parsed values and a time (seconds on a monotonic clock, except
`ShortRunDetector`, which works on unix time because its start survives sidecar restarts). Each
returns `Finding`s only on an onset or a clear; a clear is the same kind with ``state: "cleared"``
at info (as `mem.pressure` does), except the stall, which clears as `job.progressing`.

    NonfiniteDetector  a watched value NaN/Inf -> train.nonfinite (critical), per name
    GradNormGate       whether a non-finite grad norm is worth that wake (persisting, or with a
                       non-finite or frozen loss; an isolated one is fp16 loss scaling at work)
    StallDetector      no progress past max(floor, k x p95 step interval) -> job.stalled (verdict
                       from GPU use: hung / idle / unknown); progress again -> job.progressing
    SlowDetector       steps advance while the GPU idles -> train.slow (data-bound)
    RestartDetector    step/epoch falls far under its high-water mark -> train.restarted_from_zero
    MetricZeroDetector a metric exactly 0 over N evaluations while the loss falls -> train.metric_zero
    LossSpikeDetector  the loss beyond k sigma of its rolling window -> train.loss_spike
    ShortRunDetector   a clean exit far short of the expected steps/seconds -> train.short_run
    ProgressReporter   latest step/epoch/scalars, steps/s, data age -> train.progress (rate-limited);
                       only metric names (`protocol.metrics`): never a time/timestamp field
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from protocol import metrics

from onbox.detectors.hysteresis import CLEAR, ONSET, Finding, Hysteresis


@dataclasses.dataclass(frozen=True)
class TrainingThresholds:
    nonfinite_clear_n: int = 3       # finite values in a row that end a non-finite episode
    stall_floor_s: float = 300.0
    stall_k: float = 2.0             # budget = max(floor, k x p95 of the recent step intervals)
    stall_grace_s: float = 900.0     # budget until the step interval is known (loading, compiling)
    stall_window: int = 32           # recent step intervals in the p95
    busy_pct: float = 20.0           # GPU use at or above this during a stall: "hung"; under: "idle"
    slow_util_pct: float = 30.0      # steps advance while GPU use stays under this: data-bound
    slow_onset_s: float = 120.0
    slow_clear_s: float = 60.0
    slow_gap_s: float = 10.0
    restart_ratio: float = 0.5       # a step under this fraction of the high-water mark is a restart
    restart_min_step: int = 20       # ... once the high-water mark reached this step
    restart_min_epoch: float = 0.01  # ... or, judged by epochs, this epoch (sub-epoch runs too)
    grad_nonfinite_n: int = 3        # non-finite grad norms in a row that wake on their own
    zero_n: int = 3                  # evaluations in a row at exactly 0
    zero_loss_n: int = 5             # recent losses averaged to tell whether the loss falls
    spike_window: int = 50
    spike_min_n: int = 20            # values in the window before spikes are judged
    spike_k: float = 6.0
    spike_min_rel: float = 0.2       # and at least this fraction above the window's mean
    spike_clear_k: float = 3.0       # the episode ends after spike_clear_n values under mean + this
    spike_clear_n: int = 10
    short_frac: float = 0.5          # a clean exit under this fraction of the expected run is short
    progress_every_s: float = 5.0
    progress_max_scalars: int = 16
    rate_window: int = 32            # step observations in steps/s


Plain = Union[float, str]


def plain(value: float) -> Plain:
    """A float as our protocol carries it: non-finite as "nan" / "inf" / "-inf"."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def is_loss_name(name: str) -> bool:
    """A loss-named metric (loss, eval_loss, train/loss): never a file name such as loss_utils.py."""
    return metrics.is_loss_name(name)


_GRAD_NORM = re.compile(r"^(?:global_)?grad(?:ient)?s?_?(?:[\d.]+_)?norm(?:_total)?$")


def is_grad_norm_name(name: str) -> bool:
    """grad_norm, train/grad_norm, gradient_norm, grad_2.0_norm_total (Lightning's `grad_norm`)."""
    return _GRAD_NORM.match(name.lower().rsplit("/", 1)[-1]) is not None


def p95(values: Iterable[float]) -> Optional[float]:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _r(value: Optional[float], digits: int = 3) -> Optional[float]:
    return None if value is None else round(value, digits)


class NonfiniteDetector:
    """`train.nonfinite` at the first NaN/Inf of a name; cleared after `clear_n` finite values."""

    def __init__(self, clear_n: int = 3, active: Iterable[str] = ()) -> None:
        self.clear_n = max(1, clear_n)
        self.active: Dict[str, Dict[str, Any]] = {name: {"step": None, "count": 0} for name in active}
        self._finite: Dict[str, int] = {}

    def update(self, name: str, value: float, step: Optional[int], epoch: Optional[float],
               source: str, extra: Optional[Dict[str, Any]] = None) -> List[Finding]:
        data = {"name": name, "value": plain(value), "step": step, "epoch": epoch, "source": source}
        if not math.isfinite(value):
            self._finite[name] = 0
            if name in self.active:
                self.active[name]["count"] += 1
                return []
            self.active[name] = {"step": step, "count": 1}
            return [Finding("train.nonfinite", {"state": "onset", **data, **(extra or {})}, "critical")]
        if name not in self.active:
            return []
        self._finite[name] = self._finite.get(name, 0) + 1
        if self._finite[name] < self.clear_n:
            return []
        onset = self.active.pop(name)
        data.update({"state": "cleared", "since_step": onset["step"], "nonfinite_values": onset["count"]})
        return [Finding("train.nonfinite", data, "info")]


class GradNormGate:
    """Whether a non-finite grad norm should wake (`judge` gives the reason, or None).

    Under fp16 loss scaling an inf/NaN grad norm now and then is normal: the scaler skips that
    step and lowers the scale. It wakes when it persists for `n` logs in a row ("persisted"), or
    comes with a non-finite loss ("nonfinite_loss") or a frozen one, the same value as the log
    before ("frozen_loss"): the Hugging Face Trainer's default `logging_nan_inf_filter` logs a
    NaN step's loss as the running mean, so NaN weights show as a constant loss and a NaN grad norm.
    """

    def __init__(self, n: int = 3) -> None:
        self.n = max(1, n)
        self.streak = 0

    def judge(self, value: float, loss: Optional[float], prev_loss: Optional[float]) -> Optional[str]:
        if math.isfinite(value):
            self.streak = 0
            return None
        self.streak += 1
        if loss is not None and not math.isfinite(loss):
            return "nonfinite_loss"
        if loss is not None and prev_loss is not None and loss == prev_loss:
            return "frozen_loss"
        return "persisted" if self.streak >= self.n else None


class StallDetector:
    """`job.stalled` when no progress signal came within the budget (`budget_s`); then
    `job.progressing`.

    Signals: a step/epoch advance (`note_step`), a checkpoint write (`note_checkpoint`), growth of
    train.log or metrics.jsonl (`note_activity`). Any of them postpones the onset. Once the run has
    started (a step or a checkpoint was seen), only a step or a checkpoint clears a stall: a hung
    job that prints a timeout warning has not recovered. Before that, any signal clears it.
    """

    def __init__(self, t: TrainingThresholds, now: float, *, started: bool = False,
                 intervals: Iterable[float] = (), stalled: bool = False) -> None:
        self.t = t
        self.armed = True
        self.started = started
        self.last_activity = now
        self.last_signal: Optional[str] = None
        self.last_progress_at: Optional[float] = None
        self.intervals: Deque[float] = collections.deque(intervals, maxlen=t.stall_window)
        self.stalled = stalled
        self.idle_since: Optional[float] = now if stalled else None
        self.step: Optional[int] = None
        self.epoch: Optional[float] = None

    def note_step(self, now: float, step: Optional[int], epoch: Optional[float],
                  timing: bool = True) -> List[Finding]:
        """A step or epoch advanced. Lines read at one time are one observation (one interval);
        `timing=False` for lines whose write time is unknown (replay)."""
        if timing and self.last_progress_at is not None and now > self.last_progress_at:
            self.intervals.append(now - self.last_progress_at)
        self.last_progress_at = now
        self.step = step if step is not None else self.step
        self.epoch = epoch if epoch is not None else self.epoch
        self.started = True
        return self._activity(now, "step", True)

    def note_checkpoint(self, now: float) -> List[Finding]:
        self.started = True
        return self._activity(now, "ckpt", True)

    def note_progress(self, now: float, signal: str) -> List[Finding]:
        """Progress seen by a source that does not own the step (no step interval is timed)."""
        self.started = True
        return self._activity(now, signal, True)

    def note_activity(self, now: float, signal: str) -> List[Finding]:
        return self._activity(now, signal, False)

    def _activity(self, now: float, signal: str, progress: bool) -> List[Finding]:
        self.last_activity = max(self.last_activity, now)
        self.last_signal = signal
        if not (self.stalled and (progress or not self.started)):
            return []
        self.stalled = False
        idle_s = None if self.idle_since is None else round(now - self.idle_since, 1)
        self.idle_since = None
        if not self.armed:
            return []
        data = {"state": "cleared", "signal": signal, "stalled_s": idle_s, "step": self.step,
                "epoch": self.epoch}
        return [Finding("job.progressing", data, "info")]

    def budget_s(self) -> float:
        """The start-up grace until the step interval is known (two step observations), then
        max(floor, k x p95 of the recent intervals)."""
        interval = p95(self.intervals)
        if interval is None:
            return self.t.stall_grace_s
        return max(self.t.stall_floor_s, self.t.stall_k * interval)

    def check(self, now: float, gpu_util: Optional[float]) -> List[Finding]:
        if not self.armed or self.stalled:
            return []
        idle_s, budget = now - self.last_activity, self.budget_s()
        if idle_s < budget:
            return []
        self.stalled, self.idle_since = True, self.last_activity
        if gpu_util is None:
            verdict = "unknown"
        else:
            verdict = "hung" if gpu_util >= self.t.busy_pct else "idle"
        data: Dict[str, Any] = {
            "state": "onset", "verdict": verdict, "idle_s": round(idle_s, 1), "budget_s": round(budget, 2),
            "phase": "startup" if not self.intervals else "training", "gpu_util_pct": _r(gpu_util, 1),
            "step_interval_p95_s": _r(p95(self.intervals)), "last_signal": self.last_signal,
            "step": self.step, "epoch": self.epoch}
        return [Finding("job.stalled", data, "warn")]

    def progressing(self, now: float) -> bool:
        """Steps advance: started, not stalled, the last step within the budget."""
        return (self.armed and self.started and not self.stalled and self.last_progress_at is not None
                and now - self.last_progress_at < self.budget_s())

    def disarm(self) -> None:
        """The job ended: no stall can be judged (a pending one ends without an event)."""
        self.armed = False
        self.stalled = False

    def rearm(self, now: float) -> None:
        """A new job started: start-up grace again, until its own step interval is known."""
        self.armed, self.started, self.stalled = True, False, False
        self.last_activity, self.last_progress_at, self.idle_since = now, None, None
        self.intervals.clear()


class SlowDetector:
    """`train.slow` (data-bound) when steps advance while GPU use stays under `slow_util_pct`."""

    def __init__(self, t: TrainingThresholds, active: bool = False) -> None:
        self.t = t
        self.machine = Hysteresis(t.slow_onset_s, t.slow_clear_s, t.slow_gap_s)
        self.restored = active  # reported by an earlier sidecar: no second onset for this episode

    @property
    def active(self) -> bool:
        return self.machine.active or self.restored

    def update(self, now: float, gpu_util: Optional[float], progressing: bool,
               steps_per_s: Optional[float]) -> List[Finding]:
        if gpu_util is None:
            return []
        condition = progressing and gpu_util < self.t.slow_util_pct
        if self.restored:
            self.machine.active = True
            self.machine.episode_start = self.machine.last_seen = now
            self.restored = False
        transition = self.machine.update(condition, now)
        data: Dict[str, Any] = {"gpu_util_pct": round(gpu_util, 1), "steps_per_s": _r(steps_per_s)}
        if transition == ONSET:
            data.update({"state": "onset", "verdict": "data-bound",
                         "held_s": round(self.machine.held_s(now), 1)})
            return [Finding("train.slow", data, "warn")]
        if transition == CLEAR:
            return [Finding("train.slow", {"state": "cleared", **data}, "info")]
        return []


class RestartDetector:
    """`train.restarted_from_zero` when the step (or epoch) falls far under its high-water mark.

    A step that falls right after the epoch advanced is a per-epoch step counter, not a restart.
    After a restart the high-water mark starts again from the new step, so each restart is one event.
    """

    def __init__(self, t: TrainingThresholds, max_step: Optional[int] = None,
                 max_epoch: Optional[float] = None, restarts: int = 0) -> None:
        self.t = t
        self.max_step = max_step
        self.max_epoch = max_epoch
        self.last_epoch: Optional[float] = max_epoch
        self.restarts = restarts
        self._epoch_moved = False

    def update(self, step: Optional[int], epoch: Optional[float]) -> List[Finding]:
        t = self.t
        if epoch is not None and self.last_epoch is not None and epoch > self.last_epoch:
            self._epoch_moved = True
        step_back = (step is not None and self.max_step is not None and self.max_step >= t.restart_min_step
                     and step < t.restart_ratio * self.max_step and not self._epoch_moved)
        epoch_back = (epoch is not None and self.max_epoch is not None
                      and self.max_epoch >= t.restart_min_epoch and epoch < t.restart_ratio * self.max_epoch)
        out: List[Finding] = []
        if step_back or epoch_back:
            self.restarts += 1
            data = {"last_step": self.max_step, "new_step": step, "last_epoch": self.max_epoch,
                    "new_epoch": epoch, "restarts": self.restarts,
                    "by": "step" if step_back else "epoch"}
            out.append(Finding("train.restarted_from_zero", data, "warn"))
            # both marks start again: the other counter (often on another line) falls with this one
            self.max_step, self.max_epoch = step, epoch
        else:
            if step is not None:
                moved = self._epoch_moved or self.max_step is None
                self.max_step = step if moved else max(self.max_step or 0, step)
            if epoch is not None:
                self.max_epoch = epoch if self.max_epoch is None else max(self.max_epoch, epoch)
        if step is not None:
            self._epoch_moved = False
        if epoch is not None:
            self.last_epoch = epoch
        return out


class MetricZeroDetector:
    """`train.metric_zero` when a watched metric is exactly 0 for `zero_n` evaluations in a row
    while the loss falls (the mean of the last `zero_loss_n` losses is under its value when the
    zero streak began); cleared at the first non-zero value."""

    def __init__(self, t: TrainingThresholds, names: Iterable[str], active: Iterable[str] = ()) -> None:
        self.t = t
        self.names = {n.lower() for n in names}
        self.active: Set[str] = set(active)
        self.streak: Dict[str, int] = {}
        self.loss_then: Dict[str, Optional[float]] = {}
        self.losses: Deque[float] = collections.deque(maxlen=t.zero_loss_n)

    def note_loss(self, value: float) -> None:
        if math.isfinite(value):
            self.losses.append(value)

    def loss_level(self) -> Optional[float]:
        return sum(self.losses) / len(self.losses) if self.losses else None

    def update(self, name: str, value: float, step: Optional[int], epoch: Optional[float]) -> List[Finding]:
        if name.lower() not in self.names or not math.isfinite(value):
            return []
        if value != 0.0:
            self.streak.pop(name, None)
            self.loss_then.pop(name, None)
            if name not in self.active:
                return []
            self.active.discard(name)
            data = {"state": "cleared", "name": name, "value": value, "step": step, "epoch": epoch}
            return [Finding("train.metric_zero", data, "info")]
        count = self.streak[name] = self.streak.get(name, 0) + 1
        if self.loss_then.get(name) is None:
            self.loss_then[name] = self.loss_level()
        then, now = self.loss_then[name], self.loss_level()
        if name in self.active or count < self.t.zero_n or then is None or now is None or now >= then:
            return []
        self.active.add(name)
        data = {"state": "onset", "name": name, "evaluations": count, "loss_then": _r(then, 6),
                "loss_now": _r(now, 6), "step": step, "epoch": epoch}
        return [Finding("train.metric_zero", data, "warn")]


class LossSpikeDetector:
    """`train.loss_spike` when a value exceeds mean + k sigma of the rolling window (and the mean by
    `spike_min_rel`); the episode ends after `spike_clear_n` values in a row under mean +
    clear_k sigma, so a noisy stretch is one episode. Spiking values never enter the window."""

    def __init__(self, t: TrainingThresholds, name: str) -> None:
        self.t = t
        self.name = name
        self.window: Deque[float] = collections.deque(maxlen=t.spike_window)
        self.active = False
        self.calm = 0
        self.peak: Optional[float] = None

    def _stats(self) -> Tuple[float, float]:
        n = len(self.window)
        mean = sum(self.window) / n
        return mean, math.sqrt(sum((v - mean) ** 2 for v in self.window) / n)

    def update(self, value: float, step: Optional[int], epoch: Optional[float]) -> List[Finding]:
        if not math.isfinite(value):
            return []
        t = self.t
        if len(self.window) < t.spike_min_n:
            self.window.append(value)
            return []
        mean, sd = self._stats()
        spike = value > mean + t.spike_k * sd and value - mean > t.spike_min_rel * max(abs(mean), 1e-12)
        out: List[Finding] = []
        if spike and not self.active:
            self.active, self.calm, self.peak = True, 0, value
            data = {"state": "onset", "name": self.name, "value": value, "mean": _r(mean, 6),
                    "sigma": _r(sd, 6), "k": t.spike_k, "step": step, "epoch": epoch}
            out.append(Finding("train.loss_spike", data, "warn"))
        elif self.active:
            self.peak = max(self.peak or value, value)
            if value > mean + t.spike_clear_k * sd:
                self.calm = 0
            else:
                self.calm += 1
                if self.calm >= t.spike_clear_n:
                    self.active = False
                    data = {"state": "cleared", "name": self.name, "value": value, "peak": self.peak,
                            "mean": _r(mean, 6), "step": step, "epoch": epoch}
                    out.append(Finding("train.loss_spike", data, "info"))
        if not spike:
            self.window.append(value)
        return out


class ShortRunDetector:
    """`train.short_run` once, when the job exits 0 under `short_frac` of the expected steps or
    seconds. Times are unix seconds; `started_at` is the run's first job start."""

    def __init__(self, t: TrainingThresholds, started_at: float, expected_steps: Optional[int] = None,
                 expected_seconds: Optional[float] = None) -> None:
        self.t = t
        self.started_at = started_at
        self.expected_steps = expected_steps
        self.expected_seconds = expected_seconds
        self.last_step: Optional[int] = None
        self.reported = False

    def observe(self, step: Optional[int]) -> None:
        if step is not None:
            self.last_step = step

    def on_job_exit(self, now: float, code: Optional[int]) -> List[Finding]:
        if self.reported or code != 0:
            return []
        elapsed = max(0.0, now - self.started_at)
        fractions: Dict[str, float] = {}
        if self.expected_steps and self.last_step is not None:
            fractions["steps"] = self.last_step / self.expected_steps
        if self.expected_seconds:
            fractions["seconds"] = elapsed / self.expected_seconds
        short = {k: v for k, v in fractions.items() if v < self.t.short_frac}
        if not short:
            return []
        self.reported = True
        by = min(short, key=lambda k: short[k])
        data = {"code": code, "by": by, "fraction": round(short[by], 3), "last_step": self.last_step,
                "expected_steps": self.expected_steps, "elapsed_s": round(elapsed, 1),
                "expected_seconds": self.expected_seconds}
        return [Finding("train.short_run", data, "warn")]


class ProgressReporter:
    """The latest step, epoch and scalars; `train.progress` at most every `progress_every_s`, and
    only when something new arrived since the last one."""

    def __init__(self, t: TrainingThresholds, watch: Sequence[str] = ()) -> None:
        self.t = t
        self.watch = [w.lower() for w in watch]
        self.step: Optional[int] = None
        self.epoch: Optional[float] = None
        self.scalars: Dict[str, float] = {}
        self.last_record_at: Optional[float] = None
        self.rate: Deque[Tuple[float, int]] = collections.deque(maxlen=t.rate_window)
        self.last_emit: Optional[float] = None
        self.fresh = False
        self.total: Optional[int] = None      # the steps the run aims at, when known

    def observe(self, now: float, step: Optional[int], epoch: Optional[float],
                scalars: Dict[str, float]) -> None:
        if step is not None:
            if self.rate and step < self.rate[-1][1]:
                self.rate.clear()
            if not self.rate or step > self.rate[-1][1]:
                self.rate.append((now, step))
            self.step = step
        if epoch is not None:
            self.epoch = epoch
        for name, value in scalars.items():
            if not metrics.is_metric_name(name):
                continue   # a time or timestamp field is no metric (its sources drop it too)
            if name in self.scalars or len(self.scalars) < 4 * self.t.progress_max_scalars:
                self.scalars[name] = value
        self.last_record_at = now
        self.fresh = True

    def steps_per_s(self) -> Optional[float]:
        if len(self.rate) < 2:
            return None
        (t0, s0), (t1, s1) = self.rate[0], self.rate[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    def data_age_s(self, now: float) -> Optional[float]:
        return None if self.last_record_at is None else round(max(0.0, now - self.last_record_at), 2)

    def bounded_scalars(self) -> Dict[str, Plain]:
        """At most `progress_max_scalars`: watched names first, then in the order first seen."""
        lower = {name.lower(): name for name in self.scalars}
        names = [lower[w] for w in self.watch if w in lower]
        names += [n for n in self.scalars if n not in names]
        return {n: plain(self.scalars[n]) for n in names[: self.t.progress_max_scalars]}

    def eta_s(self) -> Optional[float]:
        rate = self.steps_per_s()
        if self.total is None or self.step is None or rate is None or rate <= 0:
            return None
        return round(max(0, self.total - self.step) / rate, 1)

    def snapshot(self, now: float) -> Dict[str, Any]:
        """step, epoch, scalars, steps_per_s, data_age_s; and total_steps, eta_s when a total is known."""
        out = {"step": self.step, "epoch": self.epoch, "scalars": self.bounded_scalars(),
               "steps_per_s": _r(self.steps_per_s()), "data_age_s": self.data_age_s(now)}
        if self.total is not None:
            out.update({"total_steps": self.total, "eta_s": self.eta_s()})
        return out

    def due(self, now: float) -> List[Finding]:
        if not self.fresh or (self.last_emit is not None and now - self.last_emit < self.t.progress_every_s):
            return []
        self.last_emit, self.fresh = now, False
        return [Finding("train.progress", self.snapshot(now), None)]


__all__ = ["GradNormGate", "LossSpikeDetector", "MetricZeroDetector", "NonfiniteDetector", "ProgressReporter",
           "RestartDetector", "ShortRunDetector", "SlowDetector", "StallDetector", "TrainingThresholds",
           "is_grad_norm_name", "is_loss_name", "p95", "plain"]
