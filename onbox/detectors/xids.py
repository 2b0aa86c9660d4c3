"""Xid reports from the two sources (NVML events, the kernel log) -> one `gpu.xid` each.

Both sources report the same Xid; `XidDeduper` lets the first through per (pci, code) per window.
The meaning comes from `onbox.xid.classify`, where the driver's recovery action wins over the table.
Which recovery action counts is decided by `recovery_for`: an action other than "none" is the
driver's current verdict and always counts; "none" counts only when it was read at or after the
Xid (a "none" read before the error says nothing about it).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from onbox.detectors.hysteresis import Finding
from onbox.sources.gpu import GpuInfo, GpuSample, XidEvent
from onbox.sources.kmsg import XidLine
from onbox.xid import XidDeduper, classify, normalize_pci

GPU_OFF_THE_BUS = 79


def recovery_for(sample: Optional[GpuSample], xid_ts: Optional[float]) -> Optional[str]:
    """The recovery action from the GPU's latest sample that may speak for an Xid at `xid_ts`."""
    if sample is None or sample.recovery_action is None:
        return None
    if sample.recovery_action != "none":
        return sample.recovery_action
    if xid_ts is not None and sample.ts >= xid_ts:
        return "none"
    return None


class XidReporter:
    """Turns NVML `XidEvent`s and kernel-log `XidLine`s into deduplicated `gpu.xid` findings."""

    def __init__(self, devices: Sequence[GpuInfo], deduper: XidDeduper) -> None:
        self.deduper = deduper
        self._by_index = {d.index: d for d in devices}
        self._by_pci = {normalize_pci(d.pci_bus_id): d for d in devices if d.pci_bus_id}
        self.suppressed = 0

    def gpu_for(self, index: Optional[int], pci: Optional[str]) -> Optional[GpuInfo]:
        if index is not None and index in self._by_index:
            return self._by_index[index]
        return self._by_pci.get(normalize_pci(pci)) if pci else None

    def from_nvml(self, event: XidEvent, recovery_action: Optional[str] = None) -> List[Finding]:
        info = self.gpu_for(event.index, event.pci_bus_id)
        pci = event.pci_bus_id or (info.pci_bus_id if info else None)
        return self._report(event.xid, info, pci, None, None, "nvml", recovery_action, {})

    def from_kmsg(self, line: XidLine, recovery_action: Optional[str] = None) -> List[Finding]:
        info = self.gpu_for(None, line.pci)
        extra: Dict[str, Any] = {"message": line.message[:300], "kernel_ts": line.kernel_ts}
        if line.caused_by is not None:
            extra["caused_by"] = line.caused_by
        action = line.recovery_action or recovery_action
        return self._report(line.code, info, line.pci, line.pid, line.name, "kmsg", action, extra)

    def _report(self, code: int, info: Optional[GpuInfo], pci: Optional[str], pid: Optional[int],
                name: Optional[str], source: str, action: Optional[str],
                extra: Dict[str, Any]) -> List[Finding]:
        if not self.deduper.admit(pci, code):
            self.suppressed += 1
            return []
        meaning = classify(code, action)
        data: Dict[str, Any] = {
            "gpu": info.index if info else None, "uuid": info.uuid if info else None,
            "pci": normalize_pci(pci) or pci, "code": code, "xid_name": meaning.name,
            "pid": pid, "process_name": name, "class": meaning.xid_class,
            "severity": meaning.severity, "fatal": meaning.fatal, "advice": meaning.advice,
            "advice_from": meaning.advice_from, "recovery_action": meaning.recovery_action,
            "nvidia_action": meaning.nvidia_action, "source": source,
        }
        data.update(extra)
        return [Finding("gpu.xid", data, meaning.severity)]
