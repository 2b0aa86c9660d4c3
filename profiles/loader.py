"""Reading one profile: TOML through the standard library, the schema check, then each table's own rules.

A teardown fact (an action, a storage tier, the dead-man) without a `verified = "YYYY-MM"` stamp is
refused; [ssh] and [spot] may go without one when no source dates them, and then say so in
`source`. Imports nothing of ours.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from profiles.model import NOTIFY, Action, Deadman, Profile, Scripts, Spot, Ssh, Stamp, Storage, Surface
from profiles.schema import (
    ACTION_REQUIRED,
    ENV_NAME,
    KINDS,
    MONTH,
    NAME,
    SCHEMA,
    STORAGE_REQUIRED,
    ProfileError,
    check,
    check_command,
    line_of,
    month,
    table_line,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by the 3.9 run
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
_PATH_PART = re.compile(r"^\$\{?[A-Za-z_][A-Za-z0-9_]*\}?$")


def directory(environ: Optional[Mapping[str, str]] = None) -> Path:
    """$RGT_PROFILES_DIR when set (tests, a user's own profiles), else the packaged ones."""
    env = os.environ if environ is None else environ
    return Path(env["RGT_PROFILES_DIR"]) if env.get("RGT_PROFILES_DIR") else HERE


def names(where: Optional[Path] = None) -> List[str]:
    # ruff.toml beside the profiles is this package's lint config, not a platform.
    return sorted(p.stem for p in (where or HERE).glob("*.toml") if p.stem != "ruff")


def load(name: str, where: Optional[Path] = None) -> Profile:
    if not NAME.match(name) or name == "ruff":
        raise ProfileError(f"profile name {name!r} must be lowercase letters, digits and dashes")
    path = (where or HERE) / f"{name}.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        known = ", ".join(names(where)) or "none"
        raise ProfileError(f"no profile {name!r} in {path.parent} (known: {known})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: cannot be read: {e}") from e
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML: {e}") from e
    check(doc, SCHEMA, path, text)
    _check_head(doc, name, path, text)
    actions = {key: _action(key, value, path, text) for key, value in doc.get("actions", {}).items()}
    meter_stop_action = doc.get("meter_stop_action")
    if meter_stop_action is not None and meter_stop_action not in actions:
        raise ProfileError(f"{path}:{line_of(text, 'meter_stop_action')}: meter_stop_action = "
                           f"{meter_stop_action!r} names no [actions.{meter_stop_action}] table")
    storage = {key: _storage(key, value, path, text) for key, value in doc.get("storage", {}).items()}
    return Profile(name=doc["name"], kind=doc["kind"], scripts=_scripts(doc.get("scripts", {})), path=path,
                   surface=_surface(doc.get("surface", {})), actions=actions,
                   meter_stop_action=meter_stop_action, storage=storage,
                   deadman=_deadman(doc.get("deadman"), actions, path, text),
                   ssh=_ssh(doc.get("ssh", {}), path, text), spot=_spot(doc.get("spot", {}), path, text),
                   stamps=tuple(_stamps(doc, text)), aliases=tuple(doc.get("aliases", ())))


def _check_head(doc: Mapping[str, Any], name: str, path: Path, text: str) -> None:
    for key in ("name", "kind"):
        if key not in doc:
            raise ProfileError(f"{path}: missing key {key!r}")
    if doc["name"] != name:
        raise ProfileError(f"{path}: name = {doc['name']!r} does not match the file name")
    if doc["kind"] not in KINDS:
        raise ProfileError(f"{path}:{line_of(text, 'kind')}: kind = {doc['kind']!r} is not one of "
                           f"{', '.join(KINDS)}")


def _scripts(s: Mapping[str, Any]) -> Scripts:
    return Scripts(python=s.get("python"), proxy_hook=s.get("proxy_hook"), data_dir=s.get("data_dir"),
                   durable_dir=s.get("durable_dir"), env=dict(s.get("env", {})))


def _surface(f: Mapping[str, Any]) -> Surface:
    return Surface(meter_stop=f.get("meter_stop"), danger_clocks=tuple(f.get("danger_clocks", ())),
                   notes=tuple(f.get("notes", ())))


def _stamps(doc: Mapping[str, Any], text: str) -> List[Stamp]:
    """Every `verified` of the document (its month is checked already), in file order."""
    found: List[Tuple[str, Any]] = []
    for key, value in doc.items():
        if not isinstance(value, dict):
            continue
        if "verified" in value:
            found.append((key, value["verified"]))
        found += [(f"{key}.{sub}", table["verified"]) for sub, table in value.items()
                  if isinstance(table, dict) and "verified" in table]
    stamps = [Stamp(f"{table}.verified", str(verified), line_of(text, "verified", table))
              for table, verified in found]
    return sorted(stamps, key=lambda s: s.line)


def _deadman(d: Optional[Mapping[str, Any]], actions: Mapping[str, Action], path: Path, text: str) -> Deadman:
    """The checked [deadman] table: its default never deletes anything and can always be undone."""
    if d is None:
        return Deadman()
    if not isinstance(d.get("verified"), str) or not MONTH.match(d["verified"]):
        line = line_of(text, "verified", "deadman") or line_of(text, "deadman")
        raise ProfileError(f"{path}:{line}: [deadman] needs verified = \"YYYY-MM\" (a real month), "
                           f"not {d.get('verified')!r}")
    action = d.get("action", NOTIFY)
    for name in (action, *d.get("allow", ())):
        if name == NOTIFY:
            continue
        where = f"{path}:{line_of(text, 'action' if name == action else 'allow', 'deadman')}"
        if name not in actions or actions[name].box_command is None:
            raise ProfileError(f"{where}: [deadman] names {name!r}, which is not an [actions.<name>] "
                               "with a box_command")
    chosen = actions.get(action)
    if chosen is not None and not chosen.reversible:
        raise ProfileError(f"{path}:{line_of(text, 'action', 'deadman')}: [deadman] action = {action!r} "
                           f"cannot be undone (it deletes {chosen.deletes!r}): the dead-man's default must "
                           f"be {NOTIFY!r} or a reversible action (name destructive ones in allow)")
    env = d.get("instance_id_env")
    if env is not None and not ENV_NAME.match(env):
        raise ProfileError(f"{path}:{line_of(text, 'instance_id_env', 'deadman')}: "
                           "[deadman] instance_id_env must be an environment variable name")
    return Deadman(action=action, why=d.get("why", ""), allow=tuple(d.get("allow", ())),
                   instance_id_env=env, verified=d["verified"], source=d.get("source", ""))


def _require(keys: Sequence[str], table_doc: Mapping[str, Any], table: str, head: str) -> None:
    """Refuse a table that lacks one of its required keys, naming the table's own line."""
    for key in keys:
        if key not in table_doc:
            stamp = ' = "YYYY-MM" stamp' if key == "verified" else ""
            raise ProfileError(f"{head}: [{table}] has no {key!r}{stamp}")


def _action(name: str, a: Mapping[str, Any], path: Path, text: str) -> Action:
    """One checked [actions.<name>] table (its keys and types are checked already)."""
    table = f"actions.{name}"
    head = f"{path}:{table_line(text, table)}"
    _require(ACTION_REQUIRED, a, table, head)
    verified = month(a["verified"], path, text, table)
    command = a.get("command")
    if "box_command" in a:
        check_command(a["box_command"], f"{path}:{line_of(text, 'box_command', table)}", table, "box_command")
    if command is not None:
        check_command(command, f"{path}:{line_of(text, 'command', table)}", table)
    elif "credentials_env" in a and "box_command" not in a:
        raise ProfileError(f"{head}: [{table}] names credentials_env but has no command or box_command")
    if command is None and not a.get("console") and "box_command" not in a:
        raise ProfileError(f"{head}: [{table}] needs a command, a box_command or console steps")
    return Action(name=name, stops_meter=a["stops_meter"], deletes=a["deletes"], reversible=a["reversible"],
                  verified=str(verified), still_bills=a.get("still_bills", ""), command=command,
                  credentials_env=tuple(a.get("credentials_env", ())), console=tuple(a.get("console", ())),
                  source=a.get("source", ""), box_command=a.get("box_command"))


def _storage(name: str, s: Mapping[str, Any], path: Path, text: str) -> Storage:
    """One checked [storage.<name>] table: what the tier survives, and since when that is known."""
    table = f"storage.{name}"
    _require(STORAGE_REQUIRED, s, table, f"{path}:{table_line(text, table)}")
    verified = month(s["verified"], path, text, table)
    where = s.get("path")
    if where is not None and not (where.startswith(("/", "~", "$"))
                                  and all(_PATH_PART.match(p) for p in where.split("/") if "$" in p)):
        raise ProfileError(f"{path}:{line_of(text, 'path', table)}: '{table}.path' must be absolute, or "
                           f"start with ~ or $VAR (a variable only as a whole path part), not {where!r}")
    return Storage(name=name, survives_stop=s["survives_stop"], survives_release=s["survives_release"],
                   verified=str(verified), path=where, bills_while_stopped=s.get("bills_while_stopped", ""),
                   cap=s.get("cap", ""), note=s.get("note", ""), source=s.get("source", ""))


def _ssh(s: Mapping[str, Any], path: Path, text: str) -> Ssh:
    return Ssh(user=s.get("user"), port_changes_on_restart=s.get("port_changes_on_restart"),
               rsync_works=s.get("rsync_works"), notes=tuple(s.get("notes", ())),
               verified=month(s.get("verified"), path, text, "ssh", required=False),
               source=s.get("source", ""))


def _spot(s: Mapping[str, Any], path: Path, text: str) -> Spot:
    """[spot]: when interruptible capacity is available, the signal and grace must be stated."""
    if s.get("available"):
        for key in ("signal", "grace_s"):
            if key not in s:
                raise ProfileError(f"{path}:{line_of(text, 'available', 'spot')}: [spot] available = true "
                                   f"needs {key!r} (write \"none\" / 0 when the platform gives no notice)")
    grace = s.get("grace_s")
    return Spot(available=s.get("available"), signal=s.get("signal"),
                grace_s=float(grace) if grace is not None else None, notes=tuple(s.get("notes", ())),
                verified=month(s.get("verified"), path, text, "spot", required=False),
                source=s.get("source", ""))


def load_all(where: Optional[Path] = None) -> Dict[str, Union[Profile, ProfileError]]:
    """Every profile of a directory by name: a Profile, or the ProfileError that stopped it."""
    out: Dict[str, Union[Profile, ProfileError]] = {}
    for name in names(where):
        try:
            out[name] = load(name, where)
        except ProfileError as e:
            out[name] = e
    return out
