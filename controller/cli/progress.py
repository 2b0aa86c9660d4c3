"""The progress meter of the commands that show one (`rgt verify`, `rgt pull`, `rgt install`).

Progress goes to stderr only, so stdout stays the result (`--json`: one object). On a terminal
show() redraws one line in place with \\r; elsewhere a carriage return would only garble a log,
so show() writes its plain form as a line of its own, or nothing. line() writes a whole line in
both cases. Every text goes through render.printable: a step's text may name what a box said.
"""
from __future__ import annotations

import sys
from typing import Optional

import click

from controller.render import printable


class ProgressMeter:
    """One progress line on stderr; end() takes it off the screen (or, with keep, leaves it there)."""

    def __init__(self, keep: bool = False) -> None:
        self.tty = sys.stderr.isatty()
        self.keep = keep
        self._drawn: Optional[int] = None  # length of the line being redrawn now, None when none is

    def show(self, text: str, plain: Optional[str] = None) -> None:
        """text over the line drawn before, on a terminal; elsewhere plain as a line, if given."""
        if not self.tty:
            if plain is not None:
                click.echo(printable(plain), err=True)
            return
        text = printable(text)
        click.echo("\r" + text.ljust(self._drawn or 0), nl=False, err=True)
        self._drawn = len(text)

    def line(self, text: str) -> None:
        """text as a line of its own, on a terminal too; the meter's line is ended first (end())."""
        self.end()
        click.echo(printable(text), err=True)

    def end(self) -> None:
        """The meter's line ended with a newline (keep) or wiped; nothing when none is shown."""
        if self._drawn is None:
            return
        if self.keep:
            click.echo("", err=True)
        else:
            click.echo("\r" + " " * self._drawn + "\r", nl=False, err=True)
        self._drawn = None


__all__ = ["ProgressMeter"]
