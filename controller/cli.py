"""`rgt`: the controller's command line.

Commands are thin: parse, call one function, render. RgtCommand maps what
they raise to exit codes, and RgtGroup.main prints every problem as an
`error:` line (and maybe a `hint:` line) on stderr:

    0  ok            1  runtime error (a StoreError, an unexpected exception)
    2  usage error   (Ctrl-C or SIGTERM while following is a normal end: 0)

Adding a command: decorate a function with `@main.command("name")`, reuse
the shared RUN_ARGUMENT / JSON_OPTION, raise StoreError or CliError for
problems a person can fix, and return None.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator, Optional, Sequence

import click
import protocol

from controller import render
from controller.attach import AttachError, attach
from controller.events import iter_events
from controller.store import Store, StoreError
from controller.subscriber import SubscriberError

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2


# ---- errors, exit codes, logging ---------------------------------------------


class CliError(click.ClickException):
    """A problem a person can act on; printed as `error:` plus an optional `hint:`."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.hint = hint


@dataclasses.dataclass
class CliState:
    """What the group's shared options set, in ctx.obj for every command."""

    debug: bool = False


def _report(message: str, hint: Optional[str] = None) -> None:
    click.echo(f"error: {render.printable(message)}", err=True)
    if hint:
        click.echo(f"hint: {render.printable(hint)}", err=True)


def _debugging(ctx: click.Context) -> bool:
    state = ctx.find_root().obj
    return isinstance(state, CliState) and state.debug


class RgtCommand(click.Command):
    """A command whose exceptions become CliErrors; tracebacks only with --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort, BrokenPipeError):
            raise
        except StoreError as e:
            if _debugging(ctx):
                click.echo(traceback.format_exc(), err=True, nl=False)
            raise CliError(str(e), e.hint) from e
        except Exception as e:  # the command boundary: anything else is a bug
            log.debug("%s failed: %r", ctx.command_path, e)
            debug = _debugging(ctx)
            if debug:
                click.echo(traceback.format_exc(), err=True, nl=False)
            raise CliError(f"internal error: {type(e).__name__}: {e}",
                           None if debug else "rerun with --debug for the traceback") from e


def _usage_hint(e: click.UsageError) -> Optional[str]:
    return f"see '{e.ctx.command_path} --help'" if e.ctx is not None else None


def _silence_stdout() -> None:
    """After a closed pipe (`rgt events RUN | head`), send the rest of stdout nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real fd behind stdout (an embedding program)
        pass


# click 8.2+ raises this for a bare `rgt`; 8.1 prints the help and exits 0.
_NO_ARGS_IS_HELP: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


class RgtGroup(click.Group):
    """The `rgt` group: its commands are RgtCommands, its errors `error:` lines."""

    command_class = RgtCommand

    def main(self, args: Optional[Sequence[str]] = None, prog_name: Optional[str] = None,
             complete_var: Optional[str] = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        sys.exit(self._run(args, prog_name, complete_var, extra))

    def _run(self, args: Optional[Sequence[str]], prog_name: Optional[str],
             complete_var: Optional[str], extra: Any) -> int:
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except CliError as e:
            _report(e.message, e.hint)
            return e.exit_code
        except _NO_ARGS_IS_HELP as e:
            e.show()
            return EXIT_USAGE
        except click.UsageError as e:
            _report(e.format_message(), _usage_hint(e))
            return EXIT_USAGE
        except click.ClickException as e:
            _report(e.format_message())
            return e.exit_code
        except click.Abort:
            _report("interrupted")
            return EXIT_ERROR
        except BrokenPipeError:
            _silence_stdout()
            return EXIT_OK
        # Commands return None; an int here is an exit code from click (--help, --version).
        return rv if isinstance(rv, int) else EXIT_OK


class _EchoHandler(logging.Handler):
    """Log records as `warning: ...` lines on whatever stderr is at the time."""

    def __init__(self, debug: bool) -> None:
        super().__init__()
        self._debug = debug

    def emit(self, record: logging.LogRecord) -> None:
        try:
            where = f"{record.name}: " if self._debug else ""
            click.echo(f"{record.levelname.lower()}: {where}{self.format(record)}", err=True)
        except Exception:  # logging must never raise into the caller
            self.handleError(record)


def _configure_logging(debug: bool) -> None:
    """Entry-point logging, unless something (a test runner, an embedding program) did it."""
    root = logging.getLogger()
    if root.handlers:
        return
    root.addHandler(_EchoHandler(debug))
    root.setLevel(logging.DEBUG if debug else logging.WARNING)


# ---- the group and shared options ---------------------------------------------

RUN_ARGUMENT = click.argument("run", metavar="RUN")
JSON_OPTION = click.option(
    "--json", "as_json", is_flag=True,
    help="One JSON object per line (exactly the event envelope) instead of a table.",
)


@click.group("rgt", cls=RgtGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show debug logs, and tracebacks on errors.")
@click.version_option(package_name="remote-gpu-trainer", prog_name="rgt")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Watch training runs on rented GPUs."""
    ctx.obj = CliState(debug=debug)
    _configure_logging(debug)


# ---- rgt events -----------------------------------------------------------------


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, like Ctrl-C, for the duration (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Optional[FrameType]) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _print(lines: Callable[[protocol.Event], str], batch: Sequence[protocol.Event]) -> None:
    click.echo("\n".join(lines(e) for e in batch))


@main.command("events")
@RUN_ARGUMENT
@JSON_OPTION
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until Ctrl-C.")
@click.option("--kind", "kind_prefix", metavar="PREFIX",
              help="Only kinds that start with PREFIX (gpu., job.exited).")
@click.option("--since", type=click.IntRange(min=0), default=0, metavar="SEQ",
              help="Only events after seq SEQ.")
@click.option("--limit", type=click.IntRange(min=1), default=None, metavar="N",
              help="Stop after N events (also with --follow).")
def events_command(run: str, as_json: bool, follow: bool, kind_prefix: Optional[str],
                   since: int, limit: Optional[int]) -> None:
    """Print the events of RUN (a run id, or a unique prefix of one)."""
    line = render.json_line if as_json else render.table_row
    with Store.open() as store:
        run_id = store.resolve_run(run)
        if not as_json:
            click.echo(render.table_header())
        with _sigterm_as_interrupt():
            try:
                for batch in iter_events(store, run_id, since=since, kind_prefix=kind_prefix,
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
    line = render.json_line if as_json else render.table_row
    if not quiet and not as_json:
        click.echo(render.table_header())
    hook = None if quiet else (lambda batch: _print(line, batch))
    with Store.open() as store, _sigterm_as_interrupt():
        try:
            attach(run_dir, store, on_events=hook, until_exit=until_exit, timeout_s=timeout_s,
                   wait_s=wait_s)
        except (AttachError, SubscriberError) as e:
            raise CliError(str(e)) from e
        except KeyboardInterrupt:
            log.debug("stopped attaching %s", run_dir)


if __name__ == "__main__":
    main()
