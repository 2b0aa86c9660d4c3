"""Queues of commands over hosts: the model, its rows in the store, and how an attempt ended.

A queue is a list of cells, one command each, spread over a set of hosts with at most one
running cell per host (controller.queue.dispatch places them). Everything lives in the store's
`queues` and `queue_cells` tables, so a queue outlives the process that drives it. Cell states:

    pending -> launching -> running -> done | stopped | failed | retrying -> launching -> ...
    pending | retrying -> cancelled (rgt queue cancel), cancelled -> pending (rgt queue resume)

`launching` is written before the box is asked, so a driver that dies mid-launch leaves a
trace its successor can pick up. Every change is a compare-and-set on (state, attempts, run)
inside one IMMEDIATE transaction: `rgt queue status` and the dispatcher may both judge a
running cell, and only one of them moves it.

How an attempt ended is the run's life (controller.runs.life.exit_life, the story `rgt watch` and
`rgt status` tell), read from the events the run's watcher stored (classify), never from log
lines. Only some classes may be retried, and only up to the queue's max_attempts:

    ok         done
    stopped    stopped a stop rgt was asked for (`rgt stop`, recorded before it asked the box, or
                       job.exited stop_requested): whatever the exit code; not a failure, not retried
    preempted  retry   job.preempted, job.exited preempted: true, or a SIGTERM exit (143) that nobody
                       asked rgt for
    link       retry   link.lost with no link.restored within the link budget
    launch     retry   the box could not be reached, or refused the launch
    nan        failed  a train.nonfinite onset, even when the job then exits 0
    oom        failed  job.exited oom_killed
    vanished   failed  the job disappeared without an exit record
    final      failed  exit 0, but the sidecar's final verdict failed (a durable copy failed)
    error      failed  a non-zero exit code or a signal
"""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
import shlex
import sqlite3
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from controller import paths
from controller import trust as boxtrust
from controller.errors import StoreCorrupt, recovery_hint
from controller.runs import life
from controller.store.db import LocalEvent, Store, StoreError

PENDING, LAUNCHING, RUNNING, RETRYING = "pending", "launching", "running", "retrying"
DONE, STOPPED, FAILED, CANCELLED = "done", "stopped", "failed", "cancelled"
TERMINAL = (DONE, STOPPED, FAILED, CANCELLED)
ACTIVE = (LAUNCHING, RUNNING)
RETRYABLE = ("preempted", "link", "launch")
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_LINK_BUDGET_S = 900.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,47}$")
_CELL_FIELDS = ("queue", "idx", "command", "state", "attempts", "run", "host", "reason", "history",
                "updated_at")


class QueueError(StoreError):
    """A queue that cannot be made, found or changed; `hint` is the next step."""


# ---- records ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    """How a queue runs; stored as the `options` JSON of its row."""

    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    link_budget_s: float = DEFAULT_LINK_BUDGET_S
    onbox_args: Tuple[str, ...] = ()
    source: str = ""
    cancelled: bool = False

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["onbox_args"] = list(self.onbox_args)
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Options:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in obj.items() if k in known}
        values["onbox_args"] = tuple(str(a) for a in values.get("onbox_args") or ())
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Queue:
    name: str
    hosts: Tuple[str, ...]
    options: Options
    created_at: float
    updated_at: float

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "hosts": list(self.hosts), "options": self.options.to_dict(),
                "created_at": self.created_at, "updated_at": self.updated_at}


@dataclasses.dataclass(frozen=True)
class Cell:
    queue: str
    idx: int
    command: Tuple[str, ...]
    state: str
    attempts: int
    run: str
    host: str
    reason: str
    history: Tuple[Dict[str, Any], ...]
    updated_at: float

    @property
    def last(self) -> Dict[str, Any]:
        """The newest attempt's record ({} before the first launch)."""
        return dict(self.history[-1]) if self.history else {}

    def to_dict(self) -> Dict[str, Any]:
        return {"idx": self.idx, "command": list(self.command), "state": self.state,
                "attempts": self.attempts, "run": self.run, "host": self.host, "reason": self.reason,
                "history": [dict(h) for h in self.history], "updated_at": self.updated_at}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one attempt ended: its class (see the module doc), a sentence, the job.exited seq."""

    cls: str
    reason: str
    at_seq: int = 0

    @property
    def retryable(self) -> bool:
        return self.cls in RETRYABLE


@dataclasses.dataclass(frozen=True)
class Change:
    """A cell moved from one state to another (what progress lines print)."""

    before: str
    cell: Cell


# ---- the commands file --------------------------------------------------------------------


def parse_commands(text: str, source: str = "FILE") -> List[List[str]]:
    """One command per line, split as a shell would (shlex); blank lines and # comments skipped."""
    out: List[List[str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            argv = shlex.split(line, comments=True)
        except ValueError as e:
            raise QueueError(f"{source} line {number}: {e}", hint="quote it as a shell would") from e
        if argv:
            out.append(argv)
    if not out:
        raise QueueError(f"{source} holds no command", hint="one command per line; # starts a comment")
    return out


def check_name(name: str) -> str:
    """NAME when it may name a queue: its cells' run ids (new_run_id) begin with it, so it follows
    the run-id grammar too (no '..')."""
    if not _NAME.match(name) or ".." in name:
        raise QueueError(f"queue name {name!r} must be 1-48 of A-Z a-z 0-9 . _ - (starting alphanumeric, "
                         "no '..')", hint="its cells' run ids begin with it; choose another --name")
    return name


def name_from(source: str) -> str:
    """A queue name from a file name: its stem, made safe."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", source.rsplit("/", 1)[-1].rsplit(".", 1)[0])
    stem = re.sub(r"\.{2,}", ".", stem).strip("-._")
    return stem[:40] or "queue"


def new_run_id(queue: str, idx: int) -> str:
    """A fresh run id for a cell: the queue, the cell, and a random tail (unique on every box).
    Checked by the one grammar (boxtrust.run_id): the laptop never makes an id it would refuse."""
    try:
        return boxtrust.run_id(f"{queue}-{idx}-{secrets.token_hex(3)}", f"queue {queue[:60]!r}'s run id")
    except boxtrust.Untrusted as e:
        raise QueueError(str(e), hint="start the queue again under another --name") from None


# ---- rows -----------------------------------------------------------------------------------


def _parsed(text: Any, where: str) -> Any:
    """A JSON column of the queue tables; StoreCorrupt naming the store and the row when damaged."""
    try:
        return json.loads(text)
    except (ValueError, TypeError) as e:
        path = paths.db_path()
        raise StoreCorrupt(f"the store {path} is damaged: {where} is not valid JSON",
                           hint=recovery_hint(path)) from e


def _cell(row: Sequence[Any]) -> Cell:
    d = dict(zip(_CELL_FIELDS, row))
    where = f"cell {d['idx']} of queue {str(d['queue'])[:60]!r} (table queue_cells)"
    history = _parsed(d["history"], f"the history of {where}")
    command = _parsed(d["command"], f"the command of {where}")
    if not isinstance(command, list):
        command = []
    return Cell(queue=str(d["queue"]), idx=int(d["idx"]), command=tuple(str(w) for w in command),
                state=str(d["state"]), attempts=int(d["attempts"]), run=str(d["run"]),
                host=str(d["host"]), reason=str(d["reason"]),
                history=tuple(h for h in history if isinstance(h, dict)) if isinstance(history, list)
                else (), updated_at=float(d["updated_at"]))


def _queue(row: Sequence[Any]) -> Queue:
    name, hosts, options, created, updated = row
    where = f"queue {str(name)[:60]!r} (table queues)"
    opts = _parsed(options, f"the options of {where}")
    hosts = _parsed(hosts, f"the hosts of {where}")
    return Queue(name=str(name), hosts=tuple(str(h) for h in hosts) if isinstance(hosts, list) else (),
                 options=Options.from_dict(opts if isinstance(opts, dict) else {}),
                 created_at=float(created), updated_at=float(updated))


def names(store: Store) -> List[str]:
    """Every queue's name, newest first."""
    with store.transaction() as conn:
        rows = conn.execute("SELECT name FROM queues ORDER BY created_at DESC, name").fetchall()
    return [str(r[0]) for r in rows]


def unused_name(store: Store, wanted: str) -> str:
    """`wanted`, or wanted-2, wanted-3, ... when a queue has it already."""
    taken = set(names(store))
    name, n = wanted, 1
    while name in taken:
        n += 1
        name = f"{wanted}-{n}"
    return name


def create(store: Store, name: str, hosts: Sequence[str], commands: Sequence[Sequence[str]],
           options: Options, now: float) -> Queue:
    check_name(name)
    if not hosts:
        raise QueueError("a queue needs at least one host", hint="--hosts h1,h2")
    with store.transaction() as conn:
        if conn.execute("SELECT 1 FROM queues WHERE name = ?", (name,)).fetchone():
            raise QueueError(f"a queue named {name!r} exists already",
                             hint=f"give another --name, or see 'rgt queue status {name}'")
        conn.execute("INSERT INTO queues (name, hosts, options, created_at, updated_at)"
                     " VALUES (?, ?, ?, ?, ?)",
                     (name, json.dumps(list(hosts)), json.dumps(options.to_dict()), now, now))
        conn.executemany(
            "INSERT INTO queue_cells (queue, idx, command, state, updated_at) VALUES (?, ?, ?, ?, ?)",
            [(name, i, json.dumps(list(argv)), PENDING, now) for i, argv in enumerate(commands)])
    return load(store, name)


def load(store: Store, name: str) -> Queue:
    with store.transaction() as conn:
        row = conn.execute("SELECT name, hosts, options, created_at, updated_at FROM queues WHERE name = ?",
                           (name,)).fetchone()
    if row is None:
        known = names(store)
        raise QueueError(f"no queue {name!r}",
                         hint=f"known queues: {', '.join(known[:8])}" if known
                         else "start one with 'rgt queue FILE --hosts h1,h2'")
    return _queue(row)


def cells(store: Store, name: str) -> List[Cell]:
    with store.transaction() as conn:
        rows = conn.execute(f"SELECT {', '.join(_CELL_FIELDS)} FROM queue_cells WHERE queue = ? ORDER BY idx",
                            (name,)).fetchall()
    return [_cell(r) for r in rows]


def set_options(store: Store, name: str, now: float, **changes: Any) -> Queue:
    with store.transaction() as conn:
        row = conn.execute("SELECT options FROM queues WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise QueueError(f"no queue {name!r}")
        found = _parsed(row[0], f"the options of queue {name[:60]!r} (table queues)")
        opts = dataclasses.replace(Options.from_dict(found if isinstance(found, dict) else {}), **changes)
        conn.execute("UPDATE queues SET options = ?, updated_at = ? WHERE name = ?",
                     (json.dumps(opts.to_dict()), now, name))
    return load(store, name)


def _write(conn: sqlite3.Connection, cell: Cell, now: float, changes: Mapping[str, Any]) -> Optional[Cell]:
    """Apply `changes` to the cell if its row still holds what `cell` read; the new cell, or None."""
    row = conn.execute(f"SELECT {', '.join(_CELL_FIELDS)} FROM queue_cells WHERE queue = ? AND idx = ?",
                       (cell.queue, cell.idx)).fetchone()
    if row is None:
        return None
    current = _cell(row)
    if (current.state, current.attempts, current.run) != (cell.state, cell.attempts, cell.run):
        return None
    new = dataclasses.replace(current, updated_at=now, **changes)
    conn.execute("UPDATE queue_cells SET state = ?, attempts = ?, run = ?, host = ?, reason = ?, history = ?,"
                 " updated_at = ? WHERE queue = ? AND idx = ?",
                 (new.state, new.attempts, new.run, new.host, new.reason,
                  json.dumps([dict(h) for h in new.history]), now, new.queue, new.idx))
    conn.execute("UPDATE queues SET updated_at = ? WHERE name = ?", (now, new.queue))
    return new


def transition(store: Store, cell: Cell, now: float, **changes: Any) -> Optional[Cell]:
    """Compare-and-set one cell: the new cell, or None when someone moved it first."""
    with store.transaction() as conn:
        return _write(conn, cell, now, changes)


# ---- the life of an attempt --------------------------------------------------------------------


def begin_attempt(store: Store, cell: Cell, *, host: str, run: str, in_place: bool, since_seq: int,
                  since_local: int, now: float) -> Optional[Cell]:
    """Record an attempt before the box is asked (state launching)."""
    record = {"attempt": cell.attempts + 1, "run": run, "host": host, "in_place": in_place,
              "since_seq": since_seq, "since_local": since_local, "started_at": now}
    return transition(store, cell, now, state=LAUNCHING, attempts=cell.attempts + 1, run=run, host=host,
                      reason="", history=(*cell.history, record))


def launched(store: Store, cell: Cell, answer: Mapping[str, Any], now: float) -> Optional[Cell]:
    """The box started the attempt: state running; its wrapper pid and run dir in the history."""
    last = {**cell.last, "pid": answer.get("pid"), "run_dir": answer.get("run_dir"), "launched_at": now}
    return transition(store, cell, now, state=RUNNING, history=(*cell.history[:-1], last))


def end_attempt(store: Store, cell: Cell, outcome: Outcome, max_attempts: int, now: float) -> Optional[Cell]:
    """done, stopped, failed, or retrying when the class allows it and attempts are left."""
    if outcome.cls == "ok":
        state, reason = DONE, ""
    elif outcome.cls == "stopped":
        state, reason = STOPPED, outcome.reason
    elif outcome.retryable and cell.attempts < max_attempts:
        next_try = f"attempt {cell.attempts + 1} of {max_attempts}"
        state, reason = RETRYING, f"{outcome.reason}; retrying ({next_try})"
    elif outcome.retryable:
        state, reason = FAILED, f"{outcome.reason}; no attempts left ({cell.attempts} of {max_attempts})"
    else:
        state, reason = FAILED, f"{outcome.reason} (not retried)"
    last = {**cell.last, "outcome": outcome.cls, "reason": outcome.reason, "at_seq": outcome.at_seq,
            "ended_at": now}
    return transition(store, cell, now, state=state, reason=reason, history=(*cell.history[:-1], last))


def refresh(store: Store, name: str, now: float) -> List[Change]:
    """Judge every running cell from the events stored so far; the cells that ended."""
    q = load(store, name)
    changes: List[Change] = []
    for cell in cells(store, name):
        if cell.state != RUNNING:
            continue
        last = cell.last
        outcome = classify(store, cell.run, since_seq=int(last.get("since_seq") or 0),
                           since_local=int(last.get("since_local") or 0), now=now,
                           link_budget_s=q.options.link_budget_s)
        if outcome is None:
            continue
        new = end_attempt(store, cell, outcome, q.options.max_attempts, now)
        if new is not None:
            changes.append(Change(cell.state, new))
    return changes


def cancel(store: Store, name: str, now: float) -> List[Change]:
    """Stop dispatching: the queue is marked cancelled, cells not started are cancelled."""
    set_options(store, name, now, cancelled=True)
    changes = []
    for cell in cells(store, name):
        if cell.state in (PENDING, RETRYING):
            new = transition(store, cell, now, state=CANCELLED, reason=f"cancelled while {cell.state}")
            if new is not None:
                changes.append(Change(cell.state, new))
    return changes


def reopen(store: Store, name: str, now: float) -> List[Change]:
    """Undo a cancel: cancelled cells wait again (retrying when they had run before)."""
    set_options(store, name, now, cancelled=False)
    changes = []
    for cell in cells(store, name):
        if cell.state == CANCELLED:
            new = transition(store, cell, now, state=RETRYING if cell.attempts else PENDING, reason="")
            if new is not None:
                changes.append(Change(cell.state, new))
    return changes


def counts(all_cells: Iterable[Cell]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for c in all_cells:
        out[c.state] = out.get(c.state, 0) + 1
    return out


def finished(all_cells: Sequence[Cell]) -> bool:
    return all(c.state in TERMINAL for c in all_cells)


def exit_code(all_cells: Sequence[Cell]) -> int:
    """0 when no cell failed or was cancelled (all done or stopped by request, or still going),
    else 1."""
    return 1 if any(c.state in (FAILED, CANCELLED) for c in all_cells) else 0


# ---- how an attempt ended ---------------------------------------------------------------------


def attempt_start(store: Store, run: str, since_seq: int) -> Optional[int]:
    """Where this attempt's events start. A run resumed in place shares its journal with the
    attempts before: its events begin at the first job.started after since_seq. The seq before
    that start, or None while it is not stored yet."""
    if since_seq <= 0:
        return 0
    for ev in store.events(run, since=since_seq, kind_prefix="job.started"):
        return ev.seq - 1
    return None


def _exit_outcome(data: Mapping[str, Any], seq: int, preempted: bool, nonfinite: bool,
                  stopped_by: Optional[str] = None) -> Outcome:
    """The attempt's class from its life (controller.runs.life.exit_life: the one story of an exit)."""
    ended = life.exit_life(data, stopped_by=stopped_by, preempted=preempted, nonfinite=nonfinite)
    return Outcome(ended.outcome, "" if ended.outcome == "ok" else ended.reason, seq)


def _asked_by(store: Store, run: str, since_local: int) -> Optional[str]:
    """Who asked rgt to stop this attempt (its newest stop request after since_local), or None."""
    asked = life.stop_request(life.stop_events(store, run, since_id=since_local))
    if asked is None:
        return None
    by = asked.data.get("by")
    return by if isinstance(by, str) and by else "rgt stop"


def _link_outcome(local: Sequence[LocalEvent], now: float, budget_s: float) -> Optional[Outcome]:
    lost: Optional[LocalEvent] = None
    for ev in local:
        if ev.kind == "link.lost":
            lost = lost or ev
        elif ev.kind == "link.restored":
            lost = None
    if lost is None or now - lost.ts <= budget_s:
        return None
    return Outcome("link", f"the link stayed down {now - lost.ts:.0f}s (budget {budget_s:.0f}s)")


def classify(store: Store, run: str, *, since_seq: int = 0, since_local: int = 0, now: float,
             link_budget_s: float = DEFAULT_LINK_BUDGET_S) -> Optional[Outcome]:
    """How the attempt of `run` that began after seq since_seq (and local event id since_local)
    ended, from the stored events; None while it has not ended."""
    start = attempt_start(store, run, since_seq)
    if start is not None:
        exited = store.events(run, since=start, kind_prefix=life.EXIT_KIND, limit=1)
        closed = store.events(run, since=start, kind_prefix=life.CLOSED_KIND, limit=1)
        if exited and not closed and life.closes(exited[0]) and not life.close_cut(store, run, exited[0]):
            return None   # the sidecar is closing the run: its run.closed ends the attempt
        if exited:
            end = closed[0] if closed else exited[0]
            before = [e for e in store.events(run, since=start, kind_prefix="job.preempted")
                      if e.seq < end.seq]
            nan = [e for e in store.events(run, since=start, kind_prefix="train.nonfinite")
                   if e.seq < end.seq and e.data.get("state", "onset") == "onset"]
            return _exit_outcome(end.data, end.seq, bool(before), bool(nan),
                                 stopped_by=_asked_by(store, run, since_local))
    local = [e for e in store.local_events(run, since_id=since_local) if e.kind.startswith("link.")]
    return _link_outcome(local, now, link_budget_s)
