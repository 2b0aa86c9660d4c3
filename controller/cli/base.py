"""What every `rgt` command shares: errors and exit codes, logging, common options.

Commands raise CliError (or StoreError) for problems a person can fix; RgtCommand
turns anything else into an `internal error` line, and RgtGroup.main prints each
problem as `error:` plus an optional `hint:` on stderr:

    0  ok            1  runtime error (a StoreError, an unexpected exception)
    2  usage error   (Ctrl-C or SIGTERM while following is a normal end: 0)

Commands with their own exit codes (`rgt watch`) raise click.exceptions.Exit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import Any, Iterator, Optional, Sequence

import click
from rgtlib.units import parse_duration

from controller import render
from controller.errors import StoreError

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2


def duration(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[float]:
    """A click callback: a DUR option as seconds (rgtlib.units' grammar: 90, 90s, 15m, 6h, 1d);
    a usage error when malformed, None when not given."""
    try:
        return None if value is None else parse_duration(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from e


def positive_duration(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[float]:
    """`duration`, and more than 0."""
    seconds = duration(ctx, param, value)
    if seconds is not None and seconds <= 0:
        raise click.BadParameter("must be more than 0", ctx, param)
    return seconds


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
    """The one place a CliError is printed: messages embed box text (stderr tails, answers,
    paths), so message and hint are escaped here whatever their maker did (idempotent)."""
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
                click.echo(_traceback(), err=True, nl=False)
            raise CliError(str(e), e.hint) from e
        except Exception as e:  # the command boundary: anything else is a bug
            log.debug("%s failed: %r", ctx.command_path, e)
            debug = _debugging(ctx)
            if debug:
                click.echo(_traceback(), err=True, nl=False)
            raise CliError(f"internal error: {type(e).__name__}: {e}",
                           None if debug else "rerun with --debug for the traceback") from e


def _traceback() -> str:
    """The current traceback for --debug; its exception messages may quote the box."""
    return render.printable_lines(traceback.format_exc())


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
            text = render.printable_lines(self.format(record))  # log arguments may be the box's
            click.echo(f"{record.levelname.lower()}: {where}{text}", err=True)
        except Exception:  # logging must never raise into the caller
            self.handleError(record)


def configure_logging(debug: bool) -> None:
    """Entry-point logging, unless something (a test runner, an embedding program) did it."""
    root = logging.getLogger()
    if root.handlers:
        return
    root.addHandler(_EchoHandler(debug))
    root.setLevel(logging.DEBUG if debug else logging.WARNING)



RUN_ARGUMENT = click.argument("run", metavar="RUN")
JSON_OPTION = click.option(
    "--json", "as_json", is_flag=True,
    help="JSON for programs instead of text (events: one envelope per line).",
)



def emit_json(obj: Any) -> None:
    """One JSON object on one line of stdout (the `--json` form of every command). ASCII only
    (json.dumps' default): C1 and bidi characters from a box are \\u escapes, safe on a terminal."""
    click.echo(json.dumps(obj, sort_keys=True, default=str))


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
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


