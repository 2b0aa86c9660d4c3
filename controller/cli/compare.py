"""`rgt compare RUN_A RUN_B`: what differs between two runs, and their metrics at the same step.

A thin command over controller.insight.compare; controller/cli/main.py attaches it. RUN_A and RUN_B are each
a run directory on this machine (a local run, or a copy `rgt pull` made) or a run name (or unique
prefix) in the store. People get a table of differences, a table of metrics and `warning:` lines
on stderr; `--json` prints the report as one JSON object. Exit codes: 0 compared (with or without
warnings), 1 a run cannot be read, 2 usage.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import click

from controller import render
from controller.cli.base import JSON_OPTION, CliError, RgtCommand, emit_json
from controller.insight.compare import compare, iter_rows
from controller.insight.runfacts import CompareError, RunFacts, Shell, load_dir, load_stored
from controller.store.db import Store

_WIDTH = 40


def _load(name: str, stack: contextlib.ExitStack, state: Dict[str, Any]) -> RunFacts:
    """A directory when `name` is one, else a run in the store (opened once, for both runs)."""
    if Path(name).is_dir():
        return load_dir(Path(name), name)
    if "/" in name or name in (".", ".."):
        raise CliError(f"no run directory {name!r}", hint="name a run directory or a run rgt knows")
    if "store" not in state:
        state["store"] = stack.enter_context(Store.open())
    shells: Dict[str, Shell] = state.setdefault("shells", {})
    return load_stored(state["store"], name, shells)


def _num(x: Any, signed: bool = False) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):  # "nan", "inf"
        return x
    return f"{x:+.6g}" if signed else f"{x:.6g}"


def _spread_text(row: Dict[str, Any]) -> str:
    spread = row.get("spread")
    if not spread:
        return "not enough seeds" if row.get("spread_note") else "-"
    seeds = max(g["seeds"] for g in spread["groups"])
    verdict = {True: "inside", False: "OUTSIDE", None: "?"}[spread["inside"]]
    return f"{verdict} (range {spread['range']:.4g}, {seeds} seeds)"


def _metric_lines(rows: List[Dict[str, Any]]) -> List[str]:
    table: List[Tuple[str, ...]] = []
    for r in rows:
        rel = r["rel"]
        table.append((r["metric"], "-" if r["step"] is None else str(r["step"]), _num(r["a"]),
                      _num(r["b"]), _num(r["diff"], True),
                      "-" if rel is None or not math.isfinite(rel) else f"{rel * 100:+.2f}%",
                      _spread_text(r)))
    lines = render.table(("METRIC", "STEP", "A", "B", "B-A", "REL", "SEED SPREAD"), table,
                         max_widths=(24,)).split("\n")
    lines += [render.printable(f"  {r['metric']}: {r['note']}") for r in rows if r.get("note")]
    return lines


def _print_human(report: Dict[str, Any]) -> None:
    a, b = report["a"], report["b"]
    click.echo(render.printable(f"A  {a['run_id']}  {a['where']}"))
    click.echo(render.printable(f"B  {b['run_id']}  {b['where']}"))
    click.echo("")
    rows = list(iter_rows(report))
    if rows:
        click.echo(render.table(("WHAT", "NAME", "A", "B"), rows, max_widths=(10, _WIDTH, _WIDTH, _WIDTH)))
    else:
        click.echo("no recorded difference")
    names = report["variables"]
    click.echo(render.printable(f"variables changed: {len(names)}" + (f" ({', '.join(names)})" if names
                                                                       else "")))
    click.echo("")
    if report["metrics"]:
        for line in _metric_lines(report["metrics"]):
            click.echo(line)
    else:
        click.echo("no metric in both runs")
    for note in report["notes"]:
        click.echo(f"note: {render.printable(note)}", err=True)
    for warning in report["warnings"]:
        click.echo(f"warning: {render.printable(warning)}", err=True)


@click.command("compare", cls=RgtCommand)
@click.argument("run_a", metavar="RUN_A")
@click.argument("run_b", metavar="RUN_B")
@click.option("--metric", metavar="NAME", help="Compare only this scalar of metrics.jsonl.")
@click.option("--step", type=click.IntRange(min=0), metavar="N",
              help="Compare the metrics at this step [default: the last step both runs reached].")
@JSON_OPTION
def compare_command(run_a: str, run_b: str, metric: Optional[str], step: Optional[int],
                    as_json: bool) -> None:
    """What differs between two runs (command, config keys, commit, environment names, seed,
    packages, profile, GPU) and their metrics at the same step.

    RUN_A and RUN_B are run directories (a local run or a pulled copy) or runs rgt knows. A
    warning says when more than one thing changed, or when only the seed did and whether the
    difference is inside the seed-to-seed spread of sibling runs.
    """
    with contextlib.ExitStack() as stack:
        state: Dict[str, Any] = {}
        try:
            a = _load(run_a, stack, state)
            b = _load(run_b, stack, state)
            report = compare(a, b, metric=metric, step=step)
        except CompareError as e:
            raise CliError(e.message, e.hint) from e
    if as_json:
        emit_json(report)
    else:
        _print_human(report)
