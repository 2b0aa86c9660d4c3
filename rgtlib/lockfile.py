"""Exclusive lock files (fcntl.flock), with the holder's pid written beside them or into them.

A lock is an fd holding LOCK_EX on its file; closing the fd (or the process ending, however it
ends) lets it go, so a lock never outlives its holder and a stale lock file is harmless. The fds
are opened by os.open and so are not inheritable (PEP 446): a child started by exec never holds
a lock of its parent.

    try_lock(path)                 the fd, or None when another process holds it
    take(path)                     the fd, or Held (with what the holder wrote into the file)
    wait_lock(path, timeout_s)     try_lock, retried until a deadline
    hold(path)                     a `with` block under the lock, waited for without a deadline
    lock_with_pid(lock, pid_file)  take(lock), then this process's pid into pid_file (or the lock file)
    holder_pid(lock, pid_file)     who holds `lock`, by the pid its holder wrote
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Tuple, Union

StrPath = Union[str, "os.PathLike[str]"]

PID_BYTES = 32  # what is read of a lock file for the pid its holder wrote into it


class Held(Exception):
    """Another process holds the lock; `holder` is what it wrote into the lock file (a pid, or "")."""

    def __init__(self, path: StrPath, holder: str) -> None:
        super().__init__(f"{os.fspath(path)} is locked" + (f" by pid {holder}" if holder else ""))
        self.path = path
        self.holder = holder


def _open(path: StrPath, create: bool, mode: int, append: bool = False) -> int:
    flags = os.O_RDWR | (os.O_CREAT if create else 0) | (os.O_APPEND if append else 0)
    return os.open(path, flags, mode)


def _locked_now(fd: int) -> bool:
    """LOCK_EX|LOCK_NB on `fd`: True when taken, False when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _open_locked(path: StrPath, create: bool, mode: int) -> Tuple[int, bool]:
    """`path` opened, and whether its lock was taken; the fd is closed again when flock fails."""
    fd = _open(path, create, mode)
    try:
        return fd, _locked_now(fd)
    except BaseException:
        os.close(fd)
        raise


def try_lock(path: StrPath, *, create: bool = True, mode: int = 0o600) -> Optional[int]:
    """An fd holding `path`'s exclusive lock, or None when another process holds it. The file is
    created (with `mode`) unless `create` is False; then a missing one raises FileNotFoundError."""
    fd, taken = _open_locked(path, create, mode)
    if taken:
        return fd
    os.close(fd)
    return None


def take(path: StrPath, *, create: bool = True, mode: int = 0o600) -> int:
    """try_lock, but Held (with what the holder wrote into the lock file) when it is held."""
    fd, taken = _open_locked(path, create, mode)
    if taken:
        return fd
    try:
        holder = os.pread(fd, PID_BYTES, 0).decode(errors="replace").strip()
    finally:
        os.close(fd)
    raise Held(path, holder)


def wait_lock(path: StrPath, timeout_s: float, interval_s: float = 0.05,
              mode: int = 0o600) -> Optional[int]:
    """An fd holding `path`'s exclusive lock, tried every `interval_s` until `timeout_s` have
    passed (at least once); None when it stayed held. The file is created with `mode`."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout_s
    fd = _open(path, True, mode)
    try:
        while not _locked_now(fd):
            if time.monotonic() >= deadline:
                break
            pause.wait(interval_s)  # another process's lock: nothing to block on with a deadline
        else:
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


@contextlib.contextmanager
def hold(path: StrPath, *, append: bool = False, mode: int = 0o600) -> Iterator[int]:
    """The fd of `path` (created with `mode`; O_APPEND when `append`) under its exclusive lock for
    a `with` block, waited for without a deadline: for locks whose holders keep them for ms."""
    fd = _open(path, True, mode, append)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def write_pid(pid_file: StrPath) -> None:
    """This process's pid and a newline into `pid_file`, atomically (a sibling temp file renamed
    over it), so a reader finds the old pid or the new one, never a part."""
    path = Path(pid_file)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def lock_with_pid(lock: StrPath, pid_file: Optional[StrPath] = None, mode: int = 0o600) -> int:
    """take(lock), then this process's pid written into `pid_file` (write_pid) or, without one,
    into the lock file itself (truncated first). Held when it is held; the lock is let go again
    when the pid cannot be written."""
    fd = take(lock, mode=mode)
    try:
        if pid_file is None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        else:
            write_pid(pid_file)
    except BaseException:
        os.close(fd)
        raise
    return fd


def holder_pid(lock: StrPath, pid_file: StrPath, mode: int = 0o600) -> Optional[int]:
    """The pid in `pid_file` while another process holds `lock`; None when nobody holds it, when the
    lock file cannot be opened, or when the pid cannot be read (held, but not written yet)."""
    try:
        fd = _open(lock, True, mode)
    except OSError:
        return None
    try:
        if _locked_now(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        try:
            return int(Path(pid_file).read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None
    finally:
        os.close(fd)
