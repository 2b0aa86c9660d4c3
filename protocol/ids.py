"""The one grammar for run ids, shared by both sides.

A run id names a directory on the box and files on the laptop (the watcher's lock and log,
the tunnel sockets, the pulled tree), so it is a single safe path component: it starts with
a letter or digit, holds only letters, digits, `.`, `_` and `-`, has no `..`, and is at
most 128 characters. Anything else is refused wherever an id arrives.
"""
from __future__ import annotations

import re
import secrets
import time
from typing import Any, Optional

from .errors import ProtocolError

MAX_RUN_ID_CHARS = 128
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def is_run_id(value: Any) -> bool:
    """True when VALUE is a run id by the grammar above."""
    return isinstance(value, str) and RUN_ID_RE.fullmatch(value) is not None and ".." not in value


def check_run_id(value: Any, what: str = "run id") -> str:
    """VALUE when it is a run id; ProtocolError naming WHAT otherwise."""
    if not is_run_id(value):
        shown = repr(value)[:80]
        raise ProtocolError(f"{what} {shown} is not a run id (letters, digits, '.', '_', '-'; "
                            f"starts with a letter or digit; no '..'; at most {MAX_RUN_ID_CHARS} "
                            "characters)")
    return str(value)


def new_run_id(now: Optional[float] = None) -> str:
    """20240601T120000Z-1a2b3c: sorts by start time, unique enough, and a run id by the grammar above.
    The one maker for both sides: rgt-onbox's own launches, rgt launch and rgt resume."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(3)}"
