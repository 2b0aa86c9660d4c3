"""Checkpoint custody of one run: notice committed checkpoints, hash and check them, record them in
<run>/rgt/manifest.jsonl, copy them to durable storage. The glue, like `onbox.monitor`.

A file under the checkpoint dir counts as committed when it was renamed into place (a move to a
non-temporary name, or a creation with no write after it: a rename from another directory), or
when it was closed after a write and then stayed quiet (size, mtime and inode unchanged for
`settle_s`). Under the polling observer (no close events) any created or modified file commits
once quiet. Temporary names (`*.tmp`, `*.partial`, `*.tmp.*`, dotfiles, `tmp-*` / `tmp_*`
directories) never commit; they are only watched for being left behind.

Threads: watchdog's (the change callback only updates the pending table and the queue; it never
reads a file), and "rgt-custody", one worker that hashes (SHA-256, 1 MiB reads, paced by a token
bucket at `hash_rate_bytes_s`), runs the structural check (`onbox.ckptcheck`), appends the record,
emits `ckpt.saved`, and makes the durable copies. Settling, temporary-file ages, missed files and
staleness are periodic jobs for the sidecar's scheduler (`jobs()`).

Durable policy: "all" copies every recorded checkpoint right after it is recorded; "last" copies once
hashing has caught up, and then only the newest: records of an older step than the newest recorded
step, and records whose file changed since, are skipped. Nothing is ever deleted, there or here.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Set, Tuple

from onbox import ckptcheck, manifest
from onbox.ckptcheck import is_temporary
from onbox.errors import ConfigError
from onbox.jobs import FunctionJob, PeriodicJob
from onbox.sources.checkpoints import (
    CHUNK,
    CLOSED,
    CREATED,
    DELETED,
    MODIFIED,
    MOVED,
    Change,
    CheckpointWatcher,
    Key,
    RateLimit,
    copy_stream,
    fsync_dir,
    sha256_stream,
    sha256_uncached,
    stat_key,
    unlink_quietly,
)

log = logging.getLogger(__name__)

Emit = Callable[[str, Mapping[str, Any], Optional[str]], Any]
POLICIES = ("all", "last")
OBSERVERS = ("auto", "inotify", "polling")

# What a pending file waits for before it commits.
QUIET = "quiet"        # size/mtime/inode unchanged for settle_s
CLOSE = "close"        # a close after its writes (or quiet for quiet_max_s: a writer that never closes)
NONEMPTY = "nonempty"  # created with no write seen: a rename from elsewhere once quiet and non-empty


@dataclasses.dataclass
class CustodyConfig:
    run_dir: Path
    ckpt_dir: Optional[Path] = None          # default <run>/checkpoints
    observer: str = "auto"
    settle_s: float = 2.0
    tmp_max_age_s: float = 600.0
    stale_after_s: Optional[float] = None
    hash_rate_bytes_s: Optional[int] = 200 * 1024 * 1024
    durable_dir: Optional[Path] = None
    durable_policy: str = "all"
    poll_interval_s: float = 2.0             # the polling observer's stat walk
    sweep_s: float = 30.0                    # temporary-file ages and missed files
    quiet_max_s: float = 120.0               # a file written but never closed commits after this quiet
    job_cwd: Optional[Path] = None           # the job's working directory (frameworks write under it)


@dataclasses.dataclass
class _Pending:
    need: str
    via: str
    key: Optional[Key] = None
    changed: float = 0.0


class CustodyMonitor:
    """Checkpoint custody for one run; see the module doc."""

    def __init__(self, config: CustodyConfig, emit: Emit, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_commit: Optional[Callable[[float], None]] = None) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.ckpt_dir = Path(config.ckpt_dir) if config.ckpt_dir else self.run_dir / "checkpoints"
        self.durable_dir = Path(config.durable_dir) if config.durable_dir else None
        self._validate()
        self._emit = emit
        self._clock = clock
        self._mono = monotonic
        self._on_commit = on_commit
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._bucket = RateLimit(config.hash_rate_bytes_s, CHUNK, self._stop)
        self._watcher = CheckpointWatcher(self.ckpt_dir, self._on_change, config.observer,
                                          config.poll_interval_s)
        self._worker: Optional[threading.Thread] = None
        self._pending: Dict[str, _Pending] = {}
        self._queue: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._backlog: collections.OrderedDict[str, manifest.Record] = collections.OrderedDict()
        self._notices: Deque[Tuple[str, str, str]] = collections.deque()
        self._busy: Optional[str] = None
        self._hashed = 0                                # bytes of the current file read so far
        self._known: Dict[str, manifest.Record] = {}    # newest record per ckpt-relative path
        self._suspected: Dict[str, Key] = {}            # a file already reported as it is now
        self._written: Set[str] = set()                 # closed after a write or committed
        self._warned_inplace: Set[str] = set()
        self._rewritten: Set[str] = set()               # reported "rewritten while hashing"
        self._warned_tmp: Set[Tuple[str, int]] = set()
        self._last: Optional[manifest.Record] = None
        self._since = 0.0
        self._stale = False
        self._sync_failed = False
        self._sync_streak = False
        self._degraded = False
        self.counts: Dict[str, int] = collections.Counter()
        self._last_sync_error: Optional[str] = None

    def _validate(self) -> None:
        c = self.config
        if c.observer not in OBSERVERS:
            raise ConfigError(f"observer must be one of {', '.join(OBSERVERS)}, not {c.observer!r}")
        if c.durable_policy not in POLICIES:
            raise ConfigError(f"durable_policy must be 'all' or 'last', not {c.durable_policy!r}")
        if c.settle_s < 0 or c.tmp_max_age_s <= 0:
            raise ConfigError("settle_s must be >= 0 and tmp_max_age_s > 0")
        if self.durable_dir is not None:
            d, k = os.path.abspath(self.durable_dir), os.path.abspath(self.ckpt_dir)
            if d == k or d.startswith(k.rstrip("/") + "/") or k.startswith(d.rstrip("/") + "/"):
                raise ConfigError(f"durable_dir {d} must lie outside (and not above) the checkpoint dir {k}")

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the manifest, start the observer and the worker, then scan for what is not recorded."""
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "rgt").mkdir(parents=True, exist_ok=True)
        self._since = self._clock()
        for record in manifest.read(self.run_dir):
            rel = self._from_run_rel(record.path)
            if rel is not None:
                self._known[rel] = record
                self._written.add(rel)
                if self._last is None or record.ts >= self._last.ts:
                    self._last = record
        self._watcher.start()
        self._worker = threading.Thread(target=self._work, name="rgt-custody", daemon=True)
        self._worker.start()
        if self.durable_dir is not None:
            self._queue_missing_copies()
        self.sweep_tick()

    def jobs(self) -> List[PeriodicJob]:
        """Settling (fast), temporary-file ages and missed files (slow), staleness (when set)."""
        settle_every = max(0.05, min(1.0, self.config.settle_s / 4))
        out: List[PeriodicJob] = [FunctionJob("custody.settle", settle_every, self.settle_tick),
                                  FunctionJob("custody.sweep", self.config.sweep_s, self.sweep_tick)]
        if self.config.stale_after_s is not None:
            every = max(1.0, min(60.0, self.config.stale_after_s / 10))
            out.append(FunctionJob("custody.stale", every, self.stale_tick))
        return out

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is settling, queued, being hashed or waiting for its durable copy."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._pending or self._queue or self._busy or self._backlog), timeout_s)

    @property
    def sync_failed(self) -> bool:
        """A durable copy failed at some point of this monitor's life (sticky)."""
        return self._sync_failed

    def status(self) -> Dict[str, Any]:
        with self._cond:
            last = self._last
            return {
                "ckpt_dir": str(self.ckpt_dir),
                "observer": self._watcher.kind, "observer_reason": self._watcher.reason,
                "observer_alive": self._watcher.alive(),
                "pending": len(self._pending), "queued": len(self._queue),
                "hashing": self._busy, "hashed_bytes": self._hashed if self._busy else None,
                "durable_backlog": len(self._backlog),
                "last_saved": None if last is None else {"path": last.path, "step": last.step, "ts": last.ts},
                "stale": self._stale, "sync_failed": self._sync_failed,
                "last_sync_error": self._last_sync_error, "counts": dict(self.counts),
            }

    def close(self) -> None:
        """Stop the observer, then the worker (an unfinished hash or copy is abandoned)."""
        self._watcher.stop()
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(10.0)
            self._worker = None

    # ---- paths --------------------------------------------------------------------------------

    def _rel(self, path: str) -> Optional[str]:
        rel = os.path.relpath(path, self.ckpt_dir)
        return None if rel == "." or rel.startswith("..") else rel

    def _from_run_rel(self, run_rel: str) -> Optional[str]:
        return self._rel(str(self.run_dir / run_rel))

    def _run_rel(self, rel: str) -> str:
        return os.path.relpath(self.ckpt_dir / rel, self.run_dir)

    def _stat_key(self, rel: str) -> Optional[Key]:
        try:
            st = os.stat(self.ckpt_dir / rel)
        except OSError:
            return None
        return stat_key(st) if stat.S_ISREG(st.st_mode) else None

    def _recorded(self, rel: str, key: Optional[Key]) -> bool:
        record = self._known.get(rel)
        return record is not None and key == record.key

    # ---- changes (watchdog's thread) ----------------------------------------------------------

    def _on_change(self, change: Change) -> None:
        rel = self._rel(change.path)
        commit: Optional[str] = None
        with self._cond:
            if change.kind == MOVED:
                if rel is not None:
                    self._pending.pop(rel, None)
                dest = self._rel(change.dest) if change.dest else None
                if dest is not None and not is_temporary(dest):
                    self._pending.pop(dest, None)
                    commit = dest
            elif rel is None or is_temporary(rel):
                return
            elif change.kind == DELETED:
                self._pending.pop(rel, None)
            elif self._watcher.kind == "polling" and change.kind in (CREATED, MODIFIED):
                self._settle(rel, QUIET, "poll")
            elif change.kind == CREATED:
                self._pending[rel] = _Pending(NONEMPTY, "rename", changed=self._mono())
            elif change.kind == MODIFIED:
                warn = rel in self._written and rel not in self._warned_inplace
                self._settle(rel, CLOSE, "close")
                if warn and not self._recorded(rel, self._stat_key(rel)):
                    self._warned_inplace.add(rel)
                    self._suspect_later(rel, "written_in_place", "written in place (not atomic): "
                                        "more writes after a close-after-write to the same name")
            elif change.kind == CLOSED:
                self._written.add(rel)
                self._settle(rel, QUIET, "close")
        if commit is not None:
            self._commit([(commit, "rename")])

    def _settle(self, rel: str, need: str, via: str) -> None:
        """(Re)start the quiet clock of `rel` (caller holds the lock)."""
        entry = self._pending.get(rel)
        if entry is None:
            self._pending[rel] = _Pending(need, via, changed=self._mono())
        else:
            entry.need, entry.via, entry.changed = need, via, self._mono()
        self._cond.notify_all()

    def _suspect_later(self, rel: str, code: str, reason: str) -> None:
        """A suspect found under the lock is emitted by the worker (never from watchdog's thread)."""
        self._notices.append((rel, code, reason))
        self._cond.notify_all()

    def _commit(self, items: List[Tuple[str, str]]) -> None:
        fresh = []
        for rel, via in items:
            if not self._recorded(rel, self._stat_key(rel)):
                fresh.append((rel, via))
        if not fresh:
            return
        with self._cond:
            for rel, via in fresh:
                self._written.add(rel)
                self._queue.setdefault(rel, via)
            self._cond.notify_all()
        if self._on_commit is not None:
            try:
                self._on_commit(self._mono())
            except Exception:  # a callback boundary
                log.exception("on_commit callback failed")

    # ---- periodic jobs ------------------------------------------------------------------------

    def settle_tick(self) -> None:
        """Commit the pending files that have been quiet long enough."""
        with self._cond:
            rels = list(self._pending)
        keys = {rel: self._stat_key(rel) for rel in rels}
        now = self._mono()
        ready: List[Tuple[str, str]] = []
        with self._cond:
            for rel, key in keys.items():
                p = self._pending.get(rel)
                if p is None:
                    continue
                if key is None:
                    del self._pending[rel]
                    continue
                if key != p.key:
                    p.key, p.changed = key, now
                    continue
                quiet = now - p.changed
                if p.need == CLOSE:
                    due = quiet >= self.config.quiet_max_s
                elif p.need == NONEMPTY:
                    due = (quiet >= self.config.settle_s and key[0] > 0) or quiet >= self.config.quiet_max_s
                else:
                    due = quiet >= self.config.settle_s
                if due:
                    del self._pending[rel]
                    ready.append((rel, "quiet" if p.need == CLOSE else p.via))
            self._cond.notify_all()
        self._commit(ready)

    def sweep_tick(self) -> None:
        """Walk the checkpoint dir: report temporary files left too long; settle unrecorded files."""
        now = self._clock()
        seen_tmp: Set[Tuple[str, int]] = set()
        found: Dict[str, Key] = {}
        for dirpath, dirnames, filenames in os.walk(self.ckpt_dir):
            for name in list(dirnames) + filenames:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, self.ckpt_dir)
                try:
                    st = os.stat(path, follow_symlinks=False)
                except OSError:
                    continue
                if is_temporary(name):
                    if name in dirnames:
                        dirnames.remove(name)
                    seen_tmp.add((rel, st.st_ino))
                    self._check_tmp_age(rel, st, now)
                elif stat.S_ISREG(st.st_mode):
                    found[rel] = stat_key(st)
        with self._cond:
            self._warned_tmp &= seen_tmp
            for rel, key in found.items():
                if (self._recorded(rel, key) or self._suspected.get(rel) == key or rel in self._pending
                        or rel in self._queue or rel == self._busy):
                    continue
                self._pending[rel] = _Pending(QUIET, "scan", key, self._mono())
            self._cond.notify_all()

    def _check_tmp_age(self, rel: str, st: os.stat_result, now: float) -> None:
        newest = st.st_mtime
        if stat.S_ISDIR(st.st_mode):
            for dirpath, _, filenames in os.walk(self.ckpt_dir / rel):
                for name in filenames:
                    try:
                        newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
                    except OSError:
                        continue
        age = now - newest
        if age < self.config.tmp_max_age_s or (rel, st.st_ino) in self._warned_tmp:
            return
        self._warned_tmp.add((rel, st.st_ino))
        what = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        reason = f"temporary {what} left unchanged for {age:.0f}s (over {self.config.tmp_max_age_s:.0f}s)"
        self._suspect(rel, "tmp_left", reason + ": an interrupted save?", None, age_s=round(age, 1))

    def stale_tick(self) -> None:
        """`ckpt.stale` once when no good checkpoint was saved for `stale_after_s`."""
        limit = self.config.stale_after_s
        if limit is None:
            return
        with self._cond:
            last = self._last
            since = last.ts if last is not None else self._since
            age = self._clock() - since
            if self._stale or age < limit:
                return
            self._stale = True
        self._emit("ckpt.stale", {"age_s": round(age, 1), "stale_after_s": limit,
                                  "last_path": last.path if last else None,
                                  "last_step": last.step if last else None}, "warn")

    # ---- worker -------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            record: Optional[manifest.Record] = None
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stop.is_set() or bool(self._notices or self._queue or self._backlog))
                if self._stop.is_set():
                    return
                notices = list(self._notices)
                self._notices.clear()
                if notices:
                    rel, via = "", "notices"
                elif self._queue:
                    rel, via = self._queue.popitem(last=False)
                else:
                    rel, record = self._backlog.popitem(last=False)
                    via = "durable"
                self._busy, self._hashed = rel or None, 0
            try:
                for path, code, reason in notices:
                    self._suspect(path, code, reason, None)
                if rel:
                    self._work_one(rel, via, record)
                if self._degraded:
                    self._degraded = False
                    self._emit("sidecar.recovered", {"part": "custody"}, None)
            except Exception as e:  # a work-item boundary: log, report once per streak, go on
                log.exception("custody of %s failed", rel)
                self.counts["errors"] += 1
                if not self._degraded:
                    self._degraded = True
                    self._emit("sidecar.degraded", {"part": "custody", "path": rel,
                                                    "error": f"{type(e).__name__}: {e}"[:500]}, None)
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _work_one(self, rel: str, via: str, record: Optional[manifest.Record]) -> None:
        if record is not None:
            if self._copy_wanted(rel, record):
                self._copy(rel, record)
        else:
            self._process(rel, via)

    def _suspect(self, rel: str, code: str, reason: str, key: Optional[Key], **extra: Any) -> None:
        with self._cond:
            if key is not None:
                self._suspected[rel] = key
            self.counts["suspect"] += 1
        data = {"path": self._run_rel(rel), "code": code, "reason": reason, **extra}
        self._emit("ckpt.suspect", data, "warn")

    def _process(self, rel: str, via: str) -> None:
        """Hash, check and record one committed file (see the module doc)."""
        path = self.ckpt_dir / rel
        key0 = self._stat_key(rel)
        if key0 is None or self._recorded(rel, key0) or self._suspected.get(rel) == key0:
            return
        if key0[0] == 0:
            self._suspect(rel, "zero_bytes", "zero bytes", key0)
            return
        started = time.perf_counter()
        try:
            with open(path, "rb") as f:
                opened = stat_key(os.fstat(f.fileno()))
                digest = sha256_stream(f, self._bucket, self._progress) if opened == key0 else None
                check = ckptcheck.check_file(f, key0[0], path.name) if digest else None
                after_fd = stat_key(os.fstat(f.fileno()))
        except FileNotFoundError:
            return
        key1 = self._stat_key(rel)
        if self._stop.is_set() or key1 is None or key1[2] != key0[2]:
            return  # stopped, gone, or replaced by a rename (that commit is queued on its own)
        if digest is None or check is None or key1 != key0 or after_fd != key0:
            if opened == key0 and rel not in self._rewritten:  # once until it is recorded
                self._rewritten.add(rel)
                self._suspect(rel, "rewritten_while_hashing",
                              "rewritten while hashing: size or mtime changed; hashed again once it settles",
                              None, size=key1[0])
            with self._cond:
                if rel not in self._pending:
                    self._pending[rel] = _Pending(QUIET, via, None, self._mono())
            return
        if check.status == ckptcheck.BAD:
            self._suspect(rel, "bad_structure", check.reason or "bad structure", key0,
                          format=check.format, size=key0[0], sha256=digest)
            return
        self._record(rel, via, key0, digest, check, time.perf_counter() - started)

    def _progress(self, done: int) -> None:
        self._hashed = done

    def _record(self, rel: str, via: str, key: Key, digest: str, check: ckptcheck.CheckResult,
                hash_s: float) -> None:
        step = ckptcheck.step_of(rel, check.metadata)
        record = manifest.Record(path=self._run_rel(rel), size=key[0], sha256=digest, mtime_ns=key[1],
                                 inode=key[2], step=step, format=check.format, ts=self._clock())
        manifest.append(self.run_dir, record)
        with self._cond:
            self._known[rel] = record
            self._suspected.pop(rel, None)
            self._rewritten.discard(rel)
            self._last = record
            self._stale = False
            if self.durable_dir is not None:
                self._backlog[rel] = record
        self.counts["saved"] += 1
        self._emit("ckpt.saved", {
            "path": record.path, "size": record.size, "sha256": digest, "step": step,
            "format": check.format, "check": check.status, "hash_s": round(hash_s, 4),
            "via": via, "non_atomic": {"close": True, "quiet": True, "rename": False}.get(via),
        }, None)
        if self.durable_dir is not None and self.config.durable_policy == "all":
            with self._cond:
                self._backlog.pop(rel, None)
            self._copy(rel, record)

    # ---- durable copies -----------------------------------------------------------------------

    def _queue_missing_copies(self) -> None:
        assert self.durable_dir is not None
        missing = {}
        for rel, record in self._known.items():
            if not record.matches(self.run_dir):
                continue
            try:
                same = os.stat(self.durable_dir / rel).st_size == record.size
            except OSError:
                same = False
            if not same:
                missing[rel] = record
        with self._cond:
            self._backlog.update(missing)
            self._cond.notify_all()

    def _copy_wanted(self, rel: str, record: manifest.Record) -> bool:
        """Under "last", skip what a newer step or a newer record of the same file superseded."""
        with self._cond:
            if self._known.get(rel) is not record or not record.matches(self.run_dir):
                return False
            if self.config.durable_policy != "last" or record.step is None:
                return True
            steps = [r.step for r in self._backlog.values() if r.step is not None]
            return not steps or record.step >= max(steps)

    def _copy(self, rel: str, record: manifest.Record) -> None:
        """Copy to a temporary name, fsync, read back and compare, then rename and fsync the dir."""
        assert self.durable_dir is not None
        dst = self.durable_dir / rel
        tmp = dst.with_name(f".{dst.name}.rgt-{os.getpid()}.tmp")
        started = time.perf_counter()
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            streamed = copy_stream(self.ckpt_dir / rel, tmp, record.key, self._bucket)
            back = sha256_uncached(tmp, self._bucket) if streamed == record.sha256 else None
            if back == record.sha256:
                os.replace(tmp, dst)
                fsync_dir(dst.parent)
        except OSError as e:
            unlink_quietly(tmp)
            name = errno.errorcode.get(e.errno or 0, "error")
            self._sync_fail(rel, dst, f"{name}: {e.strerror or e}", name)
            return
        if back != record.sha256:
            unlink_quietly(tmp)
            if back is not None:
                self._sync_fail(rel, dst, f"the copy reads back as {back}, not {record.sha256}", "mismatch")
            elif streamed is not None:  # the source changed under us: its new commit comes on its own
                log.info("%s changed while being copied; not copied", rel)
            return
        with self._cond:
            self._sync_streak = False
        self.counts["durable"] += 1
        self._emit("ckpt.durable", {"path": record.path, "durable_path": str(dst), "sha256": back,
                                    "size": record.size, "copy_s": round(time.perf_counter() - started, 3)},
                   None)

    def _sync_fail(self, rel: str, dst: Path, error: str, code: str) -> None:
        with self._cond:
            self._sync_failed = True
            self._last_sync_error = error
            first = not self._sync_streak
            self._sync_streak = True
        self.counts["sync_failed"] += 1
        log.error("durable copy of %s to %s failed: %s", rel, dst, error)
        if first:  # one critical per failing streak; the count and last error are in status()
            self._emit("ckpt.sync_failed", {"path": self._run_rel(rel), "durable_path": str(dst),
                                            "error": error[:500], "code": code}, "critical")



__all__ = ["CustodyConfig", "CustodyMonitor"]
