"""The checkpoint source: file-system changes under the checkpoint directory (through watchdog; the
only onbox module that imports it) and the paced reads, copies and fsyncs of checkpoint bytes.

`CheckpointWatcher` watches one directory tree and hands each file change to a callback as a plain
`Change` (kinds: created, modified, closed, moved, deleted); deciding what a change means is
`onbox.custody.monitor`'s job. Directory events are dropped (watchdog itself turns a directory move into
file moves, and a directory moved in from elsewhere into file creations). Opens, closes without a
write (our own hasher's reads) and attribute changes are dropped too.

Reads go through rgtlib.hashing (1 MiB reads paced by a `RateLimit`, a token bucket over bytes), so
hashing a 100 GB checkpoint never starves the job's own I/O; every wait ends once stopped.

Observers: "inotify" (Linux, events within a millisecond), "polling" (a stat walk every
`poll_interval_s`: it sees created, modified, moved and deleted but never a close, and it is the only
one that works where other hosts write: NFS, Lustre, CIFS, FUSE), "auto" (polling on a network or
FUSE filesystem, else inotify, falling back to polling when inotify cannot start, e.g. out of
watches or instances).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from rgtlib.hashing import RateLimit, sha256_stream
from watchdog.events import FileSystemEvent, FileSystemEventHandler  # noqa: TID251 (the watchdog seam)
from watchdog.observers.polling import PollingObserver  # noqa: TID251 (the watchdog seam)

from onbox.fsutil import fsync_dir as _fsync_dir

log = logging.getLogger(__name__)

CREATED = "created"
MODIFIED = "modified"
CLOSED = "closed"
MOVED = "moved"
DELETED = "deleted"

# watchdog event_type -> our kind; the others (opened, closed_no_write, attrib) are dropped.
_KINDS: Dict[str, str] = {
    "created": CREATED, "modified": MODIFIED, "closed": CLOSED, "moved": MOVED, "deleted": DELETED,
}

# Filesystem types where inotify does not see other hosts' writes (or sees nothing at all).
NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "glusterfs", "gpfs", "beegfs",
    "9p", "afs", "ocfs2", "fuse", "fuseblk", "virtiofs",
})
OBSERVERS = ("auto", "inotify", "polling")


@dataclasses.dataclass(frozen=True)
class Change:
    """One file change. `path` is absolute; for MOVED it is the source and `dest` the target."""

    kind: str
    path: str
    dest: Optional[str] = None


OnChange = Callable[[Change], None]


def fs_type(path: Path, mounts: str = "/proc/self/mounts") -> Optional[str]:
    """The filesystem type of the mount holding `path` (longest mount-point prefix), or None."""
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, fields[2]
    return best_type


def is_network_fs(kind: Optional[str]) -> bool:
    return kind is not None and (kind in NETWORK_FS or kind.startswith("fuse."))


class _Handler(FileSystemEventHandler):
    def __init__(self, on_change: OnChange) -> None:
        super().__init__()
        self._on_change = on_change

    def dispatch(self, event: FileSystemEvent) -> None:
        kind = _KINDS.get(event.event_type)
        if kind is None or event.is_directory:
            return
        dest = getattr(event, "dest_path", None)
        change = Change(kind, os.fsdecode(event.src_path), os.fsdecode(dest) if dest else None)
        try:
            self._on_change(change)
        except Exception:  # a callback boundary: an exception here would end watchdog's thread
            log.exception("checkpoint change handler failed on %s", change)


class CheckpointWatcher:
    """Watches `root` recursively; `start()` picks the observer, `stop()` ends its threads."""

    def __init__(self, root: Path, on_change: OnChange, mode: str = "auto",
                 poll_interval_s: float = 2.0, mounts: str = "/proc/self/mounts") -> None:
        if mode not in OBSERVERS:
            raise ValueError(f"observer must be one of {OBSERVERS}, not {mode!r}")
        self.root = Path(root)
        self.mode = mode
        self.poll_interval_s = poll_interval_s
        self.mounts = mounts
        self.kind: Optional[str] = None   # the observer in use: "inotify" or "polling"
        self.reason = "not started"
        self._handler = _Handler(on_change)
        self._observer: Any = None

    def start(self) -> None:
        """Start watching; raises OSError only when no observer can watch `root` at all."""
        use_polling = self.mode == "polling"
        if self.mode == "auto":
            fs = fs_type(self.root, self.mounts)
            if is_network_fs(fs):
                use_polling, self.reason = True, f"{fs} filesystem: inotify misses other hosts' writes"
        if not use_polling:
            try:
                self._observer = self._started(_inotify_observer())
                self.kind = "inotify"
                if self.mode == "inotify":
                    self.reason = "inotify requested"
                else:
                    self.reason = "local filesystem"
                return
            except (OSError, ImportError) as e:
                if self.mode == "inotify":
                    raise OSError(f"inotify cannot watch {self.root}: {e}") from e
                log.warning("inotify cannot watch %s (%s); polling every %.1fs",
                            self.root, e, self.poll_interval_s)
                self.reason = f"inotify failed ({e})"
        elif self.mode == "polling":
            self.reason = "polling requested"
        self._observer = self._started(PollingObserver(timeout=self.poll_interval_s))
        self.kind = "polling"

    def _started(self, observer: Any) -> Any:
        try:
            observer.schedule(self._handler, str(self.root), recursive=True)
            observer.start()
        except BaseException:
            _stop(observer, 5.0)
            raise
        return observer

    def alive(self) -> bool:
        return bool(self._observer is not None and self._observer.is_alive())

    def stop(self, timeout_s: float = 5.0) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            _stop(observer, timeout_s)


def _inotify_observer() -> Any:
    from watchdog.observers.inotify import InotifyObserver  # noqa: TID251 (Linux only)

    return InotifyObserver()


def _stop(observer: Any, timeout_s: float) -> None:
    """Stop an observer, started or not (watchdog's inotify observer owns a thread from birth)."""
    try:
        observer.stop()
    except Exception:  # a teardown boundary
        log.exception("stopping the checkpoint observer failed")
    if observer.is_alive():
        observer.join(timeout_s)


# ---- checkpoint bytes ---------------------------------------------------------------------------

Key = Tuple[int, int, int]  # (size, mtime_ns, inode): what a manifest record pins


def stat_key(st: os.stat_result) -> Key:
    return st.st_size, st.st_mtime_ns, st.st_ino


def sha256_uncached(path: Path, pace: RateLimit) -> Optional[str]:
    """SHA-256 of what the storage holds: this host's cached pages are dropped first (where honoured)."""
    with open(path, "rb") as f:
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
        hashed = sha256_stream(f, pace)
        return hashed[0] if hashed else None


def copy_stream(src: Path, dst: Path, expect: Key, pace: RateLimit) -> Optional[str]:
    """Copy src to dst (created or truncated) and fsync it; the SHA-256 of what was read, or None when
    src is no longer `expect` or we were stopped. OSError (ENOSPC, EROFS, EACCES...) propagates."""
    with open(src, "rb") as fin:
        if stat_key(os.fstat(fin.fileno())) != expect:
            return None
        with open(dst, "wb") as fout:
            hashed = sha256_stream(fin, pace, copy_to=fout)
            if hashed is None:
                return None
            fout.flush()
            os.fsync(fout.fileno())
    return hashed[0]


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable; a real I/O error is raised (see onbox.fsutil)."""
    _fsync_dir(path, strict=True)


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


__all__ = ["CLOSED", "CREATED", "DELETED", "MODIFIED", "MOVED", "Change", "CheckpointWatcher", "Key",
           "copy_stream", "fs_type", "fsync_dir", "is_network_fs", "sha256_uncached", "stat_key",
           "unlink_quietly"]
