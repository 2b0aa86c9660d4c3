"""`rgt daemon status|stop`: the follower daemon, the one background process of rgt here.

Any command that needs it starts it (controller/follow/client.py); these are for looking at it,
and for ending it so that the next command starts one with this shell's environment (it reads
RGT_SSH_CONFIG and the other knobs once, at its start). Stopping it loses nothing: the next one
resumes every run it followed and every queue not over.
"""
from __future__ import annotations

from typing import Any, Dict

import click

from controller.cli.base import JSON_OPTION, RgtCommand, RgtGroup, emit_json
from controller.follow import client


@click.group("daemon", cls=RgtGroup)
def daemon_group() -> None:
    """The follower daemon: one process that follows every run into the store."""


@daemon_group.command("status", cls=RgtCommand)
@JSON_OPTION
def status_command(as_json: bool) -> None:
    """Whether it runs, its pid, and the runs and queues it follows now.

    \b
      rgt daemon status --json   # {"pid": 4242, "runs": [...], "queues": [...], "log": ...}
    """
    pid = client.daemon_pid()
    answer = client.ask_daemon({"op": "list"}, start=False) if pid else None
    report: Dict[str, Any] = {"pid": pid, "runs": (answer or {}).get("runs", []),
                              "queues": (answer or {}).get("queues", []), "answering": answer is not None,
                              "log": str(client.daemon_files().log)}
    if as_json:
        emit_json(report)
        return
    if not pid:
        click.echo("no follower daemon runs; the next rgt command that needs one starts it")
        return
    click.echo(f"follower daemon pid {pid}{'' if answer is not None else ' (not answering)'}: "
               f"{len(report['runs'])} runs, {len(report['queues'])} queues; log {report['log']}")
    for run in report["runs"]:
        click.echo(f"  run {run}")
    for queue in report["queues"]:
        click.echo(f"  queue {queue}")


@daemon_group.command("stop", cls=RgtCommand)
@JSON_OPTION
def stop_command(as_json: bool) -> None:
    """End it (SIGTERM to the pid its lock names, then wait). Nothing is lost: the next command
    that needs it starts another, which resumes what this one followed."""
    pid = client.stop_daemon()
    if as_json:
        emit_json({"stopped": pid})
    elif pid:
        click.echo(f"stopped the follower daemon (pid {pid}); the next rgt command starts another")
    else:
        click.echo("no follower daemon ran")
