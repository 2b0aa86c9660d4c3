"""Where the controller keeps its state on this machine, and making sure that place is private.

state_dir() and db_path() only compute paths. private_dir() is what touches the disk: the state
directory (and every directory rgt puts sockets in) must belong to this user and be open to nobody
else, since whoever can write there can replace the store or a socket rgt connects to.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import Mapping, Optional

from controller.errors import StoreError

log = logging.getLogger(__name__)

# The host name that means this machine: no ssh, no box (`rgt launch local ...`).
LOCAL = "local"
DB_NAME = "rgt.db"


class UnsafeDir(StoreError):
    """A directory rgt would keep private state in is not a private directory of this user."""


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


_ELSEWHERE = "set RGT_HOME to a directory of your own (rgt creates it, mode 700)"


def private_dir(directory: Path, *, follow: bool = True) -> Path:
    """`directory`, created 0700 when missing; an existing one is checked and, if need be, tightened.

    Refused (UnsafeDir): not a directory, owned by another user (its owner could swap the
    store or a socket under us, and chmod would not take that away), or a shared sticky
    directory such as /tmp (chmod 700 on it would break every other user of it). One of
    ours that is open to others is chmod-ed to 700, with one warning: afterwards it is
    private, so the warning does not repeat. Checked through one open descriptor, so a
    directory swapped in between is never the one chmod-ed. With follow=False a symbolic link
    is refused too (a shared place like /tmp, where anyone could have planted one).
    """
    created = False
    try:
        directory.mkdir(mode=0o700, parents=True)
        created = True
    except FileExistsError:
        pass
    except OSError as e:
        raise UnsafeDir(f"cannot create {directory}: {e.strerror or e}",
                        hint=f"check the permissions of its parent, or {_ELSEWHERE}") from e
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | (0 if follow else os.O_NOFOLLOW))
    except NotADirectoryError:
        if not follow and os.path.islink(directory):
            raise UnsafeDir(f"{directory} is a symbolic link, not a directory of its own",
                            hint=f"remove it, or {_ELSEWHERE}") from None
        raise UnsafeDir(f"{directory} is not a directory; rgt keeps its state in a directory",
                        hint=f"move it aside, or {_ELSEWHERE}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW without O_DIRECTORY's answer on some systems
            raise UnsafeDir(f"{directory} is a symbolic link, not a directory of its own",
                            hint=f"remove it, or {_ELSEWHERE}") from None
        raise UnsafeDir(f"cannot open {directory}: {e.strerror or e}", hint=_ELSEWHERE) from e
    try:
        if created:
            os.fchmod(fd, 0o700)  # mkdir's mode passes through the umask
        _check(fd, directory)
    finally:
        os.close(fd)
    return directory


def _check(fd: int, directory: Path) -> None:
    st = os.fstat(fd)
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeDir(
            f"{directory} belongs to uid {st.st_uid}, not to you (uid {me}); refusing to keep rgt's "
            "store and sockets there: its owner could read or replace them",
            hint=_ELSEWHERE)
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_ISVTX and mode & 0o002:
        raise UnsafeDir(
            f"{directory} is a shared directory (mode {mode:o}: writable by everyone, sticky); "
            "refusing to keep rgt's store and sockets there, and to chmod it",
            hint=_ELSEWHERE)
    if mode & 0o077:
        os.fchmod(fd, 0o700)
        log.warning("%s was open to other users (mode %o); tightened it to 700 so that nobody else can "
                    "read or replace rgt's store and sockets there", directory, mode)


def prepare_db_files(path: Path) -> None:
    """The store's directory made private (private_dir) and the database file created 0600 when
    missing; an existing database file (or its -wal/-shm) readable by others is tightened to 0600."""
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        try:
            mode = stat.S_IMODE(os.stat(name).st_mode)
            if mode & 0o077:
                log.warning("%s had mode %o; tightening to 600", name, mode)
                os.chmod(name, 0o600)
        except FileNotFoundError:
            continue
