"""The GPU seam: the `GpuProbe` interface and the plain data it returns.

Two implementations exist: `onbox.sources.nvml.NvmlProbe` (the real driver, through pynvml) and
`onbox.sources.fake_gpu.ScriptedProbe` (scripted scenarios for tests). Detectors depend on this module
only. Units live in field names; `None` means "not supported on this GPU/driver, or not available now",
never zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Tuple

# NVML clock-event ("throttle") reason bits, decoded with our own table: pynvml's
# `nvmlClocksEventReasonAll` (0x1ff) leaves out BoardLimit and Reliability, which newer drivers set.
CLOCK_EVENT_REASONS: Dict[int, str] = {
    0x1: "GpuIdle",
    0x2: "ApplicationsClocksSetting",
    0x4: "SwPowerCap",
    0x8: "HwSlowdown",
    0x10: "SyncBoost",
    0x20: "SwThermalSlowdown",
    0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown",
    0x100: "DisplayClockSetting",
    0x200: "BoardLimit",
    0x400: "Reliability",
}

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values: the driver's own verdict on what the GPU needs.
RECOVERY_ACTIONS: Dict[int, str] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}


def decode_reasons(mask: Optional[int]) -> List[str]:
    """Names of the bits set in a clock-event reason mask, lowest bit first.

    Bits missing from `CLOCK_EVENT_REASONS` come back as ``"Unknown(0x...)"`` so that nothing a newer
    driver reports is silently dropped. ``None`` (not supported) and ``0`` both give ``[]``.
    """
    if not mask:
        return []
    names: List[str] = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(CLOCK_EVENT_REASONS.get(bit, f"Unknown(0x{bit:x})"))
        bit <<= 1
    return names


@dataclass(frozen=True)
class GpuInfo:
    """Static facts about one GPU, read once at `GpuProbe.init`."""

    index: int
    uuid: Optional[str] = None
    name: Optional[str] = None
    pci_bus_id: Optional[str] = None
    memory_total_bytes: Optional[int] = None
    sm_clock_max_mhz: Optional[int] = None
    power_limit_mw: Optional[int] = None


@dataclass(frozen=True)
class GpuProcess:
    """A compute process holding memory on a GPU."""

    pid: int
    used_memory_bytes: Optional[int] = None
    name: Optional[str] = None


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU.

    `lost` is True when the driver says the GPU is gone (GpuIsLost / Unknown error); then every reading
    is None and `error` says why. `error` alone (with `lost` False) means this reading could not be taken
    (e.g. NVML timed out); the GPU itself may be fine.
    """

    index: int
    ts: float
    utilization_gpu_pct: Optional[int] = None
    memory_used_bytes: Optional[int] = None
    memory_total_bytes: Optional[int] = None
    temperature_c: Optional[int] = None
    power_mw: Optional[int] = None
    power_limit_mw: Optional[int] = None
    sm_clock_mhz: Optional[int] = None
    sm_clock_max_mhz: Optional[int] = None
    clock_event_reasons: Optional[int] = None
    violation_power_ns: Optional[int] = None
    violation_thermal_ns: Optional[int] = None
    ecc_volatile_corrected: Optional[int] = None
    ecc_volatile_uncorrected: Optional[int] = None
    ecc_aggregate_corrected: Optional[int] = None
    ecc_aggregate_uncorrected: Optional[int] = None
    retired_pages_pending: Optional[bool] = None
    remapped_rows_pending: Optional[bool] = None
    remapped_rows_failure: Optional[bool] = None
    recovery_action: Optional[str] = None
    processes: Tuple[GpuProcess, ...] = ()
    lost: bool = False
    error: Optional[str] = None


@dataclass(frozen=True)
class XidEvent:
    """One Xid (critical driver error) reported for a GPU."""

    index: Optional[int]
    pci_bus_id: Optional[str]
    xid: int
    ts: float
    source: str = "nvml"


@dataclass(frozen=True)
class Capability:
    """What `GpuProbe.init` found. `available` False means "no usable GPU here": `reason` says why."""

    available: bool
    reason: str
    driver_version: Optional[str] = None
    nvml_version: Optional[str] = None
    device_count: int = 0
    missing_functions: Tuple[str, ...] = ()


class GpuProbe(Protocol):
    """The seam every GPU source goes through.

    Contract: `init` never raises (a missing driver is a `Capability` with ``available=False``);
    `sample` never raises for an index that `devices` listed (a failing GPU becomes a `GpuSample` with
    `lost`/`error` set, and never affects the other GPUs) and raises `IndexError` for any other index;
    `wait_xid` returns None when nothing arrived within `timeout_s`; `close` is idempotent.
    """

    def init(self) -> Capability: ...

    def devices(self) -> List[GpuInfo]: ...

    def sample(self, index: int) -> GpuSample: ...

    def wait_xid(self, timeout_s: float) -> Optional[XidEvent]: ...

    def close(self) -> None: ...
