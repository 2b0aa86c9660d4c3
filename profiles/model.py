"""What a loaded profile holds: frozen dataclasses, one per table of the schema. Imports nothing of ours."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import List, Mapping, NamedTuple, Optional, Tuple

# The dead-man's default when a profile names none: tell people, touch nothing.
NOTIFY = "notify"


class Stamp(NamedTuple):
    """One `verified = "YYYY-MM"` of a profile: the key that holds it, the month, its line."""

    key: str        # e.g. "actions.stop.verified", "ssh.verified"
    verified: str   # "YYYY-MM"
    line: int


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
class Storage:
    """One storage tier and what it survives. `path` is absolute, or starts with `~` or `$VAR`
    when it depends on the box; None when the platform lets you choose the mount point."""

    name: str
    survives_stop: bool                 # still there after the meter-stopping stop / power-off
    survives_release: bool              # still there after release / terminate / destroy
    verified: str
    path: Optional[str] = None
    bills_while_stopped: str = ""
    cap: str = ""
    note: str = ""
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Ssh:
    user: Optional[str] = None
    port_changes_on_restart: Optional[bool] = None
    rsync_works: Optional[bool] = None
    notes: Tuple[str, ...] = ()
    verified: Optional[str] = None      # None: no source gives these facts a date (see `source`)
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Spot:
    """Interruptible capacity: whether there is any, the notice a job gets, and how long it has."""

    available: Optional[bool] = None
    signal: Optional[str] = None
    grace_s: Optional[float] = None
    notes: Tuple[str, ...] = ()
    verified: Optional[str] = None
    source: str = ""


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
    storage: Mapping[str, Storage] = dataclasses.field(default_factory=dict)
    ssh: Ssh = dataclasses.field(default_factory=Ssh)
    spot: Spot = dataclasses.field(default_factory=Spot)
    stamps: Tuple[Stamp, ...] = ()      # every verified stamp of the file, in file order
    aliases: Tuple[str, ...] = ()       # what people call the platform: "vast.ai", "恒源云"

    def tier_of(self, path: str, environ: Optional[Mapping[str, str]] = None) -> Optional[Storage]:
        """The storage tier that holds `path` on the box: the tier with the longest path that is
        `path` or a folder above it (`~` and `$VAR` expanded from `environ`); on a tie the tier
        listed first. None when no tier's path covers it: treat that as surviving nothing."""
        env = os.environ if environ is None else environ
        target = os.path.normpath(path)
        best: Optional[Storage] = None
        best_len = -1
        for tier in self.storage.values():
            where = _expand(tier.path, env) if tier.path else None
            if where is None:
                continue
            inside = target == where or target.startswith(where.rstrip("/") + "/")
            if inside and len(where) > best_len:
                best, best_len = tier, len(where)
        return best


def _expand(path: str, environ: Mapping[str, str]) -> Optional[str]:
    """`path` with a leading `~` and any `$NAME` / `${NAME}` taken from `environ`; None when a
    variable is not set there (the tier's place is then unknown on this box)."""
    if path.startswith("~"):
        home = environ.get("HOME")
        if not home:
            return None
        path = home + path[1:]
    out: List[str] = []
    for part in path.split("/"):
        if part.startswith("$"):
            value = environ.get(part[1:].strip("{}"))
            if not value:
                return None
            part = value.strip("/") if out else value.rstrip("/")
        out.append(part)
    joined = "/".join(out)
    return os.path.normpath(joined) if joined.startswith("/") else None
