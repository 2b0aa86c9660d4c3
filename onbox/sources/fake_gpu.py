"""A scripted `GpuProbe` for tests and demos, with named scenarios.

`ScriptedProbe` replays a script tick by tick: the caller moves time with `advance()`, `sample(i)`
returns what the current tick scripts for GPU i (a `GpuSample`, an exception to raise, or a `Hang` that
blocks until `release()`), and `wait_xid` hands out the Xid events scripted for ticks reached so far.
Everything is deterministic: no randomness, no wall clock (timestamps are ``START_TS + tick * TICK_S``).

The scenarios mirror what `NvmlProbe` returns on real hardware: a lost GPU is a sample with
``lost=True``, an unsupported field is None.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from onbox.sources.gpu import Capability, GpuInfo, GpuProcess, GpuSample, XidEvent

MIB = 1024 * 1024
START_TS = 1_700_000_000.0
TICK_S = 1.0

H100_NAME = "NVIDIA H100 80GB HBM3"
H100_MEMORY_TOTAL_BYTES = 81559 * MIB  # what an "80GB" H100 reports (nvidia-smi: 81559MiB)
H100_POWER_LIMIT_MW = 700_000
H100_SM_CLOCK_MAX_MHZ = 1980
H100_DRIVER = "550.163.01"
H100_NVML = "12.550.163.01"
_PCI_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)  # an HGX H100 board's GPUs

REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
_GPU_LOST_ERROR = "GPU is lost (nvmlDeviceGetMemoryInfo: GPU is lost)"


class Hang:
    """A scripted sample call that blocks until `ScriptedProbe.release()`, then returns `then`."""

    def __init__(self, then: GpuSample) -> None:
        self.then = then


Step = Union[GpuSample, BaseException, Hang]


class ScriptedProbe:
    """`GpuProbe` that replays `ticks[tick][gpu_index]`; past the end the last tick repeats.

    `xids` maps a tick to the events that become available once that tick is reached. A `Hang` blocks
    the caller until `release()` or `close()` (at most `hang_limit_s`, so a broken test cannot wedge
    the suite); `hang_started` is set when a call enters it.
    """

    def __init__(
        self,
        capability: Capability,
        devices: Sequence[GpuInfo],
        ticks: Sequence[Mapping[int, Step]],
        xids: Optional[Mapping[int, Sequence[XidEvent]]] = None,
        hang_limit_s: float = 30.0,
    ) -> None:
        if not ticks and devices:
            raise ValueError("a script needs at least one tick")
        self.capability = capability
        self._devices = list(devices)
        self._ticks = list(ticks)
        self._xids = {tick: list(events) for tick, events in (xids or {}).items()}
        self._hang_limit_s = hang_limit_s
        self._cond = threading.Condition()
        self._tick = 0
        self._pending: List[XidEvent] = list(self._xids.get(0, []))
        self._closed = False
        self._released = threading.Event()
        self.hang_started = threading.Event()
        self.calls: Dict[str, int] = {"init": 0, "devices": 0, "sample": 0, "wait_xid": 0, "close": 0}

    @property
    def tick(self) -> int:
        with self._cond:
            return self._tick

    @property
    def last_tick(self) -> int:
        return max(0, len(self._ticks) - 1)

    def advance(self, steps: int = 1) -> int:
        """Move the script forward (never past its last tick) and return the new tick."""
        with self._cond:
            target = min(self._tick + steps, self.last_tick)
            for tick in range(self._tick + 1, target + 1):
                self._pending.extend(self._xids.get(tick, []))
            self._tick = target
            self._cond.notify_all()
            return target

    def release(self) -> None:
        """Let every call blocked in a `Hang` (now or later) return."""
        self._released.set()

    # -- GpuProbe ---------------------------------------------------------------------------------

    def init(self) -> Capability:
        self._count("init")
        return self.capability

    def devices(self) -> List[GpuInfo]:
        self._count("devices")
        return list(self._devices) if self.capability.available else []

    def sample(self, index: int) -> GpuSample:
        self._count("sample")
        if not self.capability.available or not any(d.index == index for d in self._devices):
            raise IndexError(f"no GPU with index {index}")
        with self._cond:
            if self._closed:
                return GpuSample(index, _ts(self._tick), error="probe closed")
            step = self._ticks[self._tick][index]
        if isinstance(step, Hang):
            self.hang_started.set()
            if not self._released.wait(self._hang_limit_s):
                raise RuntimeError(f"scripted hang on GPU {index} was never released")
            return step.then
        if isinstance(step, BaseException):
            raise step
        return step

    def wait_xid(self, timeout_s: float) -> Optional[XidEvent]:
        self._count("wait_xid")
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closed, timeout=max(0.0, timeout_s))
            if self._pending and not self._closed:
                return self._pending.pop(0)
            return None

    def close(self) -> None:
        self._count("close")
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._released.set()

    def _count(self, name: str) -> None:
        with self._cond:
            self.calls[name] += 1


# -- building blocks ------------------------------------------------------------------------------


def _ts(tick: int) -> float:
    return START_TS + tick * TICK_S


def h100_pci(index: int) -> str:
    return f"00000000:{_PCI_BUSES[index % len(_PCI_BUSES)]:02X}:00.0"


def h100_info(index: int) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-5fa0c3b1-7e21-4c0d-9a6b-{index:012d}",
        name=H100_NAME,
        pci_bus_id=h100_pci(index),
        memory_total_bytes=H100_MEMORY_TOTAL_BYTES,
        sm_clock_max_mhz=H100_SM_CLOCK_MAX_MHZ,
        power_limit_mw=H100_POWER_LIMIT_MW,
    )


def h100_capability(count: int) -> Capability:
    return Capability(True, f"{count} GPU(s) via NVML", H100_DRIVER, H100_NVML, count)


def h100_sample(index: int, tick: int, **overrides: Any) -> GpuSample:
    """A healthy H100 under steady training load; small deterministic wobble per GPU and tick."""
    sample = GpuSample(
        index=index,
        ts=_ts(tick),
        utilization_gpu_pct=96 + (index + tick) % 4,
        memory_used_bytes=(71_000 + 128 * index) * MIB,
        memory_total_bytes=H100_MEMORY_TOTAL_BYTES,
        temperature_c=62 + (3 * index + tick) % 6,
        power_mw=640_000 + ((7 * index + 13 * tick) % 50) * 1000,
        power_limit_mw=H100_POWER_LIMIT_MW,
        sm_clock_mhz=H100_SM_CLOCK_MAX_MHZ - 15 * ((index + tick) % 3),
        sm_clock_max_mhz=H100_SM_CLOCK_MAX_MHZ,
        clock_event_reasons=0,
        violation_power_ns=0,
        violation_thermal_ns=0,
        ecc_volatile_corrected=0,
        ecc_volatile_uncorrected=0,
        ecc_aggregate_corrected=0,
        ecc_aggregate_uncorrected=0,
        retired_pages_pending=None,  # H100 remaps rows instead; NVML says NotSupported
        remapped_rows_pending=False,
        remapped_rows_failure=False,
        recovery_action="none",
        processes=(GpuProcess(pid=4242 + index, used_memory_bytes=(70_500 + 128 * index) * MIB),),
    )
    return dataclasses.replace(sample, **overrides) if overrides else sample


def lost_sample(index: int, tick: int) -> GpuSample:
    """What `NvmlProbe` returns for a GPU that answers GpuIsLost."""
    return GpuSample(index, _ts(tick), lost=True, error=_GPU_LOST_ERROR)


def _healthy_ticks(gpus: int, ticks: int) -> List[Dict[int, Step]]:
    return [{i: h100_sample(i, t) for i in range(gpus)} for t in range(ticks)]


# -- named scenarios ------------------------------------------------------------------------------


def healthy_h100x8(ticks: int = 10) -> ScriptedProbe:
    """Eight H100s training steadily: no throttling, no ECC errors, no Xid."""
    return ScriptedProbe(h100_capability(8), [h100_info(i) for i in range(8)], _healthy_ticks(8, ticks))


def xid79_on_gpu3(ticks: int = 10, at_tick: int = 3) -> ScriptedProbe:
    """GPU 3 falls off the bus at `at_tick`: one Xid 79 event, then GPU 3 samples as lost; 0-2, 4-7 fine."""
    script = _healthy_ticks(8, ticks)
    for t in range(at_tick, ticks):
        script[t][3] = lost_sample(3, t)
    xid = XidEvent(index=3, pci_bus_id=h100_pci(3), xid=79, ts=_ts(at_tick))
    return ScriptedProbe(h100_capability(8), [h100_info(i) for i in range(8)], script, {at_tick: [xid]})


THROTTLE_GPU = 5


def thermal_throttle_flapping(ticks: int = 12, start_tick: int = 2, on_ticks: int = 1,
                              off_ticks: int = 1) -> ScriptedProbe:
    """GPU 5 overheats from `start_tick`: thermal slowdown for `on_ticks`, then off for `off_ticks`, over
    and over (by default on even ticks, off on odd ones).

    Throttled ticks report HwThermalSlowdown|SwThermalSlowdown, about half the SM clock, 89-91 C, and a
    thermal violation counter that grows by one full tick (1e9 ns) per throttled tick.
    """
    script = _healthy_ticks(8, ticks)
    violation_ns = 0
    for t in range(start_tick, ticks):
        throttled = (t - start_tick) % (on_ticks + off_ticks) < on_ticks
        if throttled:
            violation_ns += int(TICK_S * 1e9)
        script[t][THROTTLE_GPU] = h100_sample(
            THROTTLE_GPU,
            t,
            temperature_c=89 + t % 3 if throttled else 86 + t % 2,
            clock_event_reasons=REASON_HW_THERMAL | REASON_SW_THERMAL if throttled else 0,
            sm_clock_mhz=990 if throttled else H100_SM_CLOCK_MAX_MHZ,
            power_mw=420_000 if throttled else 655_000,
            violation_thermal_ns=violation_ns,
        )
    return ScriptedProbe(h100_capability(8), [h100_info(i) for i in range(8)], script)


def thermal_throttle_flapping_long() -> ScriptedProbe:
    """Thermal blips for 1,200 ticks (40 minutes at the 2 s sample period), a soak's noise: 2 ticks on,
    6 off (two throttled samples span one period, even when a loaded box delays the sampler). Each
    episode ends before the throttle detector's 10 s onset and each break outlasts its 5 s gap, so
    it never becomes a gpu.throttle. (The 2 s on / 2 s off of thermal_throttle_flapping is
    one throttle episode to the detector: its breaks are shorter than the gap.)"""
    return thermal_throttle_flapping(ticks=1200, on_ticks=2, off_ticks=6)


def gpu_lost_mid_run(ticks: int = 8, at_tick: int = 4) -> ScriptedProbe:
    """A one-GPU box whose H100 answers GpuIsLost from `at_tick` on, with no Xid event seen."""
    script = _healthy_ticks(1, ticks)
    for t in range(at_tick, ticks):
        script[t][0] = lost_sample(0, t)
    return ScriptedProbe(h100_capability(1), [h100_info(0)], script)


def not_supported_everywhere(ticks: int = 3) -> ScriptedProbe:
    """Two GPUs (a vGPU guest or an old driver) where every optional query answers NotSupported."""
    capability = Capability(
        True,
        "2 GPU(s) via NVML",
        driver_version=None,
        nvml_version=None,
        device_count=2,
        missing_functions=("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetFieldValues"),
    )
    script: List[Dict[int, Step]] = [{i: GpuSample(i, _ts(t)) for i in range(2)} for t in range(ticks)]
    return ScriptedProbe(capability, [GpuInfo(0), GpuInfo(1)], script)


HANG_GPU = 0


def nvml_hang(ticks: int = 5, at_tick: int = 2) -> ScriptedProbe:
    """Eight healthy H100s; at `at_tick`, sampling GPU 0 blocks until `release()`."""
    script = _healthy_ticks(8, ticks)
    script[at_tick][HANG_GPU] = Hang(h100_sample(HANG_GPU, at_tick))
    return ScriptedProbe(h100_capability(8), [h100_info(i) for i in range(8)], script)


SCENARIOS: Dict[str, Callable[[], ScriptedProbe]] = {
    "healthy_h100x8": healthy_h100x8,
    "xid79_on_gpu3": xid79_on_gpu3,
    "thermal_throttle_flapping": thermal_throttle_flapping,
    "thermal_throttle_flapping_long": thermal_throttle_flapping_long,
    "gpu_lost_mid_run": gpu_lost_mid_run,
    "not_supported_everywhere": not_supported_everywhere,
    "nvml_hang": nvml_hang,
}
