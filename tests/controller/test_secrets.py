"""`rgt secret push|list|rm` through a real sshd "box": the value travels on stdin only and lands
0600 in a 0700 directory; it never shows in a command line, the output or the store."""
from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import click
import pytest
from click.testing import CliRunner, Result

from controller.box import secrets
from controller.box.ssh import Ssh
from controller.cli.base import RgtGroup
from controller.cli.box import secret_group
from controller.store.db import Store
from tests.sshbox import SshBox, sshbox  # noqa: F401  (the fixture)

# Quotes, a newline, shell syntax and non-ASCII: the bytes must arrive exactly as they left.
VALUE = "hf_s3cr3t 'quoted' \"double\" $(touch /tmp/pwned) `id` ;|&\n\u00fcnicode-\u20ac"


@click.group(cls=RgtGroup)
def rgt() -> None:
    """`secret` under a root group, as controller/cli/main.py adds it."""


rgt.add_command(secret_group)


class Recording:
    """A shell that records what each run() was given, then runs it for real."""

    def __init__(self, inner: Ssh) -> None:
        self.inner = inner
        self.alias = inner.alias
        self.calls: List[Tuple[str, Optional[bytes]]] = []

    def run(self, command: str, *, input: Optional[bytes] = None, timeout_s: float = 60,
            check: bool = True) -> subprocess.CompletedProcess:
        self.calls.append((command, input))
        return self.inner.run(command, input=input, timeout_s=timeout_s, check=check)

    def put(self, files: Sequence[Path], remote_dir: str, timeout_s: float = 600) -> None:
        raise AssertionError("secrets never copy files")


@pytest.fixture
def box(sshbox: SshBox, tmp_path: Path) -> Iterator[Dict[str, Any]]:  # noqa: F811
    state = tmp_path / "state"
    with Store.open(state / "rgt.db") as store:
        store.add_host("box", ssh=sshbox.alias)
    env = {"RGT_HOME": str(state), "RGT_SSH_CONFIG": str(sshbox.config_file)}
    yield {"box": sshbox, "env": env, "state": state, "ssh": sshbox.ssh(tmp_path / "ctl")}


def invoke(args: Sequence[str], env: Dict[str, str]) -> Result:
    return CliRunner().invoke(rgt, ["secret", *args], env=env, catch_exceptions=False)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_push_sends_the_value_on_stdin_only_and_writes_it_private(box: Dict[str, Any]) -> None:
    home: Path = box["box"].home
    (home / ".rgt" / "secrets").mkdir(parents=True, mode=0o755)  # too open: tightened by the push
    (home / ".rgt" / "secrets").chmod(0o755)
    shell = Recording(box["ssh"])
    data = VALUE.encode()
    assert secrets.push(shell, "HF_TOKEN", data) == len(data)
    (command, given), = shell.calls
    assert given == data and VALUE not in command and "hf_s3cr3t" not in command
    assert command == secrets.push_command("HF_TOKEN", len(data))  # the whole ssh argv's variable part
    stored = home / ".rgt" / "secrets" / "HF_TOKEN"
    assert stored.read_bytes() == data
    assert mode(stored) == 0o600 and mode(stored.parent) == 0o700
    assert not Path("/tmp/pwned").exists()
    assert [p.name for p in stored.parent.iterdir()] == ["HF_TOKEN"]  # no temporary file left
    secrets.push(shell, "HF_TOKEN", b"second-value")  # replaced whole
    assert stored.read_bytes() == b"second-value" and mode(stored) == 0o600


def test_the_cli_pushes_lists_and_removes_without_showing_the_value(box: Dict[str, Any]) -> None:
    env, home = box["env"], box["box"].home
    pushed = invoke(["push", "box", "HF_TOKEN"], {**env, "HF_TOKEN": VALUE})
    assert pushed.exit_code == 0, pushed.stderr
    assert pushed.stdout.strip() == f"pushed HF_TOKEN to box ({len(VALUE.encode())} bytes)"
    other = invoke(["push", "box", "WANDB_API_KEY", "--from-env", "MY_KEY"], {**env, "MY_KEY": "wandb-777"})
    assert other.exit_code == 0 and (home / ".rgt/secrets/WANDB_API_KEY").read_text() == "wandb-777"
    (home / ".rgt" / "secrets" / "LOOSE").write_text("loose-999")
    (home / ".rgt" / "secrets" / "LOOSE").chmod(0o644)

    listed = invoke(["list", "box"], env)
    assert listed.exit_code == 0
    names = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    assert names == ["HF_TOKEN", "LOOSE", "WANDB_API_KEY"]
    assert "warning: ~/.rgt/secrets/LOOSE has mode 644; rgt-onbox skips it" in listed.stderr
    as_json = invoke(["list", "box", "--json"], env)
    rows = {r["name"]: r for r in json.loads(as_json.stdout)["secrets"]}
    size = len(VALUE.encode())
    assert rows["HF_TOKEN"] == {"name": "HF_TOKEN", "size": size, "mode": "600", "usable": True}
    assert rows["LOOSE"]["usable"] is False

    removed = invoke(["rm", "box", "HF_TOKEN"], env)
    assert removed.exit_code == 0 and not (home / ".rgt/secrets/HF_TOKEN").exists()
    again = invoke(["rm", "box", "HF_TOKEN"], env)
    assert again.exit_code == 1 and "error: no secret HF_TOKEN on box" in again.stderr

    for result in (pushed, other, listed, as_json, removed, again):
        assert "hf_s3cr3t" not in result.output and "wandb-777" not in result.output
        assert "loose-999" not in result.output
    for path in box["state"].glob("rgt.db*"):  # the database and its WAL
        data = path.read_bytes()
        assert b"hf_s3cr3t" not in data and b"wandb-777" not in data, path


@pytest.mark.parametrize("args, env, needle", [
    (["push", "box", "9LIVES"], {"9LIVES": "x"}, "'9LIVES' is not a usable secret name"),
    (["push", "box", "A-B"], {}, "'A-B' is not a usable secret name"),
    (["push", "box", "NOT_SET_ANYWHERE"], {}, "$NOT_SET_ANYWHERE is not set here"),
    (["push", "box", "EMPTY"], {"EMPTY": ""}, "$EMPTY is empty here"),
    (["push", "box", "GOOD", "--from-env", "bad name"], {}, "'bad name' is not a usable secret name"),
    (["rm", "box", "../etc"], {}, "'../etc' is not a usable secret name"),
])
def test_bad_names_and_unset_variables_are_refused_before_the_box(
        tmp_path: Path, args: List[str], env: Dict[str, str], needle: str) -> None:
    with Store.open(tmp_path / "rgt.db") as store:
        store.add_host("box", ssh="unreachable-alias-never-used")
    result = invoke(args, {"RGT_HOME": str(tmp_path), "NOT_SET_ANYWHERE": None, **env})
    assert result.exit_code == 1 and f"error: {needle}" in result.stderr, result.stderr


def test_list_of_a_box_without_secrets(box: Dict[str, Any]) -> None:
    result = invoke(["list", "box"], box["env"])
    assert result.exit_code == 0 and result.stdout.strip() == "no secrets on box"
