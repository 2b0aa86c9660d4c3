"""The box's secrets: one file per secret, pushed there by `rgt secret push HOST NAME`.

    read_secrets(environ=..., warn=...) -> {NAME: value}

The directory is $RGT_SECRETS_DIR when set, else ~/.rgt/secrets. A file counts only when its name
is a variable name ([A-Za-z_][A-Za-z0-9_]{0,127}), it is a regular file (not a link) owned by this
user, and neither group nor others may do anything with it (mode 0600 or stricter); anything else is
skipped with a warning that names the file, never its content. Dot files (a push in flight) are
skipped silently. The value is the file's bytes exactly (no newline is stripped), so it must hold
no NUL byte and fit in an environment variable.

Standard library only; Python 3.9+.
"""
from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path
from typing import Callable, Collection, Dict, Iterable, List, Mapping, Optional

from onbox.launch.redact import MIN_SECRET_LEN

log = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Linux refuses a single environment string over 128 KiB (MAX_ARG_STRLEN); stay well under it.
MAX_VALUE_BYTES = 64 << 10

Warn = Callable[[str], None]


def secrets_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    """$RGT_SECRETS_DIR when set and not empty, else ~/.rgt/secrets (HOME from `environ`)."""
    env = os.environ if environ is None else environ
    if env.get("RGT_SECRETS_DIR"):
        return Path(env["RGT_SECRETS_DIR"]).expanduser()
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".rgt" / "secrets"


def _log_warning(message: str) -> None:
    log.warning("%s", message)


def _read_one(path: Path, uid: int, warn: Warn) -> Optional[str]:
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        warn(f"secret {path} skipped: cannot open it ({e.strerror or e})")
        return None
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode):
            warn(f"secret {path} skipped: not a regular file")
            return None
        if st.st_uid != uid:
            warn(f"secret {path} skipped: owned by uid {st.st_uid}, not by this user ({uid})")
            return None
        if mode & 0o077:
            warn(f"secret {path} skipped: mode {mode:o} lets group or others in (chmod 600 {path})")
            return None
        if st.st_size > MAX_VALUE_BYTES:
            warn(f"secret {path} skipped: {st.st_size} bytes, over the {MAX_VALUE_BYTES} an "
                 "environment variable can carry safely")
            return None
        data = b""
        while True:
            chunk = os.read(fd, MAX_VALUE_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_VALUE_BYTES:
                warn(f"secret {path} skipped: it grew past {MAX_VALUE_BYTES} bytes while read")
                return None
    finally:
        os.close(fd)
    if b"\0" in data:
        warn(f"secret {path} skipped: it holds a NUL byte, which no environment variable can")
        return None
    return os.fsdecode(data)


def read_secrets(directory: Optional[Path] = None, *, environ: Optional[Mapping[str, str]] = None,
                 warn: Warn = _log_warning, reserved: Collection[str] = (),
                 uid: Optional[int] = None) -> Dict[str, str]:
    """{NAME: value} for every usable secret file (see the module doc); {} without a directory.

    A name in `reserved` (variables the launcher sets itself) is skipped with a warning."""
    where = Path(directory) if directory is not None else secrets_dir(environ)
    me = os.geteuid() if uid is None else uid
    try:
        st = os.stat(where)
    except FileNotFoundError:
        return {}
    except OSError as e:
        warn(f"secrets directory {where} skipped: {e.strerror or e}")
        return {}
    if not stat.S_ISDIR(st.st_mode):
        warn(f"secrets directory {where} skipped: not a directory")
        return {}
    if st.st_uid != me:
        warn(f"secrets directory {where} skipped: owned by uid {st.st_uid}, not by this user ({me})")
        return {}
    if stat.S_IMODE(st.st_mode) & 0o022:
        warn(f"secrets directory {where} skipped: others may write to it (chmod 700 {where})")
        return {}
    if stat.S_IMODE(st.st_mode) & 0o077:
        warn(f"secrets directory {where} has mode {stat.S_IMODE(st.st_mode):o}; chmod 700 {where}")
    found: Dict[str, str] = {}
    for name in sorted(os.listdir(where)):
        if name.startswith("."):
            continue
        if not NAME.match(name):
            warn(f"secret {where / name} skipped: its name is not a variable name")
            continue
        if name in reserved:
            warn(f"secret {where / name} skipped: the launcher sets {name} itself")
            continue
        value = _read_one(where / name, me, warn)
        if value is not None:
            found[name] = value
    return found


def maskable(values: Iterable[str], others: Iterable[str] = ()) -> List[str]:
    """The values to mask wherever text is recorded (onbox.launch.redact), with `others`, longest first.

    Every secret is masked whatever its name, but not one shorter than MIN_SECRET_LEN: masking
    every "7" would garble the records and hide nothing."""
    found = {v for v in values if len(v) >= MIN_SECRET_LEN} | set(others)
    return sorted(found, key=lambda v: (-len(v), v))


__all__ = ["MAX_VALUE_BYTES", "NAME", "maskable", "read_secrets", "secrets_dir"]
