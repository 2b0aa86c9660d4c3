"""Whole-or-nothing file writes, and reading which entries of a directory are regular files.
Standard library only: the job helper and the wrapper use it too."""
from __future__ import annotations

import errno
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Tuple, Union

# Filesystems that cannot fsync a directory say so with one of these; the rename is still atomic.
_DIR_FSYNC_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF)


def fsync_dir(path: Path, strict: bool = False) -> None:
    """Make a rename in `path` durable.

    Not strict (the default): any failure is let be. Strict: only "cannot fsync a
    directory here" is let be; a real I/O error is raised (the durable copy wants it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if strict and e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def write_atomic(path: Path, data: Union[str, bytes], mode: int = 0o644) -> None:
    """A sibling temp file, fsync, rename over `path`, fsync the directory. The temp name holds the
    pid and the thread, so two threads writing one file never share (and lose) a temp file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data.encode() if isinstance(data, str) else data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, doc: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def regular_files(base: str, names: Iterable[str]) -> Iterator[Tuple[str, os.stat_result]]:
    """(path, lstat) of each of `names` under `base` that is a regular file now: symlinks, other
    kinds and entries gone since they were listed are passed over."""
    for name in names:
        full = os.path.join(base, name)
        try:
            st = os.stat(full, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            yield full, st
