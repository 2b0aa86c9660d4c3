"""Checkpoint custody of one run: notice committed checkpoint units, hash and check them, record them
in <run>/rgt/manifest.jsonl, notice their removal, copy them to durable storage. The glue, like
`onbox.monitors.health`.

Places: the checkpoint dir ($RGT_CKPT_DIR, where every file is a checkpoint) plus the places the job
really writes, found by `onbox.custody.locate` (hints, HF's output_dir, Lightning's dirpath, large files
the job holds open for writing), each reported once as `ckpt.location` and watched from then on
(one `CheckpointWatcher` per place; a change seen by two nested places belongs to the deeper one).
Outside the checkpoint dir only units count: directory units and files with a weights suffix (or
a file the job was seen writing). The places are kept in rgt/ckpt_locations.json, so a restarted
sidecar watches them again and the gate's view scans them.

Units (`onbox.custody.units`): a file, or a directory such as HF's `checkpoint-N/`. A file unit commits
when it was renamed into place (a move to a non-temporary name, or a creation with no write after
it: a rename from another directory), or when it was closed after a write and then stayed quiet
(size, mtime and inode unchanged for `settle_s`). A directory unit commits when it was renamed
into place (`tmp-checkpoint-N` -> `checkpoint-N`) and is quiet, when its framework's last file
(HF: trainer_state.json) was closed and it is quiet (`FINAL_QUIET_S`, or `settle_s` if shorter) with
no file left open (HF rotates old saves right after that file, so waiting long loses races against a
fast run), when it stayed quiet
for `unit_settle_s` (no known last file), or at once when a `checkpoint` hint names it. Under the
polling observer (no close events) quiet is enough. A unit is hashed file by file, recorded once
and judged once: one `ckpt.saved` or one `ckpt.suspect` per save; a save judged bad (or whose
judging raised) is never left out: it also gets a suspect line in the manifest, which fails the
run's verdict (`verdict_reasons`) and the pull's verification, and which a restart reads back so it
is not judged again. Writes into a unit already
recorded give one `written_in_place` suspect, then one new record once it settles.

Removal: a recorded unit that disappears as a whole while the job is alive (its pid, else no
rgt/exit.json yet) and while no file of it was being judged (pending, queued or hashing when the
first deletion was seen) was rotated away by the job (HF save_total_limit, Lightning save_top_k);
so was one seen gone only after the job ended whose directory last changed before rgt/exit.json
was written (the watcher is late under load, the rotation came just before the exit):
`ckpt.removed` info, by "job", and a removal line in the manifest. Anything else is by "other", at
warn: a unit that vanished while being judged or while the job was not running, files vanishing
from a unit that is still there, a recorded file truncated. A unit removed by "other" stays
suspect: the pull fails closed on it.

Threads: watchdog's (the change callback only updates the pending table and the queue; beyond a
stat or a small directory listing it never reads a file), and "rgt-custody", one worker that hashes
(SHA-256, 1 MiB reads, paced by a token bucket at `hash_rate_bytes_s`), runs the structural check
(`onbox.custody.check`), appends the record, emits `ckpt.saved`, and makes the durable copies. Settling,
removals, locating, temporary-file ages, missed files and staleness are periodic jobs (`jobs()`).

Durable policy: "all" copies every recorded unit right after it is recorded; "last" copies once
hashing has caught up, and then only the newest: records of an older step than the newest recorded
step, and records whose files changed since, are skipped. Nothing is ever deleted, there or here.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from onbox.custody import manifest
from onbox.custody import units as ckptunits
from onbox.custody.check import is_temporary
from onbox.custody.locate import Locator
from onbox.custody.worker import (
    CLOSE,
    DIR,
    FILE,
    NONEMPTY,
    QUIET,
    UNIT,
    CustodyConfig,
    CustodyCore,
    Emit,
    Pending,
    Place,
)
from onbox.fsutil import write_atomic
from onbox.scheduler import FunctionJob, PeriodicJob
from onbox.sources.checkpoints import (
    CLOSED,
    CREATED,
    DELETED,
    MODIFIED,
    MOVED,
    Change,
    CheckpointWatcher,
    Key,
    stat_key,
)

log = logging.getLogger(__name__)

FINAL_QUIET_S = 0.5  # quiet a directory needs once its framework's last file is closed
CLOSING_QUIET_S = 0.2  # after the job exited: nothing of it writes any more, so a short quiet commits


@dataclasses.dataclass(frozen=True)
class _Loc:
    root: str
    unit: str                                # the unit's absolute path
    kind: str
    sub: str                                 # the file's path inside a directory unit ("" for a file unit)


class CustodyMonitor(CustodyCore):
    """Checkpoint custody for one run; see the module doc."""

    def __init__(self, config: CustodyConfig, emit: Emit, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_commit: Optional[Callable[[float], None]] = None, proc: str = "/proc") -> None:
        super().__init__(config, emit, clock=clock, monotonic=monotonic, on_commit=on_commit, proc=proc)
        self._add_watch(self.ckpt_dir, "ckpt_dir", every_file=True)
        self._locator = Locator(self.run_dir, config.job_cwd, config.job_pid, proc=proc)
        self._refused_seen = 0
        self._handing = 0   # hand-overs from _pending to _queue under way (_commit): not idle
        self._locate_lock = threading.Lock()     # the scheduler's tick and the close-out's
        self._closing = False                     # begin_close(): the job exited

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the manifest and the places, start the observers and the worker, then scan."""
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "rgt").mkdir(parents=True, exist_ok=True)
        self._since = self._clock()
        rems = manifest.removals(self.run_dir)
        for record in manifest.read(self.run_dir):
            unit = os.path.abspath(record.location(self.run_dir))
            if manifest.removal_of(record, rems) is not None:
                self._known.pop(unit, None)
                continue
            self._known[unit] = record
            self._written.add(unit)
            if record.kind == DIR:
                self._dir_units.add(unit)
            if self._last is None or record.ts >= self._last.ts:
                self._last = record
        for item in manifest.live_suspects(self.run_dir):
            sig = item.signature()
            if sig is not None:
                self._suspected[os.path.abspath(self.run_dir / item.path)] = sig
        for path, how in ckptunits.read_places(self.run_dir).items():
            if os.path.isdir(path) and self._owner(path) is None:
                self._add_watch(Path(path), how, every_file=False)
        for place in list(self._places.values()):
            place.watcher.start()
        self._worker = threading.Thread(target=self._work, name="rgt-custody", daemon=True)
        self._worker.start()
        if self._durable is not None:
            self._queue_missing_copies()
        self.sweep_tick()

    def jobs(self) -> List[PeriodicJob]:
        """Settling and removals (fast), locating, temporary-file ages and missed files (slow),
        staleness (when set)."""
        settle_every = max(0.05, min(1.0, self.config.settle_s / 4))
        out: List[PeriodicJob] = [FunctionJob("custody.settle", settle_every, self.settle_tick),
                                  FunctionJob("custody.locate", self.config.locate_s, self.locate_tick),
                                  FunctionJob("custody.sweep", self.config.sweep_s, self.sweep_tick)]
        if self.config.stale_after_s is not None:
            every = max(1.0, min(60.0, self.config.stale_after_s / 10))
            out.append(FunctionJob("custody.stale", every, self.stale_tick))
        return out

    def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is settling, queued, being hashed or waiting for its durable copy."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._pending or self._handing or self._queue
                                                    or self._busy or self._backlog or self._gone), timeout_s)

    def begin_close(self) -> None:
        """The job exited, so nothing it runs writes any more: look for places and units one last
        time, commit every unit once it is quiet for CLOSING_QUIET_S (no framework's last file, no
        settle time to wait for), and hash unpaced (the job no longer shares the disk)."""
        with self._cond:
            self._closing = True
            self._bucket.rate = None
            self._cond.notify_all()
        self.locate_tick()
        self.sweep_tick()

    def open_units(self, limit: int = 50) -> List[Dict[str, Any]]:
        """The units not done yet, the one being hashed first: each with its state (hashing, queued,
        settling, copying: its durable copy), its bytes and the bytes hashed so far."""
        with self._cond:
            busy, done = self._busy, self._hashed
            items = [(busy, "hashing")] if busy else []
            items += [(u, "queued") for u in self._queue if u != busy]
            items += [(u, "settling") for u in self._pending if u != busy and u not in self._queue]
            items += [(u, "copying") for u in self._backlog if u != busy]
        out: List[Dict[str, Any]] = []
        for unit, state in items[:limit]:
            kind = DIR if os.path.isdir(unit) else FILE
            sig = self._sig(unit, kind)   # the files custody hashes, with their sizes
            size = 0 if sig is None else sum(key[0] for _, key in sig) if kind == DIR else sig[0]
            out.append({"path": self._rec_path(unit), "state": state, "bytes": size,
                        "hashed_bytes": min(done, size) if unit == busy and state == "hashing" else 0})
        return out

    def judge_missing(self, timeout_s: float = 60.0) -> bool:
        """Have every recorded unit with a file missing judged, and wait (at most `timeout_s`) until
        it is: its removal recorded, or found back. A pull manifest asks this before it fails closed
        on a missing checkpoint. A deletion the watcher has not reported yet is taken as reported now,
        so the answer depends on the files, not on how far behind the watcher is."""
        with self._cond:
            now = self._mono()
            for unit, record in self._known.items():
                if unit in self._gone:
                    continue
                files = [os.path.join(unit, f.path) for f in record.files] if record.kind == DIR else [unit]
                if any(not os.path.lexists(f) for f in files):
                    judged = unit in self._pending or unit in self._queue or self._busy == unit
                    self._gone[unit] = (now, judged, self._job_alive())
            waiting = set(self._gone)
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not waiting.intersection(self._gone), timeout_s)

    @property
    def sync_failed(self) -> bool:
        """A durable copy failed at some point of this monitor's life (sticky)."""
        return self._durable is not None and self._durable.failed

    def status(self) -> Dict[str, Any]:
        with self._cond:
            last = self._last
            main = self._places[os.path.abspath(self.ckpt_dir)].watcher
            return {
                "ckpt_dir": str(self.ckpt_dir),
                "observer": main.kind, "observer_reason": main.reason, "observer_alive": main.alive(),
                "places": [{"path": str(p.root), "how": p.how} for p in self._places.values()],
                "refused_places": [{"path": str(p), "how": how} for p, how in self._locator.refused],
                "pending": len(self._pending), "queued": len(self._queue),
                "hashing": self._busy, "hashed_bytes": self._hashed if self._busy else None,
                "durable_backlog": len(self._backlog),
                "last_saved": None if last is None else {"path": last.path, "step": last.step, "ts": last.ts},
                "stale": self._stale, "sync_failed": self.sync_failed,
                "last_sync_error": self._durable.last_error if self._durable else None,
                "counts": dict(self.counts),
            }

    def close(self) -> None:
        """Stop the observers, record the removals already seen (so a pull after the sidecar ended
        does not wait on them forever), then stop the worker (an unfinished hash or copy is abandoned)."""
        for place in list(self._places.values()):
            place.watcher.stop()
        try:
            self._judge_removals(float("inf"))
        except OSError as e:  # a full disk: the deletions stay unrecorded, and the pull fails closed
            log.warning("cannot record removals at close: %s", e)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(10.0)
            self._worker = None

    # ---- places and paths ---------------------------------------------------------------------

    def _add_watch(self, root: Path, how: str, every_file: bool) -> Place:
        key = os.path.abspath(root)
        watcher = CheckpointWatcher(Path(key), lambda c: self._on_change(c, key), self.config.observer,
                                    self.config.poll_interval_s)
        place = Place(Path(key), how, watcher, every_file)
        self._places = {**self._places, key: place}  # replaced whole: watchdog threads read it
        return place

    def _owner(self, path: str) -> Optional[str]:
        """The deepest watched place holding `path`."""
        best: Optional[str] = None
        for root in self._places:
            inside = path == root or path.startswith(root.rstrip("/") + "/")
            if inside and (best is None or len(root) > len(best)):
                best = root
        return best

    def _locate(self, path: str) -> Optional[_Loc]:
        """The unit a file belongs to, or None (outside every place, temporary, or not a checkpoint)."""
        path = os.path.abspath(path)
        root = self._owner(path)
        if root is None or path == root:
            return None
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        if is_temporary(rel):
            return None
        unit_rel, kind = ckptunits.unit_of(rel)
        parts = rel.split("/")
        for i in range(1, len(parts)):
            if os.path.join(root, *parts[:i]) in self._dir_units:
                unit_rel, kind = "/".join(parts[:i]), DIR
                break
        unit = os.path.join(root, unit_rel)
        if kind == FILE and not (self._places[root].every_file or ckptunits.is_weight_name(unit)
                                 or unit in self._explicit):
            return None
        return _Loc(root, unit, kind, rel[len(unit_rel) + 1:] if kind == DIR else "")

    # ---- changes (watchdog's threads) ---------------------------------------------------------

    def _on_change(self, change: Change, root: str) -> None:
        if self._owner(os.path.abspath(change.dest or change.path)) != root and (
                change.kind != MOVED or self._owner(os.path.abspath(change.path)) != root):
            return  # a nested place sees it too; the deeper one handles it
        src = self._locate(change.path)
        commit: Optional[str] = None
        with self._cond:
            if change.kind == MOVED:
                dst = self._locate(change.dest) if change.dest else None
                if src is not None and (dst is None or dst.unit != src.unit):
                    self._vanished(src)
                if dst is not None and dst.kind == FILE:
                    self._pending.pop(dst.unit, None)
                    commit = dst.unit
                    self._handing += 1
                elif dst is not None:
                    renamed = src is None or src.unit != dst.unit
                    self._touch_dir(dst, CLOSED, renamed)
            elif src is None:
                return
            elif change.kind == DELETED:
                self._vanished(src)
            elif src.kind == DIR:
                self._touch_dir(src, change.kind, False)
            else:
                self._file_change(src, change.kind)
        if commit is not None:
            self._commit([(commit, "rename", FILE, self._owner(commit) or "")])

    def _file_change(self, loc: _Loc, kind: str) -> None:
        unit = loc.unit
        polling = self._places[loc.root].watcher.kind == "polling"
        if polling and kind in (CREATED, MODIFIED):
            self._settle(loc, QUIET, "poll")
        elif kind == CREATED:
            self._pending[unit] = Pending(NONEMPTY, "rename", FILE, loc.root, changed=self._mono())
        elif kind == MODIFIED:
            warn = unit in self._written and unit not in self._warned_inplace
            self._settle(loc, CLOSE, "close")
            if warn and not self._recorded(unit, self._sig(unit, FILE)):
                self._warned_inplace.add(unit)
                self._suspect_later(unit, "written_in_place", "written in place (not atomic): "
                                    "more writes after a close-after-write to the same name")
        elif kind == CLOSED:
            self._written.add(unit)
            self._settle(loc, QUIET, "close")

    def _touch_dir(self, loc: _Loc, kind: str, renamed: bool) -> None:
        """A change inside a directory unit (caller holds the lock)."""
        unit, now = loc.unit, self._mono()
        p = self._pending.get(unit)
        polling = self._places[loc.root].watcher.kind == "polling"
        if p is None:
            p = Pending(UNIT, "poll" if polling else "close", DIR, loc.root, changed=now)
            self._pending[unit] = p
            if unit in self._known and unit not in self._warned_inplace and not renamed \
                    and not self._recorded(unit, self._sig(unit, DIR)):
                self._warned_inplace.add(unit)
                self._suspect_later(unit, "written_in_place", "a recorded checkpoint directory is being "
                                    "written again (a rerun saving into the same name?)")
        if renamed:
            p.need, p.via = QUIET, "rename"
        if kind == MODIFIED and not polling:
            p.open.add(loc.sub)
        elif kind in (CLOSED, CREATED) or polling:
            if kind == CLOSED:
                p.open.discard(loc.sub)
            if loc.sub == ckptunits.final_file(os.path.basename(unit)) and (kind == CLOSED or polling):
                p.final_done = True
        p.changed = now
        self._cond.notify_all()

    def _vanished(self, loc: _Loc) -> None:
        """A file of a unit was deleted or moved away (caller holds the lock)."""
        if loc.kind == FILE:
            self._pending.pop(loc.unit, None)
        if loc.unit in self._known and loc.unit not in self._gone:
            judged = loc.unit in self._pending or loc.unit in self._queue or self._busy == loc.unit
            self._gone[loc.unit] = (self._mono(), judged, self._job_alive())
        self._cond.notify_all()

    def _settle(self, loc: _Loc, need: str, via: str) -> None:
        """(Re)start the quiet clock of a file unit (caller holds the lock)."""
        entry = self._pending.get(loc.unit)
        if entry is None:
            self._pending[loc.unit] = Pending(need, via, FILE, loc.root, changed=self._mono())
        else:
            entry.need, entry.via, entry.changed = need, via, self._mono()
        self._cond.notify_all()

    def _suspect_later(self, unit: str, code: str, reason: str) -> None:
        """A suspect found under the lock is emitted by the worker (never from watchdog's thread)."""
        self._notices.append((unit, code, reason))
        self._cond.notify_all()

    def _commit(self, items: List[Tuple[str, str, str, str]]) -> None:
        """Queue the units for hashing. The caller took them off _pending and added one to
        _handing under the same lock, so wait_idle never sees them in neither (the close-out
        would judge the run without them)."""
        fresh: List[Tuple[str, str, str, str]] = []
        try:
            fresh = [item for item in items if not self._recorded(item[0], self._sig(item[0], item[2]))]
        finally:
            with self._cond:
                for unit, via, kind, root in fresh:
                    self._written.add(unit)
                    self._queue.setdefault(unit, (via, kind, root))
                self._handing -= 1
                self._cond.notify_all()
        if not fresh:
            return
        if self._on_commit is not None:
            try:
                self._on_commit(self._mono())
            except Exception:  # a callback boundary
                log.exception("on_commit callback failed")

    # ---- periodic jobs ------------------------------------------------------------------------

    def settle_tick(self) -> None:
        """Commit the pending units that have been quiet long enough; judge removals."""
        with self._cond:
            units = [(u, p.kind) for u, p in self._pending.items()]
        sigs = {unit: self._sig(unit, kind) for unit, kind in units}
        now, c = self._mono(), self.config
        ready: List[Tuple[str, str, str, str]] = []
        with self._cond:
            for unit, sig in sigs.items():
                p = self._pending.get(unit)
                if p is None:
                    continue
                if sig is None:
                    if p.kind == FILE or not os.path.isdir(unit) or now - p.changed >= c.quiet_max_s:
                        del self._pending[unit]
                    continue
                if sig != p.key:
                    p.key, p.changed = sig, now
                    continue
                if p.kind == DIR and not p.final_done and not p.open and unit not in self._known:
                    # its last file is there although no close of it was seen: watchdog replays only
                    # creations for files written before the watch of a new directory was in place
                    final = ckptunits.final_file(os.path.basename(unit))
                    p.final_done = final is not None and any(rel == final for rel, _ in sig)
                if self._due(unit, p, sig, now - p.changed):
                    del self._pending[unit]
                    via = "quiet" if p.need == CLOSE or (p.kind == DIR and p.open) else p.via
                    ready.append((unit, via, p.kind, p.root))
            self._handing += 1 if ready else 0
            self._cond.notify_all()
        if ready:
            self._commit(ready)
        self._judge_removals(now)

    def _due(self, unit: str, p: Pending, sig: Any, quiet: float) -> bool:
        c = self.config
        if quiet >= c.quiet_max_s or (self._closing and quiet >= min(c.settle_s, CLOSING_QUIET_S)):
            return True
        if p.kind == DIR:
            if p.open:
                return False
            if p.final_done and p.need != QUIET:  # the framework's last file is closed: a short quiet
                return quiet >= min(c.settle_s, FINAL_QUIET_S)
            if p.need == QUIET:
                return quiet >= c.settle_s
            return ckptunits.final_file(os.path.basename(unit)) is None and quiet >= c.unit_settle_s
        if p.need == CLOSE:
            return False
        if p.need == NONEMPTY:
            return quiet >= c.settle_s and sig[0] > 0
        return quiet >= c.settle_s

    # ---- locating -----------------------------------------------------------------------------

    def locate_tick(self) -> None:
        """Watch the new places the job writes to; commit the units its hints name."""
        with self._locate_lock:
            self._locate_places()

    def _locate_places(self) -> None:
        found = self._locator.tick([p.root for p in self._places.values()])
        hinted, self._locator.hinted = self._locator.hinted, []
        with self._cond:
            self._explicit |= self._locator.open_files
            self._dir_units |= {os.path.abspath(h["path"]) for h in hinted if os.path.isdir(h["path"])}
        for path, how in found:
            self._add_place(path, how)
        for path, how in self._locator.refused[self._refused_seen:]:
            self._emit("ckpt.location", {"path": str(path), "how": how, "watched": False,
                                         "reason": "too broad to watch (/, home, or above the run dir); "
                                                   "checkpoints there are named by the gate"}, "warn")
        self._refused_seen = len(self._locator.refused)
        for hint in hinted:
            self._take_hint(hint["path"])

    def _add_place(self, path: Path, how: str) -> None:
        key = os.path.abspath(path)
        if not os.path.isdir(key) or self._owner(key) is not None:
            return
        place = self._add_watch(Path(key), how, every_file=False)
        try:
            place.watcher.start()
        except OSError as e:
            self._places = {k: v for k, v in self._places.items() if k != key}
            self._emit("ckpt.location", {"path": key, "how": how, "watched": False, "reason": str(e)[:300]},
                       "warn")
            return
        self._save_places()
        inside = not os.path.relpath(key, self.run_dir).startswith("..")
        data: Dict[str, Any] = {"path": key, "how": how, "watched": True, "in_run_dir": inside}
        if not inside:
            data["pull_path"] = ckptunits.ensure_link(self.run_dir, key)
        self.counts["locations"] += 1
        self._emit("ckpt.location", data, None)
        self._sweep_place(place)

    def _save_places(self) -> None:
        places = [{"path": str(p.root), "how": p.how} for p in self._places.values() if not p.every_file]
        write_atomic(ckptunits.places_file(self.run_dir), json.dumps({"v": 1, "places": places}) + "\n")

    def _take_hint(self, path: str) -> None:
        """A framework said it finished saving `path`: commit that unit now."""
        path = os.path.abspath(path)
        root = self._owner(path)
        if root is None or path == root:
            return
        if os.path.isdir(path):
            with self._cond:
                self._dir_units.add(path)
                self._pending.pop(path, None)
                self._handing += 1
            self._commit([(path, "hint", DIR, root)])
            return
        with self._cond:
            self._explicit.add(path)
        loc = self._locate(path)
        if loc is not None:
            with self._cond:
                self._pending.pop(loc.unit, None)
                self._handing += 1
            self._commit([(loc.unit, "hint", loc.kind, loc.root)])

    # ---- sweeps and staleness -----------------------------------------------------------------

    def sweep_tick(self) -> None:
        """Walk every place: report temporary files left too long; settle unrecorded units."""
        for place in list(self._places.values()):
            self._sweep_place(place)

    def _sweep_place(self, place: Place) -> None:
        now, root = self._clock(), str(place.root)
        seen_tmp: Set[Tuple[str, int]] = set()
        files: Dict[str, Tuple[Key, str]] = {}
        dirs: Dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(root):
            for name in list(dirnames) + filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path, follow_symlinks=False)
                except OSError:
                    continue
                if is_temporary(name):
                    if name in dirnames:
                        dirnames.remove(name)
                    seen_tmp.add((path, st.st_ino))
                    self._check_tmp_age(path, st, now)
                elif stat.S_ISREG(st.st_mode):
                    loc = self._locate(path)
                    if loc is not None and loc.root == root:
                        if loc.kind == FILE:
                            files[loc.unit] = (stat_key(st), root)
                        else:
                            dirs[loc.unit] = root
        dir_sigs = {unit: self._sig(unit, DIR) for unit in dirs}
        with self._cond:
            self._warned_tmp = {w for w in self._warned_tmp if not w[0].startswith(root + "/")} | \
                (self._warned_tmp & seen_tmp)
            mono = self._mono()
            for unit, (key, r) in files.items():
                if not self._busy_with(unit, key):
                    self._pending[unit] = Pending(QUIET, "scan", FILE, r, key, mono)
            for unit, r in dirs.items():
                sig = dir_sigs[unit]
                if sig is not None and not self._busy_with(unit, sig):
                    final = ckptunits.final_file(os.path.basename(unit))
                    p = self._pending[unit] = Pending(UNIT, "scan", DIR, r, sig, mono)
                    p.final_done = final is not None and any(rel == final for rel, _ in sig)
            self._cond.notify_all()

    def _busy_with(self, unit: str, sig: Any) -> bool:
        """Recorded as it is, already reported as it is, or on its way (caller holds the lock)."""
        return (self._recorded(unit, sig) or self._suspected.get(unit) == sig or unit in self._pending
                or unit in self._queue or unit == self._busy)

    def _check_tmp_age(self, path: str, st: os.stat_result, now: float) -> None:
        newest = st.st_mtime
        if stat.S_ISDIR(st.st_mode):
            for dirpath, _, filenames in os.walk(path):
                for name in filenames:
                    try:
                        newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
                    except OSError:
                        continue
        age = now - newest
        if age < self.config.tmp_max_age_s or (path, st.st_ino) in self._warned_tmp:
            return
        self._warned_tmp.add((path, st.st_ino))
        what = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        reason = f"temporary {what} left unchanged for {age:.0f}s (over {self.config.tmp_max_age_s:.0f}s)"
        self._suspect(path, "tmp_left", reason + ": an interrupted save?", None, age_s=round(age, 1))

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


__all__ = ["CustodyConfig", "CustodyMonitor"]
