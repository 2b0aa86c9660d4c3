"""The box's dead-man lease: its file, its event log, and what to do at each tick.

One lease per box, in the home directory of the user who runs the jobs:

    ~/.rgt/deadman.json          the lease (0600, in a 0700 directory; tmp + fsync + rename,
                                 read-modify-write under ~/.rgt/deadman.update.lock)
    ~/.rgt/deadman.events.jsonl  the dead-man's own log: one fsync'd JSON line per record
                                 {"seq", "ts", "kind", "sev", "data"}; sidecars relay it
    ~/.rgt/deadman.lock          held (flock) by the one running daemon (onbox/deadman/daemon.py)
    ~/.rgt/deadman.pid           that daemon's pid and start time
    ~/.rgt/DEADMAN_FIRED.txt     what happened, for a person who logs in after it fired

The lease: {"v": 1, "armed", "ttl_s", "idle_s", "renewed_at", "expires_at", "renewed_by"
(launch | controller | cli), "max_hours", "budget_started_at", "roots" (runs roots seen by
launches), "profile", "authorized" (null or {"action", "instance_id", "at", "by", "covered": the
custody record count of each run then}), "fired" (null or {"at", "boottime", "action", "argv",
"state": firing | done | failed, "exit_code"}), "renewed_boottime", "budget_boottime", "boot_id"}.
The times without "boottime" are unix seconds, for people; the boot-time stamps and the boot they
belong to are what the daemon judges by (onbox/deadman/clock.py: a wall-clock step either way never
fires it). A file that cannot be read is reported and read the safest way (`read_lease`): armed,
the default TTL (counted from when the daemon first saw it), no profile (so the action is notify),
nothing authorized, and a malformed "fired" counts as fired. Nothing here raises for a bad file.

`decide(lease, runs, now, anchors)` is a pure function of the lease, the runs' activity and the
time: no lease, not armed or already fired -> nothing; the hard budget spent -> fire; the lease
expired -> fire, unless a run makes progress (its job runs and its metrics, train.log or checkpoint
directory changed within idle_s) -> held; within 30 min (then 5 min) of either end -> a warning that
the daemon says once per lease period. The daemon passes its own time and `Anchors` (where the
period and the budget started in it) and runs whose activity it observed; without anchors the
lease's unix times are used, a one-shot reading for a person (`rgt-onbox deadman status`).

Standard library only; Python 3.9+.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from profiles import NOTIFY
from protocol.kinds import default_sev
from rgtlib import lockfile

from onbox.deadman import clock
from onbox.deadman.clock import SYSTEM, Activity, Anchors, Clocks
from onbox.fsutil import write_atomic
from onbox.runs import default_root, list_runs, read_json

VERSION = 1
DEFAULT_TTL_S = 2 * 3600.0
DEFAULT_IDLE_S = 30 * 60.0
WARN_30_S = 30 * 60.0
WARN_5_S = 5 * 60.0
RENEWERS = ("launch", "controller", "cli")
INSTANCE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_TAIL_BYTES = 8 << 10

class DeadmanError(ValueError):
    """A dead-man request that cannot be done (the message says why)."""


# ---- places -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeadmanPaths:
    """The dead-man's files under one ~/.rgt."""

    dir: Path

    @property
    def lease(self) -> Path:
        return self.dir / "deadman.json"

    @property
    def update_lock(self) -> Path:
        return self.dir / "deadman.update.lock"

    @property
    def lock(self) -> Path:
        return self.dir / "deadman.lock"

    @property
    def pid(self) -> Path:
        return self.dir / "deadman.pid"

    @property
    def events(self) -> Path:
        return self.dir / "deadman.events.jsonl"

    @property
    def fired_txt(self) -> Path:
        return self.dir / "DEADMAN_FIRED.txt"

    @property
    def log(self) -> Path:
        return self.dir / "deadman.log"

    def ensure_dir(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)


def paths_for(environ: Optional[Mapping[str, str]] = None) -> DeadmanPaths:
    """$HOME/.rgt (HOME from `environ`), like the box's secrets (onbox/launch/secrets.py)."""
    env = os.environ if environ is None else environ
    home = env.get("HOME") or os.path.expanduser("~")
    return DeadmanPaths(Path(home) / ".rgt")


# ---- the lease ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Lease:
    armed: bool = True
    ttl_s: float = DEFAULT_TTL_S
    idle_s: float = DEFAULT_IDLE_S
    renewed_at: float = 0.0
    expires_at: float = 0.0
    renewed_by: str = "launch"
    max_hours: Optional[float] = None
    budget_started_at: Optional[float] = None
    roots: List[str] = dataclasses.field(default_factory=list)
    profile: Optional[str] = None
    authorized: Optional[Dict[str, Any]] = None
    fired: Optional[Dict[str, Any]] = None
    renewed_boottime: Optional[float] = None   # onbox/deadman/clock.py: what the daemon judges by
    budget_boottime: Optional[float] = None
    boot_id: Optional[str] = None

    def to_doc(self) -> Dict[str, Any]:
        return {"v": VERSION, **dataclasses.asdict(self)}

    @property
    def state(self) -> str:
        """armed | fired | disarmed (protocol.kinds.DEADMAN_STATES, less absent and unreadable)."""
        if self.fired is not None:
            return "fired"
        return "armed" if self.armed else "disarmed"


@dataclasses.dataclass(frozen=True)
class LeaseRead:
    lease: Optional[Lease]          # None: no lease file
    problem: Optional[str] = None   # what was wrong with the file (then `lease` is the safest reading)

    @property
    def state(self) -> str:
        if self.lease is None:
            return "absent"
        return "unreadable" if self.problem and self.lease.state == "armed" else self.lease.state


def _number(value: Any, positive: bool = True) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if (value > 0 or not positive) else None


def _parse(doc: Mapping[str, Any], mtime: float, problems: List[str]) -> Lease:
    """The lease from its JSON object; a bad field falls back to its safest value and is noted."""
    def bad(name: str) -> None:
        problems.append(f"field {name!r} is malformed")

    lease = Lease(renewed_at=mtime, roots=[])
    armed = doc.get("armed")
    lease.armed = armed if isinstance(armed, bool) else True
    if not isinstance(armed, bool):
        bad("armed")
    for name in ("ttl_s", "idle_s"):
        value = _number(doc.get(name))
        if value is None:
            bad(name)
        else:
            setattr(lease, name, value)
    renewed = _number(doc.get("renewed_at"), positive=False)
    if renewed is None:
        bad("renewed_at")
    lease.renewed_at = mtime if renewed is None else renewed
    expires = _number(doc.get("expires_at"), positive=False)
    lease.expires_at = lease.renewed_at + lease.ttl_s if expires is None else expires
    by = doc.get("renewed_by")
    lease.renewed_by = by if by in RENEWERS else "cli"
    if doc.get("max_hours") is not None:
        lease.max_hours = _number(doc.get("max_hours"))
        started = _number(doc.get("budget_started_at"), positive=False)
        lease.budget_started_at = lease.renewed_at if started is None else started
        if lease.max_hours is None or started is None:
            bad("max_hours")
    roots = doc.get("roots")
    lease.roots = [r for r in roots if isinstance(r, str)] if isinstance(roots, list) else []
    profile = doc.get("profile")
    lease.profile = profile if isinstance(profile, str) and profile else None
    lease.authorized = _authorized(doc.get("authorized"), bad)
    lease.fired = _fired(doc.get("fired"), mtime, bad)
    # Missing or malformed boot stamps are not trusted: the daemon counts from when it saw them.
    lease.renewed_boottime = clock.stamp_of(doc.get("renewed_boottime"))
    if lease.max_hours is not None:
        lease.budget_boottime = clock.stamp_of(doc.get("budget_boottime"))
    boot = doc.get("boot_id")
    lease.boot_id = boot if isinstance(boot, str) and boot else None
    return lease


def _authorized(value: Any, bad: Callable[[str], None]) -> Optional[Dict[str, Any]]:
    if value is None:
        return None
    if (isinstance(value, dict) and isinstance(value.get("action"), str)
            and isinstance(value.get("instance_id"), str) and _number(value.get("at")) is not None):
        return dict(value)
    bad("authorized")  # safest: nothing is authorized
    return None


def _fired(value: Any, mtime: float, bad: Callable[[str], None]) -> Optional[Dict[str, Any]]:
    if value is None:
        return None
    if isinstance(value, dict) and value.get("state") in ("firing", "done", "failed"):
        return dict(value)
    bad("fired")  # safest: it fired (the action runs at most once)
    return {"at": mtime, "action": "unknown", "argv": [], "state": "failed", "exit_code": None}


def read_lease(paths: DeadmanPaths, environ: Optional[Mapping[str, str]] = None) -> LeaseRead:
    """The lease, None when there is none, or the safest reading of a file that is not usable."""
    try:
        raw = paths.lease.read_bytes()
        mtime = paths.lease.stat().st_mtime
    except FileNotFoundError:
        return LeaseRead(None)
    except OSError as e:
        return LeaseRead(_safest(0.0, environ), f"{paths.lease} cannot be read: {e.strerror or e}")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        return LeaseRead(_safest(mtime, environ), f"{paths.lease} is not valid JSON ({e}); "
                         "read as armed with the default TTL from its mtime, action notify")
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        return LeaseRead(_safest(mtime, environ), f"{paths.lease} is not a version {VERSION} lease; "
                         "read as armed with the default TTL from its mtime, action notify")
    problems: List[str] = []
    lease = _parse(doc, mtime, problems)
    if not lease.roots:
        lease.roots = [str(default_root(dict(environ or os.environ)))]
    return LeaseRead(lease, f"{paths.lease}: " + "; ".join(problems) if problems else None)


def _safest(mtime: float, environ: Optional[Mapping[str, str]]) -> Lease:
    return Lease(armed=True, renewed_at=mtime, expires_at=mtime + DEFAULT_TTL_S, renewed_by="cli",
                 roots=[str(default_root(dict(environ or os.environ)))])


def _write(paths: DeadmanPaths, lease: Lease) -> None:
    paths.ensure_dir()
    write_atomic(paths.lease, json.dumps(lease.to_doc(), indent=1, sort_keys=True) + "\n", mode=0o600)
    os.chmod(paths.lease, 0o600)


def update_lease(paths: DeadmanPaths, change: Callable[[LeaseRead], Optional[Lease]],
                 environ: Optional[Mapping[str, str]] = None) -> Tuple[LeaseRead, Optional[Lease]]:
    """Read, change and write the lease under the update lock. `change` returns the new lease, or
    None to leave the file as it is. Returns (what was read, what was written or None)."""
    paths.ensure_dir()
    with lockfile.hold(paths.update_lock):  # blocking: holders keep it for ms
        before = read_lease(paths, environ)
        after = change(before)
        if after is not None:
            _write(paths, after)
    return before, after


# ---- changing the lease -------------------------------------------------------------------------


def _stamped(lease: Lease, clocks: Clocks) -> Lease:
    """The lease renewed now on the boot clock, its kept budget re-stamped for this boot."""
    return dataclasses.replace(lease, renewed_boottime=clocks.boot(), boot_id=clocks.boot_id(),
                               budget_boottime=clock.restamp_budget(lease, clocks))


def arm(paths: DeadmanPaths, *, ttl_s: float, now: float, by: str = "cli", idle_s: Optional[float] = None,
        max_hours: Optional[float] = None, profile: Optional[str] = None, root: Optional[str] = None,
        environ: Optional[Mapping[str, str]] = None, clocks: Clocks = SYSTEM) -> Lease:
    """Arm (or re-arm) the lease from `now` (unix seconds, for people; the boot clock of `clocks`
    stamps it for the daemon). A fired lease starts a new period; an armed one keeps its roots,
    profile (unless one is given), authorization and running budget."""
    _check_ttl(ttl_s)

    def change(read: LeaseRead) -> Lease:
        old = read.lease if read.lease is not None and not read.problem else None
        live = old is not None and old.armed and old.fired is None
        lease = Lease(armed=True, ttl_s=ttl_s, idle_s=idle_s or (old.idle_s if old else DEFAULT_IDLE_S),
                      renewed_at=now, expires_at=now + ttl_s, renewed_by=by,
                      # a root that is gone holds no run to wait for: keep the list short
                      roots=[r for r in old.roots if os.path.isdir(r)] if old else [],
                      profile=profile or (old.profile if old else None),
                      authorized=old.authorized if live and old else None)
        if root and root not in lease.roots:
            lease.roots.append(root)
        if max_hours is not None:
            keep = live and old is not None and old.budget_started_at is not None
            lease.max_hours = max_hours
            lease.budget_started_at = old.budget_started_at if keep and old else now
            if keep and old is not None:
                lease.budget_boottime, lease.boot_id = old.budget_boottime, old.boot_id
        elif live and old is not None:
            lease.max_hours, lease.budget_started_at = old.max_hours, old.budget_started_at
            lease.budget_boottime, lease.boot_id = old.budget_boottime, old.boot_id
        return _stamped(lease, clocks)

    _, lease = update_lease(paths, change, environ)
    assert lease is not None
    append_event(paths, "deadman.armed", {
        "ttl_s": lease.ttl_s, "idle_s": lease.idle_s, "max_hours": lease.max_hours, "by": by,
        "expires_at": lease.expires_at, "profile": lease.profile, "roots": lease.roots}, now=now)
    return lease


def _check_ttl(ttl_s: Optional[float]) -> None:
    if ttl_s is not None and not (math.isfinite(ttl_s) and ttl_s > 0):
        raise DeadmanError(f"a TTL must be a positive number of seconds, not {ttl_s!r}")


def renew(paths: DeadmanPaths, *, now: float, by: str, ttl_s: Optional[float] = None,
          environ: Optional[Mapping[str, str]] = None, clocks: Clocks = SYSTEM) -> LeaseRead:
    """Renew an armed lease from `now` (unix seconds, for people; stamped on the boot clock for the
    daemon); a lease that is absent, disarmed or fired stays as it is. The record `deadman.renewed`
    is written only when it says something: a renewal by someone else than the controller's steady
    one, a new TTL, or one that came late (warned or expired)."""
    _check_ttl(ttl_s)
    said: Dict[str, Any] = {}

    def change(read: LeaseRead) -> Optional[Lease]:
        lease = read.lease
        if lease is None or not lease.armed or lease.fired is not None:
            return None
        ttl = ttl_s or lease.ttl_s
        left = clock.seconds_left(lease, now, clocks)
        late = left <= WARN_30_S
        if by != "controller" or lease.renewed_by != by or ttl != lease.ttl_s or late or read.problem:
            said.update(by=by, ttl_s=ttl, late=late, left_s=round(left, 1))
        return _stamped(dataclasses.replace(lease, renewed_at=now, expires_at=now + ttl, ttl_s=ttl,
                                            renewed_by=by), clocks)

    _, written = update_lease(paths, change, environ)
    if written is not None and said:
        append_event(paths, "deadman.renewed", {**said, "expires_at": written.expires_at}, now=now)
    return read_lease(paths, environ)


def disarm(paths: DeadmanPaths, *, now: float, by: str = "cli",
           environ: Optional[Mapping[str, str]] = None) -> LeaseRead:
    def change(read: LeaseRead) -> Optional[Lease]:
        if read.lease is None or not read.lease.armed:
            return None
        return dataclasses.replace(read.lease, armed=False, renewed_at=now, renewed_by=by)

    _, written = update_lease(paths, change, environ)
    if written is not None:
        append_event(paths, "deadman.disarmed", {"by": by}, now=now)
    return read_lease(paths, environ)


def authorize(paths: DeadmanPaths, *, action: str, instance_id: str, allowed: Sequence[str], now: float,
              by: str = "cli", environ: Optional[Mapping[str, str]] = None) -> Lease:
    """Pre-authorize one of the profile's `allow` actions for this box (DeadmanError otherwise)."""
    if action not in allowed:
        raise DeadmanError(f"{action!r} is not an action this box's profile lets a person pre-authorize "
                           f"(allowed: {', '.join(allowed) or 'none'})")
    if not INSTANCE_ID.match(instance_id):
        raise DeadmanError(f"instance id {instance_id[:40]!r} must be 1-128 of A-Z a-z 0-9 . _ : -")

    def change(read: LeaseRead) -> Lease:
        if read.lease is None or read.problem or not read.lease.armed or read.lease.fired is not None:
            raise DeadmanError(f"no usable armed lease to authorize on (state {read.state})")
        # What the person's yes covers: the checkpoints recorded now (not judged by the wall clock).
        runs = [s.run_dir for root in read.lease.roots for s in list_runs(Path(root), full=False)]
        covered = clock.manifest_counts(runs)
        return dataclasses.replace(read.lease, authorized={"action": action, "instance_id": instance_id,
                                                           "at": now, "by": by, "covered": covered})

    _, lease = update_lease(paths, change, environ)
    assert lease is not None
    append_event(paths, "deadman.authorized", {"action": action, "by": by}, now=now)
    return lease


# ---- the event log ------------------------------------------------------------------------------


def _last_seq(fd: int) -> int:
    size = os.fstat(fd).st_size
    tail = os.pread(fd, min(size, _TAIL_BYTES), max(0, size - _TAIL_BYTES))
    for line in reversed(tail.split(b"\n")):
        try:
            seq = json.loads(line).get("seq")
        except (ValueError, AttributeError):
            continue
        if isinstance(seq, int):
            return seq
    return 0


def append_event(paths: DeadmanPaths, kind: str, data: Mapping[str, Any], *, now: float,
                 sev: Optional[str] = None) -> Dict[str, Any]:
    """Append one record (next seq, under an flock of the log) and fsync it before returning."""
    paths.ensure_dir()
    with lockfile.hold(paths.events, append=True) as fd:
        record = {"seq": _last_seq(fd) + 1, "ts": now, "kind": kind, "sev": sev or default_sev(kind),
                  "data": dict(data)}
        os.write(fd, (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode())
        os.fsync(fd)
    return record


def iter_records(raw: bytes) -> Iterator[Dict[str, Any]]:
    """The well-formed records of log bytes; a torn or foreign line is skipped."""
    for line in raw.split(b"\n"):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (isinstance(record, dict) and isinstance(record.get("seq"), int)
                and isinstance(record.get("kind"), str) and isinstance(record.get("data"), dict)):
            yield record


def read_events(paths: DeadmanPaths, since: int = 0) -> List[Dict[str, Any]]:
    try:
        raw = paths.events.read_bytes()
    except FileNotFoundError:
        return []
    return [r for r in iter_records(raw) if r["seq"] > since]


def fired_since_armed(records: Sequence[Mapping[str, Any]]) -> bool:
    """The log shows a firing after the newest arming: the action must not run again."""
    last_armed = max((r["seq"] for r in records if r["kind"] == "deadman.armed"), default=0)
    return any(r["seq"] > last_armed and r["kind"] in ("deadman.firing", "deadman.fired") for r in records)


# ---- runs and the decision ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunActivity:
    run_id: str
    run_dir: str
    state: str                        # onbox.runs.RunStatus.state
    last_activity: Optional[float]    # when metrics, train.log or the checkpoint dir last changed
    ckpt_dir: str = ""

    def progressing(self, now: float, idle_s: float) -> bool:
        last = self.last_activity
        return self.state == "running" and last is not None and now - last < idle_s


def collect_runs(roots: Sequence[str], activity: Optional[Activity] = None, now: float = 0.0,
                 stat: Callable[[str], os.stat_result] = os.stat) -> List[RunActivity]:
    """Every run under the roots (each once) with its newest sign of work: with `activity` (the
    daemon's), when it saw the run's files change, in the time of `now`; without, their newest unix
    mtime (a one-shot reading for a person, never what fires)."""
    out: Dict[str, RunActivity] = {}
    watched: List[str] = []
    for root in roots:
        for status in list_runs(Path(root), full=False):  # each tick: the job's state is enough
            run_dir = Path(status.run_dir)
            if str(run_dir) in out:
                continue
            meta = read_json(run_dir / "run.json") or {}
            metrics = meta.get("metrics") if isinstance(meta.get("metrics"), str) else None
            ckpt = meta.get("ckpt_dir") if isinstance(meta.get("ckpt_dir"), str) else None
            ckpt_dir = ckpt or str(run_dir / "checkpoints")
            files = [metrics or str(run_dir / "metrics.jsonl"), str(run_dir / "train.log"), ckpt_dir]
            watched += files
            newest = (activity.last_change(files, now, stat) if activity is not None
                      else clock.newest_mtime(files, stat))
            out[str(run_dir)] = RunActivity(status.run_id, str(run_dir), status.state, newest, ckpt_dir)
    if activity is not None:
        activity.keep_only(set(watched))
    return list(out.values())


@dataclasses.dataclass(frozen=True)
class Due:
    """A warning that is due: said once per (trigger, period, minutes_left)."""

    trigger: str          # lease | budget
    period: str           # the lease period (its renewal) or the budget it belongs to
    minutes_left: int     # 30 or 5
    seconds_left: float

    @property
    def key(self) -> str:
        return f"deadman.expiring:{self.period}:{self.minutes_left}"


@dataclasses.dataclass(frozen=True)
class Decision:
    verdict: str                       # absent | disarmed | fired | armed | held | fire
    reason: str
    trigger: str = ""                  # what fires or holds: lease | budget
    period: str = ""
    seconds_left: Optional[float] = None          # until the lease expires (negative: expired)
    budget_seconds_left: Optional[float] = None
    progressing: Tuple[str, ...] = ()
    warnings: Tuple[Due, ...] = ()

    @property
    def key(self) -> str:
        """What a held verdict is said once for."""
        return f"deadman.held:{self.period}"

    def to_dict(self) -> Dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["warnings"] = [dataclasses.asdict(w) for w in self.warnings]
        return doc


def _due(trigger: str, period: str, left: float) -> Optional[Due]:
    if left <= 0 or left > WARN_30_S:
        return None
    return Due(trigger, period, 30 if left > WARN_5_S else 5, left)


def decide(lease: Optional[Lease], runs: Sequence[RunActivity], now: float,
           anchors: Optional[Anchors] = None) -> Decision:
    """What the dead-man does at `now` (see the module doc). Pure."""
    if lease is None:
        return Decision("absent", "no lease on this box")
    if not lease.armed:
        return Decision("disarmed", f"disarmed by {lease.renewed_by}")
    if lease.fired is not None:
        return Decision("fired", f"already fired ({lease.fired.get('action')}, "
                                 f"{lease.fired.get('state')}): it acts once per lease")
    at = anchors or Anchors(lease.renewed_at, lease.budget_started_at)
    left = at.lease_start + lease.ttl_s - now
    lease_period = f"lease:{lease.renewed_at!r}"
    budget_left = None
    if lease.max_hours is not None and lease.budget_started_at is not None and at.budget_start is not None:
        budget_left = at.budget_start + lease.max_hours * 3600.0 - now
    progressing = tuple(r.run_id for r in runs if r.progressing(now, lease.idle_s))
    base = Decision("armed", "", trigger="lease", period=lease_period, seconds_left=left,
                    budget_seconds_left=budget_left, progressing=progressing)
    if budget_left is not None and budget_left <= 0:
        return dataclasses.replace(base, verdict="fire", reason=f"the hard budget of {lease.max_hours:g} h "
                                   "is spent", trigger="budget", period=f"budget:{lease.budget_started_at!r}")
    budget_due = (_due("budget", f"budget:{lease.budget_started_at!r}", budget_left)
                  if budget_left is not None else None)
    warnings = tuple(w for w in (budget_due, _due("lease", lease_period, left)) if w)
    if left > 0:
        return dataclasses.replace(base, reason=f"the lease runs {left:.0f} s more", warnings=warnings)
    if progressing:
        return dataclasses.replace(base, verdict="held", warnings=warnings, reason=(
            f"the lease expired {-left:.0f} s ago, but {', '.join(progressing)} made progress within "
            f"{lease.idle_s:g} s"))
    idle = ", ".join(f"{r.run_id} ({r.state})" for r in runs) or "none"
    return dataclasses.replace(base, verdict="fire", reason=(
        f"the lease expired {-left:.0f} s ago and no run makes progress (runs: {idle})"))

__all__ = ["DEFAULT_IDLE_S", "DEFAULT_TTL_S", "NOTIFY", "Decision", "DeadmanError", "DeadmanPaths", "Due",
           "Lease", "LeaseRead", "RunActivity", "append_event", "arm", "authorize", "collect_runs", "decide",
           "disarm", "fired_since_armed", "iter_records", "paths_for", "read_events", "read_lease", "renew",
           "update_lease"]
