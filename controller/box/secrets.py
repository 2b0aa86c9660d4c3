"""Secrets on a box: `rgt secret push|list|rm HOST ...` (never in a command line, event, log or run.json).

A secret lives on the box as ~/.rgt/secrets/NAME (mode 0600, directory 0700), where
`rgt-onbox launch` finds it and exports it to the job as the variable NAME (onbox/launch/secrets.py).
The value travels only on ssh's stdin: every command line built here holds names and lengths,
never a value, and nothing here logs, stores or prints one. A push is atomic: the value goes to
a temporary file in the same directory, its length is checked, then it is renamed over NAME.
Every box command runs under `sh -c`, whatever the login shell is (bash, zsh, fish).
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from typing import List, Mapping, Optional

from controller.box.ssh import Shell

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
SECRETS_DIR = "~/.rgt/secrets"
# What the box's shell sees as the directory: $HOME expands; nothing else in it needs quoting.
_DIR = '"$HOME/.rgt/secrets"'


class SecretError(Exception):
    """A secret cannot be pushed, listed or removed; `hint` says what a person can do."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclasses.dataclass(frozen=True)
class SecretFile:
    name: str
    size: int
    mode: int
    owned: bool                 # owned by the ssh user

    @property
    def exposed(self) -> bool:
        """Group or others may use it (rgt-onbox skips such a file), or someone else owns it."""
        return bool(self.mode & 0o077) or not self.owned


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise SecretError(f"{name[:40]!r} is not a usable secret name",
                          hint="a variable name: letters, digits and _, not starting with a digit, "
                               "at most 128 characters")
    return name


def value_from_env(name: str, environ: Mapping[str, str], source: Optional[str] = None) -> bytes:
    """The value of $SOURCE (default $NAME) here, as bytes; SecretError when unset or empty."""
    var = check_name(source or name)
    value = environ.get(var)
    if value is None:
        raise SecretError(f"${var} is not set here",
                          hint=f"set it without echoing it: read -rs {var} && export {var}")
    if value == "":
        raise SecretError(f"${var} is empty here; refusing to push an empty secret")
    return value.encode("utf-8", "surrogateescape")


def _sh(script: str) -> str:
    return f"sh -c {shlex.quote(script)}"


def push_command(name: str, size: int) -> str:
    """The box command that stores stdin as the secret NAME (no value on it: name and length only)."""
    name = check_name(name)
    tmp = f'{_DIR}/.{name}.tmp.$$'
    return _sh(f"umask 077 && mkdir -p {_DIR} && chmod 700 {_DIR} && "
               f"cat > {tmp} && chmod 600 {tmp} && [ \"$(wc -c < {tmp} | tr -d ' ')\" -eq {int(size)} ] && "
               f"mv -f {tmp} {_DIR}/{name} || {{ rm -f {tmp}; exit 3; }}")


def push(shell: Shell, name: str, value: bytes, timeout_s: float = 60) -> int:
    """Store `value` as the secret NAME on the box; returns its length in bytes."""
    check_name(name)
    if not value:
        raise SecretError("refusing to push an empty secret")
    done = shell.run(push_command(name, len(value)), input=value, timeout_s=timeout_s, check=False)
    if done.returncode != 0:
        # stderr may quote the command (never the value); keep its last line only
        err = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no message"]
        raise SecretError(f"pushing {name} to {shell.alias} failed (exit {done.returncode}): {err[0][:200]}",
                          hint=f"check that {SECRETS_DIR} on the box is writable and the disk not full")
    return len(value)


_LIST = (f"[ -d {_DIR} ] || exit 0; cd {_DIR} || exit 4; printf 'dir\\t%s\\t%s\\t%s\\n' "
         "\"$(stat -c %a .)\" \"$(stat -c %u .)\" \"$(id -u)\"; "
         "for f in *; do [ -f \"$f\" ] && [ ! -L \"$f\" ] && "
         "printf 'file\\t%s\\t%s\\t%s\\n' \"$(stat -c %a \"$f\")\" \"$(stat -c %s:%u \"$f\")\" \"$f\"; "
         "done; exit 0")


@dataclasses.dataclass
class Listing:
    files: List[SecretFile]
    dir_mode: Optional[int] = None          # None: no secrets directory on the box
    dir_owned: bool = True


def list_secrets(shell: Shell, timeout_s: float = 60) -> Listing:
    """The secrets on the box (names, sizes, modes); never reads a value."""
    done = shell.run(_sh(_LIST), timeout_s=timeout_s, check=False)
    if done.returncode != 0:
        raise SecretError(f"listing {SECRETS_DIR} on {shell.alias} failed (exit {done.returncode}): "
                          f"{done.stderr.decode('utf-8', 'replace').strip()[-200:]}")
    out = Listing(files=[])
    uid = ""
    for line in done.stdout.decode("utf-8", "replace").splitlines():
        parts = line.split("\t")
        if parts[0] == "dir" and len(parts) == 4:
            out.dir_mode, uid = int(parts[1], 8), parts[3]
            out.dir_owned = parts[2] == uid
        elif parts[0] == "file" and len(parts) == 4 and NAME.match(parts[3]):
            size, _, owner = parts[2].partition(":")
            out.files.append(SecretFile(name=parts[3], size=int(size), mode=int(parts[1], 8),
                                        owned=owner == uid))
    return out


def remove(shell: Shell, name: str, timeout_s: float = 60) -> bool:
    """Delete the secret NAME on the box; False when there was none."""
    path = f"{_DIR}/{check_name(name)}"
    done = shell.run(_sh(f"if [ -e {path} ] || [ -L {path} ]; then rm -f -- {path} && echo removed; "
                         f"else echo absent; fi"), timeout_s=timeout_s, check=False)
    answer = done.stdout.decode("utf-8", "replace").strip()
    if done.returncode != 0 or answer not in ("removed", "absent"):
        raise SecretError(f"removing {name} on {shell.alias} failed (exit {done.returncode}): "
                          f"{done.stderr.decode('utf-8', 'replace').strip()[-200:]}")
    return answer == "removed"


__all__ = ["NAME", "SECRETS_DIR", "Listing", "SecretError", "SecretFile", "check_name", "list_secrets",
           "push", "push_command", "remove", "value_from_env"]
