"""The one schema every profile is checked against, and the checks that name file, key and line.

A key the schema does not know is refused, a value of the wrong type is refused, and every
message starts with `<file>:<line>:` so a person can go straight to it. Imports nothing of ours.
"""
from __future__ import annotations

import re
import shlex
import string
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
TABLE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MONTH = re.compile(r"^[0-9]{4}-(0[1-9]|1[0-2])$")
# The only words a command template may name: filled in by the controller, never a secret.
PLACEHOLDERS = ("instance_id", "host", "run_id")
# The places a profile may describe: an SSH rental, a cloud API, plain SSH, a cluster, a notebook, this host.
KINDS = ("ssh-rental", "cloud-api", "ssh", "slurm", "kubernetes", "notebook", "local")


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file (and the key and line)."""


class Each:
    """A table of named sub-tables, each checked against one schema (`[actions.<name>]`)."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.schema = schema


# Value types besides Python's own: "env" is a free table of NAME = "value", "lines" a list of
# one-line strings, "names" a list of environment-variable names, "number" an int or a float.

# One provider action that `rgt teardown` can plan and run.
ACTION: Dict[str, Any] = {
    "stops_meter": bool,
    "deletes": str,
    "still_bills": str,
    "reversible": bool,
    "command": str,
    "box_command": str,
    "credentials_env": "names",
    "console": "lines",
    "verified": str,
    "source": str,
}
ACTION_REQUIRED = ("stops_meter", "deletes", "reversible", "verified")

# One storage tier: where it is mounted and what survives what.
STORAGE: Dict[str, Any] = {
    "path": str,
    "survives_stop": bool,
    "survives_release": bool,   # release, terminate, destroy: the instance is gone
    "bills_while_stopped": str,
    "cap": str,
    "note": str,
    "verified": str,
    "source": str,
}
STORAGE_REQUIRED = ("survives_stop", "survives_release", "verified")

SCHEMA: Dict[str, Any] = {
    "name": str,
    "kind": str,
    "aliases": "lines",   # what people call the platform (English and Chinese), for `rgt explain`
    "meter_stop_action": str,
    "scripts": {
        "python": str,
        "proxy_hook": str,
        "data_dir": str,
        "durable_dir": str,
        "env": "env",
    },
    "surface": {
        "meter_stop": str,
        "danger_clocks": "lines",
        "notes": "lines",
    },
    "storage": Each(STORAGE),
    "actions": Each(ACTION),
    "ssh": {
        "user": str,
        "port_changes_on_restart": bool,
        "rsync_works": bool,
        "notes": "lines",
        "verified": str,
        "source": str,
    },
    "spot": {
        "available": bool,
        "signal": str,
        "grace_s": "number",
        "notes": "lines",
        "verified": str,
        "source": str,
    },
    "deadman": {
        "action": str,
        "why": str,
        "allow": "names",
        "instance_id_env": str,
        "verified": str,
        "source": str,
    },
}


def line_of(text: str, key: str, table: str = "") -> int:
    """The line that defines `key`: inside `[table]` when one is given and found there (as
    `key =` or as the header `[table.key]`), else the first line anywhere that does; 0 if none."""
    own = re.compile(rf"^\s*{re.escape(key)}\s*=")
    header = re.compile(r"^\s*\[\s*([^\]]+?)\s*\]")
    current = ""
    for number, line in enumerate(text.splitlines(), 1):
        found = header.match(line)
        if found:
            current = found.group(1).replace(" ", "").replace('"', "")
            if table and current == f"{table}.{key}":
                return number
        elif table and current == table and own.match(line):
            return number
    pattern = re.compile(rf"^\s*(\[[^\]]*\b{re.escape(key)}\b[^\]]*\]|{re.escape(key)}\s*=)")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return number
    return 0


def table_line(text: str, table: str) -> int:
    """The line of the header `[table]` (e.g. `[storage.volume]`), 0 if none."""
    parent, _, leaf = table.rpartition(".")
    return line_of(text, leaf, parent)


def month(value: Any, path: Path, text: str, table: str, required: bool = True) -> Optional[str]:
    """The table's `verified` stamp, checked: a real "YYYY-MM" month, present when `required`."""
    if value is None:
        if not required:
            return None
        raise ProfileError(f"{path}:{table_line(text, table)}: [{table}] has no "
                           "'verified' = \"YYYY-MM\" stamp")
    if not MONTH.match(value):
        raise ProfileError(f"{path}:{line_of(text, 'verified', table)}: '{table}.verified' must be "
                           f"\"YYYY-MM\" (a real month), not {value!r}")
    return str(value)


def check_command(command: str, where: str, table: str, key: str = "command") -> None:
    """A template: splits like a shell line, names only PLACEHOLDERS, and carries no secret-looking
    expansion (nothing runs it through a shell, so `$VAR` would reach the program as text)."""
    try:
        words = shlex.split(command)
        fields = [f for word in words for _, f, spec, conv in string.Formatter().parse(word)
                  if f is not None and (f not in PLACEHOLDERS or spec or conv)]
    except ValueError as e:
        raise ProfileError(f"{where}: '{table}.{key}' is not a usable template: {e}") from None
    if not words:
        raise ProfileError(f"{where}: '{table}.{key}' is empty")
    if fields:
        raise ProfileError(f"{where}: '{table}.{key}' may name only "
                           f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}, not {{{fields[0]}}}")
    if "$" in command or "`" in command:
        raise ProfileError(f"{where}: '{table}.{key}' must not expand variables: credentials come "
                           "only from the environment variables named in credentials_env")


def check(doc: Mapping[str, Any], schema: Mapping[str, Any], path: Path, text: str, prefix: str = "") -> None:
    """Every key of `doc` is in `schema` and has its type; nested tables are checked the same way."""
    table = prefix.rstrip(".")
    for key, value in doc.items():
        where = f"{prefix}{key}"
        line = line_of(text, key, table)
        if key not in schema:
            allowed = ", ".join(sorted(schema))
            raise ProfileError(f"{path}:{line}: unknown key {where!r} (allowed here: {allowed})")
        want = schema[key]
        if isinstance(want, Each):
            _check_each(value, want, path, text, where, line)
        elif isinstance(want, dict):
            if not isinstance(value, dict):
                raise ProfileError(f"{path}:{line}: {where!r} must be a table")
            check(value, want, path, text, f"{where}.")
        elif isinstance(want, str):
            problem = _special(want, value)
            if problem:
                raise ProfileError(f"{path}:{line}: {where!r} must {problem}")
        elif not isinstance(value, want):
            raise ProfileError(f"{path}:{line}: {where!r} must be a {want.__name__}")


def _check_each(value: Any, want: Each, path: Path, text: str, where: str, line: int) -> None:
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ProfileError(f"{path}:{line}: {where!r} must be a table of [{where}.<name>] tables")
    for name, sub in value.items():
        if not TABLE_NAME.match(name):
            raise ProfileError(f"{path}:{line_of(text, name, where)}: [{where}.{name}]: a name is "
                               "1-32 of a-z 0-9 _ (starting with a letter)")
        check(sub, want.schema, path, text, f"{where}.{name}.")


def _special(want: str, value: Any) -> Optional[str]:
    """What `value` must do to be one of the schema's own types ("be a list ..."), or None when it is."""
    if want == "env":
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and ENV_NAME.match(k) and isinstance(v, str) for k, v in value.items())
        return None if ok else 'map NAME = "value"'
    if want == "lines":
        ok = isinstance(value, list) and all(
            isinstance(v, str) and v.strip() and "\n" not in v for v in value)
        return None if ok else "be a list of one-line strings"
    if want == "names":
        ok = isinstance(value, list) and all(isinstance(v, str) and ENV_NAME.match(v) for v in value)
        return None if ok else "be a list of environment variable names"
    if want == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        return None if ok else "be a number (int or float), 0 or more"
    raise AssertionError(f"unknown schema type {want!r}")  # pragma: no cover - a bug in SCHEMA
