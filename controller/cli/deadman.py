"""`rgt deadman HOST status|renew|arm|disarm|authorize`: the box's dead-man lease from here.

Thin commands over controller/teardown/deadman.py; each prints a short block (`--json`: the box's one JSON
answer). The watcher renews the lease of a box it follows on its own; these are for a person or
an agent who wants to look, to give a box more time, or to switch its dead-man off.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional

import click

from controller.cli.base import JSON_OPTION, CliError, RgtGroup, emit_json
from controller.store.db import Store
from controller.teardown import deadman


@contextlib.contextmanager
def _problems() -> Iterator[None]:
    try:
        yield
    except deadman.DeadmanError as e:
        raise CliError(e.message, e.hint) from e


def _show(host: str, answer: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(answer)
    else:
        click.echo(deadman.render(host, answer))


@click.group("deadman", cls=RgtGroup)
@click.argument("host", metavar="HOST")
@click.pass_context
def deadman_group(ctx: click.Context, host: str) -> None:
    """The dead-man of box HOST: a lease that stops a forgotten box safely.

    \b
    The launch wrapper arms it (default 2 h, `--onbox-arg=--deadman=off` to skip). While
    rgt watches a run on the box it renews the lease; when nobody renewed it and no run on the
    box makes progress, the box takes its profile's safe action (`rgt profile show NAME`):
    power off on AutoDL, the provider's non-destructive stop on RunPod and vast.ai, a notice
    only everywhere else. Never a destructive action unless you authorized it here.
    """
    ctx.obj = host


@deadman_group.command("status")
@JSON_OPTION
@click.pass_obj
def status_command(host: str, as_json: bool) -> None:
    """The lease, its time left, the daemon, and what it would do right now."""
    with Store.open() as store, _problems():
        _show(host, deadman.status(store, host), as_json)


@deadman_group.command("renew")
@click.option("--ttl", metavar="DURATION", default=None,
              help="A new lease length (2h, 90m); default: the armed one.")
@JSON_OPTION
@click.pass_obj
def renew_command(host: str, ttl: Optional[str], as_json: bool) -> None:
    """Push the lease's expiry out by its length from now."""
    with Store.open() as store, _problems():
        _show(host, deadman.renew(store, host, ttl), as_json)


@deadman_group.command("arm")
@click.option("--ttl", metavar="DURATION", default="2h", show_default=True, help="How long a renewal lasts.")
@click.option("--idle", metavar="DURATION", default=None,
              help="A running job with no new metrics, log or checkpoint for this long is not progressing.")
@click.option("--max-hours", type=click.FloatRange(min=0, min_open=True), default=None,
              help="A hard budget: fire after this many hours even while renewed.")
@JSON_OPTION
@click.pass_obj
def arm_command(host: str, ttl: str, idle: Optional[str], max_hours: Optional[float], as_json: bool) -> None:
    """Arm the lease (launches arm it already)."""
    with Store.open() as store, _problems():
        _show(host, deadman.arm(store, host, ttl, idle, max_hours), as_json)


@deadman_group.command("disarm")
@JSON_OPTION
@click.pass_obj
def disarm_command(host: str, as_json: bool) -> None:
    """Switch the dead-man off: it will not fire until a launch or `arm` arms it again."""
    with Store.open() as store, _problems():
        _show(host, deadman.disarm(store, host), as_json)


@deadman_group.command("authorize")
@click.argument("action", metavar="ACTION")
@click.option("--instance-id", required=True, metavar="ID", help="The provider's id of this instance.")
@click.option("--yes", "typed", metavar="HOST", default=None,
              help="Confirm by typing the host name (asked for when missing).")
@JSON_OPTION
@click.pass_obj
def authorize_command(host: str, action: str, instance_id: str, typed: Optional[str], as_json: bool) -> None:
    """Let the dead-man run ACTION (one its profile allows, e.g. terminate on Lambda) when it fires.

    Refused unless the teardown gate is open for every run rgt launched on HOST (each pulled and
    verified, nothing new on the box since), and the host name is typed. The box drops back to
    its default when a checkpoint appears after this authorization.
    """
    if typed is None and not as_json:
        typed = click.prompt(f"type {host} to let its dead-man run {action}", default="", show_default=False)
    with Store.open() as store, _problems():
        _show(host, deadman.authorize(store, host, action, instance_id=instance_id, typed=typed), as_json)
