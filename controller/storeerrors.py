"""What can go wrong with the store, as errors a person can act on.

Every error carries a `hint`: the next step. translate() turns an sqlite3 error into the one
that says what went wrong with which file; controller.store raises only these.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Optional, Sequence


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
        return StoreCorrupt(
            f"{path} is not a usable rgt database ({text})",
            hint="move the file aside; rgt starts a new database at that path",
        )
    if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) \
            or "readonly" in low or "unable to open" in low:
        return StoreError(
            f"cannot use the store {path} ({text})",
            hint="check the permissions of the file and its directory, or set RGT_HOME",
        )
    return StoreError(f"store {path}: {text}")
