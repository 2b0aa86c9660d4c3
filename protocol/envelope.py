"""The event envelope (protocol v1)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# Bump the major version only when an old reader would misread a new frame
# (a field changes meaning or type, or a required field is added). Adding an
# optional field with a default, or a new kind, is not a bump.
PROTOCOL_VERSION = 1

SEVERITIES = ("info", "warn", "critical")
_SEV_RANK = {name: rank for rank, name in enumerate(SEVERITIES)}


def severity_rank(sev: str) -> int:
    """0 for info, 1 for warn, 2 for critical."""
    return _SEV_RANK[sev]


@dataclasses.dataclass(frozen=True)
class Event:
    """One observation from a sidecar.

    seq is per run, starts at 1 and never repeats, across sidecar restarts.
    ts is the observation time in unix seconds. data carries units in its
    field names (mem_used_bytes, power_mw, age_s).
    """

    run: str
    host: str
    seq: int
    ts: float
    kind: str
    sev: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    v: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": self.v,
            "run": self.run,
            "host": self.host,
            "seq": self.seq,
            "ts": self.ts,
            "kind": self.kind,
            "sev": self.sev,
            "data": dict(self.data),
        }
