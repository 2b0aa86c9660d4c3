"""`rgt`'s commands load when named: every lazy entry resolves, and a light command stays light."""
from __future__ import annotations

import ast
import subprocess
import sys

import click

from controller.cli import main as cli
from tests.helpers import REPO


def test_every_lazy_command_resolves_to_the_command_of_that_name() -> None:
    ctx = click.Context(cli.main)
    for name in cli.LAZY:
        command = cli.main.get_command(ctx, name)
        assert isinstance(command, click.Command) and command.name == name
    assert set(cli.LAZY) <= set(cli.main.list_commands(ctx))
    assert {"events", "attach"} <= set(cli.main.list_commands(ctx))


def test_rgt_explain_does_not_import_install_pull_or_rehearse() -> None:
    probe = ("import sys\nfrom controller.cli import main as cli\n"
             "try:\n    cli.main(['explain', 'nan-loss', '--top', '1'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.startswith('controller.')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip().splitlines()[-1]
    loaded = set(ast.literal_eval(out))  # a list printed by the child
    assert "controller.cli.explain" in loaded
    assert not loaded & {"controller.install.onbox", "controller.pull.fetch", "controller.rehearse.run",
                         "controller.wake.watch"}
