"""Platform profiles as data: profiles/<name>.toml, read with the standard library and validated.

Imports nothing of ours. One schema, and a key it does not know is refused with the file, the key
and its line. This first cut carries what the launcher applies (the `[scripts]` section: the
interpreter, the proxy hook, mirror variables, the data and durable directories) and what a person
must hear before renting (the `[surface]` section: what really stops the meter, the danger clocks,
short notes; printed once per platform by the controller), and the teardown facts (`[actions.<name>]`:
what each provider action stops, deletes and still bills, how to run it, when that was last checked,
and `meter_stop_action`, the one that really stops the meter). Spot, storage and dead-man facts
extend the same schema.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import string
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by the 3.9 run
    import tomli as tomllib

_HERE = Path(__file__).resolve().parent
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_ACTION_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VERIFIED = re.compile(r"^[0-9]{4}-(0[1-9]|1[0-2])$")
# The only words a command template may name: filled in by the controller, never a secret.
PLACEHOLDERS = ("instance_id", "host", "run_id")


class _Each:
    """A table of named sub-tables, each checked against one schema (`[actions.<name>]`)."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.schema = schema


# One provider action that `rgt teardown` can plan and run. "names" is a list of env-var names.
_ACTION: Dict[str, Any] = {
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
_ACTION_REQUIRED = ("stops_meter", "deletes", "reversible", "verified")

# The schema: each key's type, or a nested table. "env" is a free table of NAME = "value";
# "lines" a list of one-line strings.
_SCHEMA: Dict[str, Any] = {
    "name": str,
    "kind": str,
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
    "actions": _Each(_ACTION),
    "deadman": {
        "action": str,
        "why": str,
        "allow": "names",
        "instance_id_env": str,
        "verified": str,
        "source": str,
    },
}
# The dead-man's default when a profile names none: tell people, touch nothing.
NOTIFY = "notify"


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file (and the key and line)."""


@dataclasses.dataclass(frozen=True)
class Scripts:
    python: Optional[str] = None        # the interpreter to run `python ...` commands with
    proxy_hook: Optional[str] = None    # a shell file sourced before the job (e.g. a network accelerator)
    data_dir: Optional[str] = None      # where runs and caches belong on this platform
    durable_dir: Optional[str] = None   # storage that outlives the instance
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # e.g. HF_ENDPOINT mirrors


@dataclasses.dataclass(frozen=True)
class Surface:
    """What to tell a person the first time they meet the platform, one short line per fact."""

    meter_stop: Optional[str] = None    # the action that really stops billing
    danger_clocks: Tuple[str, ...] = ()  # timers that cost money or data when nobody acts
    notes: Tuple[str, ...] = ()

    def __bool__(self) -> bool:
        """False when the profile has nothing to tell."""
        return bool(self.meter_stop or self.danger_clocks or self.notes)


@dataclasses.dataclass(frozen=True)
class Action:
    """A provider action on the instance (stop, release, destroy ...) and what it costs.

    `command` is a template split like a shell line (never run by a shell) whose only placeholders
    are PLACEHOLDERS; credentials reach it only as the environment variables named in
    `credentials_env`. Without a command, `console` holds the exact steps for a person.
    """

    name: str
    stops_meter: bool                   # the compute meter stops once it is done
    deletes: str                        # what is lost for good ("nothing" when nothing is)
    reversible: bool                    # the instance can be brought back as it was
    verified: str                       # "YYYY-MM": when these facts were last checked
    still_bills: str = ""               # what keeps billing afterwards
    command: Optional[str] = None
    credentials_env: Tuple[str, ...] = ()
    console: Tuple[str, ...] = ()
    source: str = ""                    # where the facts come from, in short
    box_command: Optional[str] = None   # the same action run on the box itself (the dead-man's way)


@dataclasses.dataclass(frozen=True)
class Deadman:
    """What the box's dead-man does when its lease expires and nothing on the box makes progress.

    `action` is NOTIFY or a reversible action with a `box_command` (a stop that wipes a scratch
    disk is reversible: the dead-man itself refuses it while a run keeps files on a storage tier
    that does not survive a stop); `allow` names further box actions a person may pre-authorize
    per box, never the default."""

    action: str = NOTIFY
    why: str = ""
    allow: Tuple[str, ...] = ()
    instance_id_env: Optional[str] = None  # the box's variable that holds its instance id
    verified: str = ""
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    kind: str
    scripts: Scripts
    path: Path
    surface: Surface = dataclasses.field(default_factory=Surface)
    actions: Mapping[str, Action] = dataclasses.field(default_factory=dict)
    meter_stop_action: Optional[str] = None  # the action that really stops the meter
    deadman: Deadman = dataclasses.field(default_factory=Deadman)


def directory(environ: Optional[Mapping[str, str]] = None) -> Path:
    """$RGT_PROFILES_DIR when set (tests, a user's own profiles), else the packaged ones."""
    env = os.environ if environ is None else environ
    return Path(env["RGT_PROFILES_DIR"]) if env.get("RGT_PROFILES_DIR") else _HERE


def names(where: Optional[Path] = None) -> List[str]:
    # ruff.toml beside the profiles is this package's lint config, not a platform.
    return sorted(p.stem for p in (where or _HERE).glob("*.toml") if p.stem != "ruff")


def load(name: str, where: Optional[Path] = None) -> Profile:
    if not _NAME.match(name) or name == "ruff":
        raise ProfileError(f"profile name {name!r} must be lowercase letters, digits and dashes")
    path = (where or _HERE) / f"{name}.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        known = ", ".join(names(where)) or "none"
        raise ProfileError(f"no profile {name!r} in {path.parent} (known: {known})") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML: {e}") from e
    _check(doc, _SCHEMA, path, text, "")
    for key in ("name", "kind"):
        if key not in doc:
            raise ProfileError(f"{path}: missing key {key!r}")
    if doc["name"] != name:
        raise ProfileError(f"{path}: name = {doc['name']!r} does not match the file name")
    s = doc.get("scripts", {})
    scripts = Scripts(python=s.get("python"), proxy_hook=s.get("proxy_hook"), data_dir=s.get("data_dir"),
                      durable_dir=s.get("durable_dir"), env=dict(s.get("env", {})))
    f = doc.get("surface", {})
    surface = Surface(meter_stop=f.get("meter_stop"), danger_clocks=tuple(f.get("danger_clocks", ())),
                      notes=tuple(f.get("notes", ())))
    actions = {key: _action(key, value, path, text) for key, value in doc.get("actions", {}).items()}
    meter_stop_action = doc.get("meter_stop_action")
    if meter_stop_action is not None and meter_stop_action not in actions:
        raise ProfileError(f"{path}:{_line_of(text, 'meter_stop_action')}: meter_stop_action = "
                           f"{meter_stop_action!r} names no [actions.{meter_stop_action}] table")
    return Profile(name=doc["name"], kind=doc["kind"], scripts=scripts, path=path, surface=surface,
                   actions=actions, meter_stop_action=meter_stop_action,
                   deadman=_deadman(doc.get("deadman"), actions, path, text))


def _deadman(d: Optional[Mapping[str, Any]], actions: Mapping[str, Action], path: Path, text: str) -> Deadman:
    """The checked [deadman] table: its default never deletes anything and can always be undone."""
    if d is None:
        return Deadman()
    if not _VERIFIED.match(d.get("verified", "")):
        line = _line_of(text, "verified", "deadman") or _line_of(text, "deadman")
        raise ProfileError(f"{path}:{line}: [deadman] needs verified = \"YYYY-MM\" (a real month), "
                           f"not {d.get('verified')!r}")
    action = d.get("action", NOTIFY)
    for name in (action, *d.get("allow", ())):
        if name == NOTIFY:
            continue
        where = f"{path}:{_line_of(text, 'action' if name == action else 'allow', 'deadman')}"
        if name not in actions or actions[name].box_command is None:
            raise ProfileError(f"{where}: [deadman] names {name!r}, which is not an [actions.<name>] "
                               "with a box_command")
    chosen = actions.get(action)
    if chosen is not None and not chosen.reversible:
        raise ProfileError(f"{path}:{_line_of(text, 'action', 'deadman')}: [deadman] action = {action!r} "
                           f"cannot be undone (it deletes {chosen.deletes!r}): the dead-man's default must "
                           f"be {NOTIFY!r} or a reversible action (name destructive ones in allow)")
    env = d.get("instance_id_env")
    if env is not None and not _ENV_NAME.match(env):
        raise ProfileError(f"{path}:{_line_of(text, 'instance_id_env', 'deadman')}: "
                           "[deadman] instance_id_env must be an environment variable name")
    return Deadman(action=action, why=d.get("why", ""), allow=tuple(d.get("allow", ())),
                   instance_id_env=env, verified=d["verified"], source=d.get("source", ""))


def _action(name: str, a: Mapping[str, Any], path: Path, text: str) -> Action:
    """One checked [actions.<name>] table (its keys and types are checked already)."""
    table = f"actions.{name}"
    head = f"{path}:{_line_of(text, name, 'actions')}"
    for key in _ACTION_REQUIRED:
        if key not in a:
            stamp = ' = "YYYY-MM" stamp' if key == "verified" else ""
            raise ProfileError(f"{head}: [{table}] has no {key!r}{stamp}")
    if not _VERIFIED.match(a["verified"]):
        raise ProfileError(f"{path}:{_line_of(text, 'verified', table)}: '{table}.verified' must be "
                           f"\"YYYY-MM\" (a real month), not {a['verified']!r}")
    command = a.get("command")
    if "box_command" in a:
        _check_command(a["box_command"], f"{path}:{_line_of(text, 'box_command', table)}", table,
                       "box_command")
    if command is not None:
        _check_command(command, f"{path}:{_line_of(text, 'command', table)}", table)
    elif "credentials_env" in a:
        raise ProfileError(f"{head}: [{table}] names credentials_env but has no command")
    if command is None and not a.get("console") and "box_command" not in a:
        raise ProfileError(f"{head}: [{table}] needs a command, a box_command or console steps")
    return Action(name=name, stops_meter=a["stops_meter"], deletes=a["deletes"], reversible=a["reversible"],
                  verified=a["verified"], still_bills=a.get("still_bills", ""), command=command,
                  credentials_env=tuple(a.get("credentials_env", ())), console=tuple(a.get("console", ())),
                  source=a.get("source", ""), box_command=a.get("box_command"))


def _check_command(command: str, where: str, table: str, key: str = "command") -> None:
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


def _line_of(text: str, key: str, table: str = "") -> int:
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


def _check(doc: Mapping[str, Any], schema: Mapping[str, Any], path: Path, text: str, prefix: str) -> None:
    table = prefix.rstrip(".")
    for key, value in doc.items():
        where = f"{prefix}{key}"
        line = _line_of(text, key, table)
        if key not in schema:
            allowed = ", ".join(sorted(schema))
            raise ProfileError(f"{path}:{line}: unknown key {where!r} (allowed here: {allowed})")
        want = schema[key]
        if isinstance(want, _Each):
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise ProfileError(f"{path}:{line}: {where!r} must be a table of [{where}.<name>] tables")
            for name, sub in value.items():
                if not _ACTION_NAME.match(name):
                    raise ProfileError(f"{path}:{_line_of(text, name, where)}: [{where}.{name}]: a name is "
                                       "1-32 of a-z 0-9 _ (starting with a letter)")
                _check(sub, want.schema, path, text, f"{where}.{name}.")
            continue
        if isinstance(want, dict):
            if not isinstance(value, dict):
                raise ProfileError(f"{path}:{line}: {where!r} must be a table")
            _check(value, want, path, text, f"{where}.")
        elif want == "env":
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, str)
                    for k, v in value.items()):
                raise ProfileError(f"{path}:{line}: {where!r} must map NAME = \"value\"")
        elif want == "lines":
            if not isinstance(value, list) or not all(
                    isinstance(v, str) and v.strip() and "\n" not in v for v in value):
                raise ProfileError(f"{path}:{line}: {where!r} must be a list of one-line strings")
        elif want == "names":
            if not isinstance(value, list) or not all(
                    isinstance(v, str) and _ENV_NAME.match(v) for v in value):
                raise ProfileError(f"{path}:{line}: {where!r} must be a list of environment variable names")
        elif not isinstance(value, want):
            raise ProfileError(f"{path}:{line}: {where!r} must be a {want.__name__}")
