"""Where the controller keeps its state on this machine.

Nothing here touches the disk; callers create what they need (see
controller.store.Store.open, which creates the state directory 0700).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

DB_NAME = "rgt.db"


def state_dir(env: Optional[Mapping[str, str]] = None) -> Path:
    """$RGT_HOME if set, else $XDG_STATE_HOME/rgt, else ~/.local/state/rgt.

    An XDG_STATE_HOME that is not absolute is ignored, as the XDG base
    directory spec says. `env` defaults to os.environ (read at call time).
    """
    environ = os.environ if env is None else env
    home = environ.get("RGT_HOME", "")
    if home:
        return Path(home).expanduser()
    xdg = environ.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "rgt"
    return Path.home() / ".local" / "state" / "rgt"


def db_path(env: Optional[Mapping[str, str]] = None) -> Path:
    """The controller's SQLite database: state_dir()/rgt.db."""
    return state_dir(env) / DB_NAME
