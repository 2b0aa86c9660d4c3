"""The controller's SQLite store: runs, events, cursors and gaps; hosts, its own events, wakes.

One database file (controller.paths.db_path()) in WAL mode, so one process
can write (the subscriber) while others read (`rgt events --follow`,
`rgt status`). Writes are short IMMEDIATE transactions; events are idempotent
on (run, seq), so replaying a batch after a reconnect is harmless.

A Store holds one connection and is used from one thread at a time (it may be
handed from the thread that opened it to another). Every other process opens
its own Store.

Timestamps are unix seconds (REAL). JSON columns hold objects encoded by
protocol.encode_json, so a NaN stored locally reads back as "nan", exactly as
it would have travelled on the wire.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sqlite3
import time
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
)

import protocol

from controller import paths
from controller.errors import (
    AmbiguousRun,
    HostNotFound,
    RunNotFound,
    SchemaTooNew,
    StoreBusy,
    StoreCorrupt,
    StoreError,
    load_json,
    translate,
)
from controller.store import sql as storesql
from controller.store.migrations import MIGRATIONS, SCHEMA_VERSION, Migration

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "AmbiguousRun", "HostNotFound", "LocalEvent", "Migration",
           "RunNotFound", "SchemaTooNew", "Store", "StoreBusy", "StoreCorrupt", "StoreError"]

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 5.0
_LISTED_RUNS = 8  # how many candidates an error message names

# ---- records ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LocalEvent:
    """An event the controller observed itself (no sidecar seq): link.lost, sidecar.silent, ..."""

    id: int
    run: str
    ts: float
    kind: str
    sev: str
    data: Dict[str, Any]


if TYPE_CHECKING:  # typing has these from 3.10; they appear only in annotations, never evaluated
    from typing_extensions import Concatenate, ParamSpec

    _P = ParamSpec("_P")
_R = TypeVar("_R")


def _sql(fn: Callable[Concatenate[Store, _P], _R]) -> Callable[Concatenate[Store, _P], _R]:
    """Turn sqlite3 errors raised by a Store method into StoreErrors."""

    def wrapper(self: Store, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(self, *args, **kwargs)
        except sqlite3.Error as e:
            raise translate(e, self.path, BUSY_TIMEOUT_S) from e

    functools.update_wrapper(wrapper, fn)
    return wrapper


# ---- schema ---------------------------------------------------------------


def _user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _refuse_newer(found: int, supported: int, path: Path) -> None:
    if found > supported:
        raise SchemaTooNew(
            f"the store {path} has schema version {found}, newer than the version {supported} "
            f"this rgt understands",
            hint="upgrade rgt (pip install -U remote-gpu-trainer), or set RGT_HOME to use another store",
        )


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception (Ctrl-C included)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def migrate(conn: sqlite3.Connection, path: Path) -> int:
    """Bring the schema to the newest version, one transaction per step; returns it.

    Safe against another process migrating at the same time: each step
    re-reads user_version under the write lock.
    """
    migrations = MIGRATIONS
    target = len(migrations)
    found = _user_version(conn)
    _refuse_newer(found, target, path)
    for step in migrations[found:]:
        with _transaction(conn):
            now = _user_version(conn)
            _refuse_newer(now, target, path)
            if now >= step.version:
                continue
            for sql in step.statements:
                conn.execute(sql)
            conn.execute(f"PRAGMA user_version = {int(step.version)}")
        log.info("store %s: schema version %d (%s)", path, step.version, step.summary)
    return target


# ---- connecting -------------------------------------------------------------


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(
        str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        # Refuse a newer schema before this process changes anything in the file.
        _refuse_newer(_user_version(conn), len(MIGRATIONS), path)
        mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
        if mode != "wal":
            log.warning("store %s: journal mode is %s, not wal; readers may block the writer",
                        path, mode)
        conn.execute("PRAGMA synchronous = NORMAL")
        migrate(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


# ---- the store ------------------------------------------------------------


def _dump(obj: Mapping[str, Any], what: str) -> str:
    try:
        return protocol.encode_json(obj).decode("utf-8")
    except protocol.ProtocolError as e:
        raise StoreError(f"{what} cannot be stored: {e}") from e




def _prefix_upper(prefix: str) -> Optional[str]:
    """The least string above every string that starts with prefix, or None.

    SQLite compares TEXT bytewise and UTF-8 keeps code point order, so
    `prefix <= kind < upper` is exactly "kind starts with prefix", and an
    index can serve it.
    """
    chars = list(prefix)
    while chars:
        nxt = ord(chars.pop()) + 1
        if 0xD800 <= nxt <= 0xDFFF:
            nxt = 0xE000
        if nxt <= 0x10FFFF:
            return "".join(chars) + chr(nxt)
    return None


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_LISTED_RUNS])
    more = len(names) - _LISTED_RUNS
    return f"{shown} (and {more} more)" if more > 0 else shown




class Store:
    """The controller's database. Open with Store.open(); close, or use as a context manager."""

    def __init__(self, conn: sqlite3.Connection, path: Path,
                 clock: Callable[[], float] = time.time) -> None:
        self._conn = conn
        self.path = path
        self._clock = clock

    @classmethod
    def open(cls, path: Optional[Path] = None, *,
             clock: Callable[[], float] = time.time) -> Store:
        """Open (creating and migrating as needed) the store at path, default paths.db_path()."""
        path = paths.db_path() if path is None else Path(path)
        try:
            paths.prepare_db_files(path)
        except OSError as e:
            raise StoreError(
                f"cannot create the store {path}: {e.strerror or e}",
                hint="check the permissions of its directory, or set RGT_HOME",
            ) from e
        try:
            conn = _connect(path)
        except sqlite3.Error as e:
            raise translate(e, path, BUSY_TIMEOUT_S) from e
        return cls(conn, path, clock)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r})"

    def load_json(self, text: Any, where: str) -> Dict[str, Any]:
        """A JSON column read back (an object; other JSON as {}); StoreCorrupt naming this file, `where`
        (like "the meta of run 'x' (table runs)") and how to recover when it does not parse."""
        return load_json(text, self.path, where)

    # ---- writes ----------------------------------------------------------

    @_sql
    def upsert_run(self, run: str, *, host: str, boot_id: str = "", protocol_version: int = 0,
                   package_version: str = "", meta: Mapping[str, Any] = {},
                   endpoint: str = "", target: str = "", run_dir: str = "") -> None:
        """Record a run, or update it: first_seen is kept, last_seen set to now.

        `host` is the name the sidecar reports; `target` the rgt host (`rgt hosts`) it is
        reached through, and `run_dir` its directory on that box. An empty string, 0 or {}
        means "not known now" and keeps the stored value.
        """
        now = self._clock()
        self._conn.execute(storesql.UPSERT_RUN, (
            run, host, boot_id, protocol_version, package_version,
            _dump(meta, f"meta of run {run!r}"), endpoint, now, now, target, run_dir,
        ))

    @_sql
    def apply(self, run: str, events: Sequence[protocol.Event], cursor: int) -> int:
        """Store events and set the run's cursor, in one transaction; returns how many were new.

        Idempotent on (run, seq): an event already stored is left as it is.
        Every event must belong to `run` (ValueError otherwise, nothing written).

        The cursor is the caller's promise: every event with seq <= cursor is
        stored (or recorded lost with record_gap) once this commits. Readers
        rely on it (`rgt events --follow` waits above it for gap repairs);
        events above it may be stored ahead of a repair. The cursor row also
        takes the run's boot_id as upsert_run last recorded it.
        """
        if cursor < 0:
            raise ValueError(f"a cursor is >= 0, got {cursor}")
        now = self._clock()
        rows = []
        for e in events:
            if e.run != run:
                raise ValueError(f"event seq {e.seq} belongs to run {e.run!r}, not {run!r}")
            data = _dump(e.data, f"event seq {e.seq} of run {run!r}")
            rows.append((run, e.seq, e.ts, e.kind, e.sev, e.host, data, now))
        conn = self._conn
        with _transaction(conn):
            before = conn.total_changes
            if rows:
                conn.executemany(storesql.INSERT_EVENT, rows)
            added = conn.total_changes - before
            conn.execute(storesql.SET_CURSOR, (run, cursor, now))
        return added

    @_sql
    def set_lineage(self, run: str, *, resumed_from: Optional[str] = None, group_run: Optional[str] = None,
                    node: Optional[str] = None) -> None:
        """Tie a recorded run to the run it resumes, or to its multi-node group; None keeps a field."""
        for column, value in (("resumed_from", resumed_from), ("group_run", group_run), ("node", node)):
            if value is not None:
                self._conn.execute(f"UPDATE runs SET {column} = ? WHERE run = ?", (value, run))

    @_sql
    def record_launch(self, run: str, launch: Mapping[str, Any]) -> None:
        """Keep what the laptop asked for when it launched RUN (command, cwd, python, code, profile):
        the only command `rgt resume` re-runs without one given. Written once, at launch."""
        self._conn.execute("UPDATE runs SET launch = ? WHERE run = ?",
                           (_dump(launch, f"launch record of run {run!r}"), run))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside BEGIN IMMEDIATE ... COMMIT, for a module that owns its own
        tables (controller/queue/model.py); sqlite3 errors become StoreErrors."""
        try:
            with _transaction(self._conn) as conn:
                yield conn
        except sqlite3.Error as e:
            raise translate(e, self.path, BUSY_TIMEOUT_S) from e

    @_sql
    def record_gap(self, run: str, first_seq: int, last_seq: int, reason: str) -> None:
        """Remember that seqs first_seq..last_seq (inclusive) are lost; recording it again is a no-op."""
        if not 1 <= first_seq <= last_seq:
            raise ValueError(f"a gap needs 1 <= first_seq <= last_seq, got {first_seq}..{last_seq}")
        self._conn.execute(
            "INSERT OR IGNORE INTO gaps (run, first_seq, last_seq, reason, recorded_at)"
            " VALUES (?, ?, ?, ?, ?)",
            (run, first_seq, last_seq, reason, self._clock()),
        )

    # ---- reads -----------------------------------------------------------

    @_sql
    def cursor(self, run: str) -> int:
        """The run's cursor as the last apply() set it; 0 for a run never applied."""
        row = self._conn.execute("SELECT last_seq FROM cursors WHERE run = ?", (run,)).fetchone()
        return int(row[0]) if row else 0

    @_sql
    def events(self, run: str, *, since: int = 0, kind_prefix: Optional[str] = None,
               limit: Optional[int] = None) -> List[protocol.Event]:
        """The run's events with seq > since, in seq order; kind_prefix is a plain string prefix."""
        sql = "SELECT seq, ts, kind, sev, host, data FROM events WHERE run = ? AND seq > ?"
        params: List[Any] = [run, since]
        if kind_prefix:
            sql += " AND kind >= ?"
            params.append(kind_prefix)
            upper = _prefix_upper(kind_prefix)
            if upper is not None:
                sql += " AND kind < ?"
                params.append(upper)
        sql += " ORDER BY seq"
        if limit is not None:
            if limit < 0:
                raise ValueError(f"limit must be >= 0, got {limit}")
            sql += " LIMIT ?"
            params.append(limit)
        rows = self._conn.execute(sql, params).fetchall()
        return [
            protocol.Event(run=run, host=host, seq=seq, ts=ts, kind=kind, sev=sev,
                           data=self.load_json(data, f"the data of event seq {seq} of run {run!r} "
                                                     "(table events)"))
            for seq, ts, kind, sev, host, data in rows
        ]

    @_sql
    def count_events(self, run: str) -> int:
        return int(self._conn.execute("SELECT count(*) FROM events WHERE run = ?", (run,))
                   .fetchone()[0])

    @_sql
    def gaps(self, run: str) -> List[Dict[str, Any]]:
        """Recorded gaps of a run, by first_seq."""
        rows = self._conn.execute(
            "SELECT first_seq, last_seq, reason, recorded_at FROM gaps WHERE run = ?"
            " ORDER BY first_seq, last_seq", (run,)).fetchall()
        return [dict(zip(("first_seq", "last_seq", "reason", "recorded_at"), r)) for r in rows]

    @_sql
    def runs(self) -> List[Dict[str, Any]]:
        """Every known run, most recently seen first.

        Keys: run, host, boot_id, protocol_version, package_version, meta (a
        dict), endpoint, first_seen, last_seen, last_seq (the cursor),
        cursor_updated_at (None before the first apply), target, run_dir, resumed_from (the run
        this one continues), group_run and node (a multi-node run's node stream), launch (what the
        laptop asked for at launch: record_launch). A run that only
        ever had apply() calls shows with empty host and metadata.
        """
        return [self._run_item(row) for row in self._conn.execute(storesql.RUNS).fetchall()]

    def _run_item(self, row: Sequence[Any]) -> Dict[str, Any]:
        item = dict(zip(storesql.RUN_FIELDS, row))
        for column in ("meta", "launch"):
            item[column] = self.load_json(item[column], f"the {column} of run {item['run']!r} (table runs)")
        return item

    @_sql
    def resolve_run(self, name: str) -> str:
        """The run id `name` names: itself, or the one run it is a prefix of.

        Raises AmbiguousRun or RunNotFound, each with a hint naming candidates.
        """
        known: List[str] = [str(r["run"]) for r in self.runs()]
        if name in known:
            return name
        matches = sorted(r for r in known if name and r.startswith(name))
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise AmbiguousRun(
                f"{name!r} matches {len(matches)} runs: {_listing(matches)}",
                hint="give more of the run id", candidates=matches,
            )
        hint = (f"known runs, newest first: {_listing(known)}" if known
                else "no runs are recorded in this store yet; is RGT_HOME right?")
        raise RunNotFound(f"no run {name!r} in {self.path}", hint=hint, candidates=known)

    @_sql
    def data_version(self) -> int:
        """Changes whenever another connection commits to the database (not this one's commits)."""
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    @_sql
    def run(self, name: str) -> Dict[str, Any]:
        """One run as runs() lists it; `name` may be a unique prefix."""
        exact = self._run_row(name)
        if exact is not None:
            return exact
        run_id = self.resolve_run(name)
        return next(r for r in self.runs() if r["run"] == run_id)

    @_sql
    def _run_row(self, run: str) -> Optional[Dict[str, Any]]:
        """The run with exactly this id, in one query (runs() reads every row and decodes its meta)."""
        row = self._conn.execute(f"SELECT * FROM ({storesql.RUNS}) WHERE run = ?", (run,)).fetchone()
        return None if row is None else self._run_item(row)

    @_sql
    def change_marks(self) -> Dict[str, Tuple[int, float, int]]:
        """Per run: (cursor, cursor updated at, newest local event id). Every apply() and
        add_local_event() moves its run's mark, so a watcher of many runs reads only those
        whose mark moved."""
        marks: Dict[str, Tuple[int, float, int]] = {}
        for run, last_seq, updated in self._conn.execute("SELECT run, last_seq, updated_at FROM cursors"):
            marks[run] = (int(last_seq), float(updated), 0)
        for run, newest in self._conn.execute("SELECT run, MAX(id) FROM local_events GROUP BY run"):
            seq, updated, _ = marks.get(run, (0, 0.0, 0))
            marks[run] = (seq, updated, int(newest))
        return marks

    # ---- hosts -------------------------------------------------------------

    @_sql
    def add_host(self, name: str, *, ssh: str, profile: str = "", onbox: str = "", root: str = "",
                 replace: bool = False) -> None:
        """Record how to reach a box. An existing name is refused unless `replace`."""
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        try:
            self._conn.execute(
                f"{verb} INTO hosts (name, ssh, profile, added_at, onbox, root, installed)"
                " VALUES (?, ?, ?, ?, ?, ?, COALESCE((SELECT installed FROM hosts WHERE name = ?), '{}'))",
                (name, ssh, profile, self._clock(), onbox, root, name))
        except sqlite3.IntegrityError as e:
            raise StoreError(f"host {name!r} exists already",
                             hint=f"'rgt hosts add {name} ... --replace' changes it") from e

    @_sql
    def hosts(self) -> List[Dict[str, Any]]:
        """Every host, by name. Keys: name, ssh, profile, added_at, onbox, root, installed (a dict)."""
        rows = self._conn.execute(
            "SELECT name, ssh, profile, added_at, onbox, root, installed FROM hosts ORDER BY name"
        ).fetchall()
        out = []
        for row in rows:
            item = dict(zip(("name", "ssh", "profile", "added_at", "onbox", "root", "installed"), row))
            item["installed"] = self.load_json(item["installed"],
                                               f"the install record of host {item['name']!r} (table hosts)")
            out.append(item)
        return out

    @_sql
    def host(self, name: str) -> Dict[str, Any]:
        """One host; HostNotFound (with the known names) if there is none."""
        for item in self.hosts():
            if item["name"] == name:
                return item
        known = [str(h["name"]) for h in self.hosts()]
        raise HostNotFound(f"no host {name!r}",
                           hint=(f"known hosts: {_listing(known)}; " if known else "")
                           + f"add it with 'rgt hosts add {name} --ssh ALIAS'")

    @_sql
    def remove_host(self, name: str) -> None:
        self._conn.execute("DELETE FROM hosts WHERE name = ?", (name,))

    @_sql
    def set_installed(self, name: str, installed: Mapping[str, Any]) -> None:
        """Remember what `rgt install` put on the host (version, venv, onbox command)."""
        self._conn.execute("UPDATE hosts SET installed = ? WHERE name = ?",
                           (_dump(installed, f"install record of {name!r}"), name))

    # ---- what the controller saw itself ------------------------------------

    @_sql
    def add_local_event(self, run: str, kind: str, sev: str, data: Mapping[str, Any],
                        ts: Optional[float] = None) -> LocalEvent:
        """Record a controller-side event (link.lost, sidecar.silent, ...); returns it with its id."""
        if sev not in protocol.SEVERITIES:
            raise ValueError(f"severity must be one of {protocol.SEVERITIES}, got {sev!r}")
        when = self._clock() if ts is None else ts
        cur = self._conn.execute(
            "INSERT INTO local_events (run, ts, kind, sev, data) VALUES (?, ?, ?, ?, ?)",
            (run, when, kind, sev, _dump(data, f"{kind} of run {run!r}")))
        return LocalEvent(id=int(cur.lastrowid or 0), run=run, ts=when, kind=kind, sev=sev,
                          data=dict(data))

    @_sql
    def local_events(self, run: str, *, since_id: int = 0,
                     kind_prefix: Optional[str] = None) -> List[LocalEvent]:
        """The run's controller-side events with id > since_id, oldest first."""
        rows = self._conn.execute(
            "SELECT id, ts, kind, sev, data FROM local_events WHERE run = ? AND id > ? ORDER BY id",
            (run, since_id)).fetchall()
        out = [LocalEvent(id=i, run=run, ts=ts, kind=k, sev=sev,
                          data=self.load_json(d, f"the data of local event {i} of run {run!r} "
                                                 "(table local_events)"))
               for i, ts, k, sev, d in rows]
        return [e for e in out if not kind_prefix or e.kind.startswith(kind_prefix)]

    # ---- wakes, policies, facts shown ---------------------------------------

    @_sql
    def mark_woken(self, run: str, key: str) -> bool:
        """Remember that `key` (an event) ended a watch; False if it had already."""
        cur = self._conn.execute("INSERT OR IGNORE INTO wakes (run, key, woke_at) VALUES (?, ?, ?)",
                                 (run, key, self._clock()))
        return cur.rowcount == 1

    @_sql
    def woken(self, run: str) -> Dict[str, float]:
        """Keys that ended a watch of `run`, with when."""
        return {str(k): float(t) for k, t in self._conn.execute(
            "SELECT key, woke_at FROM wakes WHERE run = ? ORDER BY woke_at, key", (run,)).fetchall()}

    @_sql
    def policy(self, run: str) -> Dict[str, Any]:
        """The wake policy stored for `run` ('*': the default for all runs); {} if none."""
        row = self._conn.execute("SELECT policy FROM policies WHERE run = ?", (run,)).fetchone()
        return self.load_json(row[0], f"the wake policy of {run!r} (table policies)") if row else {}

    @_sql
    def set_policy(self, run: str, policy: Mapping[str, Any]) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO policies (run, policy, updated_at) VALUES (?, ?, ?)",
            (run, _dump(policy, f"policy of {run!r}"), self._clock()))

    @_sql
    def mark_shown(self, topic: str) -> bool:
        """Remember that a one-time notice was shown; False if it had been already."""
        cur = self._conn.execute("INSERT OR IGNORE INTO shown (topic, shown_at) VALUES (?, ?)",
                                 (topic, self._clock()))
        return cur.rowcount == 1
