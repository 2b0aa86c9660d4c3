"""The box's dead-man as seen from one run's sidecar: its records relayed, its daemon kept running.

Every tick `DeadmanFeed` reads the records the dead-man appended to ~/.rgt/deadman.events.jsonl
since the last tick and journals each deadman.* record as an event of this run (its seq in the
log rides along as `deadman_seq`), so `rgt watch` sees warnings, holds and firings like any other
event. A fresh sidecar starts at the log's end (its own start); a restarted one resumes where the
previous one stopped, from rgt/deadman.feed.json. While the lease is armed and has not fired, it
starts the daemon when none runs (at most once per `ensure_every_s`): that is how a daemon that
died comes back. `renew` answers the controller's Renew control request.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from onbox.deadman.daemon import ensure_daemon, wanted
from onbox.deadman.lease import DeadmanPaths, iter_records, paths_for, read_lease, renew
from onbox.fsutil import write_json_atomic
from onbox.runs import read_json
from onbox.scheduler import FunctionJob, PeriodicJob

log = logging.getLogger(__name__)

Emit = Callable[[str, Mapping[str, Any], Optional[str]], Any]
CURSOR = "deadman.feed.json"
READ_MAX = 256 << 10


class DeadmanFeed:
    def __init__(self, rgt_dir: Path, emit: Emit, *, environ: Optional[Mapping[str, str]] = None,
                 tick_s: float = 1.0, ensure_every_s: float = 30.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.paths: DeadmanPaths = paths_for(self.environ)
        self.cursor_path = Path(rgt_dir) / CURSOR
        self._emit = emit
        self.tick_s = tick_s
        self.ensure_every_s = ensure_every_s
        self._mono = monotonic
        self._lock = threading.Lock()
        self._inode = 0
        self._offset = 0
        self._seq = 0
        self._ensure_at: Optional[float] = None
        self._ensure_now = threading.Event()

    def start(self) -> None:
        """Resume from the cursor of an earlier sidecar of this run, else from the log's end."""
        saved = read_json(self.cursor_path)
        if saved is not None and all(isinstance(saved.get(k), int) for k in ("inode", "offset", "seq")):
            self._inode, self._offset, self._seq = saved["inode"], saved["offset"], saved["seq"]
            return
        try:
            st = os.stat(self.paths.events)
        except OSError:
            return  # no log yet: everything it will hold is new
        self._inode, self._offset = st.st_ino, st.st_size
        self._seq = max((r["seq"] for r in self._tail()), default=0)
        self._save()

    def _tail(self) -> List[Dict[str, Any]]:
        try:
            with open(self.paths.events, "rb") as f:
                f.seek(max(0, self._offset - 8192))
                return list(iter_records(f.read(8192)))
        except OSError:
            return []

    def jobs(self) -> List[PeriodicJob]:
        return [FunctionJob("deadman", self.tick_s, self.tick)]

    def tick(self) -> None:
        with self._lock:
            records = self._read_new()
            for record in records:
                data = {**record["data"], "deadman_seq": record["seq"], "deadman_ts": record.get("ts")}
                sev = record.get("sev") if record.get("sev") in ("info", "warn", "critical") else None
                self._emit(record["kind"], data, sev)
            if records:
                self._save()
        self._maybe_ensure()

    def _read_new(self) -> List[Dict[str, Any]]:
        try:
            fd = os.open(self.paths.events, os.O_RDONLY)
        except OSError:
            return []
        try:
            st = os.fstat(fd)
            if st.st_ino != self._inode or st.st_size < self._offset:  # a new log: read it whole
                self._inode, self._offset = st.st_ino, 0
            raw = os.pread(fd, READ_MAX, self._offset)
        finally:
            os.close(fd)
        complete = raw[:raw.rfind(b"\n") + 1]
        self._offset += len(complete)
        out = [r for r in iter_records(complete) if r["seq"] > self._seq and r["kind"].startswith("deadman.")]
        if out:
            self._seq = out[-1]["seq"]
        return out

    def _save(self) -> None:
        try:
            doc = {"inode": self._inode, "offset": self._offset, "seq": self._seq}
            write_json_atomic(self.cursor_path, doc)
        except OSError as e:
            log.warning("cannot save the dead-man feed cursor: %s", e)

    def _maybe_ensure(self) -> None:
        now = self._mono()
        due = self._ensure_at is None or now >= self._ensure_at or self._ensure_now.is_set()
        if not due:
            return
        self._ensure_now.clear()
        self._ensure_at = now + self.ensure_every_s
        if not wanted(read_lease(self.paths, self.environ)):
            return
        result = ensure_daemon(self.paths, self.environ)
        if result["started"]:
            log.info("started the dead-man daemon (pid %s)", result["pid"])
        elif not result["running"]:
            log.warning("the dead-man daemon is not running: %s", result["reason"])

    def renew(self, ttl_s: Optional[float]) -> Tuple[bool, float, float, str]:
        """The controller renews: (armed, expires_at, ttl_s, state). The daemon is checked at the
        next tick, off the control thread."""
        read = renew(self.paths, now=time.time(), by="controller", ttl_s=ttl_s, environ=self.environ)
        self._ensure_now.set()
        lease = read.lease
        armed = lease is not None and lease.armed and lease.fired is None
        if lease is None:
            return False, 0.0, 0.0, read.state
        return armed, float(lease.expires_at) if armed else 0.0, float(lease.ttl_s), read.state


__all__ = ["DeadmanFeed"]
