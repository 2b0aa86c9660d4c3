"""Durable copies of recorded checkpoint units (custody's copy to storage that outlives the box).

Each file of a unit is copied to a temporary name, fsynced, read back and compared, then renamed
into place and its directory fsynced. A directory unit is copied file by file under its own path.
Nothing is ever deleted, there or here. One `ckpt.sync_failed` (critical) per failing streak; the
count and the last error are kept for `status()`.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from rgtlib.hashing import RateLimit

from onbox.custody import manifest
from onbox.sources.checkpoints import Key, copy_stream, fsync_dir, sha256_uncached, unlink_quietly

log = logging.getLogger(__name__)
Emit = Callable[[str, Mapping[str, Any], Optional[str]], Any]


def unit_files(unit: str, record: manifest.Record) -> List[Tuple[Path, str, Key, str]]:
    """(source, path relative to the unit's durable place, key, sha256) of every file of a unit."""
    if record.kind != manifest.DIR:
        return [(Path(unit), "", record.key, record.sha256)]
    return [(Path(unit) / f.path, f.path, f.key, f.sha256) for f in record.files]


class DurableCopier:
    def __init__(self, durable_dir: Path, pace: RateLimit, emit: Emit, counts: Dict[str, int]) -> None:
        self.durable_dir = durable_dir
        self._pace = pace
        self._emit = emit
        self._counts = counts
        self._lock = threading.Lock()
        self.failed = False
        self.last_error: Optional[str] = None
        self._streak = False

    def present(self, rel: str, record: manifest.Record) -> bool:
        """The durable place already holds every file of the unit at its recorded size."""
        for _, sub, key, _ in unit_files("", record):
            try:
                if os.stat(self.durable_dir / rel / sub if sub else self.durable_dir / rel).st_size != key[0]:
                    return False
            except OSError:
                return False
        return True

    def copy(self, unit: str, rel: str, record: manifest.Record) -> None:
        """Copy every file of `unit` to durable_dir/rel; one ckpt.durable when all arrived."""
        started = time.perf_counter()
        for src, sub, key, sha in unit_files(unit, record):
            dst = self.durable_dir / rel / sub if sub else self.durable_dir / rel
            if not self._copy_one(src, dst, key, sha, record.path):
                return
        with self._lock:
            self._streak = False
        self._counts["durable"] += 1
        self._emit("ckpt.durable", {"path": record.path, "durable_path": str(self.durable_dir / rel),
                                    "sha256": record.sha256, "size": record.size,
                                    "copy_s": round(time.perf_counter() - started, 3)}, None)

    def _copy_one(self, src: Path, dst: Path, key: Key, sha: str, path: str) -> bool:
        tmp = dst.with_name(f".{dst.name}.rgt-{os.getpid()}.tmp")
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            streamed = copy_stream(src, tmp, key, self._pace)
            back = sha256_uncached(tmp, self._pace) if streamed == sha else None
            if back == sha:
                os.replace(tmp, dst)
                fsync_dir(dst.parent)
        except OSError as e:
            unlink_quietly(tmp)
            name = errno.errorcode.get(e.errno or 0, "error")
            self._fail(path, dst, f"{name}: {e.strerror or e}", name)
            return False
        if back != sha:
            unlink_quietly(tmp)
            if back is not None:
                self._fail(path, dst, f"the copy reads back as {back}, not {sha}", "mismatch")
            elif streamed is not None:  # the source changed under us: its new commit comes on its own
                log.info("%s changed while being copied; not copied", src)
            return False
        return True

    def _fail(self, path: str, dst: Path, error: str, code: str) -> None:
        with self._lock:
            self.failed = True
            self.last_error = error
            first = not self._streak
            self._streak = True
        self._counts["sync_failed"] += 1
        log.error("durable copy of %s to %s failed: %s", path, dst, error)
        if first:  # one critical per failing streak; the count and last error are in status()
            self._emit("ckpt.sync_failed", {"path": path, "durable_path": str(dst),
                                            "error": error[:500], "code": code}, "critical")


__all__ = ["DurableCopier", "unit_files"]
