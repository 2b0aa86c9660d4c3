"""A run's logged metrics on the laptop, and the reference run's value at the SAME step.

    curves = load(store, run)                 # every logged point the laptop has
    ref = reference(store, "baseline", progress, run=run_id)   # `rgt status --ref`

Where the points come from, best first (`Curves.source` says which):

1. the run's metrics.jsonl here: its run directory when the run is on host `local`, else the dir of
   its newest `rgt pull` (or `rgt verify`), else ./runs/<run-id>. Every line the job logged;
2. the stored train.progress events (the box's summaries, one per ~5 s), for the steps after
   the file's last one (a run pulled while it still trains) or when there is no file.

Only metrics count (`protocol.metrics`): a `time` or `timestamp` field, a file name or a banner word
is never a curve, and non-finite values are left out of the line.

`reference` compares like with like: the reference's value at the current run's step, read
exactly or interpolated between the reference's two logged steps around it. When the current step
is outside what the reference logged (it stopped earlier, or logged later), it compares both runs at
their nearest shared step instead: the current run's own value there, never this run at 300 against
the reference at 240. Each metric says how (`how`, and `note` in words).
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from protocol import metrics as schema

from controller import paths
from controller import trust as boxtrust
from controller.errors import StoreError
from controller.store.db import Store

METRICS_FILE = "metrics.jsonl"
CAP_BYTES = 64 << 20        # the newest part of a metrics.jsonl read
MAX_NAMES = 256             # metrics kept per run
PAGE = 5000                 # events read per query
STEP_KEYS = ("step", "global_step", "iteration", "iter")
EXACT, INTERPOLATED, SHARED, NEAREST = "same step", "interpolated", "nearest shared step", "nearest step"

Points = Dict[str, Dict[float, float]]   # metric -> x -> value


@dataclasses.dataclass
class Curves:
    """One run's metric points by step and by epoch, and where they were read."""

    run: str
    source: str
    by_step: Points = dataclasses.field(default_factory=dict)
    by_epoch: Points = dataclasses.field(default_factory=dict)

    @property
    def axis(self) -> str:
        """"step" when the run logs steps, else "epoch"."""
        return "step" if any(self.by_step.values()) else "epoch"

    def table(self, axis: str) -> Points:
        return self.by_step if axis == "step" else self.by_epoch

    def points(self, name: str, axis: Optional[str] = None) -> List[Tuple[float, float]]:
        """(x, value) of one metric, in x order."""
        return sorted(self.table(axis or self.axis).get(name, {}).items())

    def names(self) -> List[str]:
        return list(dict.fromkeys([*self.by_step, *self.by_epoch]))

    def add(self, step: Optional[float], epoch: Optional[float], values: Mapping[str, float]) -> None:
        for axis, x in (("step", step), ("epoch", epoch)):
            if x is None:
                continue
            table = self.table(axis)
            for name, value in values.items():
                if name in table or len(table) < MAX_NAMES:
                    table.setdefault(name, {})[x] = value


def _num(value: Any) -> Optional[float]:
    return schema.value_of(value, finite=True)


def _counter(value: Any) -> Optional[float]:
    number = _num(value)
    return number if number is not None and number >= 0 else None


def _flat(doc: Mapping[str, Any]) -> Dict[str, Any]:
    """One level of nesting as "outer/inner", as the box reads metrics.jsonl."""
    out: Dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, Mapping):
            out.update({f"{key}/{k}": v for k, v in value.items() if not isinstance(v, Mapping)})
        else:
            out[str(key)] = value
    return out


def parse_lines(data: bytes, curves: Curves, cut_first: bool = False) -> int:
    """Add every metrics line of `data` to `curves`; returns the lines that were not JSON objects."""
    lines = data.split(b"\n")
    if cut_first and lines:
        lines = lines[1:]
    bad = 0
    for raw in lines:
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            bad += 1
            continue
        if not isinstance(doc, dict):
            bad += 1
            continue
        step = next((_counter(doc[k]) for k in STEP_KEYS if k in doc), None)
        curves.add(step, _counter(doc.get("epoch")), schema.scalars(_flat(doc)))
    return bad


def _read_tail(path: Path) -> Tuple[Optional[bytes], bool]:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - CAP_BYTES))
            return f.read(CAP_BYTES), size > CAP_BYTES
    except OSError:
        return None, False


def metrics_files(store: Store, run_id: str) -> List[Path]:
    """Where this machine may hold the run's metrics.jsonl, best first (see the module doc)."""
    out: List[Path] = []
    try:
        info: Mapping[str, Any] = store.run(run_id)
    except StoreError:   # a run the store does not know has no files here
        info = {}
    if info.get("target") == paths.LOCAL and isinstance(info.get("run_dir"), str) and info["run_dir"]:
        out.append(Path(info["run_dir"]) / METRICS_FILE)
    for ev in reversed(store.local_events(run_id)):
        where = ev.data.get("dest") or ev.data.get("run_dir")
        if ev.kind in ("pull.done", "verify.done") and isinstance(where, str) and where:
            out.append(Path(where) / METRICS_FILE)
    try:
        out.append(boxtrust.contained(Path(os.path.abspath("runs")), boxtrust.run_id(run_id)) / METRICS_FILE)
    except boxtrust.Untrusted:
        pass
    return list(dict.fromkeys(out))


def _progress_events(store: Store, run_id: str) -> Iterable[Any]:
    """The run's train.progress events in seq order (paged; status.py imports this module)."""
    pos = 0
    while True:
        batch = store.events(run_id, since=pos, kind_prefix="train.progress", limit=PAGE)
        yield from batch
        if len(batch) < PAGE:
            return
        pos = batch[-1].seq


def _from_events(store: Store, run_id: str, curves: Curves, after: Optional[float]) -> int:
    """Add the run's train.progress points (those past step `after` when given); returns how many."""
    added = 0
    for ev in _progress_events(store, run_id):
        step, epoch = _counter(ev.data.get("step")), _counter(ev.data.get("epoch"))
        if after is not None and (step is None or step <= after):
            continue
        raw = ev.data.get("scalars")
        values = schema.scalars(raw) if isinstance(raw, Mapping) else {}
        if values and (step is not None or epoch is not None):
            curves.add(step, epoch, values)
            added += 1
    return added


def load(store: Store, run: str) -> Curves:
    """Every logged point of `run` the laptop has (see the module doc)."""
    run_id = store.resolve_run(run)
    for path in metrics_files(store, run_id):
        data, cut = _read_tail(path) if path.is_file() else (None, False)
        if data is None:
            continue
        curves = Curves(run_id, f"{METRICS_FILE} ({path})")
        parse_lines(data, curves, cut)
        if not curves.names():
            continue
        steps = [x for table in curves.by_step.values() for x in table]
        if _from_events(store, run_id, curves, max(steps) if steps else math.inf):
            curves.source += " + train.progress events after it"
        return curves
    curves = Curves(run_id, "train.progress events")
    _from_events(store, run_id, curves, None)
    return curves


# ---- the same step ----------------------------------------------------------------------------


Found = Tuple[float, str, Optional[Tuple[float, float]]]


def value_at(points: List[Tuple[float, float]], x: float) -> Optional[Found]:
    """(value, how, (lower, upper) neighbours when interpolated) of a series at x: its own point,
    or linear interpolation between the two logged points around x; None outside what it logged."""
    if not points or x < points[0][0] or x > points[-1][0]:
        return None
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return points[i][1], EXACT, None
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0), INTERPOLATED, (x0, x1)


def _x(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _word(axis: str, x: float) -> str:
    return f"{axis} {_x(x)}"


def compare_at(axis: str, at: float, value: Optional[float], theirs: List[Tuple[float, float]],
               mine: Iterable[Tuple[float, float]] = ()) -> Optional[Dict[str, Any]]:
    """The reference (`theirs`) against this run at the same x: at `at` (this run's `value`) when
    the reference logged around it, else at the nearest shared x of `mine` (this run's own points).
    None when no such point exists."""
    got = value_at(theirs, at)
    if got is not None:
        ref_value, how, around = got
        note = f"at {_word(axis, at)}" + ("" if around is None else
                                          f" (interpolated between {_x(around[0])} and {_x(around[1])})")
        return _row(at, value, ref_value, how, note)
    own = dict(mine)
    if value is not None:
        own[at] = value
    logged = {x for x, _ in theirs}
    shared = sorted((abs(x - at), x) for x in own if x in logged)
    if shared:
        x = shared[0][1]
        return _row(x, own[x], dict(theirs)[x], SHARED, f"nearest shared {_word(axis, x)}")
    inside = sorted((abs(x - at), x) for x in own if value_at(theirs, x) is not None)
    if inside:
        x = inside[0][1]
        found = value_at(theirs, x)
        assert found is not None
        return _row(x, own[x], found[0], NEAREST,
                    f"at {_word(axis, x)}, the nearest step of this run the reference reached (interpolated)")
    return None


def _row(x: float, value: Optional[float], ref_value: float, how: str, note: str) -> Dict[str, Any]:
    diff = value - ref_value if value is not None else None
    rel = diff / abs(ref_value) if diff is not None and ref_value else None
    return {"value": value, "ref_value": ref_value, "ref_at": x, "at": x, "how": how, "note": note,
            "diff": diff, "rel_diff": rel}


def reference(store: Store, ref: str, progress: Mapping[str, Any],
              run: Optional[str] = None) -> Dict[str, Any]:
    """The reference run's value of each current metric at the same step (else epoch); see the
    module doc. Keys: run, by, at, source, metrics {name: value, ref_value, ref_at (the step
    compared), at, how, note, diff, rel_diff}, and skipped {name: why}. `run` (the current run)
    lets a step the reference never reached be compared at the runs' nearest shared step."""
    ref_id = store.resolve_run(ref)
    theirs = load(store, ref_id)
    mine = load(store, run) if run else None
    step, epoch = _counter(progress.get("step")), _counter(progress.get("epoch"))
    by_step = step is not None and theirs.axis == "step"
    by, at = ("step", step) if by_step else ("epoch", epoch)
    out: Dict[str, Any] = {"run": ref_id, "by": by, "at": at, "source": theirs.source, "metrics": {},
                           "skipped": {}}
    if at is None:
        return out
    scalars = progress.get("scalars")
    for name, cur in (scalars.items() if isinstance(scalars, Mapping) else ()):
        if not schema.is_metric_name(name):
            continue
        raw = cur.get("value") if isinstance(cur, Mapping) else cur
        points = theirs.points(name, by)
        if not points:
            out["skipped"][name] = f"the reference logged no {name}"
            continue
        row = compare_at(by, at, _num(raw), points, mine.points(name, by) if mine else ())
        if row is None:
            out["skipped"][name] = (f"the reference logged {name} only up to {_word(by, points[-1][0])}"
                                    if points[-1][0] < at else
                                    f"the reference logged {name} only from {_word(by, points[0][0])}")
            continue
        if row["how"] in (EXACT, INTERPOLATED) and row["value"] is None:
            row["value"] = raw   # "nan": shown as it is, no difference computed
        out["metrics"][name] = row
    return out


__all__ = ["Curves", "compare_at", "load", "metrics_files", "parse_lines", "reference", "value_at"]
