"""`rgt plot`: a run's loss and metric curves (from its train.progress events) against a reference.

matplotlib is an optional extra (`remote-gpu-trainer[plot]`), imported only
here and only when a plot is drawn. The figure is built with the object API
and rendered by Agg, so nothing global (pyplot's state, the backend choice)
is touched and no display is needed.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from controller.status import all_events
from controller.store import Store

INSTALL_HINT = "pip install 'remote-gpu-trainer[plot]'"
MAX_DEFAULT_METRICS = 4  # panels drawn when no --metric is given

Series = Dict[str, List[Tuple[float, float]]]


class PlotError(Exception):
    """A plot that cannot be drawn; `hint` says what to do."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.hint = hint


def _finite(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def curves(store: Store, run: str) -> Tuple[str, Series]:
    """("step" or "epoch", {metric: [(x, value), ...]}) from the run's train.progress events.

    x is the step when the run reports steps, else the epoch. Non-finite values
    (a NaN loss) are left out of the line; the events still say when they happened.
    """
    points: List[Tuple[Optional[float], Optional[float], Dict[str, Any]]] = []
    for ev in all_events(store, run, "train.progress"):
        scalars = ev.data.get("scalars")
        points.append((_finite(ev.data.get("step")), _finite(ev.data.get("epoch")),
                       dict(scalars) if isinstance(scalars, dict) else {}))
    axis = "step" if any(p[0] is not None for p in points) else "epoch"
    out: Series = {}
    for step, epoch, scalars in points:
        x = step if axis == "step" else epoch
        if x is None:
            continue
        for name, value in scalars.items():
            y = _finite(value)
            if y is not None:
                out.setdefault(str(name), []).append((x, y))
    return axis, out


def _matplotlib() -> Any:
    """matplotlib's Figure class, or PlotError with the install hint."""
    try:
        import matplotlib.figure  # also checks the package itself, not only a cached submodule
    except ImportError as e:
        raise PlotError(f"rgt plot needs matplotlib, which is not installed ({e})", INSTALL_HINT) from e
    return matplotlib.figure.Figure


def plot(store: Store, run: str, ref: Optional[str], out_path: Path,
         metrics: Sequence[str] = ()) -> Path:
    """Draw `metrics` (default: the run's first few scalars, loss-like ones first) of `run`, and of
    `ref` when given, one panel each, into out_path (format from its suffix; PNG by default)."""
    figure_class = _matplotlib()
    run_id = store.resolve_run(run)
    axis, mine = curves(store, run_id)
    ref_id = store.resolve_run(ref) if ref else None
    ref_axis, theirs = curves(store, ref_id) if ref_id else (axis, {})
    names = list(metrics) or sorted(mine, key=lambda n: ("loss" not in n.lower(), n))[:MAX_DEFAULT_METRICS]
    if not names:
        raise PlotError(f"run {run_id} has no training values stored (no train.progress events)",
                        "is the job writing metrics.jsonl? `rgt events RUN --kind train.` shows what arrived")
    missing = [n for n in names if n not in mine and n not in theirs]
    if missing:
        known = ", ".join(sorted(set(mine) | set(theirs))) or "none"
        raise PlotError(f"no values of {', '.join(missing)} stored", f"known metrics: {known}")
    fig = figure_class(figsize=(8, 2.8 * len(names)), layout="constrained")
    axes = fig.subplots(len(names), 1, squeeze=False)
    for row, name in enumerate(names):
        ax = axes[row][0]
        for label, series, style in ((run_id, mine, "-"), (ref_id, theirs, "--")):
            values = series.get(name) if label else None
            if values:
                ax.plot([x for x, _ in values], [y for _, y in values], style, label=label)
        ax.set_ylabel(name)
        ax.set_xlabel(axis if not ref_id or ref_axis == axis else f"{axis} ({ref_id}: {ref_axis})")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    out = Path(out_path)
    fig.savefig(out)
    return out


__all__ = ["INSTALL_HINT", "PlotError", "curves", "plot"]
