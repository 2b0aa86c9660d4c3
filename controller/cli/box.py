"""`rgt install HOST` and `rgt secret push|list|rm`: what a box needs before a launch.

Thin commands: parse, call controller.install.onbox / controller.box.secrets, render. Progress goes to
stderr, results to stdout (`--json`: one object). Added to the `rgt` group in controller/cli/main.py.
What the box reports (its paths, versions, secret names) is printed through render.printable.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Optional, Tuple

import click

from controller.box import secrets
from controller.box.handle import Box, BoxError
from controller.box.ssh import Shell, SshError
from controller.cli.base import JSON_OPTION, CliError, RgtCommand, RgtGroup, emit_json
from controller.cli.progress import ProgressMeter
from controller.install import onbox as installer
from controller.install.build import BuildError
from controller.render import printable
from controller.store.db import Store

HOST_ARGUMENT = click.argument("host", metavar="HOST")


@contextlib.contextmanager
def _problems() -> Iterator[None]:
    """The package's own errors as `error:` / `hint:` lines."""
    try:
        yield
    except (BoxError, BuildError, SshError, secrets.SecretError) as e:  # BoxError: InstallError too
        raise CliError(e.message, e.hint) from e


# ---- rgt install ----------------------------------------------------------------------------------


@click.command("install", cls=RgtCommand)
@HOST_ARGUMENT
@click.option("--venv", metavar="PATH", default=None,
              help=f"The virtual environment on the box (default {installer.DEFAULT_VENV}).")
@click.option("--python", "python", metavar="PY", default=None,
              help="The box's Python 3.9+ that makes the venv (default: the host profile's, else python3).")
@click.option("--wheelhouse", "wheelhouses", multiple=True, metavar="DIR",
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Wheels of the dependencies for the box's Python (repeatable); "
                   "<state>/wheelhouse is always looked in.")
@click.option("--wheel", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              metavar="FILE", help="Ship this wheel of this rgt version instead of building one.")
@click.option("--download/--no-download", default=True, show_default=True,
              help="Fetch missing wheels HERE (pip download for the box's Python and platform) into "
                   "<state>/wheelhouse, the cache.")
@click.option("--index", is_flag=True,
              help="Let the box's pip ask its own index for wheels not found here (said on stderr); "
                   "without it a missing wheel is an error naming it.")
@click.option("--no-index-fallback", is_flag=True, hidden=True,
              help="The default now (the box's index is used only with --index); kept for old scripts.")
@JSON_OPTION
def install_command(host: str, venv: Optional[str], python: Optional[str], wheelhouses: Tuple[Path, ...],
                    wheel: Optional[Path], download: bool, index: bool, no_index_fallback: bool,
                    as_json: bool) -> None:
    """Put this exact version of rgt-onbox on HOST, without needing the box's index.

    Builds the package's wheel here, copies it and every dependency wheel (plus py-spy, optional)
    to ~/.rgt/wheels on the box, fetching missing ones here first, installs them into a venv
    offline and checks `rgt-onbox --version`. No internet is needed on the box; its own index
    is used only with --index. Running it again changes nothing when the same version is there.
    """
    if index and no_index_fallback:
        raise CliError("--index and --no-index-fallback contradict each other")
    opts = installer.InstallOptions(venv=venv, python=python, wheelhouses=wheelhouses, wheel=wheel,
                                    download=download, index=index)
    with Store.open() as store, _problems():
        result = installer.install(store, host, opts, progress=ProgressMeter().line)  # a line a step
    if as_json:
        emit_json(result.to_dict())
    elif result.already:
        click.echo(printable(f"rgt-onbox {result.version} is already installed on {host} ({result.onbox})"))
    else:
        for warning in result.warnings:
            click.echo(f"warning: {printable(warning)}", err=True)
        used = "; the box's own index supplied some dependencies (--index)" if result.used_index else ""
        click.echo(printable(f"installed rgt-onbox {result.version} on {host}: {result.onbox} "
                             f"(Python {result.python}, {result.elapsed_s:.1f}s{used})"))


# ---- rgt secret ---------------------------------------------------------------------------------


@click.group("secret", cls=RgtGroup)
def secret_group() -> None:
    """Secrets on a box: pushed through ssh's stdin, exported to jobs by name, never shown."""


def _shell(store: Store, host: str) -> Shell:
    return Box.of(store, host).shell


@secret_group.command("push")
@HOST_ARGUMENT
@click.argument("name", metavar="NAME")
@click.option("--from-env", "source", metavar="VAR", default=None,
              help="Read the value from $VAR here instead of $NAME.")
def push_command(host: str, name: str, source: Optional[str]) -> None:
    """Store the value of $NAME here as the secret NAME on HOST (~/.rgt/secrets/NAME, mode 600).

    The value goes through ssh's stdin only: it is never on a command line, in a log, the store
    or this output. `rgt-onbox launch` exports it to every job on HOST as $NAME.
    """
    with _problems():
        value = secrets.value_from_env(name, os.environ, source)
        with Store.open() as store:
            size = secrets.push(_shell(store, host), name, value)
    click.echo(printable(f"pushed {name} to {host} ({size} bytes)"))


@secret_group.command("list")
@HOST_ARGUMENT
@JSON_OPTION
def list_command(host: str, as_json: bool) -> None:
    """Names of the secrets on HOST (with size and mode; never a value)."""
    with _problems(), Store.open() as store:
        listing = secrets.list_secrets(_shell(store, host))
    exposed = [f for f in listing.files if f.exposed]
    for f in exposed:
        click.echo(printable(f"warning: {secrets.SECRETS_DIR}/{f.name} has mode {f.mode:o}"
                             f"{'' if f.owned else ' and another owner'}; rgt-onbox skips it "
                             f"(fix: chmod 600 {secrets.SECRETS_DIR}/{f.name})"), err=True)
    if listing.dir_mode is not None and (listing.dir_mode & 0o077 or not listing.dir_owned):
        click.echo(f"warning: {secrets.SECRETS_DIR} has mode {listing.dir_mode:o}"
                   f"{'' if listing.dir_owned else ' and another owner'} (fix: chmod 700 "
                   f"{secrets.SECRETS_DIR})", err=True)
    if as_json:
        rows = [{"name": f.name, "size": f.size, "mode": f"{f.mode:o}", "usable": not f.exposed}
                for f in listing.files]
        emit_json({"host": host, "secrets": rows,
                   "dir_mode": None if listing.dir_mode is None else f"{listing.dir_mode:o}"})
        return
    if not listing.files:
        click.echo(printable(f"no secrets on {host}"))
        return
    click.echo(f"{'NAME':<32} {'BYTES':>7} MODE")
    for f in listing.files:
        click.echo(printable(f"{f.name:<32} {f.size:>7} {f.mode:o}"
                             f"{'  (skipped by rgt-onbox)' if f.exposed else ''}"))


@secret_group.command("rm")
@HOST_ARGUMENT
@click.argument("name", metavar="NAME")
def rm_command(host: str, name: str) -> None:
    """Delete the secret NAME on HOST (jobs launched from now on no longer get it)."""
    with _problems(), Store.open() as store:
        found = secrets.remove(_shell(store, host), name)
    if not found:
        raise CliError(f"no secret {name} on {host}", hint=f"rgt secret list {host}")
    click.echo(printable(f"removed {name} from {host}"))


__all__ = ["install_command", "secret_group"]
