"""`rgt plot`: a run's loss and metric curves, from every logged point, against a reference.

The points are `controller.runs.metrics.load`'s: the run's metrics.jsonl on this machine (a local
run's, or the one `rgt pull` brought home) with the stored train.progress events after it, else those
events alone (the box's ~5 s summaries). Only metrics are drawn (`protocol.metrics`: never a `time`
field). A loss panel whose values span more than a decade is drawn on a log y axis: on a linear
one, a loss falling from 10 to 0.1 is a flat line after its first steps.

matplotlib is an optional extra (`remote-gpu-trainer[plot]`), imported only
here and only when a plot is drawn. The figure is built with the object API
and rendered by Agg, so nothing global (pyplot's state, the backend choice)
is touched and no display is needed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from protocol import metrics as schema

from controller.runs.metrics import Curves, load
from controller.store.db import Store

INSTALL_HINT = "pip install 'remote-gpu-trainer[plot]'"
MAX_DEFAULT_METRICS = 4  # panels drawn when no --metric is given
DECADE = 10.0            # a loss whose max / min exceeds this is drawn on a log axis
LOG_NAMES = ("ppl", "perplexity")

Series = Dict[str, List[Tuple[float, float]]]


class PlotError(Exception):
    """A plot that cannot be drawn; `hint` says what to do."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.hint = hint


def _series(c: Curves) -> Series:
    return {name: c.points(name) for name in c.names() if c.points(name)}


def curves(store: Store, run: str) -> Tuple[str, Series]:
    """("step" or "epoch", {metric: [(x, value), ...]}) from every logged point of the run.

    x is the step when the run reports steps, else the epoch. Non-finite values
    (a NaN loss) are left out of the line; the events still say when they happened.
    """
    c = load(store, run)
    return c.axis, _series(c)


def log_scale(name: str, values: Sequence[float]) -> bool:
    """Whether a panel is drawn on a log y axis: a loss (or perplexity) whose values are all
    positive and span more than a decade."""
    low = name.lower().rsplit("/", 1)[-1]
    if not (schema.is_loss_name(name) or low.endswith(LOG_NAMES)) or not values:
        return False
    smallest, largest = min(values), max(values)
    return smallest > 0 and largest / smallest > DECADE


def _matplotlib() -> Any:
    """matplotlib's Figure class, or PlotError with the install hint."""
    try:
        import matplotlib.figure  # also checks the package itself, not only a cached submodule
    except ImportError as e:
        raise PlotError(f"rgt plot needs matplotlib, which is not installed ({e})", INSTALL_HINT) from e
    return matplotlib.figure.Figure


def figure(store: Store, run: str, ref: Optional[str], metrics: Sequence[str] = ()) -> Any:
    """The matplotlib Figure `plot` writes: one panel per metric, the run solid, `ref` dashed."""
    figure_class = _matplotlib()
    mine_c = load(store, run)
    run_id, axis, mine = mine_c.run, mine_c.axis, _series(mine_c)
    theirs_c = load(store, ref) if ref else None
    ref_id = theirs_c.run if theirs_c else None
    ref_axis, theirs = (theirs_c.axis, _series(theirs_c)) if theirs_c else (axis, {})
    names = list(metrics) or sorted(mine, key=lambda n: ("loss" not in n.lower(), n))[:MAX_DEFAULT_METRICS]
    if not names:
        raise PlotError(f"run {run_id} has no training values stored (no metrics.jsonl here, no "
                        "train.progress events)",
                        "is the job writing metrics.jsonl? `rgt events RUN --kind train.` shows what arrived")
    missing = [n for n in names if n not in mine and n not in theirs]
    if missing:
        known = ", ".join(sorted(set(mine) | set(theirs))) or "none"
        raise PlotError(f"no values of {', '.join(missing)} stored", f"known metrics: {known}")
    fig = figure_class(figsize=(8, 2.8 * len(names)), layout="constrained")
    fig.suptitle(f"{run_id}: {mine_c.source}" + (f"\n{ref_id}: {theirs_c.source}" if theirs_c else ""),
                 fontsize="small")
    axes = fig.subplots(len(names), 1, squeeze=False)
    for row, name in enumerate(names):
        ax = axes[row][0]
        drawn: List[float] = []
        for label, series, style in ((run_id, mine, "-"), (ref_id, theirs, "--")):
            values = series.get(name) if label else None
            if values:
                ax.plot([x for x, _ in values], [y for _, y in values], style, label=label)
                drawn += [y for _, y in values]
        if log_scale(name, drawn):
            ax.set_yscale("log")
        ax.set_ylabel(name)
        ax.set_xlabel(axis if not ref_id or ref_axis == axis else f"{axis} ({ref_id}: {ref_axis})")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(loc="best", fontsize="small")
    return fig


def plot(store: Store, run: str, ref: Optional[str], out_path: Path,
         metrics: Sequence[str] = ()) -> Path:
    """Draw `metrics` (default: the run's first few scalars, loss-like ones first) of `run`, and of
    `ref` when given, one panel each, into out_path (format from its suffix; PNG by default)."""
    fig = figure(store, run, ref, metrics)
    out = Path(out_path)
    fig.savefig(out)
    return out


__all__ = ["INSTALL_HINT", "PlotError", "curves", "figure", "log_scale", "plot"]
