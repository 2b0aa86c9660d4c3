"""Per-GPU detectors: throttle, lost, ECC, foreign memory; and the health of the probe itself.

Each one is fed `GpuSample`s and a monotonic time and returns the `Finding`s it decided on. A sample
with `lost` or `error` set carries no readings; detectors that need readings skip it (neither onset
nor clear evidence).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from onbox.detectors.hysteresis import CLEAR, ONSET, Finding, Hysteresis
from onbox.sources.gpu import GpuInfo, GpuProcess, GpuSample, decode_reasons

REASON_GPU_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80
# Clock-event reasons that are faults (the GPU cannot hold its clocks); SwPowerCap and GpuIdle never are.
FAULT_REASONS = REASON_HW_SLOWDOWN | REASON_SW_THERMAL | REASON_HW_THERMAL | REASON_HW_POWER_BRAKE
HOT_SLOW_SIGNAL = "SmClockLowWhileHot"


@dataclasses.dataclass(frozen=True)
class GpuThresholds:
    """The limits past which a GPU reading is a fault: a healthy data-centre GPU stays inside them."""

    throttle_onset_s: float = 10.0
    throttle_clear_s: float = 30.0
    throttle_gap_s: float = 5.0          # a break shorter than this does not end a throttle episode
    hot_c: int = 83
    slow_clock_frac: float = 0.70
    foreign_onset_s: float = 10.0
    foreign_clear_s: float = 30.0
    foreign_min_bytes: int = 64 << 20    # smaller holders are ignored (None bytes always count)
    ecc_repeat_s: float = 300.0          # at most one gpu.ecc per GPU per this long; rises in between add up
    probe_clear_s: float = 10.0          # NVML answering again this long -> sidecar.recovered


def _ident(info: GpuInfo) -> Dict[str, Any]:
    return {"gpu": info.index, "uuid": info.uuid, "pci": info.pci_bus_id}


def _readable(sample: GpuSample) -> bool:
    return not sample.lost and sample.error is None


def hot_and_slow(sample: GpuSample, info: GpuInfo, t: GpuThresholds) -> bool:
    """SM clock under `slow_clock_frac` of its max while at or above `hot_c` (not while idle)."""
    clock, temp = sample.sm_clock_mhz, sample.temperature_c
    top = sample.sm_clock_max_mhz or info.sm_clock_max_mhz
    if clock is None or temp is None or not top:
        return False
    if sample.clock_event_reasons is not None and sample.clock_event_reasons & REASON_GPU_IDLE:
        return False
    return temp >= t.hot_c and clock < t.slow_clock_frac * top


class ThrottleDetector:
    """`gpu.throttle` when fault reasons (or hot-and-slow) hold; `gpu.throttle_cleared` after."""

    def __init__(self, info: GpuInfo, t: GpuThresholds) -> None:
        self.info = info
        self.t = t
        self.machine = Hysteresis(t.throttle_onset_s, t.throttle_clear_s, t.throttle_gap_s)
        self._episode()

    def _episode(self) -> None:
        self.mask = 0
        self.hot_slow = False
        self.temp_max: Optional[int] = None
        self.clock_min: Optional[int] = None

    def update(self, sample: GpuSample, now: float) -> List[Finding]:
        if not _readable(sample):
            return []
        fault = (sample.clock_event_reasons or 0) & FAULT_REASONS
        slow = hot_and_slow(sample, self.info, self.t)
        condition = bool(fault) or slow
        if condition:
            if self.machine.episode_start is None:
                self._episode()
            self.mask |= fault
            self.hot_slow = self.hot_slow or slow
            if sample.temperature_c is not None:
                self.temp_max = max(self.temp_max or sample.temperature_c, sample.temperature_c)
            if sample.sm_clock_mhz is not None:
                self.clock_min = min(self.clock_min or sample.sm_clock_mhz, sample.sm_clock_mhz)
        onset_at = self.machine.onset_at
        transition = self.machine.update(condition, now)
        if transition == ONSET:
            return [Finding("gpu.throttle", self._data("onset", now, None), "warn")]
        if transition == CLEAR:
            return [Finding("gpu.throttle_cleared", self._data("cleared", now, onset_at), "info")]
        return []

    def _reasons(self) -> List[str]:
        return decode_reasons(self.mask) + ([HOT_SLOW_SIGNAL] if self.hot_slow else [])

    def _data(self, state: str, now: float, onset_at: Optional[float]) -> Dict[str, Any]:
        data = _ident(self.info)
        data.update({
            "state": state, "reasons": self._reasons(), "reasons_mask": self.mask,
            "sm_clock_low_while_hot": self.hot_slow, "temperature_c_max": self.temp_max,
            "sm_clock_mhz_min": self.clock_min, "sm_clock_max_mhz": self.info.sm_clock_max_mhz,
        })
        if state == "onset":
            data["held_s"] = round(self.machine.held_s(now), 3)
        elif onset_at is not None:
            data["throttled_s"] = round(now - onset_at, 3)
        return data


class LostDetector:
    """`gpu.lost` once per GPU: a lost sample (GpuIsLost/Unknown), an Xid 79, or the kernel's line."""

    def __init__(self, info: GpuInfo) -> None:
        self.info = info
        self.lost = False

    def update(self, sample: GpuSample, now: float) -> List[Finding]:
        if not sample.lost:
            return []
        return self.report("sample", sample.error)

    def report(self, evidence: str, detail: Optional[str] = None) -> List[Finding]:
        """The one `gpu.lost` finding, the first time any evidence arrives."""
        if self.lost:
            return []
        self.lost = True
        data = _ident(self.info)
        data.update({"evidence": evidence, "detail": detail})
        return [Finding("gpu.lost", data, "critical")]


class EccDetector:
    """`gpu.ecc` (critical) when uncorrected ECC counts rise or row remapping fails.

    The first readable sample sets the baseline. A counter that goes down (driver reload) re-baselines.
    Rises within `ecc_repeat_s` of the last report add up and go out once that window has passed.
    """

    _COUNTERS = ("ecc_volatile_uncorrected", "ecc_aggregate_uncorrected")

    def __init__(self, info: GpuInfo, t: GpuThresholds) -> None:
        self.info = info
        self.t = t
        self.base: Dict[str, Optional[int]] = {name: None for name in self._COUNTERS}
        self.pending: Dict[str, int] = {name: 0 for name in self._COUNTERS}
        self.last_report: Optional[float] = None
        self.remap_failed = False

    def update(self, sample: GpuSample, now: float) -> List[Finding]:
        if not _readable(sample):
            return []
        out: List[Finding] = []
        for name in self._COUNTERS:
            value, base = getattr(sample, name), self.base[name]
            if value is None:
                continue
            if base is not None and value > base:
                self.pending[name] += value - base
            self.base[name] = value
        if sample.remapped_rows_failure and not self.remap_failed:
            self.remap_failed = True
            out.append(self._finding(sample, "row_remap_failure"))
        rose = any(self.pending.values())
        if rose and (self.last_report is None or now - self.last_report >= self.t.ecc_repeat_s):
            out.append(self._finding(sample, "uncorrected_rose"))
            self.pending = {name: 0 for name in self._COUNTERS}
            self.last_report = now
        return out

    def _finding(self, sample: GpuSample, reason: str) -> Finding:
        data = _ident(self.info)
        data.update({
            "reason": reason,
            "ecc_volatile_uncorrected": sample.ecc_volatile_uncorrected,
            "ecc_aggregate_uncorrected": sample.ecc_aggregate_uncorrected,
            "volatile_uncorrected_delta": self.pending["ecc_volatile_uncorrected"],
            "aggregate_uncorrected_delta": self.pending["ecc_aggregate_uncorrected"],
            "remapped_rows_pending": sample.remapped_rows_pending,
            "remapped_rows_failure": sample.remapped_rows_failure,
            "retired_pages_pending": sample.retired_pages_pending,
        })
        return Finding("gpu.ecc", data, "critical")


class ForeignMemoryDetector:
    """`gpu.foreign_memory` when processes that are not the job hold GPU memory (onset and clear).

    The caller decides which processes are foreign (it knows the job's process tree); this only
    applies the size floor and the hysteresis. The sidecar reports; it never kills anything.
    """

    def __init__(self, info: GpuInfo, t: GpuThresholds) -> None:
        self.info = info
        self.t = t
        self.machine = Hysteresis(t.foreign_onset_s, t.foreign_clear_s, t.throttle_gap_s)
        self.holders: List[GpuProcess] = []

    def update(self, foreign: Sequence[GpuProcess], now: float) -> List[Finding]:
        big = [p for p in foreign
               if p.used_memory_bytes is None or p.used_memory_bytes >= self.t.foreign_min_bytes]
        if big:
            self.holders = list(big)
        transition = self.machine.update(bool(big), now)
        if transition is None:
            return []
        data = _ident(self.info)
        data["state"] = "onset" if transition == ONSET else "cleared"
        if transition == ONSET:
            known = [p.used_memory_bytes for p in self.holders if p.used_memory_bytes is not None]
            data.update({
                "pids": [p.pid for p in self.holders],
                "processes": [{"pid": p.pid, "used_memory_bytes": p.used_memory_bytes, "name": p.name}
                              for p in self.holders],
                "bytes": sum(known),
            })
            return [Finding("gpu.foreign_memory", data, "warn")]
        data["pids"] = [p.pid for p in self.holders]
        return [Finding("gpu.foreign_memory_cleared", data, "info")]


class ProbeHealthDetector:
    """`sidecar.degraded` (part "nvml") when sampling fails or hangs; `sidecar.recovered` after."""

    PART = "nvml"

    def __init__(self, t: GpuThresholds) -> None:
        self.machine = Hysteresis(0.0, t.probe_clear_s)
        self.started: Optional[float] = None

    def update(self, failing: bool, now: float, error: Optional[str] = None,
               gpus: Sequence[int] = ()) -> List[Finding]:
        transition = self.machine.update(failing, now)
        if transition == ONSET:
            self.started = now
            return [Finding("sidecar.degraded",
                            {"part": self.PART, "error": (error or "GPU sampling failed")[:500],
                             "gpus": list(gpus)}, "warn")]
        if transition == CLEAR:
            started, self.started = self.started, None
            took = None if started is None else round(now - started, 3)
            return [Finding("sidecar.recovered", {"part": self.PART, "degraded_s": took}, "info")]
        return []
