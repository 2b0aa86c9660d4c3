"""The training-signal monitor of one run: metrics.jsonl, train.log, framework files -> detectors -> emit.

`TrainingMonitor` tails <run>/metrics.jsonl and <run>/train.log every `tail_s` (a stat, then only
the new bytes), follows the files frameworks write by default under the job's cwd
(`onbox.sources.jobfiles`: Hugging Face trainer_state.json, Lightning metrics.csv, TensorBoard
event files; sources "hfstate", "csv", "tfevents"), feeds each parsed record to the pure detectors
in `onbox.detectors.training`, judges
stalls with the GPU use from `gpu_util` and the checkpoint writes the custody code reports through
`note_checkpoint`, and hands every finding to `emit(kind, data, sev)`. It runs on the sidecar's
scheduler (`jobs()`); `note_checkpoint` may come from another thread (one lock guards the state;
events are emitted outside it).

One value, one source: a scalar name (and the step, and the epoch) is taken from the first source
that gave it, and the other source's values for it are ignored. So a job that writes the loss to
both files is judged once, and a block-buffered train.log cannot replay stale values. Owners are
saved with the state. A step that advances in a source that does not own the step still counts as
progress for the stall detector (a Rich bar in a non-TTY prints nothing, metrics.csv moves); so
does the growth of any followed file as activity.

Grad norms (`is_grad_norm_name`) are watched for NaN/Inf by default, through `GradNormGate`: an
isolated non-finite one (fp16 loss scaling) does not wake; one that persists, or comes with a
non-finite or frozen loss, is `train.nonfinite` with ``reason``. Naming the grad norm in `watch`
judges it as any watched scalar (at once). `train.progress` carries ``total_steps`` and ``eta_s``
when a total is known (`expected_steps`, else a progress bar's or trainer_state.json's total). It is
rate-limited (`progress_every_s`) while the job runs; at the job's exit (`on_job_exit`, which the
sidecar calls before it journals `job.exited`) the newest snapshot goes out at once, so the exit is
never followed by the progress it ended with.

Times: lines are dated by their file's mtime (read with the stat the tail makes anyway), clamped to
the span since the previous poll, so step intervals and idle times are not rounded up to `tail_s`.
A step interval is the time between two polls that saw the step advance (however many lines each
brought), so a block-buffered log gets the budget of its flushes, not of its steps.

Sidecar restarts: <run>/rgt/training_state.json (written atomically, at once after an event and
otherwise at most every `state_every_s`) keeps the tails' positions, the high-water step and epoch,
the recent step intervals, what is active (non-finite names, zero metrics, stall, slow) and the
bad-line counts. A new sidecar resumes each tail (and each framework file) at its saved position,
so old lines are not judged again, and compares new steps with the saved high-water mark. Without
a usable position (no state file, or the file was replaced), the existing lines (the newest
`history_bytes`) are replayed quietly to rebuild that state; then only what still holds is
reported, marked ``replayed: true``: a name still non-finite, a metric still at zero, and the last
restart found.

New job attempts: when `job_key` differs from the saved one (a relaunched job, served by a new
sidecar), or `on_job_start()` is called, the job is judged afresh: the start-up grace applies
again and the active episodes (non-finite, zero metric, spike, stall, slow) end without events, so
the new job's first NaN is reported. The high-water step and the tail positions carry over, so a
relaunch that ignored its checkpoint is still a restart from zero.

Resumed runs (`rgt resume`, run.json "resume"; or a relaunch in place from the newest recorded
checkpoint, run.json "resume_from"): the attempt starts with `resume_step`, the checkpoint's step, as
its high-water step, so a job that ignores RGT_RESUME_FROM and begins at step 0 is
`train.restarted_from_zero` on its first lines, while one that goes on from the checkpoint is not,
however far the killed attempt had got past it. Within one attempt the saved high-water mark wins.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

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
    is_loss_name,
)
from onbox.scheduler import FunctionJob, PeriodicJob
from onbox.sources.jobfiles import JobFiles
from onbox.sources.metrics import MetricsSource, Record, SourceRead
from onbox.sources.trainlog import LogSource

log = logging.getLogger(__name__)

Emit = Callable[[str, Mapping[str, Any], Optional[str]], Any]
STATE_FILE = "training_state.json"
STATE_VERSION = 1   # keys are only ever added (an older sidecar ignores them); bump when one changes meaning
_STEP, _EPOCH = "@step", "@epoch"   # ownership keys of the counters (never a scalar name)


@dataclasses.dataclass
class TrainingConfig:
    run_dir: Path
    metrics_path: Optional[Path] = None       # default <run>/metrics.jsonl
    log_path: Optional[Path] = None           # default <run>/train.log
    log_regex: Optional[str] = None           # named groups: step, epoch, and scalars
    watch: Sequence[str] = ("loss",)          # loss-like names: non-finite + spikes; others: also zero
    tail_s: float = 0.25
    stall: bool = True                        # judge stalls and slow runs (off: no job to judge)
    stall_floor_s: float = 300.0
    stall_k: float = 2.0
    stall_grace_s: float = 900.0
    progress_every_s: float = 5.0
    expected_steps: Optional[int] = None
    expected_seconds: Optional[float] = None
    job_key: Optional[str] = None             # the job attempt (e.g. "<attempt>:<pid>"); see the doc
    resume_step: Optional[int] = None         # a run resumed elsewhere starts from this step (see the doc)
    job_cwd: Optional[Path] = None            # the job's working directory (frameworks write under it)
    state_every_s: float = 5.0
    scan_s: float = 5.0                       # re-scan of job_cwd for framework files
    gpu_every_s: float = 1.0                  # gpu_util() is called at most this often
    metrics_history_bytes: int = 8 << 20
    log_history_bytes: int = 2 << 20
    thresholds: TrainingThresholds = dataclasses.field(default_factory=TrainingThresholds)


def load_state(path: Path) -> Dict[str, Any]:
    """The saved state, or {} when there is none or it cannot be read."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) and doc.get("v") == STATE_VERSION else {}


def save_state(path: Path, doc: Mapping[str, Any]) -> None:
    """Write `doc` to a temp file beside `path`, then rename it into place."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n")
    os.replace(tmp, path)


def _num(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _dict(value: Any) -> Dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> Optional[int]:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


Source = Union[MetricsSource, LogSource]
SOURCE_NAMES = ("metrics", "log", "hfstate", "csv", "tfevents")
OLD_FILE_SLACK_S = 2.0   # a framework file older than the run's start by this much is not judged


class TrainingMonitor:
    """Training signals of one run; see the module doc."""

    def __init__(self, config: TrainingConfig, emit: Emit, *,
                 gpu_util: Callable[[], Optional[float]] = lambda: None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._emit = emit
        self._gpu_util = gpu_util
        self._clock = clock
        self._mono = monotonic
        self.run_dir = Path(config.run_dir)
        self.state_path = self.run_dir / "rgt" / STATE_FILE
        self.t = dataclasses.replace(
            config.thresholds, stall_floor_s=config.stall_floor_s, stall_k=config.stall_k,
            stall_grace_s=config.stall_grace_s, progress_every_s=config.progress_every_s)
        self._watch = [w.lower() for w in config.watch]
        self._losses = [w for w in self._watch if is_loss_name(w)]
        self._metrics = MetricsSource(config.metrics_path or self.run_dir / "metrics.jsonl",
                                      history_bytes=config.metrics_history_bytes)
        self._log = LogSource(config.log_path or self.run_dir / "train.log", config.log_regex,
                              declared=tuple(config.watch), history_bytes=config.log_history_bytes)
        self._sources: Tuple[Source, ...] = (self._metrics, self._log)
        self._files = JobFiles(config.job_cwd, scan_s=config.scan_s, monotonic=monotonic)
        self._lock = threading.RLock()
        # Held from reading the files to emitting what they showed, by tick() and on_job_exit(): a
        # progress a tick read is journaled before the job's exit, never after it.
        self._out = threading.RLock()
        self._owner: Dict[str, str] = {}
        self._bad_reported: Dict[str, bool] = {name: False for name in SOURCE_NAMES}
        self._gates: Dict[str, GradNormGate] = {}
        self._loss_now: Optional[float] = None
        self._loss_prev: Optional[float] = None
        self._source_step: Dict[str, int] = {}
        self._spikes: Dict[str, LossSpikeDetector] = {}
        self._util_at: Optional[float] = None
        self._util: Optional[float] = None
        self._util_failed = False
        self._polled_at = 0.0
        self._saved_at: Optional[float] = None
        self._dirty = False
        self._save_failed = False
        self._job_exited = False
        self._closed = False
        self._job_key = config.job_key
        self._run_started_at = 0.0
        self._last_step: Optional[int] = None
        self._last_epoch: Optional[float] = None
        # built in start(), from the saved state
        self._nonfinite = NonfiniteDetector(self.t.nonfinite_clear_n)
        self._stall = StallDetector(self.t, 0.0)
        self._slow = SlowDetector(self.t)
        self._restart = RestartDetector(self.t)
        self._zero = MetricZeroDetector(self.t, [w for w in self._watch if not is_loss_name(w)])
        self._short = ShortRunDetector(self.t, 0.0)
        self._progress = ProgressReporter(self.t, self._watch)

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the saved state, read what the files already hold, report what still holds."""
        findings: List[Finding] = []
        with self._lock:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            now = self._mono()
            self._polled_at = now
            state = load_state(self.state_path)
            self._build(state, now)
            tails = _dict(state.get("tails"))
            for src in self._sources:
                saved = _dict(tails.get(src.name))
                inode, offset = _int(saved.get("inode")), _int(saved.get("offset"))
                if inode is not None and offset is not None:
                    src.tail.restore(inode, offset)
                src.bad_lines = _int(saved.get("bad_lines")) or 0
                self._bad_reported[src.name] = saved.get("bad_reported") is True
                got = src.drain()
                if src.tail.restored:
                    for record in got.records:
                        findings += self._process(record, now, timing=False)
                else:
                    findings += self._replay(got.records, now)
                findings += self._report_bad(src)
            for name in state.get("files_bad_reported") or []:
                if name in ("hfstate", "csv", "tfevents"):
                    self._bad_reported[name] = True
            since = self._run_started_at - OLD_FILE_SLACK_S
            for name, (history, live) in self._files.start(_dict(state.get("files")), since).items():
                findings += self._replay(history.records, now)
                for record in live.records:
                    findings += self._process(record, now, timing=False)
                findings += self._report_bad_files(name)
            self._save(now)
        self._emit_all(findings)

    def _build(self, state: Mapping[str, Any], now: float) -> None:
        same_job = self.config.job_key is None or state.get("job_key") == self.config.job_key
        active = _dict(state.get("active")) if same_job else {}
        names = [str(n) for n in active.get("nonfinite", []) if isinstance(n, str)]
        zeros = [str(n) for n in active.get("metric_zero", []) if isinstance(n, str)]
        intervals = [float(v) for v in state.get("intervals_s", []) if _num(v) is not None and v >= 0]
        intervals = intervals if same_job else []
        self._run_started_at = _num(state.get("run_started_at")) or self._clock()
        self._nonfinite = NonfiniteDetector(self.t.nonfinite_clear_n, names)
        self._stall = StallDetector(self.t, now, started=same_job and state.get("started") is True,
                                    intervals=intervals,
                                    stalled=active.get("stalled") is True)
        self._stall.step, self._stall.epoch = _int(state.get("last_step")), _num(state.get("last_epoch"))
        self._slow = SlowDetector(self.t, active.get("slow") is True)
        max_step, max_epoch = _int(state.get("max_step")), _num(state.get("max_epoch"))
        if max_step is None or (not same_job and self.config.resume_step is not None):
            # a new attempt that resumes from a checkpoint is judged against that checkpoint's step,
            # not against how far the killed attempt got past it
            max_step = self.config.resume_step
            max_epoch = max_epoch if same_job else None
        self._restart = RestartDetector(self.t, max_step, max_epoch, _int(state.get("restarts")) or 0)
        self._zero = MetricZeroDetector(self.t, [w for w in self._watch if not is_loss_name(w)], zeros)
        self._short = ShortRunDetector(self.t, self._run_started_at, self.config.expected_steps,
                                       self.config.expected_seconds)
        self._short.observe(_int(state.get("last_step")))
        self._last_step, self._last_epoch = self._stall.step, self._stall.epoch
        self._owner = {str(k): str(v) for k, v in _dict(state.get("owners")).items()}
        self._progress.total = self.config.expected_steps or _int(state.get("total_steps"))
        bar = _dict(_dict(_dict(state.get("tails")).get("log")).get("bar")) if same_job else {}
        parser = self._log.parser
        parser.bar_total, parser.bar_last = _int(bar.get("total")), _int(bar.get("last"))
        parser.bar_done = bar.get("done") is True

    def jobs(self) -> List[PeriodicJob]:
        """The periodic work for the sidecar's scheduler: one tail-and-judge job."""
        return [FunctionJob("train", self.config.tail_s, self.tick)]

    def close(self) -> None:
        """Save the state and close the files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._save(self._mono())
            for src in self._sources:
                src.close()

    # ---- the periodic work --------------------------------------------------------------------

    def tick(self) -> None:
        """Read both files' new lines, judge, rate-limited telemetry, save the state when due."""
        with self._out:
            with self._lock:
                now = self._mono()
                findings = self._poll(now)
                findings += self._check(now)
                findings += self._progress.due(now)
                self._maybe_save(now, findings)
            self._emit_all(findings)

    def note_checkpoint(self, now: Optional[float] = None) -> None:
        """A checkpoint was written (custody calls this; `now` is on the monitor's monotonic clock)."""
        with self._lock:
            findings = self._stall.note_checkpoint(self._mono() if now is None else now)
            self._maybe_save(self._mono(), findings)
        self._emit_all(findings)

    def on_job_exit(self, code: Optional[int]) -> None:
        """The job ended: read its last lines, judge a short run, stop judging stalls, and report the
        newest progress now, not rate-limited: the sidecar calls this before it journals job.exited,
        so the exit never comes before the step and metrics the job ended with."""
        with self._out:
            with self._lock:
                now = self._mono()
                findings: List[Finding] = []
                for src in self._sources:
                    findings += self._handle(src, src.drain(), now)
                for name, got in self._files.poll(force=True).items():
                    findings += self._handle_files(name, got, now)
                self._polled_at = now
                findings += self._short.on_job_exit(self._clock(), code)
                findings += self._final_progress(now)
                self._stall.disarm()
                self._job_exited = True
                self._save(now)
            self._emit_all(findings)

    def _final_progress(self, now: float) -> List[Finding]:
        """The newest progress snapshot when the last train.progress does not hold it yet."""
        progress = self._progress
        if not progress.fresh:
            return []
        progress.last_emit, progress.fresh = now, False
        return [Finding("train.progress", progress.snapshot(now), None)]

    def on_job_start(self, job_key: Optional[str] = None) -> None:
        """A new job attempt started under this monitor: judged afresh (see the module doc)."""
        with self._lock:
            now = self._mono()
            self._stall.rearm(now)
            self._slow = SlowDetector(self.t)
            self._nonfinite.active.clear()
            self._zero.active.clear()
            self._spikes.clear()
            self._gates.clear()
            self._log.parser.new_attempt()
            self._job_exited = False
            self._short.reported = False
            self._job_key = job_key if job_key is not None else self._job_key
            self._save(now)

    def status(self) -> Dict[str, Any]:
        """A small summary for the heartbeat."""
        with self._lock:
            now = self._mono()
            return {
                "step": self._progress.step, "epoch": self._progress.epoch,
                "steps_per_s": self._progress.snapshot(now)["steps_per_s"],
                "total_steps": self._progress.total, "eta_s": self._progress.eta_s(),
                "data_age_s": self._progress.data_age_s(now),
                "stalled": self._stall.stalled, "stall_budget_s": round(self._stall.budget_s(), 2),
                "slow": self._slow.active, "nonfinite": sorted(self._nonfinite.active),
                "metric_zero": sorted(self._zero.active),
                "loss_spike": sorted(n for n, d in self._spikes.items() if d.active),
                "restarts": self._restart.restarts, "job_exited": self._job_exited,
                "bad_lines": {**{s.name: s.bad_lines for s in self._sources},
                              **{n: b[0] for n, b in self._files.bad().items()}},
            }

    # ---- reading ------------------------------------------------------------------------------

    def _poll(self, now: float) -> List[Finding]:
        out: List[Finding] = []
        for src in self._sources:
            out += self._handle(src, src.poll(), now)
        for name, got in self._files.poll().items():
            out += self._handle_files(name, got, now)
        self._polled_at = now
        return out

    def _written_at(self, got: SourceRead, now: float) -> float:
        """When the newest bytes were written, on the monotonic clock: the file's mtime, trusted only
        between the previous poll and now (a skewed network-filesystem clock errs by one poll)."""
        if got.mtime is None:
            return now
        lag = self._clock() - got.mtime
        return now - min(max(lag, 0.0), max(0.0, now - self._polled_at))

    def _handle(self, src: Source, got: SourceRead, now: float) -> List[Finding]:
        return self._judge_read(src.name, got, now) + self._report_bad(src)

    def _handle_files(self, name: str, got: SourceRead, now: float) -> List[Finding]:
        return self._judge_read(name, got, now) + self._report_bad_files(name)

    def _judge_read(self, name: str, got: SourceRead, now: float) -> List[Finding]:
        out: List[Finding] = []
        at = self._written_at(got, now)
        if got.new_bytes:
            self._dirty = True
            out += self._stall.note_activity(at, name)
        for record in got.records:
            out += self._process(record, at)
        return out

    def _owns(self, source: str, key: str) -> bool:
        return self._owner.setdefault(key, source) == source

    def _process(self, rec: Record, now: float, timing: bool = True) -> List[Finding]:
        """One record through the detectors (values its source does not own are ignored)."""
        out: List[Finding] = []
        step = rec.step if rec.step is not None and self._owns(rec.source, _STEP) else None
        epoch = rec.epoch if rec.epoch is not None and self._owns(rec.source, _EPOCH) else None
        scalars = {n: v for n, v in rec.scalars.items() if self._owns(rec.source, n.lower())}
        if rec.total and not self.config.expected_steps:
            self._progress.total = rec.total
        if rec.step is not None and step is None:
            out += self._foreign_step(rec, now)
        loss = self._primary_loss(scalars)
        if loss is not None:
            self._loss_prev, self._loss_now = self._loss_now, loss
        if step is not None or epoch is not None:
            out += self._restart.update(step, epoch)
            advanced = (step is not None and step != self._last_step) or (
                epoch is not None and epoch != self._last_epoch)
            self._last_step = step if step is not None else self._last_step
            self._last_epoch = epoch if epoch is not None else self._last_epoch
            if advanced:
                out += self._stall.note_step(now, step, epoch, timing)
            self._short.observe(step)
        at_step = step if step is not None else self._last_step
        at_epoch = epoch if epoch is not None else self._last_epoch
        for name, value in scalars.items():
            low = name.lower()
            if is_grad_norm_name(low) and low not in self._watch:
                out += self._grad_norm(name, value, at_step, at_epoch, rec.source)
                continue
            if low in self._watch or is_loss_name(low):
                out += self._nonfinite.update(name, value, at_step, at_epoch, rec.source)
            if low in self._losses:
                if low == self._losses[0]:
                    self._zero.note_loss(value)
                spike = self._spikes.setdefault(name, LossSpikeDetector(self.t, name))
                out += spike.update(value, at_step, at_epoch)
            out += self._zero.update(name, value, at_step, at_epoch)
        if step is not None or epoch is not None or scalars:
            self._progress.observe(now, step, epoch, scalars)
        return out

    def _foreign_step(self, rec: Record, now: float) -> List[Finding]:
        """A step from a source that does not own the step: progress when it advanced."""
        assert rec.step is not None
        last = self._source_step.get(rec.source)
        self._source_step[rec.source] = rec.step
        if last is None or rec.step <= last:
            return []
        return self._stall.note_progress(now, rec.source)

    def _primary_loss(self, scalars: Mapping[str, float]) -> Optional[float]:
        """The training loss of a record: the first watched loss name, else a loss-like name that is
        not an evaluation's."""
        lower = {n.lower(): v for n, v in scalars.items()}
        for name in self._losses:
            if name in lower:
                return lower[name]
        for name, value in lower.items():
            if is_loss_name(name) and not name.startswith(("eval", "val", "test")):
                return value
        return None

    def _grad_norm(self, name: str, value: float, step: Optional[int], epoch: Optional[float],
                   source: str) -> List[Finding]:
        gate = self._gates.setdefault(name, GradNormGate(self.t.grad_nonfinite_n))
        reason = gate.judge(value, self._loss_now, self._loss_prev)
        if reason is None and not math.isfinite(value) and name not in self._nonfinite.active:
            return []   # an isolated one: fp16 loss scaling skipped a step
        extra = {"reason": reason, "consecutive": gate.streak} if reason is not None else None
        return self._nonfinite.update(name, value, step, epoch, source, extra)

    def _replay(self, records: Sequence[Record], now: float) -> List[Finding]:
        """History with unknown write times: rebuild state, report only what still holds."""
        last: Dict[Tuple[str, Any], Finding] = {}
        for record in records:
            for f in self._process(record, now, timing=False):
                last[(f.kind, f.data.get("name"))] = f
        keep = ("train.nonfinite", "train.metric_zero", "train.restarted_from_zero")
        return [Finding(f.kind, {**f.data, "replayed": True}, f.sev) for f in last.values()
                if f.kind in keep and f.data.get("state") != "cleared"]

    def _report_bad(self, src: Source) -> List[Finding]:
        return self._bad_finding(src.name, src.bad_lines, str(src.tail.path), src.bad_example)

    def _report_bad_files(self, name: str) -> List[Finding]:
        count, path = self._files.bad()[name]
        return self._bad_finding(name, count, path, None)

    def _bad_finding(self, name: str, count: int, path: Optional[str],
                     example: Optional[str]) -> List[Finding]:
        if not count or self._bad_reported[name]:
            return []
        self._bad_reported[name] = True
        data = {"source": name, "path": path, "bad_lines": count, "example": example}
        return [Finding("train.bad_metrics", data, None)]

    # ---- judging ------------------------------------------------------------------------------

    def _gpu(self, now: float) -> Optional[float]:
        if self._util_at is None or now - self._util_at >= self.config.gpu_every_s:
            self._util_at = now
            try:
                self._util = self._gpu_util()
            except Exception:  # a seam boundary: the GPU use is then unknown, the tail goes on
                if not self._util_failed:
                    log.exception("gpu_util failed; stalls get the verdict 'unknown'")
                self._util_failed, self._util = True, None
        return self._util

    def _check(self, now: float) -> List[Finding]:
        if not self.config.stall or self._job_exited:
            return []
        util = self._gpu(now)
        out = self._stall.check(now, util)
        out += self._slow.update(now, util, self._stall.progressing(now), self._progress.steps_per_s())
        return out

    # ---- state --------------------------------------------------------------------------------

    def _state(self) -> Dict[str, Any]:
        tails: Dict[str, Any] = {}
        for src in self._sources:
            pos = src.tail.position()
            tails[src.name] = {"inode": pos[0] if pos else None, "offset": pos[1] if pos else None,
                               "bad_lines": src.bad_lines, "bad_reported": self._bad_reported[src.name]}
        parser = self._log.parser
        tails["log"]["bar"] = {"total": parser.bar_total, "last": parser.bar_last, "done": parser.bar_done}
        return {
            "v": STATE_VERSION, "ts": round(self._clock(), 3), "run_started_at": self._run_started_at,
            "job_key": self._job_key,
            "max_step": self._restart.max_step, "max_epoch": self._restart.max_epoch,
            "restarts": self._restart.restarts, "last_step": self._last_step, "last_epoch": self._last_epoch,
            "started": self._stall.started, "intervals_s": [round(v, 4) for v in self._stall.intervals],
            "tails": tails, "files": self._files.state(), "owners": dict(self._owner),
            "total_steps": self._progress.total,
            "files_bad_reported": sorted(n for n in ("hfstate", "csv", "tfevents") if self._bad_reported[n]),
            "active": {"nonfinite": sorted(self._nonfinite.active), "metric_zero": sorted(self._zero.active),
                       "stalled": self._stall.stalled, "slow": self._slow.active},
        }

    def _maybe_save(self, now: float, findings: Sequence[Finding]) -> None:
        material = any(f.kind != "train.progress" for f in findings)
        due = self._saved_at is None or now - self._saved_at >= self.config.state_every_s
        if material or (self._dirty and due):
            self._save(now)

    def _save(self, now: float) -> None:
        self._saved_at, self._dirty = now, False
        try:
            save_state(self.state_path, self._state())
        except (OSError, ValueError) as e:  # a full disk must not stop the tail
            if not self._save_failed:
                log.warning("cannot save %s: %s", self.state_path, e)
            self._save_failed = True
        else:
            self._save_failed = False

    def _emit_all(self, findings: Sequence[Finding]) -> None:
        for f in findings:
            self._emit(f.kind, f.data, f.sev)


__all__ = ["STATE_FILE", "TrainingConfig", "TrainingMonitor", "load_state", "save_state"]
