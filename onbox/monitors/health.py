"""The health monitor of one run: sources -> detectors -> emit. The glue, and nothing else.

`HealthMonitor` reads the GPU probe (sampling on its own thread, Xid events on another), the kernel
log, the job process and its cgroup, and the watched filesystems; feeds each reading to the pure
detectors in `onbox.detectors`; and hands every finding to `emit(kind, data, sev)`. It gives the
sidecar's scheduler its periodic work through `jobs()`. A machine without a driver or library runs
everything but the GPU section (`capability()` says why).

Threads: "rgt-gpu-sampler" runs one sampling round at a time, so a probe call that hangs never
blocks the scheduler (the round is reported as `sidecar.degraded` part "nvml" and its late result is
dropped); "rgt-xid" waits on the probe's Xid events. The kernel log is polled, non-blocking.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from onbox.callrunner import CallRunner, CallTimeout, RunnerClosed
from onbox.detectors.aggregate import GpuWindow
from onbox.detectors.disk import DiskDetector, DiskThresholds
from onbox.detectors.gpu import (
    EccDetector,
    ForeignMemoryDetector,
    GpuThresholds,
    LostDetector,
    ProbeHealthDetector,
    ThrottleDetector,
)
from onbox.detectors.hang import StoppedDetector
from onbox.detectors.hysteresis import Finding
from onbox.detectors.job import ExitRecord, JobDetector, parse_exit_record
from onbox.detectors.memory import MemoryDetector, MemReading, MemThresholds
from onbox.detectors.xids import GPU_OFF_THE_BUS, XidReporter, recovery_for
from onbox.monitors.probes import init_probe, make_probe
from onbox.scheduler import FunctionJob, PeriodicJob
from onbox.sources import host
from onbox.sources.fake_gpu import TICK_S, ScriptedProbe
from onbox.sources.gpu import Capability, GpuInfo, GpuProbe, GpuProcess, GpuSample, XidEvent
from onbox.sources.kmsg import (
    KERNEL_FACILITY,
    KmsgReader,
    OomLine,
    oom_from_record,
    parse_gpu_lost,
    xid_from_record,
)
from onbox.sources.process import ProcessSource, ProcessView, ProcInfo, proc_env, proc_state
from onbox.xid import XidDeduper

log = logging.getLogger(__name__)

Emit = Callable[[str, Mapping[str, Any], Optional[str]], Any]


@dataclasses.dataclass
class MonitorConfig:
    run_dir: Path
    job_pid: Optional[int] = None
    gpu: str = "auto"            # "auto" (NVML if available), "none", or "fake:<scenario name>"
    gpu_sample_s: float = 2.0
    gpu_report_s: float = 30.0
    job_poll_s: float = 1.0
    disk_poll_s: float = 10.0
    watch_paths: Sequence[Path] = ()
    kmsg: bool = True
    kmsg_path: str = "/dev/kmsg"
    kmsg_poll_s: float = 1.0
    disk_report_s: float = 60.0        # disk.sample telemetry
    gpu_round_timeout_s: float = 5.0   # a sampling round slower than this is a hang
    xid_dedupe_s: float = 10.0         # the same (pci, Xid) from NVML and the kernel log is one report
    exit_grace_s: float = 3.0          # wait this long for the launcher's exit.json before "vanished"
    tree_refresh_s: float = 5.0        # a GPU pid not yet in the job's tree: re-walk at most this often
    children_refresh_s: float = 30.0   # otherwise re-walk the tree (children count) this often
    gpu_thresholds: GpuThresholds = dataclasses.field(default_factory=GpuThresholds)
    mem_thresholds: MemThresholds = dataclasses.field(default_factory=MemThresholds)
    disk_thresholds: DiskThresholds = dataclasses.field(default_factory=DiskThresholds)


def read_marker(path: Path) -> Optional[Dict[str, Any]]:
    """A job marker: JSON, or the older plain "<pid>" line."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text.isdigit():
        return {"pid": int(text)}
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class HealthMonitor:
    """GPU, job, memory, disk and kernel-log watching for one run; see the module doc."""

    def __init__(self, config: MonitorConfig, emit: Emit, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, probe: Optional[GpuProbe] = None,
                 processes: Optional[ProcessSource] = None, cgroups: Optional[host.CgroupReader] = None,
                 stat: Callable[[str], Any] = os.statvfs,
                 host_memory: Callable[[], Tuple[int, int]] = host.host_memory,
                 boot_id: Callable[[], Optional[str]] = host.boot_id,
                 state: Callable[[int], Optional[str]] = proc_state) -> None:
        self.config = config
        self._emit = emit
        self._clock = clock
        self._mono = monotonic
        self.run_dir = Path(config.run_dir)
        self.rgt_dir = self.run_dir / "rgt"
        self._own_probe = probe is None
        self._probe = probe if probe is not None else make_probe(config.gpu)
        self._advance_fake = self._own_probe and isinstance(self._probe, ScriptedProbe)
        self._processes: ProcessSource = processes or ProcessView()
        self._cgroups = cgroups or host.CgroupReader()
        self._stat = stat
        self._host_memory = host_memory
        self._boot_id = boot_id
        self._state = state
        self._cap = Capability(False, "not started")
        self._lock = threading.Lock()
        self._kmsg_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._runner = CallRunner("rgt-gpu-sampler")
        self._sampling: Optional[int] = None  # the GPU the round is reading now
        self._stuck = False
        self._devices: List[GpuInfo] = []
        self._latest: Dict[int, GpuSample] = {}
        self._windows: Dict[int, GpuWindow] = {}
        self._throttle: Dict[int, ThrottleDetector] = {}
        self._lost: Dict[int, LostDetector] = {}
        self._ecc: Dict[int, EccDetector] = {}
        self._foreign: Dict[int, ForeignMemoryDetector] = {}
        self._probe_health = ProbeHealthDetector(config.gpu_thresholds)
        self._xids = XidReporter([], XidDeduper(config.xid_dedupe_s, monotonic))
        self._kmsg: Optional[KmsgReader] = None
        self._job: Optional[JobDetector] = None
        self._job_created: Optional[float] = None
        self._job_ticks: Optional[int] = None    # when the job started, in ticks since boot
        self._job_tree: Set[int] = set()
        self._holds: Dict[int, Tuple[float, Optional[bool]]] = {}
        self._tree_at: Optional[float] = None
        self._job_state: Dict[str, Any] = {}
        self._cgroup: Optional[host.CgroupLocation] = None
        self._job_cgroups: Dict[str, host.CgroupLocation] = {}  # every memory cgroup a job process was in
        self._job_pids: Set[int] = set()                        # every pid ever seen in the job's tree
        self._oom_memcg: Optional[str] = None                   # v1's "limit of" line, for the next kill line
        self._stopped = StoppedDetector()
        self._mem = MemoryDetector(config.mem_thresholds)
        self._disks: List[Tuple[DiskDetector, Path]] = []
        self._disk_report_at: Optional[float] = None

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Init the probe (never raises), announce the job, open the kernel log, start threads."""
        self.rgt_dir.mkdir(parents=True, exist_ok=True)
        self._cap = init_probe(self._probe, self.config.gpu)
        if self._cap.available and self._probe is not None:
            self._start_gpu(self._probe)
        else:
            log.info("GPU section off: %s", self._cap.reason)
        if self.config.kmsg:
            reader = KmsgReader(self.config.kmsg_path)
            if reader.available:
                self._kmsg = reader
            else:
                log.info("kernel log not readable (%s); Xids come from NVML only", reader.reason)
        if self.config.job_pid:
            self._start_job(self.config.job_pid)
        self._start_disks()

    def _start_gpu(self, probe: GpuProbe) -> None:
        try:
            devices = probe.devices()
        except Exception as e:  # seam boundary
            log.exception("GPU probe could not list devices")
            self._cap = Capability(False, f"GPU probe could not list devices: {e}")
            return
        now = self._mono()
        t = self.config.gpu_thresholds
        self._devices = devices
        self._xids = XidReporter(devices, self._xids.deduper)
        for info in devices:
            self._windows[info.index] = GpuWindow(info, now)
            self._throttle[info.index] = ThrottleDetector(info, t)
            self._lost[info.index] = LostDetector(info)
            self._ecc[info.index] = EccDetector(info, t)
            self._foreign[info.index] = ForeignMemoryDetector(info, t)
        thread = threading.Thread(target=self._xid_loop, args=(probe,), name="rgt-xid", daemon=True)
        thread.start()
        self._threads.append(thread)

    def jobs(self) -> List[PeriodicJob]:
        """The periodic work for the sidecar's scheduler."""
        out: List[PeriodicJob] = []
        if self._devices:
            out.append(FunctionJob("gpu", self.config.gpu_sample_s, self.gpu_tick))
        if self._job is not None:
            out.append(FunctionJob("job", self.config.job_poll_s, self.job_tick))
        if self._kmsg is not None:
            out.append(FunctionJob("kmsg", self.config.kmsg_poll_s, self.kmsg_tick))
        if self._disks:
            out.append(FunctionJob("disk", self.config.disk_poll_s, self.disk_tick))
        return out

    def capability(self) -> Capability:
        return self._cap

    def status(self) -> Dict[str, Any]:
        """A small summary for the heartbeat: GPU section, kernel log, job, disks."""
        return {
            "gpu": {"available": self._cap.available, "reason": self._cap.reason,
                    "devices": len(self._devices), "stuck": self._stuck},
            "kmsg": self._kmsg is not None,
            "job": dict(self._job_state),
            "xid_suppressed": self._xids.suppressed,
        }

    def recent_gpu_util(self) -> Optional[float]:
        """Mean utilization (%) of the latest samples of the GPUs the job uses (all GPUs when none
        is known to be the job's); None without GPU readings. Feeds the stall verdict."""
        with self._lock:
            latest = list(self._latest.values())
        mine = [s for s in latest if any(self._job_flag(p.pid) for p in s.processes)] or latest
        values = [s.utilization_gpu_pct for s in mine if s.utilization_gpu_pct is not None]
        return sum(values) / len(values) if values else None

    def close(self) -> None:
        """Stop the threads and close the probe and the kernel log. Idempotent."""
        self._stop.set()
        if self._probe is not None:
            try:
                self._probe.close()  # wakes wait_xid and releases a stuck call where it can
            except Exception:  # best effort at shutdown
                log.exception("GPU probe close failed")
        for thread in self._threads:
            thread.join(5.0)
        self._threads = []
        self._runner.stop(5.0)
        with self._kmsg_lock:
            if self._kmsg is not None:
                self._kmsg.close()

    def wait_gpu_idle(self, timeout_s: float) -> bool:
        """Wait until no sampling round is stuck (tests; shutdown)."""
        return self._runner.wait_recovered(timeout_s)

    def _emit_all(self, findings: Sequence[Finding]) -> None:
        for f in findings:
            self._emit(f.kind, f.data, f.sev)

    # ---- GPU ----------------------------------------------------------------------------------

    def gpu_tick(self) -> None:
        """One sampling round of every GPU (bounded by `gpu_round_timeout_s`), then the detectors."""
        now = self._mono()
        self._runner.start()
        try:
            samples = self._runner.call("a GPU sampling round", self._sample_round,
                                        self.config.gpu_round_timeout_s)
        except CallTimeout:  # this round hung, or an earlier one still has: the readings are late
            self._round_hung(now)
            return
        except RunnerClosed:
            return
        except Exception as error:  # the round raised: the probe is unhealthy, the sidecar goes on
            self._stuck = False
            self._emit_all(self._probe_health.update(True, now, f"sampling failed: {error!r}"))
            return
        self._stuck = False
        self._process_round(samples, now)
        if self._advance_fake and isinstance(self._probe, ScriptedProbe):
            self._probe.advance(max(1, round(self.config.gpu_sample_s / TICK_S)))

    def _round_hung(self, now: float) -> None:
        self._stuck = True
        gpu = self._sampling
        text = (f"GPU probe call for GPU {gpu} did not return within "
                f"{self.config.gpu_round_timeout_s:g} s (driver hang?)")
        self._emit_all(self._probe_health.update(True, now, text, [gpu] if gpu is not None else []))

    def _sample_round(self) -> List[GpuSample]:
        assert self._probe is not None
        out = []
        for info in self._devices:
            self._sampling = info.index
            try:
                out.append(self._probe.sample(info.index))
            except Exception as e:  # one bad GPU degrades only its own record
                out.append(GpuSample(info.index, self._clock(), error=f"{type(e).__name__}: {e}"))
        self._sampling = None
        return out

    def _process_round(self, samples: Sequence[GpuSample], now: float) -> None:
        self._report_if_due(now)  # the window ends before this round: it opens the next one
        findings: List[Finding] = []
        failing: List[GpuSample] = []
        watch_foreign = self._job is not None and not self._job.exited
        if watch_foreign:
            self._refresh_tree_for(p.pid for s in samples for p in s.processes)
        with self._lock:
            for s in samples:
                if s.index not in self._windows:
                    continue
                self._windows[s.index].add(s)
                findings += self._lost[s.index].update(s, now)
                if s.lost:
                    continue
                if s.error is not None:
                    failing.append(s)
                    continue
                self._latest[s.index] = s
                findings += self._throttle[s.index].update(s, now)
                findings += self._ecc[s.index].update(s, now)
                if watch_foreign:
                    findings += self._foreign[s.index].update(self._foreign_of(s.processes), now)
        error = failing[0].error if failing else None
        findings += self._probe_health.update(bool(failing), now, error, [s.index for s in failing])
        self._emit_all(findings)

    def _report_if_due(self, now: float) -> None:
        for window in self._windows.values():
            if now - window.started >= self.config.gpu_report_s:
                self._emit("gpu.sample", window.report(now, self._job_flag), None)

    def _job_flag(self, pid: int) -> Optional[bool]:
        """True: the job or its descendant; False: another process here; None: cannot tell."""
        if self._job is None:
            return None
        if pid in self._job_tree:
            return True
        return False if self._processes.visible(pid) else None

    def _foreign_of(self, processes: Sequence[GpuProcess]) -> List[GpuProcess]:
        """Holders that are not the job, visible here, and (where their fds can be read) hold a GPU."""
        return [p for p in processes
                if self._job_flag(p.pid) is False and self._holds_gpu(p.pid) is not False]

    def _holds_gpu(self, pid: int) -> Optional[bool]:
        now = self._mono()
        cached = self._holds.get(pid)
        if cached is None or now - cached[0] >= self.config.children_refresh_s:
            if len(self._holds) > 256:
                self._holds.clear()
            cached = (now, self._processes.holds_gpu(pid))
            self._holds[pid] = cached
        return cached[1]

    def _refresh_tree_for(self, pids: Iterable[int]) -> None:
        if any(pid not in self._job_tree and self._processes.visible(pid) for pid in pids):
            self._refresh_tree(self._mono(), self.config.tree_refresh_s)

    def _refresh_tree(self, now: float, min_age_s: float) -> None:
        """Walk the job's process tree (it reads every process: costly) unless done within `min_age_s`."""
        if self._job is None:
            return
        if self._tree_at is not None and now - self._tree_at < min_age_s:
            return
        self._tree_at = now
        self._job_tree = self._processes.tree(self._job.pid) if self._job_alive() else set()
        if len(self._job_pids) < 4096:
            self._job_pids |= self._job_tree
        self._job.children = max(0, len(self._job_tree) - 1) if self._job_tree else self._job.children

    # ---- Xids ---------------------------------------------------------------------------------

    def _xid_loop(self, probe: GpuProbe) -> None:
        while not self._stop.is_set():
            try:
                event = probe.wait_xid(1.0)
            except Exception:  # a thread boundary: log, back off, go on
                log.exception("waiting for Xid events failed")
                self._stop.wait(5.0)
                continue
            if event is None or self._stop.is_set():
                continue
            self.kmsg_tick()  # the kernel's copy carries pid and name: let it win the dedupe
            self._on_nvml_xid(event)

    def _on_nvml_xid(self, event: XidEvent) -> None:
        with self._lock:
            info = self._xids.gpu_for(event.index, event.pci_bus_id)
            latest = self._latest.get(info.index) if info else None
            findings = self._xids.from_nvml(event, recovery_for(latest, event.ts))
            if event.xid == GPU_OFF_THE_BUS and info is not None:
                findings += self._lost[info.index].report("xid79", "Xid 79 from NVML events")
        self._emit_all(findings)

    def kmsg_tick(self) -> None:
        """Read the kernel log's new records: Xid lines and "fallen off the bus" lines."""
        with self._kmsg_lock:
            records = self._kmsg.read_records() if self._kmsg is not None else []
        findings: List[Finding] = []
        with self._lock:
            for record in records:
                oom = oom_from_record(record)
                if oom is not None:
                    self._on_oom_line(oom)
                    continue
                if record.facility != KERNEL_FACILITY or "NVRM" not in record.message:
                    continue
                line = xid_from_record(record)
                if line is not None:
                    info = self._xids.gpu_for(None, line.pci)
                    latest = self._latest.get(info.index) if info else None
                    findings += self._xids.from_kmsg(line, recovery_for(latest, None))
                    if line.code == GPU_OFF_THE_BUS and info is not None:
                        findings += self._lost[info.index].report("xid79", line.message[:300])
                    continue
                gone = parse_gpu_lost(record.message)
                info = self._xids.gpu_for(None, gone.pci) if gone else None
                if gone is not None and info is not None:
                    findings += self._lost[info.index].report("kmsg", gone.raw[:300])
        self._emit_all(findings)

    def _on_oom_line(self, oom: OomLine) -> None:
        """A kernel OOM-killer line: evidence for the job's exit when it names one of its pids."""
        job = self._job
        if job is None:
            return
        if oom.pid is None:  # v1's "Task in /a killed as a result of limit of /a": the kill line follows
            self._oom_memcg = oom.memcg
            return
        memcg, self._oom_memcg = oom.memcg or self._oom_memcg, None
        if oom.pid != job.pid and oom.pid not in self._job_pids:
            return
        limit = self._cgroups.describe(memcg) if memcg else None
        job.note_kernel_oom(oom.pid, oom.name, oom.scope, limit)
        log.warning("kernel OOM killer: %s", oom.raw[:300])

    # ---- job and memory -----------------------------------------------------------------------

    def _start_job(self, pid: int) -> None:
        marker = read_marker(self.rgt_dir / "job.announced")
        done = read_marker(self.rgt_dir / "job.exit_reported")
        boot = self._boot_id()
        info = self._processes.info(pid)
        rebooted = False
        if marker is not None and marker.get("pid") == pid:
            prev_boot = marker.get("boot_id")
            rebooted = bool(prev_boot and boot and prev_boot != boot)
            created = marker.get("create_time")
            self._job_created = float(created) if isinstance(created, (int, float)) else None
            ticks = marker.get("start_ticks")
            self._job_ticks = ticks if isinstance(ticks, int) and not isinstance(ticks, bool) else None
        else:
            self._job_created = info.create_time if info else None
            self._job_ticks = info.start_ticks if info else None
            self._emit("job.started", {"pid": pid, "name": info.name if info else None,
                                       "create_time": self._job_created, "alive": info is not None}, None)
            doc = {"pid": pid, "create_time": self._job_created, "start_ticks": self._job_ticks,
                   "boot_id": boot}
            (self.rgt_dir / "job.announced").write_text(json.dumps(doc) + "\n")
        self._job = JobDetector(pid, self.config.exit_grace_s, rebooted)
        if done is not None and done.get("pid") == pid:
            self._job.exited = True  # an earlier sidecar of this run already reported the exit
        self._cgroup = self._cgroups.locate(pid if info is not None and not rebooted else None)
        self._job_pids = {pid}
        self._job_state = {"pid": pid, "alive": self._job_alive(), "rebooted": rebooted}

    def _job_alive(self) -> bool:
        return self._job_info() is not None

    def _job_info(self) -> Optional[ProcInfo]:
        """The watched job's process, or None when it is gone (or its pid now names another process)."""
        if self._job is None or self._job.rebooted:
            return None
        info = self._processes.info(self._job.pid)
        if info is None:
            return None
        if self._job_ticks is not None and info.start_ticks is not None:
            return info if info.start_ticks == self._job_ticks else None
        created = self._job_created   # a marker from before the ticks were recorded: the wall clock
        same = created is None or not info.create_time or abs(info.create_time - created) < 1.0
        return info if same else None

    def _read_exit_record(self) -> Optional[ExitRecord]:
        try:
            return parse_exit_record((self.rgt_dir / "exit.json").read_text())
        except OSError:
            return None

    def read_memory(self) -> Optional[MemReading]:
        """The job cgroup's memory against its limit, or the whole box's when no limit applies."""
        cg = self._cgroups.memory(self._cgroup) if self._cgroup is not None else None
        if cg is not None and cg.max_bytes:
            used = cg.working_set_bytes if cg.working_set_bytes is not None else cg.current_bytes
            return MemReading("cgroup", used, cg.max_bytes, cg.oom_kill, cg.path)
        try:
            total, avail = self._host_memory()
        except Exception:  # psutil boundary; memory pressure is then unknown
            log.exception("reading host memory failed")
            return None
        return MemReading("host", total - avail, total, cg.oom_kill if cg else None, cg.path if cg else None)

    def job_tick(self) -> None:
        """Liveness, exit, memory pressure and OOM kills of the watched job."""
        job = self._job
        if job is None or job.exited:
            return
        now = self._mono()
        info = self._job_info()
        alive = info is not None
        mem = self.read_memory()
        if alive:
            self._refresh_tree(now, self.config.children_refresh_s)
        else:
            self.kmsg_tick()  # the kernel's OOM line, if any, before the exit is judged
        self._watch_cgroups(job, alive)
        findings = self._stopped.update(now, self._stopped_now() if alive else {}, alive)
        record = None if alive else self._read_exit_record()
        findings += job.update(now, alive, record, mem.oom_kill if mem else None,
                               info.rss_bytes if info else None)
        if alive and mem is not None:
            extra = {"pid": job.pid, "rss_bytes": info.rss_bytes if info else None, "children": job.children}
            findings += self._mem.update(mem, now, extra)
        self._job_state.update({"alive": alive, "rss_bytes": job.last_rss_bytes, "children": job.children})
        if job.exited:
            (self.rgt_dir / "job.exit_reported").write_text(json.dumps({"pid": job.pid}) + "\n")
        self._emit_all(findings)

    def _watch_cgroups(self, job: JobDetector, alive: bool) -> None:
        """Re-read which memory cgroup each job process is in (a job may move itself into one of its
        own: systemd-run --scope, a Slurm step) and each such cgroup's oom_kill counter and limit."""
        if alive:
            pids = [job.pid, *sorted(self._job_tree - {job.pid})][:16]
            for pid in pids:
                where = self._cgroups.locate(pid)
                if where is None:
                    continue
                if len(self._job_cgroups) < 64:
                    self._job_cgroups.setdefault(str(where.leaf), where)
                if pid != job.pid and self._cgroup is not None and where.leaf != self._cgroup.leaf:
                    self._cgroup = where  # memory pressure follows the job into its own cgroup
                    job.oom_base = self._mem.oom_base = None  # another cgroup's counter: a new base
        for where in list(self._job_cgroups.values()):
            mem = self._cgroups.memory(where)
            if mem is None:
                continue
            limit = host.describe_limit(where, mem)
            job.observe_cgroup(host.kernel_path(where), mem.oom_kill, limit)
            if self._cgroup is not None and where.leaf == self._cgroup.leaf:
                job.main_limit = limit
        self._job_state["cgroups"] = sorted(host.kernel_path(w) for w in self._job_cgroups.values())

    def _stopped_now(self) -> Dict[int, Dict[str, Any]]:
        """The job's processes in state T (stopped by a signal), with their name and rank."""
        out: Dict[int, Dict[str, Any]] = {}
        for pid in sorted(self._job_tree | ({self._job.pid} if self._job else set()))[:64]:
            if self._state(pid) != "T":
                continue
            env = proc_env(pid)
            rank = env.get("RANK") or env.get("LOCAL_RANK")
            out[pid] = {"pid": pid, "name": self._processes.name(pid),
                        "rank": int(rank) if rank is not None and rank.isdigit() else None}
        return out

    # ---- disks --------------------------------------------------------------------------------

    def _start_disks(self) -> None:
        groups: Dict[Any, List[Path]] = {}
        for path in [self.run_dir, *self.config.watch_paths]:
            try:
                key: Any = os.stat(path).st_dev
            except OSError:
                log.warning("watched path %s is not readable; it is checked as its own filesystem", path)
                key = str(path)
            groups.setdefault(key, []).append(Path(path))
        for paths in groups.values():
            self._disks.append((DiskDetector([str(p) for p in paths], self.config.disk_thresholds), paths[0]))

    def disk_tick(self) -> None:
        """statvfs of every watched filesystem; disk.low / disk.ok; disk.sample at its low rate."""
        now = self._mono()
        findings: List[Finding] = []
        for detector, path in self._disks:
            try:
                usage = host.disk_usage(path, self._stat)
            except OSError as e:
                log.debug("statvfs %s failed: %s", path, e)
                continue
            findings += detector.update(usage, now)
        self._emit_all(findings)
        if self._disk_report_at is None or now - self._disk_report_at >= self.config.disk_report_s:
            self._disk_report_at = now
            rows = [row for row in (d.sample() for d, _ in self._disks) if row is not None]
            if rows:
                self._emit("disk.sample", {"filesystems": rows}, None)


__all__ = ["HealthMonitor", "MonitorConfig", "init_probe", "make_probe"]
