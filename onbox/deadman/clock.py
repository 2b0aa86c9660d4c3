"""What the dead-man counts as time passing: clocks a wall-clock step cannot move, and changes it saw.

The box's wall clock is not to be trusted: NTP, a person or a broken RTC can step it hours either
way, and a dead-man that compared unix seconds once stopped a training run after a 3 h step forward.
So every duration the dead-man judges is measured on the boot clock (`Clocks.boot`: CLOCK_BOOTTIME,
which counts suspend; CLOCK_MONOTONIC where the platform lacks it) and every sign of work is a file
change the daemon saw with its own eyes. Unix seconds stay in the lease, the records and the Renew
reply, for people; they never fire anything.

The lease (onbox/deadman/lease.py) carries boot-time stamps of its own: `renewed_boottime` (when it was
armed or renewed), `budget_boottime` (when its hard budget started) and `boot_id`, the boot they were
taken in (/proc/sys/kernel/random/boot_id, "+monotonic" appended when the fallback clock took them).
Whoever writes the lease stamps it, so a renewal by another process (a sidecar answering the
controller's Renew, `rgt-onbox deadman renew`) is exact to the daemon that reads it.

Firing later is the safe direction (the run keeps its box; at worst it bills a little longer);
firing sooner can kill a run that trains. Each case leans that way:

- a stamp of this boot, not in its future: exact, so the daemon fires at most one tick after the
  lease's real end, whatever the wall clock did;
- no stamp, a stamp of another boot (the count restarted at the reboot, so an old value would read
  as far in the past, or the future), a stamp in this boot's future, or no boot id at all (a
  platform without one): not trusted; that period counts from when this daemon first saw it;
- `arm` and `renew` re-stamp a kept budget whose stamp is of another boot with their own now;
- a run's files: their mtimes were made by the wall clock and mean nothing; the daemon keeps each
  file's (mtime_ns, size, inode) and when it saw that change; a file it sees for the first time
  counts as changed now, so a restarted daemon waits a whole idle window before it calls a run idle;
- an authorization voids itself on any checkpoint newer than it by the wall clock, or recorded
  after it by position in the run's custody manifest (append-only): both, so a step back of the
  wall clock cannot make an unpulled checkpoint look older than the person's yes.

Standard library only; Python 3.9+.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from onbox.custody import manifest

if TYPE_CHECKING:
    from onbox.deadman.lease import Lease

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
Signature = Tuple[int, int, int]      # (mtime_ns, size, inode)
_chosen: Dict[str, Any] = {}          # the process's boot clock and boot id, found on first use


def _boot_clock() -> Tuple[int, str]:
    """(clock id, suffix of the boot id): CLOCK_BOOTTIME where it works, else CLOCK_MONOTONIC."""
    if "clock" not in _chosen:
        clock, suffix = time.CLOCK_MONOTONIC, "+monotonic"
        boottime = getattr(time, "CLOCK_BOOTTIME", None)
        if boottime is not None:
            try:
                time.clock_gettime(boottime)
                clock, suffix = boottime, ""
            except OSError:
                pass
        _chosen["clock"] = (clock, suffix)
    found: Tuple[int, str] = _chosen["clock"]
    return found


def read_boot_id(path: Path = BOOT_ID_FILE) -> Optional[str]:
    """This boot's id with the boot clock's suffix; None where the kernel gives none."""
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    return f"{raw}{_boot_clock()[1]}" if raw else None


class Clocks:
    """wall(): unix seconds, for people and records; boot(): seconds that no wall-clock step moves;
    boot_id(): the boot that boot() counts from (None: unknown, so no stamp is trusted). Tests
    subclass it to step either clock without touching the system's."""

    def wall(self) -> float:
        return time.time()

    def boot(self) -> float:
        return time.clock_gettime(_boot_clock()[0])

    def boot_id(self) -> Optional[str]:
        if "boot_id" not in _chosen:
            _chosen["boot_id"] = read_boot_id()
        found: Optional[str] = _chosen["boot_id"]
        return found


SYSTEM = Clocks()


class Timebase:
    """The daemon's time: boot seconds, or under the RGT_DEADMAN_TIMESCALE=K test hook boot
    seconds that run K times faster from the daemon's start. `frame(b)` maps a boot stamp into it."""

    def __init__(self, clocks: Optional[Clocks] = None, scale: float = 1.0) -> None:
        self.clocks = clocks or SYSTEM
        self.scale = scale
        self.start = self.clocks.boot()

    def frame(self, boot: float) -> float:
        return boot if self.scale == 1.0 else self.start + self.scale * (boot - self.start)

    def now(self) -> float:
        return self.frame(self.clocks.boot())

    def wall(self) -> float:
        return self.clocks.wall()


def stamp_of(value: Any) -> Optional[float]:
    """A boot-time stamp as read from a file: a finite number >= 0, else None (not trusted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value == value:
        return None
    return float(value) if 0 <= value < float("inf") else None


def trusted(lease: Lease, clocks: Clocks) -> bool:
    """The lease's boot-time stamps were taken in this boot, on this clock."""
    here = clocks.boot_id()
    return here is not None and lease.boot_id == here


def restamp_budget(lease: Lease, clocks: Clocks) -> Optional[float]:
    """The budget's start for a lease about to be stamped with this boot: its stamp when it is of
    this boot and not in its future, else this boot's now (later, never sooner)."""
    if lease.max_hours is None or lease.budget_started_at is None:
        return None
    now = clocks.boot()
    kept = lease.budget_boottime if trusted(lease, clocks) else None
    return kept if kept is not None and kept <= now else now


def seconds_left(lease: Lease, wall_now: float, clocks: Clocks) -> float:
    """What the lease has left for a one-shot reader: by its boot stamp when trusted, else by
    its unix times (for a person only: the daemon never judges that way)."""
    if trusted(lease, clocks) and lease.renewed_boottime is not None:
        return lease.renewed_boottime + lease.ttl_s - clocks.boot()
    return lease.expires_at - wall_now


@dataclasses.dataclass(frozen=True)
class Anchors:
    """When the lease period and the budget started, in the daemon's time."""

    lease_start: float
    budget_start: Optional[float] = None


class LeaseTimer:
    """Places the lease's periods in the daemon's time (see the module doc for the cases)."""

    def __init__(self, base: Timebase) -> None:
        self.base = base
        self._first: Dict[Tuple[Any, ...], float] = {}  # a period it could not place -> first seen

    def anchors(self, lease: Lease, now: float) -> Anchors:
        ok = trusted(lease, self.base.clocks)
        keys: List[Tuple[Any, ...]] = [("lease", lease.renewed_at, lease.renewed_boottime)]
        start = self._start(keys[0], lease.renewed_boottime if ok else None, now)
        budget = None
        if lease.max_hours is not None and lease.budget_started_at is not None:
            keys.append(("budget", lease.budget_started_at))
            budget = self._start(keys[1], lease.budget_boottime if ok else None, now)
        self._first = {k: v for k, v in self._first.items() if k in keys}
        return Anchors(start, budget)

    def _start(self, key: Tuple[Any, ...], stamp: Optional[float], now: float) -> float:
        if stamp is not None:
            at = self.base.frame(stamp)
            if at <= now:
                return at
        return self._first.setdefault(key, now)


class Activity:
    """The files the daemon watches: path -> (their signature, when it saw that signature first)."""

    def __init__(self) -> None:
        self._seen: Dict[str, Tuple[Signature, float]] = {}

    def last_change(self, paths: Sequence[str], now: float,
                    stat: Callable[[str], os.stat_result] = os.stat) -> Optional[float]:
        """When any of `paths` last changed as far as this daemon saw (now for a first sight);
        None when none of them exists."""
        newest: Optional[float] = None
        for path in paths:
            try:
                st = stat(path)
            except OSError:
                self._seen.pop(path, None)
                continue
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
            old = self._seen.get(path)
            at = old[1] if old is not None and old[0] == sig else now
            self._seen[path] = (sig, at)
            newest = at if newest is None else max(newest, at)
        return newest

    def keep_only(self, paths: Collection[str]) -> None:
        """Forget the files of runs that are gone (the map stays as small as the roster)."""
        self._seen = {p: v for p, v in self._seen.items() if p in paths}


def newest_mtime(paths: Sequence[str], stat: Callable[[str], os.stat_result] = os.stat) -> Optional[float]:
    """The newest unix mtime of `paths`: a one-shot reading for a person, never what fires."""
    newest: Optional[float] = None
    for path in paths:
        try:
            mtime = stat(path).st_mtime
        except OSError:
            continue
        newest = mtime if newest is None else max(newest, mtime)
    return newest


def manifest_counts(run_dirs: Sequence[str]) -> Dict[str, int]:
    """How many custody records each run has now, by run id: what an authorization covers."""
    return {Path(d).name: len(manifest.read(Path(d))) for d in run_dirs}


def newer_checkpoints(run_dirs: Sequence[str], since: float,
                      covered: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Custody-recorded checkpoints an authorization at `since` did not cover (they void it): newer
    by the wall clock, or past the record count it saw (see the module doc). An authorization
    without counts covers only by the wall clock (older files)."""
    out = []
    for d in run_dirs:
        seen = covered.get(Path(d).name, 0) if covered is not None else None
        count = seen if isinstance(seen, int) and not isinstance(seen, bool) else 0
        for i, r in enumerate(manifest.read(Path(d))):
            if r.ts > since or (covered is not None and i >= count):
                out.append(f"{Path(d).name}/{r.path}")
    return out


__all__ = ["SYSTEM", "Activity", "Anchors", "Clocks", "LeaseTimer", "Timebase", "manifest_counts",
           "newer_checkpoints", "newest_mtime", "read_boot_id", "restamp_budget", "seconds_left", "stamp_of",
           "trusted"]
