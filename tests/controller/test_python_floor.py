"""The package's Python floor (pyproject.toml's requires-python) holds for the whole distribution.

On this Python every controller module imports and `rgt` (and `rgt-onbox`) answer --help for
every command, so `make py39` running this file on a real 3.9 shows rgt works there. Below the
floor both entry points print one line, which Python they need and which they found, and exit 2:
checked on whatever older interpreters this machine has (pyenv's 2.7 to 3.8 in this image), and
always on this one with sys.version_info set just below the floor before the entry point's import.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import click
import pytest
from click.testing import CliRunner

import controller
from tests.helpers import pyenv_glob

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SCRIPTS: Dict[str, str] = PROJECT["scripts"]   # name -> "module:attr"


def _floor() -> Tuple[int, int]:
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", PROJECT["requires-python"])
    assert match, f"requires-python is {PROJECT['requires-python']!r}; this test reads only '>=X.Y'"
    return int(match.group(1)), int(match.group(2))


FLOOR = _floor()


def _entry_code(script: str) -> str:
    """What the console script pip writes for `script` runs: import the entry point, call it."""
    module, attr = SCRIPTS[script].split(":")
    return f"import sys; from {module} import {attr} as entry; sys.exit(entry())"


def _run(python: str, code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # No bytecode: Python 2 would write its .pyc files beside the sources.
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONHOME", None)
    return subprocess.run([python, "-c", code, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def _refusal(script: str, version: Sequence[int], python: str) -> str:
    return (f"{script} needs Python {FLOOR[0]}.{FLOOR[1]} or newer; this is Python "
            f"{version[0]}.{version[1]}.{version[2]} ({python})\n")


def test_the_entry_points_are_the_two_packages_with_the_check() -> None:
    # The check lives in controller/__init__.py and onbox/__init__.py: it runs first only while
    # each entry point lies inside one of those packages.
    assert {name: target.split(".")[0] for name, target in SCRIPTS.items()} == {
        "rgt": "controller", "rgt-onbox": "onbox"}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_just_below_the_floor_the_entry_point_says_so_in_one_line_and_exits_2(script: str,
                                                                               tmp_path: Path) -> None:
    below = (FLOOR[0], FLOOR[1] - 1, 18, "final", 0)
    code = f"import sys; sys.version_info = {below!r}; {_entry_code(script)}"
    out = _run(sys.executable, code, "--help", cwd=tmp_path)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", _refusal(script, below, sys.executable))


@pytest.mark.parametrize("package", ["controller", "onbox"])
def test_at_the_floor_the_check_lets_the_package_import(package: str, tmp_path: Path) -> None:
    at = (FLOOR[0], FLOOR[1], 0, "final", 0)
    out = _run(sys.executable, f"import sys; sys.version_info = {at!r}; import {package}; print('imported')",
               cwd=tmp_path)
    assert (out.returncode, out.stdout, out.stderr) == (0, "imported\n", "")


def _old_pythons() -> List[str]:
    """Interpreters below the floor on this machine: pyenv's, and pythonX.Y on PATH."""
    found: Dict[str, str] = {}
    names = ["python2.7"] + [f"python3.{minor}" for minor in range(6, FLOOR[1])]
    for name in names:
        version = name[len("python"):]
        candidates = pyenv_glob(f"{version}.*/bin/{name}")
        on_path = shutil.which(name)
        if on_path and "/.pyenv/shims/" not in on_path:  # a shim answers only for pyenv's selected versions
            candidates.append(on_path)
        if candidates:
            found[version] = candidates[-1]
    return [found[v] for v in sorted(found)]


OLD_PYTHONS = _old_pythons()


@pytest.mark.skipif(not OLD_PYTHONS, reason="no Python older than the floor on this machine")
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_real_older_python_is_told_which_python_to_use(script: str, tmp_path: Path) -> None:
    for python in OLD_PYTHONS:
        probe = _run(python, "import sys; print('%d %d %d' % sys.version_info[:3])", cwd=tmp_path)
        version = [int(part) for part in probe.stdout.split()]
        assert version[:2] < list(FLOOR), python
        out = _run(python, _entry_code(script), "--help", cwd=tmp_path)
        assert (out.returncode, out.stdout, out.stderr) == (2, "", _refusal(script, version, python)), python
        # `python -m onbox.cli` (how a box is often driven) goes through the same check.
        module = SCRIPTS[script].split(":")[0]
        out = _run(python, f"import runpy; runpy.run_module({module!r}, run_name='__main__')", cwd=tmp_path)
        assert (out.returncode, out.stderr) == (2, _refusal(script, version, python)), python


def test_every_controller_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(controller.__path__, "controller.")]
    assert "controller.cli.main" in names and "controller.store.db" in names
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # every failure is reported, not only the first
            failed[name] = f"{type(e).__name__}: {e}"
    assert failed == {}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_the_entry_point_starts_and_shows_its_help(script: str, tmp_path: Path) -> None:
    out = _run(sys.executable, _entry_code(script), "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Usage: ") and "Commands:" in out.stdout


def _commands(group: click.Group, argv: Tuple[str, ...] = ()) -> List[Tuple[str, ...]]:
    """The argv of every command under group (lazily loaded ones included), groups and leaves. A
    group's own arguments (`rgt deadman HOST arm`) get a placeholder: --help never reads it."""
    ctx = click.Context(group)
    found: List[Tuple[str, ...]] = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, (*argv, name)
        found.append((*argv, name))
        if isinstance(command, click.Group):
            own = tuple("x" for p in command.params if isinstance(p, click.Argument))
            found.extend(_commands(command, (*argv, name, *own)))
    return found


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_command_answers_help(script: str) -> None:
    module, attr = SCRIPTS[script].split(":")
    main = getattr(importlib.import_module(module), attr)
    found = _commands(main)
    assert len(found) >= 10 and any(len(argv) > 1 for argv in found), found  # the tree was walked
    for argv in found:
        result = CliRunner().invoke(main, [*argv, "--help"], prog_name=script)
        assert result.exit_code == 0, (argv, result.output)
        usage = result.output.splitlines()[0]
        assert usage.startswith(f"Usage: {script} ") and argv[-1] in usage.split(), (argv, result.output)
