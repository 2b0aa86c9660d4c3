"""`rgt verify RUN_DIR`: prove a pulled run (identity, safe load, recomputed metric).

A thin command over controller.verify.prove.verify; controller/cli/main.py attaches it. People see one line
per proof on stdout and one `error:` line per failure on stderr; `--json` prints the report
(exactly what PULL_VERIFIED.json holds, plus "report_path") as one JSON object. Exit codes:
0 every proof that ran passed, 1 a proof failed (the last error line names which), 2 usage.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import click

from controller import render
from controller.cli.base import CliError, RgtCommand, emit_json
from controller.cli.progress import ProgressMeter
from controller.store.db import Store
from controller.verify import units as verify_units
from controller.verify.load import DEFAULT_TIMEOUT_S
from controller.verify.metric import (
    DEFAULT_EVAL_TIMEOUT_S,
    DEFAULT_METRIC,
    DEFAULT_TOLERANCE,
    EvalCommandError,
)
from controller.verify.prove import PROOFS, Report, verify


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _summary(name: str, proof: Dict[str, Any]) -> str:
    if proof.get("reason"):  # skipped, or failed as a whole (the manifest, nothing to evaluate)
        return str(proof["reason"])
    if name == "identity":
        extra = len(proof.get("extra", []))
        return (f"{proof['passed']}/{proof['files']} files match ({_gb(proof.get('bytes', 0))}), "
                f"{extra} extra")
    if name == "safe_load":
        text = f"{proof['loaded']} loaded, {proof['failed']} failed, {proof['unknown_format']} unknown format"
        if proof.get("skipped"):
            text += f", {proof['skipped']} not tried (identity failed)"
        checked = proof.get("finite_checked")
        if isinstance(checked, list):
            checked = ", ".join(checked) if len(checked) <= 2 else f"{len(checked)} checkpoints"
        return text + (f"; NaN/Inf checked in {checked}" if checked else "")
    evaluated = proof.get("evaluated", [])
    parts = [f"step {r['step']}: {r['recomputed']!r} vs reported {r['reported']!r}"
             for r in evaluated if r.get("ok")]
    return "; ".join(parts) or f"{proof['failed']} of {len(evaluated)} checkpoint(s) disagree"


def _print_human(report: Report) -> None:
    for name in PROOFS:
        proof = report.proofs[name]
        click.echo(render.printable(f"{name:<10} {proof['status']:<8} {_summary(name, proof)}").rstrip())
        for note in proof.get("notes", []):
            click.echo(f"warning: {render.printable(note)}", err=True)
    for row in report.units:
        click.echo(render.printable(f"  {verify_units.line(row)}"))
    if report.rotated_away:
        click.echo(render.printable(f"rotated away by the job: {', '.join(report.rotated_away)} "
                                    "(gone on purpose, not missing)"))
    for path in report.nonfinite:
        click.echo(render.printable(f"warning: non-finite checkpoint: {path} holds NaN/Inf weights"
                                    + ("" if not report.ok else " (allowed by --allow-nonfinite)")), err=True)
    for line in report.failures():
        click.echo(f"error: {render.printable(line)}", err=True)
    if report.ok:
        click.echo(render.printable(f"PULL VERIFIED: {report.path}"))


def _pulled_dir(name: str) -> Path:
    """RUN_DIR as given, or the directory a run id (or prefix) was last pulled into."""
    if Path(name).is_dir():
        return Path(name)
    if "/" in name or name in (".", ".."):
        raise click.UsageError(f"directory {name!r} does not exist")
    from controller.teardown.gate import pulled_dir_of

    with Store.open() as store:
        run = store.resolve_run(name)
        where = pulled_dir_of(store, run)
    if where is None or not where.is_dir():
        raise CliError(f"{name!r} is not a directory, and run {run} has no pull here",
                       hint=f"pull it first: rgt pull {run}")
    return where


def _record(report: Any, run_dir: Path) -> None:
    """verify.done in the store, so `rgt teardown` finds the proof (only for runs the store knows)."""
    run_id = str(report.to_dict().get("run_id") or "")
    with Store.open() as store:
        if run_id not in {r["run"] for r in store.runs()}:
            return
        store.add_local_event(run_id, "verify.done", "info" if report.ok else "warn",
                              {"dest": str(run_dir.resolve()), "ok": report.ok,
                               "manifest_sha256": report.to_dict().get("manifest_sha256"),
                               "nonfinite": [{"path": f.path, "unit": f.unit, "step": f.step}
                                             for f in report.files if f.nonfinite],
                               "rotated_away": list(report.rotated_away)})


@click.command("verify", cls=RgtCommand)
@click.argument("run_dir", metavar="RUN_DIR|RUN")
@click.option("--manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The box's PULL_MANIFEST.json [default: RUN_DIR/rgt/PULL_MANIFEST.json].")
@click.option("--eval-cmd", metavar="CMD",
              help="Recompute a metric: e.g. 'python eval.py {ckpt}' (no shell; {ckpt} is the path).")
@click.option("--metric", "eval_metric", default=DEFAULT_METRIC, show_default=True, metavar="NAME",
              help="The key of the eval's last JSON line and of metrics.jsonl to compare.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=DEFAULT_TOLERANCE, show_default=True,
              help="Relative tolerance of the metric comparison (absolute floor 1e-6).")
@click.option("--eval-all", is_flag=True, help="Evaluate every checkpoint step, not only the newest.")
@click.option("--eval-timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_EVAL_TIMEOUT_S,
              show_default=True, metavar="SECONDS", help="Per-checkpoint limit of the eval command.")
@click.option("--trust-pickle", is_flag=True,
              help="Load pickle checkpoints (still weights_only=True) under a torch older than 2.10.")
@click.option("--check-finite", is_flag=True,
              help="Check every checkpoint's weights for NaN/Inf (the newest one's always are).")
@click.option("--allow-nonfinite", is_flag=True,
              help="Report NaN/Inf weights without failing (the files stay named as non-finite).")
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="N",
              help="Files hashed at once [default: CPU count].")
@click.option("--load-timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_TIMEOUT_S,
              show_default=True, metavar="SECONDS", help="Per-file limit of a safe load.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def verify_command(run_dir: str, manifest: Optional[Path], eval_cmd: Optional[str], eval_metric: str,
                   tolerance: float, eval_all: bool, eval_timeout: float, trust_pickle: bool,
                   check_finite: bool, allow_nonfinite: bool, workers: Optional[int], load_timeout: float,
                   as_json: bool) -> None:
    """Prove a pulled run against its manifest and write RUN_DIR/rgt/PULL_VERIFIED.json.

    RUN_DIR is the pulled directory; a run id (or prefix) names the directory `rgt pull` put
    it in. The result is recorded for `rgt teardown`.
    """
    where = _pulled_dir(run_dir)
    meter = ProgressMeter()  # `hash 3/10` redrawn, only on a terminal and without --json

    def progress(stage: str, done: int, total: int) -> None:
        meter.show(f"{stage} {done}/{total}")

    try:
        report = verify(where, manifest, eval_cmd=eval_cmd, eval_metric=eval_metric, tolerance=tolerance,
                        trust_pickle=trust_pickle, check_finite=check_finite, workers=workers,
                        load_timeout_s=load_timeout, eval_all=eval_all, eval_timeout_s=eval_timeout,
                        allow_nonfinite=allow_nonfinite,
                        progress=progress if meter.tty and not as_json else None)
    except EvalCommandError as e:
        raise click.UsageError(str(e)) from e
    finally:
        meter.end()
    _record(report, where)
    if as_json:
        emit_json({**report.to_dict(), "report_path": str(report.path)})
    else:
        _print_human(report)
    if not report.ok:
        failed = [name for name in PROOFS if report.proofs[name]["status"] == "failed"]
        raise CliError(f"verification failed: {', '.join(failed)} (report: {report.path})",
                       "nothing on the box may be destroyed until `rgt verify` passes")
