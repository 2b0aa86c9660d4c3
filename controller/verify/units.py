"""Checkpoints as units: the files of one save (an HF `checkpoint-N/` dir, a Lightning `.ckpt`, a
sharded dir) are proven and reported together, and the box's rotation is named, not failed.

- A file's unit is the manifest entry's "unit" when the box states one; else, for a checkpoint
  file, its parent dir when that dir is named like a save (`checkpoint-N`, `global_stepN`, ...) or
  holds other checkpoint files of the same step; else the file itself.
- The newest unit (highest step) has its weights checked for NaN/Inf by default; with no step
  known anywhere every unit is.
- The manifest's "removed" entries by "job" are checkpoints the job rotated away (save_total_limit,
  save_top_k): gone on purpose, named in the report. By "other" they stay a failure.
- The box's custody log (the pulled rgt/manifest.jsonl, once its identity passed) may hold suspect
  lines: saves the box itself judged bad or could not judge (`custody_suspects`). A live one (no
  record of its path written at or after it) is a failure: the pull lacks a checkpoint the box
  refused, or holds one it refused.
"""
from __future__ import annotations

import json
import posixpath
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from controller.verify.identity import Entry, Removed

_SAVE_DIR = re.compile(r"^(checkpoint|ckpt|global_step|step|epoch)[-_=]?\d+", re.IGNORECASE)
CUSTODY_REL = "rgt/manifest.jsonl"
MAX_CUSTODY_BYTES = 64 << 20


def _ts(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def custody_suspects(raw: bytes) -> List[Dict[str, str]]:
    """The live suspect lines of a custody log ({"path", "code", "reason"}, box text cut short):
    the newest per path that no record of that path, written at or after it, covers."""
    recorded: Dict[str, float] = {}
    latest: Dict[str, Tuple[float, Dict[str, str]]] = {}
    for line in raw.splitlines():
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # a torn or hostile line proves nothing either way
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("path"), str):
            continue
        ts, path = _ts(obj.get("ts")), obj["path"]
        if ts is None:
            continue
        if "op" not in obj:
            recorded[path] = max(ts, recorded.get(path, ts))
        elif obj["op"] == "suspect":
            latest[path] = (ts, {"path": path[:300], "code": str(obj.get("code") or "suspect")[:60],
                                 "reason": str(obj.get("reason") or "no reason given")[:300]})
    return [item for path, (ts, item) in sorted(latest.items()) if recorded.get(path, float("-inf")) < ts]


def units_of(entries: Sequence[Entry]) -> Dict[str, Optional[str]]:
    """{path: its unit} (None for includes)."""
    by_parent: Dict[str, Set[Optional[int]]] = {}
    for e in entries:
        if e.kind == "checkpoint" and e.unit is None:
            by_parent.setdefault(posixpath.dirname(e.path), set()).add(e.step)
    count: Dict[str, int] = {}
    for e in entries:
        if e.kind == "checkpoint":
            parent = posixpath.dirname(e.path)
            count[parent] = count.get(parent, 0) + 1
    out: Dict[str, Optional[str]] = {}
    for e in entries:
        if e.kind != "checkpoint":
            out[e.path] = e.unit
            continue
        parent = posixpath.dirname(e.path)
        if e.unit is not None:
            out[e.path] = e.unit
        elif parent and (_SAVE_DIR.match(posixpath.basename(parent))
                         or (count[parent] > 1 and len(by_parent.get(parent, set())) == 1)):
            out[e.path] = parent
        else:
            out[e.path] = e.path
    return out


def unit_steps(entries: Sequence[Entry], units: Dict[str, Optional[str]]) -> Dict[str, Optional[int]]:
    """{unit: its step (the highest of its files)}."""
    steps: Dict[str, Optional[int]] = {}
    for e in entries:
        unit = units.get(e.path)
        if unit is None:
            continue
        old = steps.get(unit)
        steps[unit] = e.step if old is None else old if e.step is None else max(old, e.step)
    return steps


def newest_units(steps: Dict[str, Optional[int]]) -> List[str]:
    """The unit(s) whose weights are checked for NaN/Inf by default: the highest step, or every
    unit when no step is known."""
    known = {u: s for u, s in steps.items() if s is not None}
    if not known:
        return sorted(steps)
    top = max(known.values())
    return sorted(u for u, s in known.items() if s == top)


def shown(unit: str, files: Iterable[str]) -> str:
    """A unit as people read it: `checkpoint-60/` for a dir, the file itself otherwise."""
    return unit if list(files) == [unit] else unit.rstrip("/") + "/"


def removed_name(r: Removed) -> str:
    """What a removed checkpoint is called in a report: its unit, else the save dir in its path."""
    if r.unit:
        return r.unit
    parts = r.path.split("/")
    for i, part in enumerate(parts[:-1]):
        if _SAVE_DIR.match(part):
            return "/".join(parts[:i + 1])
    return r.path


def rotation(removed: Sequence[Removed]) -> Tuple[List[str], List[Removed]]:
    """(the names the job rotated away, the removals by anything else)."""
    names = list(dict.fromkeys(removed_name(r) for r in removed if r.by == "job"))
    return names, [r for r in removed if r.by != "job"]


def summarize(files: Sequence[Any], steps: Dict[str, Optional[int]], newest: Sequence[str]
              ) -> List[Dict[str, Any]]:
    """One row per unit (FileReport-like rows with .path .unit .size .identity .load .nonfinite)."""
    rows: Dict[str, Dict[str, Any]] = {}
    for f in files:
        if f.unit is None:
            continue
        row = rows.setdefault(f.unit, {"unit": f.unit, "step": steps.get(f.unit), "files": [], "bytes": 0,
                                       "newest": f.unit in newest, "weights_finite": None,
                                       "nonfinite_files": [], "ok": True})
        row["files"].append(f.path)
        row["bytes"] += f.size or 0
        failed = f.identity != "ok" or f.failures()
        row["ok"] = row["ok"] and not failed
        if f.nonfinite is not None:
            if f.nonfinite:
                row["weights_finite"] = False
                row["nonfinite_files"].append(f.path)
            elif row["weights_finite"] is None:
                row["weights_finite"] = True
    out = sorted(rows.values(), key=lambda r: (-1 if r["step"] is None else r["step"], r["unit"]))
    for row in out:
        row["name"] = shown(row["unit"], row["files"])
    return out


def line(row: Dict[str, Any]) -> str:
    """`checkpoint-60/: 8 files, weights finite (newest)`."""
    n = len(row["files"])
    finite = {True: "weights finite", False: "weights NOT FINITE (NaN/Inf in "
              + ", ".join(row["nonfinite_files"][:3]) + ")",
              None: "weights not checked for NaN/Inf"}[row["weights_finite"]]
    tail = " (newest)" if row["newest"] else ""
    text = f"{row['name']}: {n} file{'s' if n != 1 else ''}, {finite}{tail}"
    return text + ("" if row["ok"] else ", FAILED")


__all__ = ["CUSTODY_REL", "custody_suspects", "line", "newest_units", "removed_name", "rotation", "shown",
           "summarize", "unit_steps", "units_of"]
