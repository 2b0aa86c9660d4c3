"""Making a GPU probe from a setting, and starting it without ever raising."""
from __future__ import annotations

import logging
from typing import Optional

from onbox.errors import ConfigError
from onbox.sources.fake_gpu import SCENARIOS
from onbox.sources.gpu import Capability, GpuProbe
from onbox.sources.nvml import NvmlProbe

log = logging.getLogger(__name__)


def make_probe(spec: str) -> Optional[GpuProbe]:
    """The probe a `gpu` setting names: NVML for "auto", a scripted scenario for "fake:<name>"."""
    if spec == "none":
        return None
    if spec == "auto":
        return NvmlProbe()
    if spec.startswith("fake:"):
        name = spec[len("fake:"):]
        if name not in SCENARIOS:
            raise ConfigError(f"unknown fake GPU scenario {name!r} (known: {', '.join(sorted(SCENARIOS))})")
        return SCENARIOS[name]()
    raise ConfigError(f"gpu must be 'auto', 'none' or 'fake:<scenario>', not {spec!r}")


def init_probe(probe: Optional[GpuProbe], spec: str) -> Capability:
    """`probe.init()`, never raising; an absent probe is a capability that says the GPU part is off."""
    if probe is None:
        return Capability(False, f"GPU monitoring is off (gpu={spec})")
    try:
        return probe.init()
    except Exception as e:  # seam boundary: a broken probe turns the GPU section off, nothing else
        log.exception("GPU probe init failed")
        return Capability(False, f"GPU probe init failed: {type(e).__name__}: {e}")
