"""`rgt-onbox health`: a pre-flight check of this box before paying for GPU hours.

Samples the GPUs for a few seconds (one round a second) and judges each check PASS / WARN / FAIL:
Xid history (the kernel log's backlog when readable, plus NVML events while sampling), GPU lost,
throttle (fault clock-event reasons, or SM clock under 70 % of max at >= 83 C), temperature, ECC,
row remapping, the driver's recovery action, foreign VRAM holders, NVML responsiveness; then disk
(bytes and inodes) and memory headroom, which need no GPU. Without a driver or library the GPU
section is SKIP ("unavailable"), never a failure. Exit 0 for PASS or WARN, 2 for FAIL.

A shell health script of the usual kind is the model, with its defects fixed: lettered PCI ids
match, every GPU is checked (or the one `--gpu` names), ECC and row remapping are read.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from onbox.callrunner import CallRunner, CallTimeout
from onbox.detectors.gpu import FAULT_REASONS, GpuThresholds, hot_and_slow
from onbox.monitors.probes import init_probe, make_probe
from onbox.sources import host
from onbox.sources.fake_gpu import TICK_S, ScriptedProbe
from onbox.sources.gpu import GpuInfo, GpuProbe, GpuSample, XidEvent, decode_reasons
from onbox.sources.kmsg import KERNEL_FACILITY, KmsgReader, parse_gpu_lost, xid_from_record
from onbox.xid import classify, normalize_pci

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
_RANK = {PASS: 0, SKIP: 0, WARN: 1, FAIL: 2}
EXIT_OK, EXIT_FAIL = 0, 2
WARN_PCT, FAIL_PCT = 90.0, 97.0
GIB = float(1 << 30)


@dataclasses.dataclass
class Check:
    name: str
    status: str
    detail: str
    gpu: Optional[int] = None
    data: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {"check": self.name, "gpu": self.gpu, "status": self.status, "detail": self.detail,
                **self.data}


@dataclasses.dataclass
class _Seen:
    """What the sampling saw: samples per GPU, Xids, the GPU that hung, kernel-log findings."""

    samples: Dict[int, List[GpuSample]]
    nvml_xids: List[XidEvent] = dataclasses.field(default_factory=list)
    hung: Optional[int] = None
    kmsg_readable: bool = False
    kmsg_reason: str = ""
    kmsg_xids: List[Tuple[int, str, str]] = dataclasses.field(default_factory=list)  # code, pci, message
    kmsg_lost: List[str] = dataclasses.field(default_factory=list)


def worst(statuses: Sequence[str]) -> str:
    return max(statuses, key=lambda s: _RANK[s], default=PASS) if statuses else PASS


def _pct_status(pct: Optional[float]) -> str:
    if pct is None:
        return SKIP
    return FAIL if pct >= FAIL_PCT else WARN if pct >= WARN_PCT else PASS


# ---- sampling ------------------------------------------------------------------------------------


def _default_pace(probe: GpuProbe, seen: _Seen) -> Callable[[float], None]:
    if isinstance(probe, ScriptedProbe):  # a demo scenario moves on a tick per second, without waiting
        scripted = probe

        def advance(seconds: float) -> None:
            scripted.advance(max(1, round(seconds / TICK_S)))
        return advance

    def pace(seconds: float) -> None:  # wait on the Xid event set: the pause doubles as a listen
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            event = probe.wait_xid(remaining)
            if event is not None:
                seen.nvml_xids.append(event)
    return pace


def _drain_xids(probe: GpuProbe, seen: _Seen) -> None:
    for _ in range(1000):
        event = probe.wait_xid(0.0)
        if event is None:
            return
        seen.nvml_xids.append(event)


def _sample(probe: GpuProbe, devices: Sequence[GpuInfo], rounds: int, interval_s: float,
            timeout_s: float, pace: Optional[Callable[[float], None]]) -> _Seen:
    seen = _Seen({d.index: [] for d in devices})
    pace_fn = pace or _default_pace(probe, seen)
    runner = CallRunner("rgt-health-sampler")
    sampling: List[Optional[int]] = [None]  # the GPU the round is reading now

    def one_round() -> List[GpuSample]:
        out = []
        for info in devices:
            sampling[0] = info.index
            try:
                out.append(probe.sample(info.index))
            except Exception as e:  # one bad GPU degrades only its own record
                out.append(GpuSample(info.index, time.time(), error=f"{type(e).__name__}: {e}"))
        return out

    runner.start()
    try:
        for r in range(rounds):
            if r:
                pace_fn(interval_s)
            _drain_xids(probe, seen)
            try:
                result = runner.call("a GPU sampling round", one_round, timeout_s)
            except CallTimeout:
                seen.hung = sampling[0]
                break
            for s in result:
                seen.samples[s.index].append(s)
        _drain_xids(probe, seen)
    finally:
        probe.close()  # releases a stuck call where the probe can
        runner.stop(timeout_s)
    return seen


def _read_kmsg(path: str, seen: _Seen) -> None:
    reader = KmsgReader(path, backlog=True)
    seen.kmsg_readable, seen.kmsg_reason = reader.available, reader.reason
    with reader:
        for record in reader.read_records():
            if record.facility != KERNEL_FACILITY or "NVRM" not in record.message:
                continue
            line = xid_from_record(record)
            if line is not None:
                seen.kmsg_xids.append((line.code, line.pci, line.message[:200]))
                continue
            gone = parse_gpu_lost(record.message)
            if gone is not None:
                seen.kmsg_lost.append(gone.pci)


# ---- GPU checks ----------------------------------------------------------------------------------


def _good(samples: Sequence[GpuSample]) -> List[GpuSample]:
    return [s for s in samples if not s.lost and s.error is None]


def _values(samples: Sequence[GpuSample], name: str) -> List[Any]:
    return [getattr(s, name) for s in samples if getattr(s, name) is not None]


def _xid_check(seen: _Seen, devices: Sequence[GpuInfo], only: Optional[int]) -> Check:
    pci_of = {d.index: normalize_pci(d.pci_bus_id) for d in devices}
    index_of = {pci: i for i, pci in pci_of.items() if pci}
    found: List[Dict[str, Any]] = []
    for code, pci, message in seen.kmsg_xids:
        found.append({"code": code, "pci": pci, "gpu": index_of.get(pci), "source": "kmsg",
                      "message": message})
    for ev in seen.nvml_xids:
        nvml_pci = normalize_pci(ev.pci_bus_id) or pci_of.get(ev.index if ev.index is not None else -1)
        gpu = ev.index if ev.index is not None else index_of.get(nvml_pci or "")
        found.append({"code": ev.xid, "pci": nvml_pci, "gpu": gpu, "source": "nvml"})
    if only is not None:
        found = [x for x in found if x["gpu"] == only]
    fatal = sorted({x["code"] for x in found if classify(x["code"]).fatal})
    codes = sorted({x["code"] for x in found})
    data = {"xids": found[-50:], "kmsg_readable": seen.kmsg_readable}
    if fatal:
        return Check("xid", FAIL, f"fatal Xid {', '.join(map(str, fatal))} seen: this box is bad, re-rent",
                     only, data)
    if codes:
        return Check("xid", WARN, f"Xid {', '.join(map(str, codes))} seen (usually application faults)",
                     only, data)
    if not seen.kmsg_readable:
        return Check("xid", WARN, f"kernel log not readable ({seen.kmsg_reason}): Xid history unknown; "
                     "none during sampling", only, data)
    return Check("xid", PASS, "no Xid in the kernel log since boot", only, data)


def _gpu_checks(info: GpuInfo, samples: Sequence[GpuSample], seen: _Seen) -> List[Check]:
    i, good = info.index, _good(samples)
    checks: List[Check] = []
    pci = normalize_pci(info.pci_bus_id)
    xid79 = any(x.xid == 79 and (x.index == i or normalize_pci(x.pci_bus_id) == pci) for x in seen.nvml_xids)
    xid79 = xid79 or any(code == 79 and p == pci for code, p, _ in seen.kmsg_xids) or pci in seen.kmsg_lost
    if any(s.lost for s in samples) or xid79:
        checks.append(Check("gpu_lost", FAIL, "the GPU is lost (fell off the bus): re-rent", i))
    else:
        checks.append(Check("gpu_lost", PASS, "answering", i))
    if seen.hung == i:
        detail = "a probe call for this GPU did not return in time (driver hang?)"
        checks.append(Check("nvml", WARN, detail, i))
    elif samples and not good:
        errors = [s.error for s in samples if s.error]
        checks.append(Check("nvml", WARN, f"no reading: {errors[-1] if errors else 'unknown'}", i))
    if not good:
        return checks
    checks += [_throttle_check(info, good), _temperature_check(i, good), _ecc_check(i, good),
               _remap_check(i, good), _recovery_check(i, good), _foreign_check(i, good[-1])]
    return checks


def _throttle_check(info: GpuInfo, good: Sequence[GpuSample]) -> Check:
    t = GpuThresholds()
    mask = 0
    for s in good:
        mask |= (s.clock_event_reasons or 0) & FAULT_REASONS
    slow = [s for s in good if hot_and_slow(s, info, t)]
    if mask or slow:
        reasons = decode_reasons(mask) + (["SmClockLowWhileHot"] if slow else [])
        return Check("throttle", FAIL, f"clocks cut: {', '.join(reasons)}", info.index,
                     {"reasons": reasons, "reasons_mask": mask})
    if not _values(good, "clock_event_reasons") and not _values(good, "sm_clock_mhz"):
        return Check("throttle", SKIP, "clock-event reasons not supported here", info.index)
    clocks = _values(good, "sm_clock_mhz")
    top = good[-1].sm_clock_max_mhz or info.sm_clock_max_mhz
    detail = f"no slowdown; SM clock {min(clocks)}-{max(clocks)} of {top} MHz" if clocks else "no slowdown"
    return Check("throttle", PASS, detail, info.index)


def _temperature_check(i: int, good: Sequence[GpuSample]) -> Check:
    temps = _values(good, "temperature_c")
    if not temps:
        return Check("temperature", SKIP, "not supported", i)
    hot = GpuThresholds().hot_c
    status = WARN if max(temps) >= hot else PASS
    detail = f"max {max(temps)} C" + (f" (>= {hot} C: watch for throttling)" if status == WARN else "")
    return Check("temperature", status, detail, i, {"temperature_c_max": max(temps)})


def _ecc_check(i: int, good: Sequence[GpuSample]) -> Check:
    vol = _values(good, "ecc_volatile_uncorrected")
    agg = _values(good, "ecc_aggregate_uncorrected")
    data = {"ecc_volatile_uncorrected": vol[-1] if vol else None,
            "ecc_aggregate_uncorrected": agg[-1] if agg else None}
    if not vol and not agg:
        return Check("ecc", SKIP, "ECC counters not supported (ECC off or not reported)", i, data)
    if (vol and (vol[-1] > 0 or vol[-1] > vol[0])) or (agg and agg[-1] > agg[0]):
        return Check("ecc", FAIL, "uncorrected ECC errors since the last reset: data may be corrupt", i, data)
    if agg and agg[-1] > 0:
        return Check("ecc", WARN, f"{agg[-1]} uncorrected ECC error(s) in the GPU's lifetime", i, data)
    return Check("ecc", PASS, "no uncorrected ECC errors", i, data)


def _remap_check(i: int, good: Sequence[GpuSample]) -> Check:
    failure = _values(good, "remapped_rows_failure")
    pending = _values(good, "remapped_rows_pending") + _values(good, "retired_pages_pending")
    if not failure and not pending:
        return Check("row_remap", SKIP, "row remapping / page retirement not reported", i)
    if any(failure):
        return Check("row_remap", FAIL, "row remapping failed: memory can no longer repair itself", i)
    if any(pending):
        return Check("row_remap", WARN, "a row remap / page retirement is pending (needs a GPU reset)", i)
    return Check("row_remap", PASS, "nothing pending", i)


def _recovery_check(i: int, good: Sequence[GpuSample]) -> Check:
    actions = _values(good, "recovery_action")
    if not actions:
        return Check("recovery_action", SKIP, "not reported by this driver", i)
    if actions[-1] != "none":
        return Check("recovery_action", FAIL, f"the driver asks for {actions[-1]}: re-rent", i,
                     {"recovery_action": actions[-1]})
    return Check("recovery_action", PASS, "none", i)


def _foreign_check(i: int, last: GpuSample) -> Check:
    holders = [p for p in last.processes if p.pid != os.getpid()]
    if not holders:
        return Check("foreign_vram", PASS, "no process holds GPU memory", i)
    known = [p.used_memory_bytes for p in holders if p.used_memory_bytes is not None]
    detail = (f"{len(holders)} process(es) already hold {sum(known) / GIB:.1f} GiB: "
              f"pids {', '.join(str(p.pid) for p in holders[:8])}")
    data = {"processes": [{"pid": p.pid, "used_memory_bytes": p.used_memory_bytes} for p in holders]}
    return Check("foreign_vram", WARN, detail, i, data)


# ---- box checks ----------------------------------------------------------------------------------


def _disk_checks(paths: Sequence[Path], stat: Callable[[str], Any]) -> List[Check]:
    checks: List[Check] = []
    seen_devices = set()
    for path in paths:
        try:
            usage = host.disk_usage(path, stat)
        except OSError as e:
            checks.append(Check("disk", WARN, f"{path}: cannot read ({e.strerror or e})"))
            continue
        if usage.device is not None and usage.device in seen_devices:
            continue
        seen_devices.add(usage.device)
        bp, ip = usage.bytes_used_pct, usage.inodes_used_pct
        status = worst([_pct_status(bp), _pct_status(ip)])
        status = PASS if status == SKIP else status
        inodes = f"; inodes {ip:.1f}%" if ip is not None else ""
        detail = f"{path}: {bp or 0:.1f}% used, {usage.avail_bytes / GIB:.1f} GiB free{inodes}"
        checks.append(Check("disk", status, detail, None, {
            "path": str(path), "used_pct": None if bp is None else round(bp, 2),
            "avail_bytes": usage.avail_bytes, "inodes_used_pct": None if ip is None else round(ip, 2)}))
    return checks


def _memory_check(cgroups: host.CgroupReader, host_memory: Callable[[], Tuple[int, int]]) -> Check:
    where = cgroups.locate(None)
    cg = cgroups.memory(where) if where is not None else None
    cg_used = None if cg is None else (cg.working_set_bytes if cg.working_set_bytes is not None
                                       else cg.current_bytes)
    if cg is not None and cg.max_bytes and cg_used is not None:
        used, limit, scope = cg_used, cg.max_bytes, "cgroup"
    else:
        total, avail = host_memory()
        used, limit, scope = total - avail, total, "host"
    pct = 100.0 * used / limit if limit else None
    status = _pct_status(pct)
    detail = f"{scope}: {pct or 0:.1f}% used, {(limit - used) / GIB:.1f} GiB headroom"
    return Check("memory", status, detail, None, {"scope": scope, "used_bytes": used, "limit_bytes": limit})


# ---- the command ---------------------------------------------------------------------------------


def collect(gpu_index: Optional[int], seconds: float, run_dir: Optional[Path],
            probe: Optional[GpuProbe] = None, *, gpu: str = "auto", kmsg_path: str = "/dev/kmsg",
            pace: Optional[Callable[[float], None]] = None, stat: Callable[[str], Any] = os.statvfs,
            cgroups: Optional[host.CgroupReader] = None,
            host_memory: Callable[[], Tuple[int, int]] = host.host_memory,
            interval_s: float = 1.0, round_timeout_s: float = 5.0) -> Dict[str, Any]:
    """Run every check; returns the report (what `--json` prints)."""
    probe = probe if probe is not None else make_probe(gpu)
    cap = init_probe(probe, gpu)
    checks: List[Check] = []
    names: List[Optional[str]] = []
    if cap.available and probe is not None:
        names = [d.name for d in probe.devices()]  # read once at init: the model, for `rgt compare`
        checks += _gpu_section(probe, gpu_index, seconds, kmsg_path, pace, interval_s, round_timeout_s)
    else:
        if probe is not None:
            probe.close()
        checks.append(Check("gpu", SKIP, f"unavailable: {cap.reason}", gpu_index))
    paths = [run_dir or Path.cwd(), Path("/")]
    checks += _disk_checks(paths, stat)
    checks.append(_memory_check(cgroups or host.CgroupReader(), host_memory))
    result = worst([c.status for c in checks])
    result = PASS if result == SKIP else result
    return {
        "result": result, "exit_code": EXIT_FAIL if result == FAIL else EXIT_OK, "seconds": seconds,
        "gpu": {"available": cap.available, "reason": cap.reason, "driver_version": cap.driver_version,
                "devices": cap.device_count, "names": names},
        "checks": [c.to_dict() for c in checks],
    }


def _gpu_section(probe: GpuProbe, gpu_index: Optional[int], seconds: float, kmsg_path: str,
                 pace: Optional[Callable[[float], None]], interval_s: float,
                 timeout_s: float) -> List[Check]:
    devices = probe.devices()
    if gpu_index is not None:
        chosen = [d for d in devices if d.index == gpu_index]
        if not chosen:
            probe.close()
            have = ", ".join(str(d.index) for d in devices) or "none"
            return [Check("gpu", FAIL, f"no GPU {gpu_index} here (have {have})", gpu_index)]
        devices = chosen
    rounds = max(1, int(round(seconds / interval_s)))
    seen = _sample(probe, devices, rounds, interval_s, timeout_s, pace)
    _read_kmsg(kmsg_path, seen)
    checks = [_xid_check(seen, devices, gpu_index)]
    for info in devices:
        checks += _gpu_checks(info, seen.samples[info.index], seen)
    return checks


def _gpu_list(indices: Sequence[int]) -> str:
    """[0, 1, 2, 4, 6, 7] -> "0-2,4,6-7"."""
    runs: List[List[int]] = []
    for i in sorted(set(indices)):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _table_rows(checks: Sequence[Dict[str, Any]]) -> List[Tuple[str, str, str, str]]:
    """One row per check and status: GPUs that PASS (or SKIP) a check alike share a row."""
    rows: List[Tuple[str, str, str, str]] = []
    groups: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    order: List[Tuple[str, str]] = []
    for c in checks:
        if c["gpu"] is None or c["status"] not in (PASS, SKIP):
            key = (c["check"], f"{c['status']}#{len(order)}")
        else:
            key = (c["check"], c["status"])
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(c)
    for key in order:
        members = groups[key]
        gpus = [m["gpu"] for m in members if m["gpu"] is not None]
        details = list(dict.fromkeys(m["detail"] for m in members))
        detail = details[0] if len(details) == 1 else " | ".join(details)[:100]
        rows.append((key[0], _gpu_list(gpus) if gpus else "-", members[0]["status"], detail))
    rank = {name: n for n, name in reversed(list(enumerate(c["check"] for c in checks)))}
    return sorted(rows, key=lambda row: rank[row[0]])


def render_table(report: Dict[str, Any]) -> str:
    rows = [("CHECK", "GPU", "STATUS", "DETAIL"), *_table_rows(report["checks"])]
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    lines = ["  ".join([*(r[k].ljust(widths[k]) for k in range(3)), r[3]]).rstrip() for r in rows]
    lines.append(f"RESULT: {report['result']}")
    return "\n".join(lines) + "\n"


def run_health(gpu_index: Optional[int], seconds: float, as_json: bool, run_dir: Optional[Path],
               stdout: TextIO, probe: Optional[GpuProbe] = None, **options: Any) -> int:
    """Print the pre-flight report (a table, or one JSON object) and return the exit code.

    `options` go to `collect` (gpu="auto" | "none" | "fake:<scenario>", kmsg_path, pace, stat,
    cgroups, host_memory, interval_s, round_timeout_s). An unknown `gpu` raises ConfigError.
    """
    report = collect(gpu_index, seconds, run_dir, probe, **options)
    if as_json:
        stdout.write(json.dumps(report) + "\n")
    else:
        stdout.write(render_table(report))
    return int(report["exit_code"])
