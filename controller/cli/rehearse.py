"""`rgt rehearse [--steps N] -- CMD...`: the launch command, rehearsed on this machine (CPU only).

The stages and what each proves are in controller/rehearse/run.py. Output: a table of stages, then
`rehearse: PASS`, or `rehearse: FAIL at <stage>: <detail>` and a `hint:` line; `--json` gives one
object {result, failed_stage, stages, run_dir, root, kept, hint, notes}. Progress lines go to stderr
as stages complete. Exit 0 only when every stage passed, 1 when one failed, 2 on usage errors.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import click

from controller import render
from controller.cli.base import (
    JSON_OPTION,
    CliError,
    RgtCommand,
    emit_json,
    positive_duration,
    sigterm_as_interrupt,
)
from controller.rehearse.checks import Stage
from controller.rehearse.run import Rehearsal, RehearseOptions, RehearseResult

EXIT_FAILED = 1


def _progress(stage: Stage) -> None:
    click.echo(render.printable(f"rehearse: {stage.name}: {stage.status} ({stage.seconds:.1f} s) "
                                f"{stage.detail}"), err=True)


def render_result(result: RehearseResult) -> None:
    """The stage table, the verdict line, and where the run directory is (stdout); hint on stderr."""
    click.echo(f"{'STAGE':<22} {'STATUS':<8} {'SECONDS':>7}  DETAIL")
    for s in result.stages:
        click.echo(render.printable(f"{s.name:<22} {s.status:<8} {s.seconds:>7.1f}  {s.detail}".rstrip()))
    for note in result.notes:
        click.echo(render.printable(f"note: {note}"), err=True)
    failed = result.failed
    if result.ok:
        click.echo("rehearse: PASS")
    else:
        name, detail = (failed.name, failed.detail) if failed else ("?", "not every stage ran")
        click.echo(render.printable(f"rehearse: FAIL at {name}: {detail}"))
        if result.hint:
            click.echo(render.printable(f"hint: {result.hint}"), err=True)
    if result.kept:
        click.echo(render.printable(f"run dir kept: {result.run_dir} (remove {result.root} when done)"),
                   err=True)


@click.command("rehearse", cls=RgtCommand, context_settings={"allow_interspersed_args": False})
@click.option("--steps", type=click.IntRange(min=1), default=None, metavar="N",
              help="After the resume check, stop the job (SIGTERM) once it logs step N "
                   "(default: let it run to its own end).")
@click.option("--timeout", "timeout_s", default="10m", show_default=True, metavar="DUR",
              callback=positive_duration, help="Give up on the whole rehearsal after this long.")
@click.option("--stall-floor", "stall_floor_s", default="30s", show_default=True, metavar="DUR",
              callback=positive_duration, help="Silence the sidecar calls a stall (a stage fails on it).")
@click.option("--grace", "grace_s", default="30s", show_default=True, metavar="DUR",
              callback=positive_duration, help="With --steps: time from the SIGTERM to the SIGKILL.")
@click.option("--keep", is_flag=True, help="Keep the private run directory after a pass too.")
@click.option("--cwd", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="The job's working directory (default: this one); a framework's default output_dir "
                   "lands there.")
@click.option("--tmp-dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Where the private run root is made (default: the system's temp dir).")
@JSON_OPTION
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD...")
def rehearse_command(steps: Optional[int], timeout_s: float, stall_floor_s: float, grace_s: float,
                     keep: bool, cwd: Optional[Path], tmp_dir: Optional[Path], as_json: bool,
                     command: Sequence[str]) -> None:
    """Rehearse the launch command here, on CPU, before renting a GPU.

    \b
      rgt rehearse -- python train.py --config tiny.yaml
      rgt rehearse --steps 200 --json -- python train.py

    Runs CMD under the sidecar in a private temporary run root (never the real one,
    never rgt's store), with CUDA_VISIBLE_DEVICES="". Stages: launch, metrics seen,
    checkpoint committed, resume (SIGKILL after the first checkpoint, relaunch, the
    step must not go back), safe load (every checkpoint hashes and loads with
    weights_only), clean exit. The run directory is removed after a pass (unless
    --keep) and kept after a failure. Exit 0 when every stage passed, 1 otherwise.
    """
    opts = RehearseOptions(command=list(command), steps=steps, timeout_s=timeout_s,
                           stall_floor_s=stall_floor_s, grace_s=grace_s, keep=keep, tmp_dir=tmp_dir,
                           cwd=cwd.resolve() if cwd else None)
    try:
        rehearsal = Rehearsal(opts)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot start the rehearsal: {e}") from e
    click.echo(render.printable(f"rehearse: private run root {rehearsal.root}"), err=True)
    with sigterm_as_interrupt():
        result = rehearsal.run(_progress)
    if as_json:
        emit_json(result.to_dict())
    else:
        render_result(result)
    if not result.ok:
        raise click.exceptions.Exit(EXIT_FAILED)
