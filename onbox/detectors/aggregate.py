"""One GPU's samples over the report window, folded into the data of a `gpu.sample` event.

Gauges (utilization, memory used, temperature, power, SM clock) become ``{"min", "mean", "max"}``
over the samples that had them (None when none did). The clock-event reason mask is the union over
the window. Counters (violation time, ECC) are reported as their last value and, for the violation
counters, the rise since the previous window. Flags (retired pages / row remap pending, remap
failure) are true when any sample in the window said so. The processes are the last sample's,
each flagged `job` True/False (None when the job is unknown or the pid is not visible here).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from onbox.sources.gpu import GpuInfo, GpuSample, decode_reasons

_GAUGES = ("utilization_gpu_pct", "memory_used_bytes", "temperature_c", "power_mw", "sm_clock_mhz")
_LAST = ("memory_total_bytes", "power_limit_mw", "sm_clock_max_mhz", "ecc_volatile_corrected",
         "ecc_volatile_uncorrected", "ecc_aggregate_corrected", "ecc_aggregate_uncorrected",
         "recovery_action")
_FLAGS = ("retired_pages_pending", "remapped_rows_pending", "remapped_rows_failure")
_VIOLATIONS = ("violation_power_ns", "violation_thermal_ns")

JobFlag = Callable[[int], Optional[bool]]


class _Gauge:
    __slots__ = ("low", "high", "total", "count")

    def __init__(self) -> None:
        self.low: Optional[float] = None
        self.high: Optional[float] = None
        self.total = 0.0
        self.count = 0

    def add(self, value: Optional[float]) -> None:
        if value is None:
            return
        self.low = value if self.low is None else min(self.low, value)
        self.high = value if self.high is None else max(self.high, value)
        self.total += value
        self.count += 1

    def summary(self) -> Optional[Dict[str, float]]:
        if not self.count:
            return None
        return {"min": self.low or 0, "mean": round(self.total / self.count, 2), "max": self.high or 0}


class GpuWindow:
    """Aggregates one GPU's samples; `report` returns the event data and starts the next window."""

    def __init__(self, info: GpuInfo, now: float) -> None:
        self.info = info
        self.started = now
        self._baseline: Dict[str, Optional[int]] = {name: None for name in _VIOLATIONS}
        self._reset()

    def _reset(self) -> None:
        self.samples = 0
        self.lost = 0
        self.errors = 0
        self.last_error: Optional[str] = None
        self._gauges = {name: _Gauge() for name in _GAUGES}
        self._last: Dict[str, Any] = {name: None for name in _LAST + _VIOLATIONS}
        self._flags: Dict[str, Optional[bool]] = {name: None for name in _FLAGS}
        self._reasons: Optional[int] = None
        self._processes: List[Dict[str, Any]] = []
        self._last_sample: Optional[GpuSample] = None

    def add(self, sample: GpuSample) -> None:
        self.samples += 1
        if sample.lost:
            self.lost += 1
        if sample.error:
            self.errors += 1
            self.last_error = sample.error
        for name, gauge in self._gauges.items():
            gauge.add(getattr(sample, name))
        for name in _LAST + _VIOLATIONS:
            value = getattr(sample, name)
            if value is not None:
                self._last[name] = value
                if name in self._baseline and self._baseline[name] is None:
                    self._baseline[name] = value
        for name in _FLAGS:
            value = getattr(sample, name)
            if value is not None:
                self._flags[name] = bool(self._flags[name]) or value
        if sample.clock_event_reasons is not None:
            self._reasons = (self._reasons or 0) | sample.clock_event_reasons
        if not sample.lost and sample.error is None:
            self._last_sample = sample

    def report(self, now: float, job_flag: JobFlag) -> Dict[str, Any]:
        """The `gpu.sample` data for the window that ends now; the next window starts empty."""
        data: Dict[str, Any] = {
            "gpu": self.info.index, "uuid": self.info.uuid, "pci": self.info.pci_bus_id,
            "window_s": round(now - self.started, 3), "samples": self.samples,
            "lost": self.lost, "errors": self.errors,
        }
        if self.last_error:
            data["last_error"] = self.last_error
        for name, gauge in self._gauges.items():
            data[name] = gauge.summary()
        data.update(self._last)
        data.update(self._flags)
        data["clock_event_reasons"] = self._reasons
        data["clock_event_reason_names"] = decode_reasons(self._reasons)
        for name in _VIOLATIONS:
            last, base = self._last[name], self._baseline[name]
            data[f"{name}_delta"] = None if last is None or base is None else max(0, last - base)
            self._baseline[name] = last if last is not None else base
        processes = self._last_sample.processes if self._last_sample is not None else ()
        data["processes"] = [
            {"pid": p.pid, "used_memory_bytes": p.used_memory_bytes, "name": p.name, "job": job_flag(p.pid)}
            for p in processes
        ]
        self.started = now
        self._reset()
        return data
