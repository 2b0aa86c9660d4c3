"""`rgt`: the controller's command line.

Commands are thin: parse, call one function, render. Exit codes, errors and
the shared options live in controller.cli.base. Adding a command: decorate a
function with `@main.command("name")` here, or write it in its own module as a
`@click.command(cls=RgtCommand)` and name it in LAZY (imported when first used); reuse
RUN_ARGUMENT / JSON_OPTION, raise StoreError or CliError for problems a person
can fix, and return None.
"""
from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import click

from controller import render
from controller.cli.base import (
    JSON_OPTION,
    RUN_ARGUMENT,
    CliError,
    CliState,
    RgtGroup,
    configure_logging,
    sigterm_as_interrupt,
)

log = logging.getLogger(__name__)


# Commands in their own modules, imported only when named (or listed by --help): `rgt explain`
# and `rgt watch` start without loading pull, install, rehearse and the rest. name -> (module, attr)
LAZY: Dict[str, Tuple[str, str]] = {
    "hosts": ("controller.cli.runs", "hosts_group"),
    "launch": ("controller.cli.runs", "launch_command"),
    "runs": ("controller.cli.runs", "runs_command"),
    "stop": ("controller.cli.runs", "stop_command"),
    "watch": ("controller.cli.watch", "watch_command"),
    "status": ("controller.cli.watch", "status_command"),
    "plot": ("controller.cli.watch", "plot_command"),
    "policy": ("controller.cli.watch", "policy_command"),
    "install": ("controller.cli.box", "install_command"),
    "secret": ("controller.cli.box", "secret_group"),
    "verify": ("controller.cli.verify", "verify_command"),
    "pull": ("controller.cli.pull", "pull_command"),
    "teardown": ("controller.cli.pull", "teardown_command"),
    "profile": ("controller.cli.profile", "profile_group"),
    "deadman": ("controller.cli.deadman", "deadman_group"),
    "daemon": ("controller.cli.daemon", "daemon_group"),
    "rehearse": ("controller.cli.rehearse", "rehearse_command"),
    "explain": ("controller.cli.explain", "explain_command"),
    "reconcile": ("controller.cli.reconcile", "reconcile_command"),
    "compare": ("controller.cli.compare", "compare_command"),
    "track": ("controller.cli.track", "track_command"),
    "resume": ("controller.cli.resume", "resume_command"),
    "queue": ("controller.cli.queue", "queue_group"),
}


class LazyGroup(RgtGroup):
    """RgtGroup whose LAZY commands are imported when first looked up."""

    def list_commands(self, ctx: click.Context) -> List[str]:
        return sorted({*super().list_commands(ctx), *LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        if cmd_name in LAZY and cmd_name not in self.commands:
            module, attr = LAZY[cmd_name]
            command = getattr(importlib.import_module(module), attr)
            if not isinstance(command, click.Command) or command.name != cmd_name:
                raise RuntimeError(f"{module}.{attr} is not the `rgt {cmd_name}` command")
            self.add_command(command)
        return super().get_command(ctx, cmd_name)


@click.group("rgt", cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show debug logs, and tracebacks on errors.")
@click.version_option(package_name="remote-gpu-trainer", prog_name="rgt")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Watch training runs on rented GPUs."""
    ctx.obj = CliState(debug=debug)
    configure_logging(debug)


# ---- rgt events -----------------------------------------------------------------


_Shown = TypeVar("_Shown")


def _print(lines: Callable[[_Shown], str], batch: Sequence[_Shown]) -> None:
    click.echo("\n".join(lines(e) for e in batch))


@main.command("events")
@RUN_ARGUMENT
@JSON_OPTION
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until Ctrl-C.")
@click.option("--kind", "kind_prefix", metavar="PREFIX",
              help="Only kinds that start with PREFIX (gpu., job.exited, link.).")
@click.option("--since", type=click.IntRange(min=0), default=0, metavar="SEQ",
              help="Only box events after seq SEQ, and controller events recorded after it.")
@click.option("--limit", type=click.IntRange(min=1), default=None, metavar="N",
              help="Stop after N events (also with --follow).")
def events_command(run: str, as_json: bool, follow: bool, kind_prefix: Optional[str],
                   since: int, limit: Optional[int]) -> None:
    """Print every event of RUN (a run id, or a unique prefix of one) in time order.

    Box events (the sidecar's journal) and controller events (what rgt recorded itself:
    link.lost, link.restored, sidecar.silent, run.stop_requested, verification results, ...)
    in one stream; the SOURCE column (the "source" field with --json) says which: "box" or
    "controller". A controller event has no seq ("-"; null and its "id" with --json).
    """
    from controller.runs import eventlog
    from controller.store.db import Store

    line = eventlog.json_line if as_json else eventlog.table_row
    with Store.open() as store:
        run_id = store.resolve_run(run)
        if not as_json:
            click.echo(eventlog.table_header())
        with sigterm_as_interrupt():
            try:
                for batch in eventlog.iter_stream(store, run_id, since=since, kind_prefix=kind_prefix,
                                                  limit=limit, follow=follow):
                    _print(line, batch)
            except KeyboardInterrupt:
                if not follow:
                    raise
                log.debug("stopped following %s", run_id)


# ---- rgt attach -----------------------------------------------------------------


@main.command("attach")
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(file_okay=False, path_type=Path))
@JSON_OPTION
@click.option("--until-exit", is_flag=True,
              help="Return once the job's exit (or the sidecar's stop) is stored "
                   "and nothing is left to fetch.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Return after this long.")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              metavar="SECONDS", help="How long to wait for the run's sidecar to come up.")
@click.option("--quiet", "-q", is_flag=True, help="Store the events without printing them.")
def attach_command(run_dir: Path, as_json: bool, until_exit: bool, timeout_s: Optional[float],
                   wait_s: float, quiet: bool) -> None:
    """Follow the sidecar of RUN_DIR on this machine (host `local`) into the store.

    Every event lands in the store exactly once and in order, also after this
    command or the sidecar was killed and restarted; events print as they land.
    """
    from controller.follow.attach import AttachError, attach
    from controller.follow.subscriber import SubscriberError
    from controller.store.db import Store

    line = render.json_line if as_json else render.table_row
    if not quiet and not as_json:
        click.echo(render.table_header())
    hook = None if quiet else (lambda batch: _print(line, batch))
    with Store.open() as store, sigterm_as_interrupt():
        try:
            attach(run_dir, store, on_events=hook, until_exit=until_exit, timeout_s=timeout_s,
                   wait_s=wait_s)
        except (AttachError, SubscriberError) as e:
            raise CliError(str(e)) from e
        except KeyboardInterrupt:
            log.debug("stopped attaching %s", run_dir)


if __name__ == "__main__":
    main()
