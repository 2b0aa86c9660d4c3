"""The state of one run's checkpoint custody and its worker thread ("rgt-custody"): hashing,
checking and recording committed units, removal lines, durable copies. `onbox.custody.monitor` is the
change side (observers, settling, places, sweeps) built on it; read its module doc first.

A committed unit is never left out because judging it went wrong: one that fails its structural
check ("bad_structure") or whose hashing or check raised ("check_failed") gets a suspect line in
rgt/manifest.jsonl (`manifest.Suspect`) besides its `ckpt.suspect` event, and while that line is
live `verdict_reasons()` names it, so the run's verdict fails and the pull's verification fails on
it (the controller reads the pulled rgt/manifest.jsonl).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Set, Tuple

from rgtlib.hashing import CHUNK, RateLimit, sha256_stream, unit_digest

from onbox.custody import check as ckptcheck
from onbox.custody import manifest, units
from onbox.custody.durable import DurableCopier
from onbox.errors import ConfigError
from onbox.hints import HintReader
from onbox.sources.checkpoints import CheckpointWatcher, Key, stat_key

log = logging.getLogger(__name__)

Emit = Callable[[str, Mapping[str, Any], Optional[str]], Any]
POLICIES = ("all", "last")
OBSERVERS = ("auto", "inotify", "polling")

# What a pending unit waits for before it commits.
QUIET = "quiet"        # unchanged for settle_s
CLOSE = "close"        # a close after its writes (or quiet for quiet_max_s: a writer that never closes)
NONEMPTY = "nonempty"  # created with no write seen: a rename from elsewhere once quiet and non-empty
UNIT = "unit"          # a directory: its last file written (or unit_settle_s quiet), nothing open
FILE, DIR = manifest.FILE, manifest.DIR


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
    job_pid: Optional[int] = None            # the job (its descendants' open files are looked at)
    unit_settle_s: float = 10.0              # quiet time of a directory unit with no known last file
    locate_s: float = 5.0                    # how often new places are looked for


@dataclasses.dataclass
class Pending:
    need: str
    via: str
    kind: str
    root: str
    key: Any = None                          # a file's Key, a directory's signature
    changed: float = 0.0
    open: Set[str] = dataclasses.field(default_factory=set)
    final_done: bool = False


@dataclasses.dataclass
class Place:
    root: Path
    how: str
    watcher: CheckpointWatcher
    every_file: bool                         # the checkpoint dir: every file there is a checkpoint




@dataclasses.dataclass
class HashedFile:
    path: str
    key: Key
    sha256: str
    check: ckptcheck.CheckResult


@dataclasses.dataclass
class DirHash:
    """The result of hashing a directory unit: `changed` when anything moved under us."""

    files: List[HashedFile]
    changed: bool = False
    stopped: bool = False


def safe_check(f: Any, size: int, name: str) -> ckptcheck.CheckResult:
    """`ckptcheck.check_file`, and "bad" with the reason when checking raised anyway."""
    try:
        return ckptcheck.check_file(f, size, name)
    except Exception as e:  # a verdict, never a unit left out
        return ckptcheck.CheckResult("unknown", ckptcheck.BAD,
                                     f"checking it raised {type(e).__name__}: {str(e)[:200]}")


def hash_dir(unit: Path, pace: RateLimit, progress: Callable[[int], None]) -> DirHash:
    """Hash and check every file of a directory unit; `changed` when its listing or any file's key
    differs at the end from the start (the caller settles it and tries again)."""
    sig0 = units.signature(unit)
    done: List[HashedFile] = []
    total = 0
    for rel, key in sig0:
        try:
            with open(unit / rel, "rb") as f:
                if stat_key(os.fstat(f.fileno())) != key:
                    return DirHash(done, changed=True)
                hashed = sha256_stream(f, pace, _offset(progress, total))
                if hashed is None:
                    return DirHash(done, stopped=True)
                digest = hashed[0]
                check = safe_check(f, key[0], Path(rel).name)
                if stat_key(os.fstat(f.fileno())) != key:
                    return DirHash(done, changed=True)
        except FileNotFoundError:
            return DirHash(done, changed=True)
        total += key[0]
        done.append(HashedFile(rel, key, digest, check))
    return DirHash(done, changed=units.signature(unit) != sig0)


def _offset(progress: Callable[[int], None], base: int) -> Callable[[int], None]:
    return lambda n: progress(base + n)


class CustodyCore:
    """The shared state and the worker; `onbox.custody.monitor.CustodyMonitor` adds the change side."""

    def __init__(self, config: CustodyConfig, emit: Emit, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_commit: Optional[Callable[[float], None]] = None, proc: str = "/proc") -> None:
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.ckpt_dir = Path(config.ckpt_dir) if config.ckpt_dir else self.run_dir / "checkpoints"
        self.durable_dir = Path(config.durable_dir) if config.durable_dir else None
        self._validate()
        self._emit = emit
        self._clock = clock
        self._mono = monotonic
        self._on_commit = on_commit
        self._proc = proc
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._bucket = RateLimit(config.hash_rate_bytes_s, CHUNK, self._stop)
        self.counts: Dict[str, int] = collections.Counter()
        self._durable = (DurableCopier(self.durable_dir, self._bucket, emit, self.counts)
                         if self.durable_dir is not None else None)
        self._places: Dict[str, Place] = {}           # replaced whole (watchdog's threads read it)
        self._worker: Optional[threading.Thread] = None
        self._pending: Dict[str, Pending] = {}
        self._queue: collections.OrderedDict[str, Tuple[str, str, str]] = collections.OrderedDict()
        self._backlog: collections.OrderedDict[str, manifest.Record] = collections.OrderedDict()
        self._notices: Deque[Tuple[str, str, str]] = collections.deque()
        self._busy: Optional[str] = None
        self._hashed = 0                                # bytes of the current unit read so far
        self._known: Dict[str, manifest.Record] = {}    # newest live record per unit (absolute path)
        self._suspected: Dict[str, Any] = {}            # a unit already reported as it is now
        self._written: Set[str] = set()                 # closed after a write or committed
        self._warned_inplace: Set[str] = set()
        self._rewritten: Set[str] = set()               # reported "rewritten while hashing"
        self._warned_tmp: Set[Tuple[str, int]] = set()
        self._gone: Dict[str, Tuple[float, bool, bool]] = {}  # unit -> (seen, judged, job alive)
        self._dir_units: Set[str] = set()               # directories a hint or a record made units
        self._step_hints = HintReader(self.run_dir)     # "step" hints of rgt.report.save
        self._hinted_steps: Dict[Tuple[str, int], int] = {}  # (absolute path, inode) -> step
        self._explicit: Set[str] = set()                # files the job was seen writing
        self._last: Optional[manifest.Record] = None
        self._since = 0.0
        self._stale = False
        self._weights_bad = False                       # the newest sampled weights were NaN/Inf
        self._degraded = False

    def _validate(self) -> None:
        c = self.config
        if c.observer not in OBSERVERS:
            raise ConfigError(f"observer must be one of {', '.join(OBSERVERS)}, not {c.observer!r}")
        if c.durable_policy not in POLICIES:
            raise ConfigError(f"durable_policy must be 'all' or 'last', not {c.durable_policy!r}")
        if c.settle_s < 0 or c.tmp_max_age_s <= 0 or c.unit_settle_s < 0:
            raise ConfigError("settle_s and unit_settle_s must be >= 0 and tmp_max_age_s > 0")
        if self.durable_dir is not None:
            d, k = os.path.abspath(self.durable_dir), os.path.abspath(self.ckpt_dir)
            if d == k or d.startswith(k.rstrip("/") + "/") or k.startswith(d.rstrip("/") + "/"):
                raise ConfigError(f"durable_dir {d} must lie outside (and not above) the checkpoint dir {k}")

    def _rec_path(self, unit: str) -> str:
        rel = os.path.relpath(unit, self.run_dir)
        return unit if rel.startswith("..") else rel.replace(os.sep, "/")

    def _sig(self, unit: str, kind: str) -> Any:
        if kind == DIR:
            return units.signature(Path(unit)) or None
        try:
            st = os.stat(unit)
        except OSError:
            return None
        return stat_key(st) if stat.S_ISREG(st.st_mode) else None

    def _recorded(self, unit: str, sig: Any) -> bool:
        record = self._known.get(unit)
        if record is None or sig is None:
            return False
        if record.kind == DIR:
            return bool(sig == tuple(sorted((f.path, f.key) for f in record.files)))
        return bool(sig == record.key)

    # ---- removals -----------------------------------------------------------------------------

    def _judge_removals(self, now: float) -> None:
        grace = max(self.config.settle_s, 0.1)  # let a whole rmtree land before judging it
        with self._cond:
            due = [(u, judged, alive) for u, (t, judged, alive) in self._gone.items() if now - t >= grace]
        for unit, judged, alive in due:
            try:
                self._judge_removal(unit, judged, alive)
            finally:
                with self._cond:
                    self._gone.pop(unit, None)
                    self._cond.notify_all()

    def _judge_removal(self, unit: str, judged: bool, alive: bool) -> None:
        """See the module doc: by "job" only for a whole unit gone while the job ran, unjudged."""
        record = self._known.get(unit)
        if record is None:
            return
        if not os.path.lexists(unit):
            before_exit = not alive and not judged and self._gone_before_exit(unit)
            by = "job" if (alive or before_exit) and not judged else "other"
            reason = {"job": "removed as a whole while the job ran (its own rotation: HF save_total_limit, "
                             "Lightning save_top_k)" + ("; seen after it exited" if before_exit else ""),
                      "other": "removed while it was still being judged" if judged else
                               "removed while the job was not running"}[by]
        elif record.kind == DIR:
            gone = [f.path for f in record.files if not os.path.lexists(os.path.join(unit, f.path))]
            if not gone:
                return
            by, reason = "other", f"{len(gone)} file(s) vanished from it: {', '.join(gone[:5])}"
        else:
            return
        manifest.append_removal(self.run_dir, manifest.Removal(record.path, record.sha256, by, reason,
                                                               self._clock()))
        sig = self._sig(unit, record.kind)
        with self._cond:
            self._known.pop(unit, None)
            self._backlog.pop(unit, None)
            if sig is not None:
                self._suspected[unit] = sig  # what is left of it stays suspect until written again
        self.counts["removed_by_" + by] += 1
        self._emit("ckpt.removed", {"path": record.path, "sha256": record.sha256, "by": by, "reason": reason,
                                    "step": record.step, "kind": record.kind, "size": record.size,
                                    "files": len(record.files) or 1}, None if by == "job" else "warn")

    def _gone_before_exit(self, unit: str) -> bool:
        """Seen gone after the job ended, yet removed before it: the unit's directory last changed
        no later than the wrapper wrote rgt/exit.json (after it reaped the job). A rotation just
        before the exit reaches custody late under load, and it is still the job's own; anything
        that changed the directory after the exit (or no exit.json) leaves the removal by "other"."""
        try:
            parent = os.stat(os.path.dirname(unit)).st_mtime_ns
            ended = os.stat(self.run_dir / "rgt" / "exit.json").st_mtime_ns
        except OSError:
            return False
        return parent <= ended

    def _job_alive(self) -> bool:
        """The job's pid is alive (not a zombie); without a pid, the wrapper wrote no rgt/exit.json."""
        pid = self.config.job_pid
        if not pid:
            return not (self.run_dir / "rgt" / "exit.json").exists()
        try:
            with open(f"{self._proc}/{pid}/stat", "rb") as f:
                raw = f.read(4096)
            return raw[raw.rindex(b")") + 2:][:1] not in (b"Z", b"X")
        except (OSError, ValueError):
            return False

    # ---- worker -------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            record: Optional[manifest.Record] = None
            item: Tuple[str, str, str] = ("", FILE, "")
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stop.is_set() or bool(self._notices or self._queue or self._backlog))
                if self._stop.is_set():
                    return
                notices = list(self._notices)
                self._notices.clear()
                if notices:
                    unit = ""
                elif self._queue:
                    unit, item = self._queue.popitem(last=False)
                else:
                    unit, record = self._backlog.popitem(last=False)
                self._busy, self._hashed = unit or None, 0
            try:
                for path, code, reason in notices:
                    self._suspect(path, code, reason, None)
                if unit and record is not None:
                    if self._copy_wanted(unit, record):
                        self._copy(unit, record)
                elif unit:
                    via, kind, root = item
                    (self._process_dir if kind == DIR else self._process_file)(unit, via, root)
                if self._degraded:
                    self._degraded = False
                    self._emit("sidecar.recovered", {"part": "custody"}, None)
            except Exception as e:  # a work-item boundary: log, report once per streak, go on
                log.exception("custody of %s failed", unit)
                self.counts["errors"] += 1
                if unit and record is None:  # judging a committed unit raised: it stays in, as suspect
                    self._suspect_failed(unit, item[1], e)
                if not self._degraded:
                    self._degraded = True
                    self._emit("sidecar.degraded", {"part": "custody", "path": unit,
                                                    "error": f"{type(e).__name__}: {e}"[:500]}, None)
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _suspect(self, unit: str, code: str, reason: str, sig: Any, **extra: Any) -> None:
        with self._cond:
            if sig is not None:
                self._suspected[unit] = sig
            self.counts["suspect"] += 1
        self._emit("ckpt.suspect", {"path": self._rec_path(unit), "code": code, "reason": reason, **extra},
                   "warn")

    def _suspect_unit(self, unit: str, kind: str, code: str, reason: str, sig: Any,
                      digest: Optional[str] = None, unit_files: Tuple[manifest.UnitFile, ...] = (),
                      **extra: Any) -> None:
        """A committed unit judged bad: its suspect line in the manifest, then its ckpt.suspect."""
        size = mtime = inode = None
        if kind == FILE and sig is not None:
            size, mtime, inode = sig
        elif kind == DIR:
            size = sum(f.size for f in unit_files) if unit_files else None
        path = self._rec_path(unit)
        line = manifest.Suspect(path=path, code=code, reason=reason, ts=self._clock(), kind=kind, size=size,
                                sha256=digest, mtime_ns=mtime, inode=inode, files=unit_files,
                                root=self._owner_root(unit) if os.path.isabs(path) else None)
        recorded = True
        try:
            manifest.append_suspect(self.run_dir, line)
        except OSError as e:  # a full disk: the event still names it, the gate's view still sees the file
            log.error("cannot record suspect %s: %s", unit, e)
            recorded = False
        self.counts["suspect_recorded"] += int(recorded)
        self._suspect(unit, code, reason, sig, recorded=recorded, **extra)

    def _suspect_failed(self, unit: str, kind: str, error: BaseException) -> None:
        """Hashing or checking a committed unit raised: record it as suspect with the error."""
        try:
            sig = self._sig(unit, kind)
            if sig is None or self._recorded(unit, sig):
                return  # gone meanwhile (its removal is judged on its own), or recorded before it raised
            files: Tuple[manifest.UnitFile, ...] = ()
            if kind == DIR:
                files = tuple(manifest.UnitFile(rel, k[0], "", k[1], k[2]) for rel, k in sig)
            self._suspect_unit(unit, kind, "check_failed",
                               f"checking it raised {type(error).__name__}: {str(error)[:300]}", sig,
                               unit_files=files)
        except Exception:  # the boundary's own fallback: logged, the degraded event still goes out
            log.exception("cannot record %s as suspect", unit)

    def _owner_root(self, unit: str) -> Optional[str]:
        best: Optional[str] = None
        for root in self._places:
            if unit.startswith(root.rstrip("/") + "/") and (best is None or len(root) > len(best)):
                best = root
        return best

    def verdict_reasons(self) -> List[str]:
        """Why the run cannot pass on custody's account: every live suspect line, one reason each."""
        out = []
        for item in manifest.live_suspects(self.run_dir):
            out.append(f"checkpoint {item.path} is suspect ({item.code}: {item.reason[:200]}) (ckpt.suspect)")
        return out

    def _repend(self, unit: str, via: str, kind: str, root: str, size: Optional[int]) -> None:
        """Changed while being hashed: one suspect until it is recorded, then settle it again."""
        if unit not in self._rewritten:
            self._rewritten.add(unit)
            self._suspect(unit, "rewritten_while_hashing",
                          "rewritten while hashing: size or mtime changed; hashed again once it settles",
                          None, size=size)
        with self._cond:
            if unit not in self._pending:
                self._pending[unit] = Pending(QUIET, via, kind, root, None, self._mono())

    def _process_file(self, unit: str, via: str, root: str) -> None:
        """Hash, check and record one committed file unit (see the module doc)."""
        key0 = self._sig(unit, FILE)
        if key0 is None or self._recorded(unit, key0) or self._suspected.get(unit) == key0:
            return
        if key0[0] == 0:
            self._suspect(unit, "zero_bytes", "zero bytes", key0)
            return
        started = time.perf_counter()
        try:
            with open(unit, "rb") as f:
                opened = stat_key(os.fstat(f.fileno()))
                hashed = sha256_stream(f, self._bucket, self._progress) if opened == key0 else None
                digest = hashed[0] if hashed else None
                check = safe_check(f, key0[0], os.path.basename(unit)) if digest else None
                after_fd = stat_key(os.fstat(f.fileno()))
        except FileNotFoundError:
            return
        key1 = self._sig(unit, FILE)
        if self._stop.is_set() or key1 is None or key1[2] != key0[2]:
            return  # stopped, gone, or replaced by a rename (that commit is queued on its own)
        if digest is None or check is None or key1 != key0 or after_fd != key0:
            if opened == key0:
                self._repend(unit, via, FILE, root, key1[0])
            return
        if check.status == ckptcheck.BAD:
            self._suspect_unit(unit, FILE, "bad_structure", check.reason or "bad structure", key0, digest,
                               format=check.format, size=key0[0], sha256=digest)
            return
        step = ckptcheck.step_of(os.path.relpath(unit, root), check.metadata)
        if step is None:
            step = self._hinted_step(unit, key0[2])
        record = manifest.Record(path=self._rec_path(unit), size=key0[0], sha256=digest, mtime_ns=key0[1],
                                 inode=key0[2], step=step, format=check.format, ts=self._clock(),
                                 root=self._outside_root(unit, root))
        self._finish(unit, record, via, check.status, time.perf_counter() - started)
        self._judge_weights(record, [("", check)])

    def _hinted_step(self, unit: str, inode: int) -> Optional[int]:
        """The step a "step" hint gave this very file (path and inode), written before its rename."""
        for hint in self._step_hints.poll():
            if hint["kind"] == "step" and "step" in hint and "inode" in hint:
                self._hinted_steps[(os.path.abspath(hint["path"]), hint["inode"])] = hint["step"]
        return self._hinted_steps.get((os.path.abspath(unit), inode))

    def _process_dir(self, unit: str, via: str, root: str) -> None:
        """Hash (file by file), check and record one committed directory unit."""
        sig0 = self._sig(unit, DIR)
        if sig0 is None or self._recorded(unit, sig0) or self._suspected.get(unit) == sig0:
            return
        started = time.perf_counter()
        result = hash_dir(Path(unit), self._bucket, self._progress)
        if self._stop.is_set() or result.stopped or not os.path.isdir(unit):
            return
        if result.changed:
            self._repend(unit, via, DIR, root, None)
            return
        bad = [(f.path, f.check.reason or "bad structure") for f in result.files
               if f.check.status == ckptcheck.BAD]
        bad += [(f.path, "zero bytes") for f in result.files
                if f.key[0] == 0 and units.is_weight_name(f.path)]
        if bad:
            hashed = tuple(manifest.UnitFile(f.path, f.key[0], f.sha256, f.key[1], f.key[2])
                           for f in result.files)
            self._suspect_unit(unit, DIR, "bad_structure", "; ".join(f"{p}: {r}" for p, r in bad[:5]), sig0,
                               unit_digest((f.path, f.size, f.sha256) for f in hashed), hashed,
                               files=len(result.files), bad=[p for p, _ in bad[:20]])
            return
        files = tuple(manifest.UnitFile(f.path, f.key[0], f.sha256, f.key[1], f.key[2]) for f in result.files)
        try:
            inode = os.stat(unit).st_ino
        except OSError:
            return
        rel = os.path.relpath(unit, root)
        record = manifest.Record(
            path=self._rec_path(unit), size=sum(f.size for f in files),
            sha256=unit_digest((f.path, f.size, f.sha256) for f in files),
            mtime_ns=max(f.mtime_ns for f in files), inode=inode, step=units.unit_step(Path(unit), rel),
            format=units.framework_of(os.path.basename(unit)), ts=self._clock(), kind=DIR, files=files,
            root=self._outside_root(unit, root))
        checked = "ok" if all(f.check.status == ckptcheck.OK or f.check.format == ckptcheck.OTHER
                              for f in result.files) else "unchecked"
        self._finish(unit, record, via, checked, time.perf_counter() - started)
        self._judge_weights(record, [(f.path, f.check) for f in result.files])

    def _judge_weights(self, record: manifest.Record,
                       checks: List[Tuple[str, ckptcheck.CheckResult]]) -> None:
        """`train.nonfinite` (name "checkpoint weights") when a new checkpoint's sampled safetensors
        weights hold NaN/Inf, and its clear at the next checkpoint whose weights are finite. A unit
        with no safetensors file says nothing either way (torch files are judged by `rgt verify`)."""
        sampled = [(rel, c) for rel, c in checks if c.format == ckptcheck.SAFETENSORS]
        if not sampled:
            return
        bad = [(rel, c.nonfinite) for rel, c in sampled if c.nonfinite]
        with self._cond:
            was, self._weights_bad = self._weights_bad, bool(bad)
        if bool(bad) == was:
            return
        where = record.path if not bad or not bad[0][0] else f"{record.path}/{bad[0][0]}"
        data: Dict[str, Any] = {"state": "onset" if bad else "cleared", "name": "checkpoint weights",
                                "value": "NaN/Inf" if bad else "finite", "step": record.step, "epoch": None,
                                "source": f"checkpoint {where}", "path": record.path}
        if bad:
            data["tensors"] = list(bad[0][1])
        self._emit("train.nonfinite", data, "critical" if bad else "info")

    def _outside_root(self, unit: str, root: str) -> Optional[str]:
        if not os.path.isabs(self._rec_path(unit)):
            return None
        units.ensure_link(self.run_dir, root)
        return root

    def _progress(self, done: int) -> None:
        self._hashed = done

    def _finish(self, unit: str, record: manifest.Record, via: str, check: str, hash_s: float) -> None:
        manifest.append(self.run_dir, record)
        with self._cond:
            self._known[unit] = record
            if record.kind == DIR:
                self._dir_units.add(unit)
            self._suspected.pop(unit, None)
            self._rewritten.discard(unit)
            self._last = record
            self._stale = False
            if self._durable is not None:
                self._backlog[unit] = record
        self.counts["saved"] += 1
        data: Dict[str, Any] = {
            "path": record.path, "size": record.size, "sha256": record.sha256, "step": record.step,
            "format": record.format, "check": check, "hash_s": round(hash_s, 4), "via": via,
            "non_atomic": {"close": True, "quiet": True, "rename": False, "hint": False}.get(via),
            "kind": record.kind}
        if record.kind == DIR:
            data["files"] = len(record.files)
        if record.root is not None:
            data["pull_path"] = units.in_pull_path(self.run_dir, record.path, record.root)
        self._emit("ckpt.saved", data, None)
        if self._durable is not None and self.config.durable_policy == "all":
            with self._cond:
                self._backlog.pop(unit, None)
            self._copy(unit, record)

    # ---- durable copies -----------------------------------------------------------------------

    def _durable_rel(self, unit: str, record: manifest.Record) -> str:
        rel = os.path.relpath(unit, self.ckpt_dir)
        if not rel.startswith(".."):
            return rel
        return units.in_pull_path(self.run_dir, record.path, record.root) or os.path.basename(unit)

    def _queue_missing_copies(self) -> None:
        assert self._durable is not None
        missing = {unit: r for unit, r in self._known.items()
                   if r.matches(self.run_dir) and not self._durable.present(self._durable_rel(unit, r), r)}
        with self._cond:
            self._backlog.update(missing)
            self._cond.notify_all()

    def _copy_wanted(self, unit: str, record: manifest.Record) -> bool:
        """Under "last", skip what a newer step or a newer record of the same unit superseded."""
        with self._cond:
            if self._known.get(unit) is not record or not record.matches(self.run_dir):
                return False
            if self.config.durable_policy != "last" or record.step is None:
                return True
            steps = [r.step for r in self._backlog.values() if r.step is not None]
            return not steps or record.step >= max(steps)

    def _copy(self, unit: str, record: manifest.Record) -> None:
        assert self._durable is not None
        self._durable.copy(unit, self._durable_rel(unit, record), record)



__all__ = ["CustodyConfig", "CustodyCore", "Pending", "Place", "safe_check"]
