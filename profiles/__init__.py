"""Platform profiles as data: profiles/<name>.toml, read with the standard library and validated.

Imports nothing of ours. One schema, and a key it does not know is refused with the file, the key
and its line. This first cut carries what the launcher applies (the `[scripts]` section: the
interpreter, the proxy hook, mirror variables, the data and durable directories) and what a person
must hear before renting (the `[surface]` section: what really stops the meter, the danger clocks,
short notes; printed once per platform by the controller). The billing, teardown and dead-man facts
of each platform extend the same schema.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by the 3.9 run
    import tomli as tomllib

_HERE = Path(__file__).resolve().parent
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")

# The schema: each key's type, or a nested table. "env" is a free table of NAME = "value";
# "lines" a list of one-line strings.
_SCHEMA: Dict[str, Any] = {
    "name": str,
    "kind": str,
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
}


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
class Profile:
    name: str
    kind: str
    scripts: Scripts
    path: Path
    surface: Surface = dataclasses.field(default_factory=Surface)


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
    return Profile(name=doc["name"], kind=doc["kind"], scripts=scripts, path=path, surface=surface)


def _line_of(text: str, key: str) -> int:
    """The first line that defines `key` (as `key =` or in a table header); 0 when not found."""
    pattern = re.compile(rf"^\s*(\[[^\]]*\b{re.escape(key)}\b[^\]]*\]|{re.escape(key)}\s*=)")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return number
    return 0


def _check(doc: Mapping[str, Any], schema: Mapping[str, Any], path: Path, text: str, prefix: str) -> None:
    for key, value in doc.items():
        where = f"{prefix}{key}"
        if key not in schema:
            allowed = ", ".join(sorted(schema))
            raise ProfileError(
                f"{path}:{_line_of(text, key)}: unknown key {where!r} (allowed here: {allowed})")
        want = schema[key]
        if isinstance(want, dict):
            if not isinstance(value, dict):
                raise ProfileError(f"{path}:{_line_of(text, key)}: {where!r} must be a table")
            _check(value, want, path, text, f"{where}.")
        elif want == "env":
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k) and isinstance(v, str)
                    for k, v in value.items()):
                raise ProfileError(f"{path}:{_line_of(text, key)}: {where!r} must map NAME = \"value\"")
        elif want == "lines":
            if not isinstance(value, list) or not all(
                    isinstance(v, str) and v.strip() and "\n" not in v for v in value):
                raise ProfileError(
                    f"{path}:{_line_of(text, key)}: {where!r} must be a list of one-line strings")
        elif not isinstance(value, want):
            raise ProfileError(f"{path}:{_line_of(text, key)}: {where!r} must be a {want.__name__}")
