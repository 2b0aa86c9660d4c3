"""`rgt reconcile DOC`: check the numbers a write-up claims against the run's evidence.

A thin command over controller.insight.reconcile.reconcile (the rules are in its docstring and in
controller.insight.claims_doc's). People get one table line per claim, the evidence nobody claimed,
and a count; `--json` prints the whole report as one JSON object. Exit codes: 0 no drift,
1 a claimed number drifted (or, with --strict, a claim is unbacked or there is no claim at all),
2 usage.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional, Tuple

import click

from controller import render
from controller.cli.base import JSON_OPTION, CliError, RgtCommand, emit_json
from controller.insight.reconcile import Finding, ReconcileError, Report, Value, reconcile


def _num(x: float) -> str:
    return f"{x:.6g}"


def _source(v: Optional[Value]) -> str:
    return "-" if v is None else f"{v.source} [{v.key}{', ' + v.where if v.where else ''}]"


def _lines(found: List[Finding]) -> str:
    return ", ".join(str(n) for n in sorted({f.claim.line for f in found}))


def _count(found: List[Finding]) -> str:
    return "1 claim has" if len(found) == 1 else f"{len(found)} claims have"


def _row(f: Finding) -> Tuple[str, ...]:
    c, v = f.claim, f.evidence
    evidence = "-" if v is None else _num(v.value) + (f" ({f.scaled})" if f.scaled else "")
    return (f"{c.line}:{c.col}", f.status, c.metric, c.shown, evidence, _source(v))


def _print_human(report: Report) -> None:
    if report.findings:
        click.echo(render.table(("LINE:COL", "STATUS", "METRIC", "SHOWN", "EVIDENCE", "SOURCE"),
                                [_row(f) for f in report.findings]))
    if report.missing:
        click.echo("never claimed (in the evidence, compared with no claim):")
        for v in report.missing:
            click.echo(render.printable(f"  {v.metric:<10} {_num(v.value):<10} {_source(v)}"))
    click.echo(f"{len(report.findings)} claims: {len(report.drifted)} drifted, "
               f"{len(report.unbacked)} unbacked, {len(report.matched)} matched; "
               f"{len(report.missing)} evidence values never claimed")


def _warn(report: Report, strict: bool) -> None:
    for note in report.notes:
        click.echo(f"warning: {render.printable(note)}", err=True)
    if not strict and report.unbacked:
        click.echo(f"warning: {_count(report.unbacked)} no evidence for their metric "
                   f"(unbacked, lines {_lines(report.unbacked)})", err=True)
    if not strict and not report.findings:
        click.echo(f"warning: no metric claims found in {render.printable(report.doc)}", err=True)


def _fail(report: Report, strict: bool) -> None:
    if report.drifted:
        raise CliError(f"{_count(report.drifted)} drifted from the evidence (lines {_lines(report.drifted)})",
                       "correct the document, or point --evidence at the run it describes")
    if strict and report.unbacked:
        raise CliError(f"{_count(report.unbacked)} no evidence for their metric "
                       f"(lines {_lines(report.unbacked)}; --strict)")
    if strict and not report.findings:
        raise CliError(f"no metric claims found in {report.doc} (--strict)")


@click.command("reconcile", cls=RgtCommand)
@click.argument("doc", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--evidence", "evidence", multiple=True, metavar="PATH",
              type=click.Path(exists=True, path_type=Path),
              help="A run directory, metrics.jsonl, eval JSON or PULL_VERIFIED.json; repeatable "
                   "[default: the current directory].")
@click.option("--tolerance", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="T",
              help="Absolute slack added to the precision each number shows.")
@click.option("--rows", "rows", metavar="REGEX",
              help="Only table rows whose label matches REGEX (case-insensitive) hold claims, e.g. 'ours'.")
@click.option("--strict", is_flag=True, help="Also fail on unbacked claims and on a document without claims.")
@JSON_OPTION
def reconcile_command(doc: Path, evidence: Tuple[Path, ...], tolerance: float, rows: Optional[str],
                      strict: bool, as_json: bool) -> None:
    """Check the metric numbers in DOC (Markdown, LaTeX or text) against a run's evidence.

    A number matches at the precision it is shown with: 91.3 matches 91.27, not 91.36.
    Exits 1 when a number drifts.
    """
    try:
        pattern = re.compile(rows, re.I) if rows is not None else None
    except re.error as e:
        raise click.BadParameter(f"not a regular expression: {e}", param_hint="--rows") from e
    try:
        report = reconcile(doc, list(evidence) or [Path(".")], tolerance, pattern)
    except ReconcileError as e:
        raise CliError(str(e), e.hint) from e
    if as_json:
        emit_json(report.to_dict(strict))
    else:
        _print_human(report)
        _warn(report, strict)
    _fail(report, strict)
