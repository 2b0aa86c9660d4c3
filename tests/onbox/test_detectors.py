"""The pure detectors: state machines fed readings and a time; no threads, no sleeps, no system."""
from __future__ import annotations

import dataclasses
from typing import List

import pytest

from onbox.detectors.aggregate import GpuWindow
from onbox.detectors.disk import DiskDetector, DiskThresholds, eta_to_full_s, slope_per_s
from onbox.detectors.gpu import (
    EccDetector,
    ForeignMemoryDetector,
    GpuThresholds,
    LostDetector,
    ProbeHealthDetector,
    ThrottleDetector,
)
from onbox.detectors.hysteresis import CLEAR, ESCALATE, ONSET, Finding, Hysteresis, LevelMachine
from onbox.detectors.job import ExitRecord, JobDetector, parse_exit_record
from onbox.detectors.memory import MemoryDetector, MemReading, MemThresholds
from onbox.detectors.xids import XidReporter, recovery_for
from onbox.sources.fake_gpu import h100_info, h100_pci, h100_sample
from onbox.sources.gpu import GpuProcess, GpuSample, XidEvent
from onbox.sources.host import DiskUsage
from onbox.sources.kmsg import parse_line
from onbox.xid import XidDeduper

T = GpuThresholds()


def kinds(findings: List[Finding]) -> List[tuple]:
    return [(f.kind, f.sev) for f in findings]


# ---- hysteresis -----------------------------------------------------------------------------------


def test_onset_needs_the_condition_sustained_and_a_break_restarts_the_count() -> None:
    h = Hysteresis(onset_s=10, clear_s=30)  # gap 0: any clear sample breaks the episode
    assert [h.update(True, t) for t in range(0, 10, 2)] == [None] * 5
    assert h.update(False, 10) is None
    assert [h.update(True, t) for t in range(12, 22, 2)] == [None] * 5
    assert h.update(True, 22) == ONSET
    assert h.update(True, 24) is None


def test_flapping_condition_gives_one_onset_and_one_clear() -> None:
    h = Hysteresis(onset_s=10, clear_s=30, gap_s=5)
    out = [h.update(t % 2 == 0, t) for t in range(0, 200)]  # on/off every second for 200 s
    assert out.count(ONSET) == 1 and out.index(ONSET) == 10
    assert CLEAR not in out
    tail = [h.update(False, t) for t in range(200, 260)]
    assert tail.count(CLEAR) == 1 and tail.index(CLEAR) == 28  # last seen at 198 -> clear at 228


def test_a_gap_as_long_as_gap_s_ends_the_episode() -> None:
    h = Hysteresis(onset_s=10, clear_s=30, gap_s=5)
    assert h.update(True, 0) is None
    assert h.update(False, 5) is None  # 5 s without: the count restarts
    assert h.update(True, 6) is None
    assert h.update(True, 15) is None
    assert h.update(True, 16) == ONSET


def test_onset_zero_fires_at_once_and_clear_waits_its_window() -> None:
    h = Hysteresis(onset_s=0, clear_s=10)
    assert h.update(True, 0) == ONSET
    assert h.update(False, 5) is None
    assert h.update(True, 6) is None  # seen again: the clear window restarts
    assert h.update(False, 15) is None
    assert h.update(False, 16) == CLEAR


def test_level_machine_onset_escalation_and_clear() -> None:
    m = LevelMachine(warn=90, critical=97, clear_below=88, clear_s=30)
    assert m.update(50, 0) is None
    assert m.update(91, 1) == ONSET and m.level == "warn"
    assert m.update(95, 2) is None
    assert m.update(98, 3) == ESCALATE and m.level == "critical"
    assert m.update(99, 4) is None and m.update(93, 5) is None  # no step down, no repeat
    assert m.update(85, 10) is None
    assert m.update(89, 20) is None  # above the clear line: the clear window restarts
    assert m.update(85, 49) is None
    assert m.update(85, 50) == CLEAR and m.level is None
    assert m.update(None, 60) is None
    assert m.update(98, 61) == ONSET and m.level == "critical"


# ---- throttle ---------------------------------------------------------------------------------------


def _throttle_run(mask: int, seconds: int = 20, **overrides: object) -> List[Finding]:
    det = ThrottleDetector(h100_info(0), T)
    out: List[Finding] = []
    for t in range(seconds):
        out += det.update(h100_sample(0, t, clock_event_reasons=mask, **overrides), float(t))
    return out


@pytest.mark.parametrize("bit", [0x8, 0x20, 0x40, 0x80])
def test_each_fault_reason_sustained_ten_seconds_is_a_throttle(bit: int) -> None:
    out = _throttle_run(bit)
    assert kinds(out) == [("gpu.throttle", "warn")]
    assert out[0].data["reasons_mask"] == bit and out[0].data["held_s"] == 10.0


@pytest.mark.parametrize("mask", [0x1, 0x4, 0x2 | 0x4 | 0x10 | 0x100])
def test_power_cap_idle_and_other_reasons_are_never_faults(mask: int) -> None:
    assert _throttle_run(mask, seconds=120) == []


def test_hot_and_slow_is_a_second_signal_but_not_while_idle() -> None:
    hot_slow = {"temperature_c": 84, "sm_clock_mhz": 1300}  # 1300 < 0.7 * 1980
    out = _throttle_run(0, **hot_slow)
    assert kinds(out) == [("gpu.throttle", "warn")] and out[0].data["reasons"] == ["SmClockLowWhileHot"]
    assert _throttle_run(0x1, seconds=60, **hot_slow) == []
    assert _throttle_run(0, seconds=60, temperature_c=82, sm_clock_mhz=1300) == []
    assert _throttle_run(0, seconds=60, temperature_c=90, sm_clock_mhz=1400) == []  # 1400 >= 1386


def test_throttle_clears_after_thirty_seconds_without_and_reports_the_episode() -> None:
    det = ThrottleDetector(h100_info(2), T)
    out: List[Finding] = []
    for t in range(0, 15):
        out += det.update(h100_sample(2, t, clock_event_reasons=0x8), float(t))
    for t in range(15, 60):
        out += det.update(h100_sample(2, t), float(t))
    assert kinds(out) == [("gpu.throttle", "warn"), ("gpu.throttle_cleared", "info")]
    cleared = out[1].data
    assert cleared["reasons"] == ["HwSlowdown"] and cleared["throttled_s"] == 34.0  # onset 10, clear 44
    assert cleared["gpu"] == 2 and cleared["pci"] == h100_pci(2)


def test_lost_and_error_samples_are_neither_onset_nor_clear_evidence() -> None:
    det = ThrottleDetector(h100_info(0), T)
    for t in range(0, 12):
        det.update(h100_sample(0, t, clock_event_reasons=0x40), float(t))
    assert det.machine.active
    for t in range(12, 100):
        assert det.update(GpuSample(0, float(t), error="NVML degraded"), float(t)) == []
    assert det.machine.active


# ---- lost, ECC, foreign, probe health ----------------------------------------------------------


def test_lost_is_reported_once_whatever_the_evidence() -> None:
    det = LostDetector(h100_info(3))
    assert kinds(det.report("xid79")) == [("gpu.lost", "critical")]
    assert det.update(GpuSample(3, 1.0, lost=True, error="GPU is lost"), 1.0) == []
    fresh = LostDetector(h100_info(3))
    out = fresh.update(GpuSample(3, 1.0, lost=True, error="GPU is lost"), 1.0)
    assert out[0].data == {"gpu": 3, "uuid": h100_info(3).uuid, "pci": h100_pci(3), "evidence": "sample",
                           "detail": "GPU is lost"}


def test_ecc_rise_is_critical_and_repeats_are_folded_into_one_per_window() -> None:
    det = EccDetector(h100_info(1), T)
    assert det.update(h100_sample(1, 0, ecc_volatile_uncorrected=2, ecc_aggregate_uncorrected=5), 0) == []
    out = det.update(h100_sample(1, 1, ecc_volatile_uncorrected=3, ecc_aggregate_uncorrected=6), 1)
    assert kinds(out) == [("gpu.ecc", "critical")]
    assert out[0].data["volatile_uncorrected_delta"] == 1 and out[0].data["reason"] == "uncorrected_rose"
    assert det.update(h100_sample(1, 2, ecc_volatile_uncorrected=5, ecc_aggregate_uncorrected=8), 2) == []
    assert det.update(h100_sample(1, 3, ecc_volatile_uncorrected=5, ecc_aggregate_uncorrected=8), 300) == []
    later = det.update(h100_sample(1, 4, ecc_volatile_uncorrected=6, ecc_aggregate_uncorrected=9), 301)
    assert kinds(later) == [("gpu.ecc", "critical")]
    assert later[0].data["volatile_uncorrected_delta"] == 3  # 3->5 then 5->6, folded


def test_ecc_counter_reset_rebaselines_and_remap_failure_reports_once() -> None:
    det = EccDetector(h100_info(0), T)
    det.update(h100_sample(0, 0, ecc_volatile_uncorrected=4), 0)
    assert det.update(h100_sample(0, 1, ecc_volatile_uncorrected=0), 1) == []  # driver reload
    out = det.update(h100_sample(0, 2, remapped_rows_failure=True), 2)
    assert kinds(out) == [("gpu.ecc", "critical")] and out[0].data["reason"] == "row_remap_failure"
    assert det.update(h100_sample(0, 3, remapped_rows_failure=True), 3) == []


def test_foreign_memory_onset_clear_and_size_floor() -> None:
    det = ForeignMemoryDetector(h100_info(0), T)
    tiny = [GpuProcess(77, 1 << 20)]
    assert all(det.update(tiny, float(t)) == [] for t in range(60))
    big = [GpuProcess(88, 3 << 30, "python"), GpuProcess(99, None)]
    out: List[Finding] = []
    for t in range(60, 75):
        out += det.update(big, float(t))
    assert kinds(out) == [("gpu.foreign_memory", "warn")]
    assert out[0].data["pids"] == [88, 99] and out[0].data["bytes"] == 3 << 30
    for t in range(75, 110):
        out += det.update([], float(t))
    assert kinds(out)[1:] == [("gpu.foreign_memory_cleared", "info")] and out[1].data["state"] == "cleared"


def test_probe_health_degraded_then_recovered_after_its_clear_window() -> None:
    det = ProbeHealthDetector(T)
    out = det.update(True, 0, "hung", [0]) + det.update(True, 1) + det.update(False, 2)
    out += det.update(False, 10)
    assert kinds(out) == [("sidecar.degraded", "warn")]
    out = det.update(False, 11)  # last failing at 1: ten seconds clean
    assert kinds(out) == [("sidecar.recovered", "info")] and out[0].data["part"] == "nvml"


# ---- Xids ---------------------------------------------------------------------------------------------


def test_recovery_action_none_counts_only_when_read_after_the_xid() -> None:
    before = h100_sample(3, 2)  # recovery_action "none" at START+2
    assert recovery_for(before, before.ts + 1) is None
    assert recovery_for(before, before.ts) == "none"
    reset = dataclasses.replace(before, recovery_action="gpu_reset")
    assert recovery_for(reset, before.ts + 50) == "gpu_reset"
    assert recovery_for(None, 1.0) is None


def test_xid_from_nvml_and_kmsg_is_reported_once_with_the_meaning() -> None:
    clock = [0.0]
    rep = XidReporter([h100_info(i) for i in range(8)], XidDeduper(10.0, clock=lambda: clock[0]))
    line = parse_line("NVRM: Xid (PCI:0000:5d:00): 79, pid=4321, name=python3, GPU has fallen off the bus.")
    assert line is not None
    out = rep.from_kmsg(line)
    assert kinds(out) == [("gpu.xid", "critical")]
    d = out[0].data
    assert (d["gpu"], d["code"], d["pid"], d["process_name"], d["class"], d["fatal"], d["source"]) == (
        3, 79, 4321, "python3", "node_reboot", True, "kmsg")
    assert rep.from_nvml(XidEvent(3, h100_pci(3), 79, 1.0)) == [] and rep.suppressed == 1
    clock[0] = 11.0
    assert kinds(rep.from_nvml(XidEvent(3, h100_pci(3), 79, 12.0))) == [("gpu.xid", "critical")]


def test_the_drivers_recovery_action_wins_over_the_table() -> None:
    rep = XidReporter([h100_info(0)], XidDeduper(10.0, clock=lambda: 0.0))
    out = rep.from_nvml(XidEvent(0, None, 13, 1.0), "gpu_reset")
    assert out[0].sev == "critical" and out[0].data["fatal"] and out[0].data["advice_from"] == "driver"
    assert out[0].data["pci"] == "0000:18:00"
    calm = rep.from_nvml(XidEvent(0, None, 31, 1.0))
    assert calm[0].sev == "warn" and not calm[0].data["fatal"] and calm[0].data["class"] == "application"


# ---- job, memory --------------------------------------------------------------------------------------


def test_exit_record_parsing_tolerates_torn_and_odd_files() -> None:
    assert parse_exit_record('{"code": 0, "signal": null, "oom_killed": false}') == ExitRecord(0, None, False)
    assert parse_exit_record('{"code": null, "signal": 9, "oom_killed": true}') == ExitRecord(None, 9, True)
    assert parse_exit_record('{"code": true}') == ExitRecord(None, None, False)
    assert parse_exit_record('{"code": 1') is None and parse_exit_record("[1]") is None


def test_job_exit_from_the_record_once() -> None:
    det = JobDetector(100, grace_s=3)
    assert det.update(0, True, None, oom_kill=0, rss_bytes=5) == []
    out = det.update(1, False, ExitRecord(0, None, False), oom_kill=0)
    assert kinds(out) == [("job.exited", "info")]
    assert out[0].data["code"] == 0 and not out[0].data["vanished"] and out[0].data["last_rss_bytes"] == 5
    assert det.update(2, False, ExitRecord(0, None, False)) == []


def test_job_oom_from_the_counter_and_vanished_after_grace() -> None:
    det = JobDetector(100, grace_s=3)
    det.update(0, True, None, oom_kill=2)
    assert det.update(1, False, None, oom_kill=3) == []
    assert det.update(3.9, False, None, oom_kill=3) == []
    out = det.update(4, False, None, oom_kill=3)
    assert kinds(out) == [("job.exited", "critical")]
    d = out[0].data
    assert d["vanished"] and d["code"] is None and d["oom_killed"]
    assert d["evidence"] == {"exit_record": False, "oom_kill_delta": 1, "rebooted": False, "signal": None}
    rec = JobDetector(7, grace_s=3)
    rec.update(0, True, None, oom_kill=0)
    out = rec.update(1, False, ExitRecord(1, None, False), oom_kill=1)
    assert out[0].data["oom_killed"] and out[0].sev == "critical"


def test_job_after_a_reboot_is_gone_at_once() -> None:
    out = JobDetector(100, rebooted=True).update(0, False, None)
    assert kinds(out) == [("job.exited", "critical")] and out[0].data["evidence"]["rebooted"]


def test_memory_pressure_onset_escalation_clear_and_oom_kill() -> None:
    det = MemoryDetector(MemThresholds())

    def read(used: int, oom: int = 0) -> MemReading:
        return MemReading("cgroup", used, 1000, oom, "/sys/fs/cgroup/job")

    assert det.update(read(500), 0) == []
    assert kinds(det.update(read(920), 1)) == [("mem.pressure", "warn")]
    assert det.update(read(870), 2) == []  # above the clear line: still under pressure
    out = det.update(read(975), 3)
    assert kinds(out) == [("mem.pressure", "critical")] and out[0].data["state"] == "escalated"
    assert det.update(read(800), 4) == [] and det.update(read(800), 32) == []
    out = det.update(read(800), 33)  # last at or above 85 % at 3
    assert kinds(out) == [("mem.ok", "info")] and out[0].data["state"] == "cleared"
    out = det.update(read(500, oom=2), 40)
    assert kinds(out) == [("mem.pressure", "critical")] and out[0].data["oom_kill_delta"] == 2
    assert det.update(read(500, oom=3), 50) == []  # within the repeat window
    assert det.update(read(500, oom=3), 100)[0].data["oom_kill_delta"] == 1


# ---- disk ----------------------------------------------------------------------------------------------


def _usage(used: int, total: int = 1000, inodes_used: int = 10, inodes: int = 100) -> DiskUsage:
    return DiskUsage("/run", 1, total, used, total - used, inodes, inodes_used, inodes - inodes_used)


def test_least_squares_trend_and_eta() -> None:
    pts = [(0.0, 100.0), (10.0, 120.0), (20.0, 140.0)]
    assert slope_per_s(pts) == pytest.approx(2.0)
    assert eta_to_full_s(pts, 100.0) == 50.0
    assert eta_to_full_s(pts[:2], 100.0) is None
    assert eta_to_full_s([(0.0, 5.0), (1.0, 4.0), (2.0, 3.0)], 100.0) is None  # draining


def test_disk_low_escalates_and_clears_per_resource() -> None:
    det = DiskDetector(["/run", "/run/ckpt"], DiskThresholds(clear_s=30))
    assert det.update(_usage(500), 0) == []
    assert det.update(_usage(850), 10) == []
    out = det.update(_usage(910), 20)
    assert kinds(out) == [("disk.low", "warn")]
    assert out[0].data["resource"] == "bytes" and out[0].data["eta_to_full_s"] is not None
    assert out[0].data["paths"] == ["/run", "/run/ckpt"]
    out = det.update(_usage(980, inodes_used=98), 30)
    assert kinds(out) == [("disk.low", "critical"), ("disk.low", "critical")]
    assert [f.data["resource"] for f in out] == ["bytes", "inodes"]
    assert det.update(_usage(950, inodes_used=95), 40) == []
    assert det.update(_usage(500, inodes_used=95), 50) == []
    out = det.update(_usage(500, inodes_used=95), 80)
    assert kinds(out) == [("disk.ok", "info")] and out[0].data["resource"] == "bytes"
    assert det.sample() is not None and det.sample()["used_pct"] == 50.0  # type: ignore[index]


# ---- aggregation ----------------------------------------------------------------------------------------


def test_window_min_mean_max_union_and_violation_delta() -> None:
    win = GpuWindow(h100_info(0), 0.0)
    win.add(h100_sample(0, 0, temperature_c=60, clock_event_reasons=0x4, violation_power_ns=100))
    win.add(h100_sample(0, 1, temperature_c=70, clock_event_reasons=0x1, violation_power_ns=400))
    win.add(GpuSample(0, 2.0, error="timeout"))
    data = win.report(30.0, lambda pid: pid == 4242)
    assert data["temperature_c"] == {"min": 60, "mean": 65.0, "max": 70}
    assert data["clock_event_reasons"] == 0x5
    assert data["clock_event_reason_names"] == ["GpuIdle", "SwPowerCap"]
    assert data["samples"] == 3 and data["errors"] == 1 and data["last_error"] == "timeout"
    assert data["violation_power_ns"] == 400 and data["violation_power_ns_delta"] == 300
    assert data["processes"][0]["pid"] == 4242 and data["processes"][0]["job"] is True
    win.add(h100_sample(0, 3, violation_power_ns=1000))
    nxt = win.report(60.0, lambda pid: None)
    assert nxt["violation_power_ns_delta"] == 600 and nxt["window_s"] == 30.0 and nxt["samples"] == 1
    empty = GpuWindow(h100_info(1), 0.0).report(30.0, lambda pid: None)
    assert empty["temperature_c"] is None and empty["processes"] == []
