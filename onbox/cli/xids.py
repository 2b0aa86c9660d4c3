"""`rgt-onbox xids [FILE|-] [--json]`: what the Xids in a kernel log mean for a rented box.

Kernel-log text (dmesg, dmesg -T, journalctl -k, /dev/kmsg records) -> one record per Xid line with
its class, severity, fatal flag and advice -> a short table or one JSON object.

Exit codes: 0 no fatal Xid (application errors and warnings only, or none at all); 2 the box should
not be trusted (a fatal Xid, or a ``GPU has fallen off the bus`` line); 1 the input could not be read
or the catalog is broken.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, TextIO, Tuple

from onbox.sources.kmsg import GpuLostLine, XidLine, parse_gpu_lost_text, parse_text
from onbox.xid import XidCatalog, XidCatalogError, load_catalog

EXIT_OK = 0
EXIT_UNREADABLE = 1
EXIT_FATAL = 2

_SEVERITY_RANK = {"info": 0, "warn": 1, "critical": 2}
_BAD_BOX = "this box is bad: save what you can, pull checkpoints, re-rent"


@dataclass(frozen=True)
class XidRecord:
    """One Xid line and what it means."""

    code: int
    pci: str
    pid: Optional[int]
    name: Optional[str]
    xid_class: str
    severity: str
    fatal: bool
    advice: str
    xid_name: str
    known: bool
    message: str
    kernel_ts: Optional[float] = None
    wall_time: Optional[str] = None
    recovery_action: Optional[str] = None
    caused_by: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        return {
            "code": self.code,
            "pci": self.pci,
            "pid": self.pid,
            "name": self.name,
            "class": self.xid_class,
            "severity": self.severity,
            "fatal": self.fatal,
            "advice": self.advice,
            "xid_name": self.xid_name,
            "known": self.known,
            "message": self.message,
            "kernel_ts": self.kernel_ts,
            "wall_time": self.wall_time,
            "recovery_action": self.recovery_action,
            "caused_by": self.caused_by,
        }


def _record(line: XidLine, catalog: XidCatalog) -> XidRecord:
    info = catalog.classify(line.code, line.recovery_action)
    return XidRecord(
        code=line.code,
        pci=line.pci,
        pid=line.pid,
        name=line.name,
        xid_class=info.xid_class,
        severity=info.severity,
        fatal=info.fatal,
        advice=info.advice,
        xid_name=info.name,
        known=info.known,
        message=line.message,
        kernel_ts=line.kernel_ts,
        wall_time=line.wall_time,
        recovery_action=info.recovery_action,
        caused_by=line.caused_by,
    )


def _exit_code(records: List[XidRecord], gpu_lost: List[GpuLostLine]) -> int:
    return EXIT_FATAL if gpu_lost or any(r.fatal for r in records) else EXIT_OK


def report(text: str, catalog: Optional[XidCatalog] = None) -> Tuple[List[XidRecord], int]:
    """Records for every Xid in `text`, in log order, and the exit code (2 if any is fatal, else 0).

    A ``GPU has fallen off the bus`` line also makes the exit code 2 (it is not an Xid record).
    """
    cat = catalog or load_catalog()
    records = [_record(line, cat) for line in parse_text(text)]
    return records, _exit_code(records, parse_gpu_lost_text(text))


def summarize(records: List[XidRecord], gpu_lost: List[GpuLostLine], catalog: XidCatalog) -> Dict[str, Any]:
    """Counts, the worst severity and a one-line verdict."""
    by_class: Dict[str, int] = {}
    by_code: Dict[str, int] = {}
    for r in records:
        by_class[r.xid_class] = by_class.get(r.xid_class, 0) + 1
        by_code[str(r.code)] = by_code.get(str(r.code), 0) + 1
    worst: Optional[str] = None
    for r in records:
        if worst is None or _SEVERITY_RANK[r.severity] > _SEVERITY_RANK[worst]:
            worst = r.severity
    fatal = [r for r in records if r.fatal]
    lost_pcis = sorted({g.pci for g in gpu_lost})
    if gpu_lost:
        worst = "critical"
    if fatal or gpu_lost:
        causes = [f"Xid {r.code} on {r.pci}" for r in fatal]
        causes += [f"GPU {pci} fell off the bus" for pci in lost_pcis]
        verdict = f"{_BAD_BOX} ({', '.join(dict.fromkeys(causes))})"
    elif records:
        verdict = f"no fatal Xid: {len(records)} Xid line(s); read the advice"
    else:
        verdict = "no Xid lines found"
    return {
        "count": len(records),
        "fatal": len(fatal),
        "by_class": by_class,
        "by_code": by_code,
        "worst_severity": worst,
        "gpu_lost": lost_pcis,
        "verdict": verdict,
        "exit_code": _exit_code(records, gpu_lost),
        "catalog": {"schema_version": catalog.schema_version, "verified": catalog.verified},
    }


def render_json(records: List[XidRecord], gpu_lost: List[GpuLostLine], catalog: XidCatalog) -> str:
    """One JSON object: ``{"xids": [...], "summary": {...}}``."""
    doc = {"xids": [r.to_dict() for r in records], "summary": summarize(records, gpu_lost, catalog)}
    return json.dumps(doc, sort_keys=False)


def _when(r: XidRecord) -> str:
    if r.wall_time:
        return r.wall_time
    if r.kernel_ts is not None:
        return f"{r.kernel_ts:.6f}"
    return "-"


def render_table(records: List[XidRecord], gpu_lost: List[GpuLostLine], catalog: XidCatalog) -> str:
    """A short human table, the advice once per (code, class), and the verdict."""
    summary = summarize(records, gpu_lost, catalog)
    lines: List[str] = []
    if records:
        header = ("XID", "PCI", "PID", "NAME", "CLASS", "SEVERITY", "FATAL", "TIME")
        rows = [
            (str(r.code), r.pci, "-" if r.pid is None else str(r.pid), (r.name or "-")[:16],
             r.xid_class, r.severity, "yes" if r.fatal else "no", _when(r))
            for r in records
        ]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        lines.append("")
        lines.append("advice:")
        seen = set()
        for r in records:
            key = (r.code, r.xid_class, r.advice)
            if key not in seen:
                seen.add(key)
                lines.append(f"  Xid {r.code} {r.xid_name} ({r.xid_class}): {r.advice}")
    for pci in summary["gpu_lost"]:
        lines.append(f"GPU {pci} has fallen off the bus (kernel log)")
    lines.append(f"verdict: {summary['verdict']}")
    return "\n".join(lines) + "\n"


def run_xids(
    source: str,
    as_json: bool,
    stdin: TextIO,
    stdout: TextIO,
    stderr: Optional[TextIO] = None,
) -> int:
    """Read a kernel log from a file path or ``-`` (stdin), print the report, return the exit code."""
    err = stderr if stderr is not None else sys.stderr
    try:
        if source == "-":
            text = stdin.read()
        else:
            with open(source, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        err.write(f"error: cannot read {source}: {e.strerror or e}\n")
        return EXIT_UNREADABLE
    try:
        catalog = load_catalog()
    except XidCatalogError as e:
        err.write(f"error: {e}\n")
        return EXIT_UNREADABLE
    records, code = report(text, catalog)
    gpu_lost = parse_gpu_lost_text(text)
    if as_json:
        stdout.write(render_json(records, gpu_lost, catalog) + "\n")
    else:
        stdout.write(render_table(records, gpu_lost, catalog))
    return code
