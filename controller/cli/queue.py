"""`rgt queue`: run a file of commands over several hosts, one cell per host at a time.

    rgt queue FILE --hosts h1,h2 [--name N] [--max-attempts K] [--foreground] [--json]
    rgt queue status [NAME] [--json]
    rgt queue resume NAME [--foreground]
    rgt queue cancel NAME [--stop-running]

The queue lives in the store (controller.queue.model); a background dispatcher per queue
(controller.queue.dispatch) places its cells. Exit codes of `--foreground` and `status`: 0 no cell
failed (all done or stopped by request, or still going), 1 some cell failed or was cancelled, 2 usage.
"""
from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import click

from controller import render
from controller.cli.base import (
    JSON_OPTION,
    CliError,
    RgtCommand,
    RgtGroup,
    duration,
    emit_json,
    sigterm_as_interrupt,
)
from controller.queue import dispatch
from controller.queue import model as q
from controller.store.db import Store

_REASON_WIDTH = 70


class QueueGroup(RgtGroup):
    """`rgt queue FILE ...` is `rgt queue start FILE ...`: a first word that names no subcommand is
    the commands file."""

    def resolve_command(self, ctx: click.Context,
                        args: List[str]) -> Tuple[Optional[str], Optional[click.Command], List[str]]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            return "start", self.commands["start"], list(args)
        return super().resolve_command(ctx, args)


def _hosts(ctx: click.Context, param: click.Parameter, value: str) -> List[str]:
    hosts = [h.strip() for h in value.split(",") if h.strip()]
    if not hosts:
        raise click.BadParameter("name at least one host: --hosts h1,h2", ctx, param)
    twice = sorted({h for h in hosts if hosts.count(h) > 1})
    if twice:
        raise click.BadParameter(f"{', '.join(twice)} named twice: a host runs one cell at a time",
                                 ctx, param)
    return hosts


# ---- rendering -------------------------------------------------------------------------------


def _short(text: str, width: int = _REASON_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def progress_line(change: q.Change) -> str:
    c = change.cell
    where = f" on {c.host} as {c.run}" if c.run else ""
    why = f": {c.reason}" if c.reason else ""
    return render.printable(f"cell {c.idx}{where}: {change.before} -> {c.state}{why}")


def _report(store: Store, name: str) -> Dict[str, Any]:
    queue = q.load(store, name)
    cells = q.cells(store, name)
    state = ("cancelled" if queue.options.cancelled else "finished" if q.finished(cells) else "running")
    return {**queue.to_dict(), "state": state, "dispatcher_pid": dispatch.running_pid(name),
            "counts": q.counts(cells), "exit": q.exit_code(cells), "cells": [c.to_dict() for c in cells]}


def _print_report(report: Dict[str, Any]) -> None:
    counts = ", ".join(f"{n} {s}" for s, n in sorted(report["counts"].items()))
    driver = f"dispatcher pid {report['dispatcher_pid']}" if report["dispatcher_pid"] else "no dispatcher"
    click.echo(render.printable(
        f"queue {report['name']} ({report['state']}; {driver}): {len(report['cells'])} cells over "
        f"{', '.join(report['hosts'])}, max {report['options']['max_attempts']} attempts: {counts}"))
    click.echo(f"  {'CELL':>4} {'STATE':<10} {'HOST':<12} {'RUN':<34} {'TRIES':>5}  REASON / COMMAND")
    for c in report["cells"]:
        text = c["reason"] or shlex.join(c["command"])
        click.echo(render.printable(f"  {c['idx']:>4} {c['state']:<10} {c['host'] or '-':<12} "
                                    f"{c['run'] or '-':<34} {c['attempts']:>5}  {_short(text)}"))


# ---- driving -----------------------------------------------------------------------------------


def _foreground(store: Store, name: str, as_json: bool) -> int:
    """Run the dispatcher in this process, one line per cell change; the queue's exit code."""

    def show(change: q.Change) -> None:
        if as_json:
            emit_json({"change": {"before": change.before, **change.cell.to_dict()}})
        else:
            click.echo(progress_line(change))

    try:
        with dispatch.holding(name), sigterm_as_interrupt():
            dispatcher = dispatch.Dispatcher(store, name)
            try:
                code = dispatcher.serve(show)
            except KeyboardInterrupt:
                click.echo(f"stopped driving queue {name}; its running cells go on. "
                           f"next: rgt queue resume {name}", err=True)
                raise click.exceptions.Exit(q.exit_code(q.cells(store, name))) from None
    except dispatch.Busy:
        raise CliError(f"queue {name} is driven by dispatcher pid {dispatch.running_pid(name)}",
                       hint=f"follow it with 'rgt queue status {name}'") from None
    report = _report(store, name)
    if as_json:
        emit_json(report)
    else:
        _print_report(report)
    return code


def _background(store: Store, name: str, as_json: bool, verb: str) -> None:
    pid = dispatch.ensure_dispatcher(store, name)
    report = _report(store, name)
    report["dispatcher_pid"] = pid
    if as_json:
        emit_json(report)
        return
    click.echo(render.printable(f"queue {name}: {verb}, {len(report['cells'])} cells over "
                                f"{', '.join(report['hosts'])}; dispatcher pid {pid or '-'}"))
    click.echo(f"next: rgt queue status {name}   (rgt watch --all wakes on any of its runs)", err=True)


# ---- commands ----------------------------------------------------------------------------------


@click.group("queue", cls=QueueGroup, no_args_is_help=True,
             subcommand_metavar="FILE --hosts H1,H2,... | COMMAND [ARGS]...")
def queue_group() -> None:
    """Run a file of commands over several hosts, one at a time per host.

    \b
      rgt queue ablations.txt --hosts gpu1,gpu2     one command per line (# comments)
      rgt queue status [NAME] [--json]              every cell: state, host, run, tries, reason
      rgt queue resume NAME                         carry on (after a restart, or a cancel)
      rgt queue cancel NAME [--stop-running]        stop placing cells
    A cell that was preempted, or whose box stayed unreachable, is retried (up to
    --max-attempts); NaN, OOM or a failing command fail the cell, never retried. A cell whose
    run was stopped through rgt (`rgt stop RUN`) ends "stopped": not retried, not a failure.
    """


@queue_group.command("start", cls=RgtCommand)
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--hosts", "hosts", required=True, callback=_hosts, metavar="H1,H2,...",
              help="The hosts to run on (`rgt hosts`); each runs one cell at a time.")
@click.option("--name", default=None, help="Queue name (default: FILE's stem).")
@click.option("--max-attempts", type=click.IntRange(min=1), default=q.DEFAULT_MAX_ATTEMPTS, show_default=True,
              help="Attempts per cell, counting the first.")
@click.option("--link-budget", "link_budget_s", default="15m", show_default=True, callback=duration,
              metavar="DUR", help="How long a cell's link may stay down before it is retried elsewhere.")
@click.option("--onbox-arg", "onbox_args", multiple=True, metavar="ARG",
              help="Extra `rgt-onbox launch` argument for every cell, repeatable.")
@click.option("--foreground", is_flag=True, help="Drive the queue here, one line per cell change.")
@JSON_OPTION
def start_command(file: Path, hosts: Sequence[str], name: Optional[str], max_attempts: int,
                  link_budget_s: float, onbox_args: Sequence[str], foreground: bool, as_json: bool) -> None:
    """Run FILE's commands (one per line) over HOSTS. `rgt queue FILE ...` is the same."""
    from controller.box.handle import host_record

    try:
        commands = q.parse_commands(file.read_text(encoding="utf-8"), str(file))
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {file}: {e}", param_hint="FILE") from e
    except q.QueueError as e:
        raise click.BadParameter(str(e), param_hint="FILE") from e
    if name is not None:
        try:
            q.check_name(name)
        except q.QueueError as e:
            raise click.BadParameter(str(e), param_hint="--name") from e
    options = q.Options(max_attempts=max_attempts, link_budget_s=link_budget_s, onbox_args=tuple(onbox_args),
                        source=str(file.resolve()))
    with Store.open() as store:
        for host in hosts:
            host_record(store, host)  # an unknown host is refused before anything is stored
        name = name or q.unused_name(store, q.name_from(file.name))
        q.create(store, name, hosts, commands, options, time.time())
        if foreground:
            raise click.exceptions.Exit(_foreground(store, name, as_json))
        _background(store, name, as_json, "started")


@queue_group.command("status", cls=RgtCommand)
@click.argument("name", required=False)
@JSON_OPTION
def status_command(name: Optional[str], as_json: bool) -> None:
    """Every cell of NAME (default: all queues): state, host, run, tries.

    Also each cell's reason (why it failed, or why it is retried). A queue still going whose
    dispatcher died gets a new one."""
    with Store.open() as store:
        wanted = [name] if name else q.names(store)
        reports = []
        for n in wanted:
            q.refresh(store, n, time.time())
            dispatch.ensure_dispatcher(store, n)
            reports.append(_report(store, n))
    code = max([r["exit"] for r in reports] or [0])
    if as_json:
        emit_json(reports[0] if name else {"queues": reports})
    elif not reports:
        click.echo("no queues; start one with 'rgt queue FILE --hosts h1,h2'", err=True)
    for r in reports if not as_json else ():
        _print_report(r)
    if code:
        raise click.exceptions.Exit(code)


@queue_group.command("resume", cls=RgtCommand)
@click.argument("name")
@click.option("--foreground", is_flag=True, help="Drive the queue here, one line per cell change.")
@JSON_OPTION
def resume_command(name: str, foreground: bool, as_json: bool) -> None:
    """Carry on with queue NAME (after a restart, or a cancel).

    A dead dispatcher is started again; after `rgt queue cancel`, the cancelled cells wait again."""
    with Store.open() as store:
        q.load(store, name)
        q.reopen(store, name, time.time())
        if foreground:
            raise click.exceptions.Exit(_foreground(store, name, as_json))
        _background(store, name, as_json, "resumed")


@queue_group.command("cancel", cls=RgtCommand)
@click.argument("name")
@click.option("--stop-running", is_flag=True, help="Also stop the cells' running jobs (as `rgt stop`).")
@click.option("--grace", default="30s", show_default=True, help="With --stop-running: SIGTERM to SIGKILL.")
@JSON_OPTION
def cancel_command(name: str, stop_running: bool, grace: str, as_json: bool) -> None:
    """Stop placing queue NAME's cells. Running jobs go on unless --stop-running."""
    stopped: List[Dict[str, Any]] = []
    with Store.open() as store:
        q.load(store, name)
        q.set_options(store, name, time.time(), cancelled=True)
        dispatch.stop_dispatcher(name, timeout_s=60.0)
        q.cancel(store, name, time.time())
        if stop_running:
            stopped = _stop_running(store, name, grace)
        report = _report(store, name)
    report["stopped"] = stopped
    if as_json:
        emit_json(report)
        return
    _print_report(report)
    for s in stopped:
        click.echo(render.printable(f"cell {s['idx']} ({s['run']}): {s['outcome']}"), err=True)


def _stop_running(store: Store, name: str, grace: str) -> List[Dict[str, Any]]:
    """rgt's own stop for every running cell; each such cell is then cancelled, its attempt
    recorded as stopped."""
    from controller.box import jobs as boxes
    from controller.box.ssh import SshError

    out = []
    for cell in q.cells(store, name):
        if cell.state not in q.ACTIVE or not cell.run:
            continue
        try:
            answer = boxes.stop(store, cell.run, grace, by="rgt queue cancel")
            outcome = str(answer.get("outcome", "asked"))
        except (boxes.BoxError, SshError) as e:
            outcome = f"could not stop: {e}"
        last = {**cell.last, "outcome": "stopped", "reason": f"stopped by rgt queue cancel ({outcome})",
                "ended_at": time.time()}
        q.transition(store, cell, time.time(), state=q.CANCELLED, reason=last["reason"],
                     history=(*cell.history[:-1], last))
        out.append({"idx": cell.idx, "run": cell.run, "outcome": outcome})
    return out


__all__ = ["progress_line", "queue_group"]
