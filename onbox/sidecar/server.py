"""The sidecar of one run: journal -> publisher, control requests, periodic jobs.

Every event goes through `emit`: it is journaled first, then published, under
one lock, so the live stream is in seq order and never carries an event the
journal does not hold (or, with a full disk, does not hold in its ring).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from protocol import (
    PACKAGE_VERSION,
    PROTOCOL_VERSION,
    ErrorReply,
    Event,
    Hello,
    HelloReply,
    Manifest,
    ManifestReply,
    ProtocolError,
    Renew,
    RenewReply,
    SinceReply,
    decode_request,
    encode_reply,
)
from protocol.codec import PAGE_BYTES, request_id_of
from protocol.ids import is_run_id
from rgtlib import lockfile

from onbox.custody.monitor import CustodyMonitor
from onbox.custody.preempt import PreemptWatch
from onbox.custody.pullmanifest import MANIFEST_REL, ManifestError, build_manifest, save_manifest
from onbox.deadman.feed import DeadmanFeed
from onbox.errors import AlreadyServing, ConfigError
from onbox.fsutil import write_json_atomic
from onbox.launch.settings import custody_config, load_watch, training_config
from onbox.monitors.health import HealthMonitor, MonitorConfig
from onbox.monitors.stacks import BUDGET_S as STACKS_BUDGET_S
from onbox.monitors.stacks import StackCapture, StallStacks
from onbox.monitors.training import TrainingMonitor
from onbox.runs import read_json
from onbox.scheduler import FunctionJob, PeriodicJob, Scheduler
from onbox.sidecar.closing import BUDGET_S as CLOSE_BUDGET_S
from onbox.sidecar.closing import Closer, closed_marker, journaled_close
from onbox.sidecar.journal import Journal
from onbox.sidecar.transport import CurveServer, EventServer, socket_dir_for
from onbox.sources import process, slurm

log = logging.getLogger(__name__)



@dataclasses.dataclass
class SidecarConfig:
    run_dir: Path
    run_id: str = ""                  # default: run.json's id, else the dir name
    host: str = ""                    # default: run.json's host, else this machine's name
    heartbeat_s: float = 30.0
    tcp: Optional[Tuple[str, int]] = None
    curve: Optional[CurveServer] = None
    job_pid: Optional[int] = None
    gpu: str = "auto"                 # "auto" (NVML when present), "none", "fake:<scenario>"
    gpu_sample_s: float = 2.0
    watch_paths: Sequence[Path] = ()  # filesystems to watch besides the run dir's
    kmsg: bool = True                 # read Xids from /dev/kmsg too, when readable
    stacks: bool = True               # a job.stalled carries the job's Python stacks (monitors/stacks)
    stacks_budget_s: float = STACKS_BUDGET_S  # the longest a job.stalled onset is held for them
    watch: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # over run.json's "watch"
    synthetic_count: int = 0          # tests and benchmarks: emit until last_seq reaches it
    synthetic_rate_hz: float = 0.0    # 0 = as fast as possible
    synthetic_delay_s: float = 0.0    # wait before the first synthetic event
    journal_rotate_bytes: int = 16 << 20
    journal_ring_max: int = 10_000
    close_budget_s: float = CLOSE_BUDGET_S   # the longest the close-out after the job's exit holds run.closed


def _run_meta(run_dir: Path) -> Dict[str, Any]:
    try:
        meta = json.loads((run_dir / "run.json").read_text())
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return {}


def _checked_id(value: str, what: str) -> str:
    if not is_run_id(value):
        raise ConfigError(f"{what} {value!r} must be 1-128 of A-Z a-z 0-9 . _ - (starting alphanumeric, "
                          "no '..')")
    return value


class Sidecar:
    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir).resolve()
        self.rgt_dir = self.run_dir / "rgt"
        meta = _run_meta(self.run_dir)
        keep = ("id", "project", "profile", "started_at", "git_sha", "watch", "command", "cwd", "resume",
                "resumes", "group", "node", "nodes", "scheduler")
        self.meta: Dict[str, Any] = {k: meta[k] for k in keep if k in meta}
        self.run_id = _checked_id(config.run_id or str(meta.get("id") or self.run_dir.name), "run id")
        host = config.host or str(meta.get("host") or os.uname().nodename.split(".")[0])
        self.host = _checked_id(host, "host name")
        self.boot_id = uuid.uuid4().hex
        self.started_mono = time.monotonic()
        self.journal = Journal(self.rgt_dir, self.run_id, self.host,
                               rotate_bytes=config.journal_rotate_bytes,
                               ring_max=config.journal_ring_max)
        sock_dir = None if config.tcp else socket_dir_for(self.rgt_dir)
        self.server = EventServer(sock_dir=sock_dir, tcp=config.tcp, curve=config.curve)
        self._emit_lock = threading.Lock()
        self._stop = threading.Event()
        self._finishing = False   # finish(): stop once the run is closed (run.closed journaled)
        self._lock_fd = -1
        self._threads: List[threading.Thread] = []
        self._scheduler: Optional[Scheduler] = None
        # refused: answered with an error reply; request_errors: a bug, answered as "internal";
        # requests_dropped: not even an error reply could be encoded, so nothing was sent.
        self.counters = {"requests": 0, "refused": 0, "too_large": 0, "request_errors": 0,
                         "requests_dropped": 0}
        self.monitor = HealthMonitor(
            MonitorConfig(run_dir=self.run_dir, job_pid=config.job_pid, gpu=config.gpu,
                          gpu_sample_s=config.gpu_sample_s,
                          watch_paths=tuple(config.watch_paths), kmsg=config.kmsg),
            self.emit)
        self.stalls = StallStacks(config.job_pid, self._emit_now,
                                  StackCapture(self.run_dir) if config.stacks else None,
                                  budget_s=config.stacks_budget_s)
        watch = load_watch(self.run_dir, config.watch)
        self.training = TrainingMonitor(training_config(self.run_dir, watch, config.job_pid), self.emit,
                                        gpu_util=self.monitor.recent_gpu_util)
        self.custody = CustodyMonitor(custody_config(self.run_dir, watch, config.job_pid), self.emit,
                                      on_commit=self.training.note_checkpoint)
        self.deadman = DeadmanFeed(self.rgt_dir, self.emit)
        self.closer = Closer(self.run_dir, self.host, self.custody, self.emit, self._verdict, self._stop,
                             self._on_closed, budget_s=config.close_budget_s)
        self.preempt = PreemptWatch(self.rgt_dir, self.emit, self._flush_custody,
                                    scheduler=slurm.from_record(meta.get("scheduler")),
                                    group=meta.get("group"))

    # ---- life -------------------------------------------------------------

    def start(self) -> None:
        self.rgt_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        self.journal.open()
        endpoints = self.server.bind()
        endpoints.write(self.rgt_dir)
        (self.rgt_dir / "sidecar.pid").write_text(f"{os.getpid()}\n")
        self.emit("sidecar.started", {
            "boot_id": self.boot_id, "pid": os.getpid(), "package_version": PACKAGE_VERSION,
            "protocol_version": PROTOCOL_VERSION, "transport": "tcp" if self.config.tcp else "ipc",
        })
        self.monitor.start()
        self.training.start()
        self.custody.start()
        self.deadman.start()
        self.emit("sidecar.capability", {**self.monitor.status(), "custody": self.custody.status()})
        self._resume_close()
        self._scheduler = Scheduler(self._jobs(), self._job_failed)
        self._scheduler.start()
        if self.config.synthetic_count:
            self._spawn("rgt-synthetic", self._synthetic)

    def _exit_reported(self) -> bool:
        done = read_json(self.rgt_dir / "job.exit_reported")
        return done is not None and (self.config.job_pid is None or done.get("pid") == self.config.job_pid)

    def _resume_close(self) -> None:
        """An earlier sidecar reported the job's exit and did not mark the run closed (killed mid
        close-out): close it now, unless its journal already holds the run.closed."""
        if not self._exit_reported() or closed_marker(self.rgt_dir) is not None:
            return
        exited, closed = journaled_close(self.journal)
        if closed is not None:
            write_json_atomic(self.rgt_dir / "run.closed", {"exit_seq": exited.seq if exited else None,
                                                            "seq": closed.seq, "incomplete": []})
        elif exited is not None:
            log.info("the job's exit (seq %d) was reported, the run not closed: closing it now", exited.seq)
            self.closer.start(exited)

    def _take_lock(self) -> None:
        try:
            self._lock_fd = lockfile.lock_with_pid(self.rgt_dir / "sidecar.lock")  # its pid written into it
        except lockfile.Held as e:
            raise AlreadyServing(
                f"another sidecar (pid {e.holder or '?'}) already serves {self.run_dir}") from None

    def _spawn(self, name: str, target: Any) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def serve(self) -> None:
        """Answer control requests on this thread until stop()."""
        self.server.serve(self.handle, self._stop)

    def stop(self) -> None:
        self._stop.set()

    def finish(self) -> None:
        """Stop once the run is closed (now, when it is, or when there is no job): a scheduler
        ending a step signals every process of it, and the exit and the close matter most."""
        self._finishing = True
        if self.config.job_pid is None or closed_marker(self.rgt_dir) is not None:
            self.stop()
            return
        log.info("the step is ending: stopping once the run is closed")

    def _on_closed(self) -> None:
        if self._finishing:
            self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._scheduler is not None:
            self._scheduler.stop()
        for t in self._threads:
            t.join(5.0)
        self.closer.join(10.0)   # it sees the stop within a few seconds; a restarted sidecar closes again
        self.custody.close()
        self.training.close()
        self.monitor.close()
        self.stalls.close()
        try:
            self.emit("sidecar.stopping", {"boot_id": self.boot_id})
        finally:
            self.journal.close()
            self.server.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    # ---- events -----------------------------------------------------------

    def emit(self, kind: str, data: Optional[Mapping[str, Any]] = None,
             sev: Optional[str] = None) -> Optional[Event]:
        """Journal, then publish. Thread-safe; returns the journaled event, or None when the stall
        hook took it (a job.stalled held while its stacks are captured, or merged into an open one)."""
        if not self.stalls.route(kind, data or {}, sev):
            return None
        return self._emit_now(kind, data, sev)

    def _emit_now(self, kind: str, data: Optional[Mapping[str, Any]] = None,
                  sev: Optional[str] = None) -> Event:
        if kind == "job.exited":
            data, sev = self._final_status(dict(data or {}), sev)
        with self._emit_lock:
            published = self.journal.append(kind, data, sev)
            for _, frame in published:
                self.server.publish(frame)
        event = next(ev for ev, _ in published if ev.kind == kind)
        if kind == "job.exited":
            self.closer.start(event)
        return event

    def _publish_all(self, published: List[Tuple[Event, bytes]]) -> None:
        for _, frame in published:
            self.server.publish(frame)

    # ---- control ----------------------------------------------------------

    def handle(self, frames: List[bytes]) -> List[bytes]:
        """One request to its reply frames; never raises. [] means: drop it, answer nothing (not
        even an error reply could be encoded); the caller then sends nothing."""
        self.counters["requests"] += 1
        try:
            return self._answer(frames)
        except ProtocolError as e:
            self.counters["refused"] += 1
            if e.code == "too_large":
                self.counters["too_large"] += 1
            log.info("refused a control request: %s", e)
            rid = request_id_of(frames) if e.code != "too_large" else ""
            return self._error(rid, e.code, str(e))
        except Exception as e:  # a request boundary: answer, log, keep serving
            self.counters["request_errors"] += 1
            log.exception("control request failed")
            return self._error("", "internal", f"{type(e).__name__}: {e}")

    def _error(self, rid: str, code: str, message: str) -> List[bytes]:
        """An error reply, or [] (dropped, counted) when even that cannot be encoded."""
        for attempt in ((rid, message), ("", message.encode("ascii", "backslashreplace").decode("ascii"))):
            try:
                return encode_reply(ErrorReply(id=attempt[0], code=code, message=attempt[1]))
            except Exception:  # the last resort below drops the request
                continue
        self.counters["requests_dropped"] += 1
        log.warning("dropped a control request: no error reply could be encoded")
        return []

    def _answer(self, frames: List[bytes]) -> List[bytes]:
        req = decode_request(frames)
        if isinstance(req, Hello):
            return encode_reply(HelloReply(
                id=req.id, protocol_version=PROTOCOL_VERSION, package_version=PACKAGE_VERSION,
                boot_id=self.boot_id, host=self.host, run=self.run_id,
                run_meta=self.meta, last_seq=self.journal.last_seq,
                oldest_seq=self.journal.oldest_seq,
            ))
        if isinstance(req, Manifest):
            return self._manifest(req)
        if isinstance(req, Renew):
            return self._renew(req)
        with self._emit_lock:  # a consistent (events, last_seq) pair
            events, more = self.journal.read_since(req.seq, req.limit, PAGE_BYTES)
            last, oldest = self.journal.last_seq, self.journal.oldest_seq
        return encode_reply(SinceReply(id=req.id, events=(), more=more, last_seq=last,
                                       oldest_seq=oldest), events)

    def _renew(self, req: Renew) -> List[bytes]:
        """Renew the box's dead-man lease for the controller (it never arms one)."""
        try:
            armed, expires_at, ttl_s, state = self.deadman.renew(req.ttl_s)
        except (OSError, ValueError) as e:
            log.exception("renew failed")
            return self._error(req.id, "internal", f"renew: {e}")
        return encode_reply(RenewReply(id=req.id, armed=armed, expires_at=expires_at, ttl_s=ttl_s,
                                       state=state))

    def _manifest(self, req: Manifest) -> List[bytes]:
        """Build and write rgt/PULL_MANIFEST.json; the reply carries it (or says where it is).

        Runs on the control thread, so hello/since wait while it hashes: fine for moderate rosters,
        since custody hashes are reused and only the includes and checkpoints changed or not yet
        recorded are read (unpaced). A large manifest is better built with `rgt-onbox manifest`.
        """
        try:
            doc = build_manifest(self.run_dir, host=self.host, extra_includes=req.includes,
                                 judge_missing=self.custody.judge_missing)
            save_manifest(self.run_dir, doc)
        except ManifestError as e:
            return self._error(req.id, "refused", str(e))
        except OSError as e:
            log.exception("manifest failed")
            return self._error(req.id, "internal", f"manifest: {e}")
        try:
            return encode_reply(ManifestReply(id=req.id, path=MANIFEST_REL, sha256=doc["sha256"],
                                              files=len(doc["files"]), total_bytes=doc["total_bytes"],
                                              doc=doc))
        except ProtocolError as e:  # over the reply cap: the file is there, fetch it instead
            return self._error(req.id, e.code, (
                f"{e}; the manifest ({len(doc['files'])} files, sha256 {doc['sha256']}) was written to "
                f"{MANIFEST_REL}: fetch that file instead"))

    # ---- jobs -------------------------------------------------------------

    def _jobs(self) -> List[PeriodicJob]:
        return [
            FunctionJob("heartbeat", self.config.heartbeat_s, self._heartbeat),
            FunctionJob("journal", 1.0, self._journal_tick),
            *self.monitor.jobs(),
            *self.training.jobs(),
            *self.custody.jobs(),
            *self.deadman.jobs(),
            self.preempt,
        ]

    def _flush_custody(self, timeout_s: float) -> None:
        """Hash what the job just wrote (a checkpoint saved in a preemption's grace) before going on."""
        self.custody.sweep_tick()
        self.custody.wait_idle(timeout_s)

    def _heartbeat(self) -> None:
        data: Dict[str, Any] = {"boot_id": self.boot_id, "interval_s": self.config.heartbeat_s,
                                "uptime_s": round(time.monotonic() - self.started_mono, 1)}
        data.update(self.journal.stats())
        data.update(self.counters)
        data.update(process.own_usage())
        data["monitor"] = self.monitor.status()
        data["training"] = self.training.status()
        data["custody"] = self.custody.status()
        data["closeout"] = self.closer.state
        self.emit("heartbeat", data)

    def _final_status(self, data: Dict[str, Any],
                      sev: Optional[str]) -> Tuple[Dict[str, Any], Optional[str]]:
        """The job exited: let the training detectors read its last lines (they journal the newest
        train.progress now, so it comes before job.exited, not one rate-limit later), then judge the run.

        The run failed when the job did, and also when a durable checkpoint copy
        failed, a checkpoint is suspect (custody could not check it, or it failed), or the watched
        scalars were still NaN/Inf at the end, even if training
        exited 0. The verdict goes into the event and
        into rgt/final.json. Runs outside the emit lock: the detectors emit too.
        """
        code = data.get("code")
        self.training.on_job_exit(code if isinstance(code, int) else None)
        ok, reasons = self._verdict(data)
        data.update(final_ok=ok, final_reasons=reasons, closing=True)
        if data.get("preempted"):
            self.preempt.report_now()
        if data.get("preempted") and self.preempt.reason():
            data["preempt_reason"] = self.preempt.reason()   # time_limit, requeued, ...
        return data, ("info" if ok else "warn") if sev in (None, "info") else sev

    def _verdict(self, data: Mapping[str, Any]) -> Tuple[bool, List[str]]:
        """The run's verdict now (at the exit, and again once the run is closed), into rgt/final.json."""
        code = data.get("code")
        reasons = []
        if code != 0:
            reasons.append(f"job exited with code {code}" if code is not None
                           else "job exited without an exit code")
        if self.custody.sync_failed:
            reasons.append("a durable checkpoint copy failed (ckpt.sync_failed)")
        # A checkpoint custody could not check is recorded as suspect, never left out: the run fails.
        reasons += self.custody.verdict_reasons()
        nonfinite = self.training.status().get("nonfinite") or []
        if nonfinite:
            names = ", ".join(map(str, nonfinite))
            reasons.append(f"training ended with non-finite {names} (train.nonfinite)")
        write_json_atomic(self.rgt_dir / "final.json", {"ok": not reasons, "code": code, "reasons": reasons})
        return not reasons, reasons

    def _journal_tick(self) -> None:
        with self._emit_lock:
            self._publish_all(self.journal.tick())

    def _job_failed(self, name: str, error: Optional[BaseException]) -> None:
        if error is None:
            self.emit("sidecar.recovered", {"part": name})
        else:
            self.emit("sidecar.degraded", {"part": name, "error": f"{type(error).__name__}: {error}"[:500]})

    def _synthetic(self) -> None:
        if self._stop.wait(self.config.synthetic_delay_s):
            return
        rate = self.config.synthetic_rate_hz
        period = 1.0 / rate if rate > 0 else 0.0
        next_at = time.monotonic()
        while not self._stop.is_set() and self.journal.last_seq < self.config.synthetic_count:
            self.emit("synthetic.tick", {"boot_id": self.boot_id[:8], "at_seq": self.journal.last_seq})
            if period:
                next_at += period
                delay = next_at - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    return
