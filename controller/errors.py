"""What can go wrong with the store, as errors a person can act on.

Every error carries a `hint`: the next step. translate() turns an sqlite3 error into the one
that says what went wrong with which file; controller.store.db raises only these.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Dict, Optional, Sequence


class StoreError(Exception):
    """Anything the store cannot do. `hint` is a next step for a person, or None."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.hint = hint


class SchemaTooNew(StoreError):
    """The database was written by a newer rgt than this one."""


class StoreBusy(StoreError):
    """Another connection held the write lock past the busy timeout."""


class StoreCorrupt(StoreError):
    """The file is not an SQLite database, or SQLite found it damaged."""


class HostNotFound(StoreError):
    """No host of that name (`rgt hosts add` records them)."""


class RunNotFound(StoreError):
    """No run has that id or starts with that prefix. `candidates`: known runs, newest first."""

    def __init__(self, message: str, hint: Optional[str], candidates: Sequence[str]) -> None:
        super().__init__(message, hint)
        self.candidates = list(candidates)


class AmbiguousRun(StoreError):
    """A prefix matches more than one run. `candidates`: the matches, sorted."""

    def __init__(self, message: str, hint: Optional[str], candidates: Sequence[str]) -> None:
        super().__init__(message, hint)
        self.candidates = list(candidates)


def recovery_hint(path: Path) -> str:
    """How to get going again after the store at `path` is damaged, and what that costs.

    What it says is what holds: the box's journal keeps every event (rotated files are replayed
    too) and a watcher re-fetches a run's events from seq 1 when its cursor is gone, so only what
    this laptop alone recorded is lost with the file.
    """
    return (f"move {path} aside (with its -wal and -shm files, if any); rgt starts an empty store "
            "there. No event is lost: each box's journal keeps them all, and `rgt track HOST RUN` "
            "(`rgt attach RUN_DIR` for host local) fetches a run's events again. Lost with the file: "
            "the hosts (`rgt hosts add` them again first), wake records (a new `rgt watch` may "
            "report old events again; --from-now skips them), policies, queues and launch records")


def load_json(text: Any, path: Path, where: str) -> Dict[str, Any]:
    """A JSON column of the store read back: an object (other JSON, which rgt never writes, as {}).

    Text that does not parse means the file was damaged or edited by hand: StoreCorrupt naming
    the file, the row (`where`, like "the meta of run 'x' (table runs)") and the way back.
    """
    try:
        obj = json.loads(text)
    except (ValueError, TypeError) as e:
        detail = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise StoreCorrupt(f"the store {path} is damaged: {where} is not valid JSON ({detail})",
                           hint=recovery_hint(path)) from e
    return obj if isinstance(obj, dict) else {}


def translate(e: sqlite3.Error, path: Path, busy_timeout_s: float) -> StoreError:
    """A StoreError that says what went wrong with which file."""
    name = str(getattr(e, "sqlite_errorname", ""))
    text = str(e)
    low = text.lower()
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in low:
        return StoreBusy(
            f"the store {path} stayed locked for over {busy_timeout_s:g} s ({text})",
            hint="another rgt process is writing to it; try again",
        )
    if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in low \
            or "malformed" in low:
        return StoreCorrupt(f"the store {path} is damaged or not an rgt database ({text})",
                            hint=recovery_hint(path))
    if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) \
            or "readonly" in low or "unable to open" in low:
        return StoreError(
            f"cannot use the store {path} ({text})",
            hint="check the permissions of the file and its directory, or set RGT_HOME",
        )
    return StoreError(f"store {path}: {text}")
