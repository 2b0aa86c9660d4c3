"""The teardown gate's view of a run: what the box holds now, by the paths a pull uses, beside what
custody recorded (onbox.custody.manifest) and what the pull manifest would list (onbox.custody.pullmanifest).

Standard library only, no threads; bounded walks (MAX_GATE_ENTRIES entries, fixed depths), so a box
with a huge tree answers in bounded time and the controller's gate fails closed on what it lacks.
"""
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from onbox.custody import units
from onbox.custody.check import is_temporary
from onbox.custody.pullmanifest import (
    ManifestError,
    live_records,
    pull_rel,
    removed_entries,
    run_meta,
    unit_files,
)
from onbox.fsutil import regular_files
from onbox.runs import utc_iso

GATE_SCHEMA = "rgt.gate_view"
MAX_GATE_ENTRIES = 200_000
_SKIP_SCAN = frozenset({"__pycache__", "node_modules", "site-packages", "venv", ".venv", "wandb", "rgt"})


def ckpt_dir_of(run_dir: Path) -> Path:
    """The run's checkpoint dir from run.json; an absolute path recorded under .../active/<run-id>/
    is taken relative to `run_dir`, so a sealed run (moved to export/) still finds its own."""
    meta = run_meta(run_dir)
    value = (meta.get("watch") or {}).get("ckpt_dir") if isinstance(meta.get("watch"), dict) else None
    value = value or meta.get("ckpt_dir")
    if not isinstance(value, str) or not value:
        return Path(run_dir) / "checkpoints"
    p = Path(value)
    if not p.is_absolute():
        return Path(run_dir) / p
    parts = p.parts
    for i in range(len(parts) - 1):
        if parts[i] == "active" and parts[i + 1] == Path(run_dir).name:
            return Path(run_dir).joinpath(*parts[i + 2:])
    return p


def _started_at(meta: Dict[str, Any]) -> Optional[float]:
    value = meta.get("started_at")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def _walk_files(top: Path, max_depth: int, budget: List[int],
                skip: bool = True) -> Iterator[Tuple[str, os.stat_result]]:
    """(path, stat) of the regular files under `top`, sorted, bounded in depth and in entries;
    `skip`: never into hidden, virtualenv or cache directories."""
    for base, dirs, files in os.walk(top):
        depth = os.path.relpath(base, top).count(os.sep) + (0 if base == str(top) else 1)
        dirs[:] = sorted(d for d in dirs
                         if depth < max_depth and not (skip and (d.startswith(".") or d in _SKIP_SCAN)))
        budget[0] -= len(files) + len(dirs)
        if budget[0] < 0:
            return
        yield from regular_files(base, sorted(files))


def _checkpoint_like(rel: str, st: os.stat_result) -> bool:
    parts = rel.split("/")
    in_unit = any(units.is_unit_dir(p) or p.startswith("checkpoint-") for p in parts[:-1])
    return st.st_size > 0 and (units.is_weight_name(parts[-1]) or in_unit)


def gate_view(run_dir: Path) -> Dict[str, Any]:
    """What the box holds now, by the paths a pull uses:

    - "checkpoints": every file of every live recorded unit (newest record per unit, minus those the
      job rotated away): {pull path: {"sha256", "size", "step", "unit"}};
    - "missing": pull paths of those files that are gone (a unit removed by "other" stays here);
    - "removed": the units removed since they were recorded ({"path", "sha256", "by", "reason",
      "ts", "step"}; by "job" is rotation, gone on purpose);
    - "unrecorded": files no record covers ({"path", "size", "reason"}): in a watched place, any file
      of the checkpoint dir or a checkpoint-like file of another place ("no_record" or "changed");
      under the job's cwd, checkpoint-like files (*.pt *.pth *.bin *.ckpt *.safetensors, files under
      checkpoint-*/ and other unit dirs) written since the run started and outside every watched
      place ("outside_watch": the job wrote where custody did not look; `path` is absolute when it
      lies outside the run dir);
    - "partials": temporary files in watched places."""
    root = Path(os.path.realpath(run_dir))
    live, _ = live_records(root)
    meta = run_meta(root)
    ckpt_dir = Path(os.path.realpath(ckpt_dir_of(root)))
    checkpoints: Dict[str, Dict[str, Any]] = {}
    keys: Dict[str, Optional[Tuple[int, int, int]]] = {}
    missing: List[str] = []
    for _, rec in sorted(live.items()):
        try:
            unit = pull_rel(root, rec)
        except ManifestError:
            continue
        for rel, key, digest in unit_files(rec, unit):
            checkpoints[rel] = {"sha256": digest, "size": key[0] if key else 0, "step": rec.step,
                                "unit": unit}
            keys[rel] = key
            if not os.path.lexists(root / rel):
                missing.append(rel)
    places = [(ckpt_dir, True)] + [(Path(os.path.realpath(p)), False) for p in units.read_places(root)]
    unrecorded: List[Dict[str, Any]] = []
    partials: List[str] = []
    budget = [MAX_GATE_ENTRIES]
    for place, every in places:
        inside = place == root or root in place.parents
        base = os.path.relpath(place, root) if inside else units.external_rel(str(place))
        for full, st in _walk_files(place, 64, budget, skip=False):
            sub = os.path.relpath(full, place).replace(os.sep, "/")
            rel = f"{base}/{sub}".replace(os.sep, "/")
            if is_temporary(sub):
                partials.append(rel)
            elif every or _checkpoint_like(sub, st):
                if rel not in keys or keys[rel] != (st.st_size, st.st_mtime_ns, st.st_ino):
                    unrecorded.append({"path": rel, "size": st.st_size,
                                       "reason": "no_record" if rel not in keys else "changed"})
    unrecorded += _outside_watch(root, meta, [p for p, _ in places], keys)
    return {"schema": GATE_SCHEMA, "version": 1, "run_id": str(meta.get("id") or root.name),
            "run_dir": str(root), "at": utc_iso(),
            "ckpt_dir": os.path.relpath(ckpt_dir, root).replace(os.sep, "/"),
            "checkpoints": checkpoints, "unrecorded": unrecorded, "missing": sorted(missing),
            "partials": partials, "removed": removed_entries(root, only_job=False)}


def _outside_watch(root: Path, meta: Dict[str, Any], places: List[Path],
                   keys: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Checkpoint-like files the job wrote under its cwd where no place is watched."""
    cwd = meta.get("cwd")
    if not isinstance(cwd, str) or not cwd.startswith("/") or not os.path.isdir(cwd):
        return []
    top = Path(os.path.realpath(cwd))
    since = _started_at(meta)
    out: List[Dict[str, Any]] = []
    for full, st in _walk_files(top, 4, [MAX_GATE_ENTRIES]):
        path = Path(full)
        if any(p == path or p in path.parents for p in places) or (root / "rgt") in path.parents:
            continue
        if since is not None and st.st_mtime < since - 1:
            continue  # there before the run started: not the job's output
        inside = root in path.parents
        rel = os.path.relpath(full, root).replace(os.sep, "/") if inside else full
        if _checkpoint_like(os.path.relpath(full, top).replace(os.sep, "/"), st) and rel not in keys:
            out.append({"path": rel, "size": st.st_size, "reason": "outside_watch"})
    return out


__all__ = ["GATE_SCHEMA", "MAX_GATE_ENTRIES", "ckpt_dir_of", "gate_view"]
