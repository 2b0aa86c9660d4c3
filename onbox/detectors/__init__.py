"""Detectors: small state machines that turn readings into findings.

Each detector is pure: it is fed readings and a time (seconds on a monotonic clock), keeps its own
state, and returns `Finding`s (kind, data, severity) for the onsets and clears it decides on. It
never reads the system, never sleeps and never emits; `onbox.monitors.health` feeds it and emits what it
returns. One concept per module:

    hysteresis  the onset/clear machine every detector is built on, and `Finding`
    aggregate   min/mean/max of GPU samples over the report window (`gpu.sample`)
    gpu         throttle, lost, ECC, foreign memory and probe health, per GPU
    xids        Xid reports from NVML and the kernel log -> `gpu.xid` (deduplicated)
    job         the job's exit, vanishing and OOM kill -> `job.exited`
    memory      cgroup/host memory pressure and the oom_kill counter -> `mem.pressure`
    disk        bytes and inodes of watched filesystems -> `disk.low` / `disk.ok` / `disk.sample`
"""
from __future__ import annotations

from onbox.detectors.hysteresis import Finding, Hysteresis

__all__ = ["Finding", "Hysteresis"]
