"""`rgt pull` and `rgt teardown`: bring a run home, then give the box back only when that is safe.

Thin commands over controller.pull.fetch and controller.teardown.gate; controller/cli/main.py
adds them to the `rgt` group. Exit codes: 0 done, 1 refused or failed (an `error:` line says why,
a `hint:` line what to do), 2 usage.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import click

from controller import render
from controller.cli.base import (
    JSON_OPTION,
    RUN_ARGUMENT,
    CliError,
    RgtCommand,
    emit_json,
    sigterm_as_interrupt,
)
from controller.cli.progress import ProgressMeter
from controller.pull.fetch import CLOSE_WAIT_S, Progress, PullError, PullResult, pending_text, pull
from controller.store.db import Store
from controller.teardown import gate as teardown

# ---- rgt pull ---------------------------------------------------------------------------------


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _clock(seconds: Optional[float]) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _progress_text(p: Progress) -> str:
    pct = 100.0 * p.pulled_bytes / p.total_bytes if p.total_bytes else 100.0
    return (f"{_mb(p.pulled_bytes)} / {_mb(p.total_bytes)}  {pct:5.1f}%  "
            f"{p.rate_bps / 1e6:7.1f} MB/s  ETA {_clock(p.eta_s)}")


@click.command("pull", cls=RgtCommand)
@RUN_ARGUMENT
@click.option("--to", "dest", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Where the run goes [default: ./runs/<run-id>].")
@click.option("--bwlimit", metavar="RATE", default=None,
              help="Cap the transfer rate, bytes per second with a k/m/g suffix (rsync's --bwlimit: 20m).")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=CLOSE_WAIT_S, show_default=True,
              metavar="SECONDS", help="How long to wait for a box still closing the run (its job exited; "
                                      "the last checkpoints are being committed) before giving up.")
@JSON_OPTION
def pull_command(run: str, dest: Optional[Path], bwlimit: Optional[str], wait_s: float,
                 as_json: bool) -> None:
    """Copy RUN's manifest and every file it lists into DIR, resumably.

    \b
    One rsync over the host's ssh master, into DIR.partial/ first: DIR appears only complete.
    Interrupted? Run the same command again: nothing received is sent twice.
    A job that exited while the box still commits its last checkpoints: the pull waits for
    the run's final manifest (--wait, saying what is pending); a close that left units
    hashing fails naming them, after copying what was listed.
    Then prove the copy with `rgt verify DIR` (the teardown gate needs it).
    """
    meter = ProgressMeter(keep=True)  # on a terminal the line stays: the transfer's last numbers

    def progress(p: Progress) -> None:  # off a terminal: one JSON object per update
        meter.show(_progress_text(p), plain=json.dumps(p.to_dict(), sort_keys=True))

    def closing(close: Dict[str, Any]) -> None:  # the box is still committing the last checkpoints
        meter.show(f"waiting for the box to close the run: {pending_text(close)}",
                   plain=json.dumps({"closing": close}, sort_keys=True))

    try:  # SIGTERM ends rsync too (it keeps what it received), not only this process
        with Store.open() as store, sigterm_as_interrupt():
            result = pull(store, run, dest, bwlimit=bwlimit, on_progress=progress, on_closing=closing,
                          close_wait_s=wait_s)
    except PullError as e:
        raise CliError(e.message, e.hint) from e
    finally:
        meter.end()
    if as_json:
        emit_json(result.to_dict())
        _not_final(result, quiet=True)
        return
    sent = result.rsync.get("literal_bytes", 0)
    click.echo(render.printable(
        f"pulled {result.run}: {result.files} files, {_mb(result.bytes)} into {result.dest} "
        f"({_mb(sent)} sent, {_mb(result.resumed_bytes)} already here, {result.elapsed_s:.1f}s)"))
    if result.rotated_away:
        click.echo(render.printable(f"rotated away by the job: {', '.join(result.rotated_away)} "
                                    "(gone on purpose, not missing)"))
    for item in result.removed_other:
        click.echo(render.printable(f"warning: {item}: removed from the box by something other than the "
                                    "job's rotation; `rgt verify` will fail it"), err=True)
    if result.previous:
        click.echo(render.printable(f"warning: the earlier pull held files this one does not; kept as "
                                    f"{result.previous}"), err=True)
    _not_final(result, quiet=False)
    click.echo(render.printable(f"next: rgt verify {result.dest}"), err=True)


def _not_final(result: PullResult, quiet: bool) -> None:
    """Say when the pulled manifest is not the run's final one; fail when the box will extend it."""
    state = result.close.get("state")
    if state == "incomplete":
        names = ", ".join(result.close.get("incomplete") or [])
        raise CliError(f"the manifest of {result.run} is not final: checkpoint(s) still being committed at "
                       f"the run's close ({names}); what was listed is home",
                       f"run `rgt pull {result.run}` again once their ckpt.saved are in (`rgt status`)")
    if state == "closing":   # the box's wait ended with the close still going: never call it final
        raise CliError(f"the manifest of {result.run} is not final: the box is still closing the run "
                       f"({pending_text(result.close)}); what was listed is home",
                       f"run `rgt pull {result.run}` again once `rgt status` says it is closed")
    if quiet:
        return
    if state == "running":
        click.echo("note: the job is still running: this pull is a snapshot, not the run's final state",
                   err=True)
    elif state == "unclosed":
        click.echo("warning: the job exited and no sidecar closed the run: checkpoints it wrote at the end "
                   "may be missing from this pull (`rgt status` shows what the box recorded)", err=True)


# ---- rgt teardown -------------------------------------------------------------------------------


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _print_plan(p: teardown.Plan) -> None:
    lines = [f"run {p.run} on host {p.host} (profile {p.profile})"]
    g = p.gate
    lines.append(f"gate: {'OPEN' if g.open else 'CLOSED'}: {g.reason}")
    lines += [f"      also: {problem}" for problem in g.problems[1:]]
    if g.rotated_away:
        lines.append(f"      rotated away by the job: {', '.join(g.rotated_away)} "
                     "(gone on purpose, not missing)")
    if p.meter_stop:
        lines.append(f"meter: {p.meter_stop}")
    lines += [f"danger clock: {clock}" for clock in p.danger_clocks]
    if not p.actions:
        lines.append("no teardown actions in this profile: nothing here for rgt to stop or release")
    for a in p.actions:
        lines.append("")
        lines.append(a.name + ("  (the profile's meter_stop_action)" if a.meter_stop else ""))
        lines.append(f"    stops the meter: {_yes_no(a.stops_meter)}; reversible: {_yes_no(a.reversible)}")
        lines.append(f"    deletes: {a.deletes or 'nothing'}")
        lines.append(f"    still bills: {a.still_bills or '(nothing stated)'}")
        lines.append(f"    verified {a.verified}" + (f" ({a.source})" if a.source else ""))
        if a.warning:
            lines.append(f"    {a.warning}")
        if a.command:
            creds = f"  (credentials from {', '.join(a.credentials_env)})" if a.credentials_env else ""
            lines.append(f"    runs: {a.command}{creds}")
        else:
            lines.append("    rgt prints these console steps:")
            lines += [f"      {i}. {step}" for i, step in enumerate(a.console, 1)]
        lines.append(f"    now: {'allowed' if a.allowed else 'REFUSED'} ({a.why})")
    click.echo("\n".join(render.printable(line) for line in lines))


def _ask(p: teardown.Plan, a: teardown.ActionPlan) -> Optional[str]:
    click.echo(render.printable(f"{a.name} on {p.host}: deletes {a.deletes or 'nothing'}; "
                                f"reversible: {_yes_no(a.reversible)}"), err=True)
    try:
        return str(click.prompt(render.printable(f"type the run id ({p.run}) to go on"), err=True, default="",
                                show_default=False))
    except click.Abort:
        return None


def _print_result(r: teardown.ActionResult) -> None:
    if r.mode == "console":
        click.echo(render.printable(f"{r.action}: rgt cannot do this itself. In the provider's console:"))
        for i, step in enumerate(r.console, 1):
            click.echo(render.printable(f"  {i}. {step}"))
        return
    if r.output:
        click.echo(render.printable_lines(r.output.rstrip("\n")))
    click.echo(render.printable(f"{r.action}: {' '.join(r.argv)} exited {r.exit_code}"), err=True)


@click.command("teardown", cls=RgtCommand)
@RUN_ARGUMENT
@click.option("--plan", "show_plan", is_flag=True,
              help="Show every action's costs and the gate; run nothing.")
@click.option("--action", "action", metavar="NAME", default=None, help="Run the profile's action NAME.")
@click.option("--yes", "typed", metavar="RUN_ID", default=None,
              help="The run id, typed ahead for scripts (instead of the prompt).")
@click.option("--from", "from_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              metavar="DIR",
              help="The pulled dir whose PULL_VERIFIED.json counts [default: the newest pull].")
@click.option("--instance-id", default=None, metavar="ID",
              help="The provider's instance id, for commands that name {instance_id}.")
@JSON_OPTION
def teardown_command(run: str, show_plan: bool, action: Optional[str], typed: Optional[str],
                     from_dir: Optional[Path], instance_id: Optional[str], as_json: bool) -> None:
    """Plan or run a provider action on RUN's box, behind the verified-pull gate.

    \b
      rgt teardown RUN --plan                  what each action stops, deletes and still bills
      rgt teardown RUN --action release        asks for the run id, then runs it or prints the steps
    The gate is open only when PULL_VERIFIED.json covers every checkpoint the box holds now.
    Destructive actions never run while it is closed; a stop that deletes nothing may.
    """
    if show_plan == (action is not None):
        raise click.UsageError("give exactly one of --plan and --action NAME")
    try:
        with Store.open() as store:
            p = teardown.plan(store, run, from_dir=from_dir, record=show_plan)
            if action is None:
                emit_json(p.to_dict()) if as_json else _print_plan(p)
                return
            a = p.action(action)
            if not a.allowed:
                raise teardown.TeardownError(f"{action}: {a.why}", hint=f"see `rgt teardown {p.run} --plan`")
            result = teardown.execute(store, p, action, typed if typed is not None else _ask(p, a),
                                      instance_id=instance_id)
    except teardown.TeardownError as e:
        raise CliError(e.message, e.hint) from e
    emit_json(result.to_dict()) if as_json else _print_result(result)
    if result.ok is False:
        raise CliError(f"{result.action} failed (exit {result.exit_code})",
                       hint="check the provider's console for the instance's state before trying again")


__all__ = ["pull_command", "teardown_command"]
