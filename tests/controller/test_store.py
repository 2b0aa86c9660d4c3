"""controller.store.db and controller.paths against real SQLite files."""
from __future__ import annotations

import math
import os
import sqlite3
import stat
from pathlib import Path
from typing import Any, Iterator, List

import pytest

from controller import paths
from controller.store import db as store
from controller.store.db import (
    SCHEMA_VERSION,
    AmbiguousRun,
    HostNotFound,
    Migration,
    RunNotFound,
    SchemaTooNew,
    Store,
    StoreBusy,
    StoreCorrupt,
    StoreError,
)
from protocol import Event

RUN = "train-7f3a"


def ev(seq: int, kind: str = "heartbeat", sev: str = "info", run: str = RUN, **data: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=1_700_000_000.25 + seq, kind=kind, sev=sev,
                 data=data or {"n": seq})


@pytest.fixture
def db(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        yield s


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---- paths ----------------------------------------------------------------


def test_state_dir_prefers_rgt_home_then_xdg_then_home(tmp_path: Path) -> None:
    assert paths.state_dir({"RGT_HOME": "/a/b", "XDG_STATE_HOME": "/x"}) == Path("/a/b")
    assert paths.state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/rgt")
    # The XDG spec says a relative value is invalid and must be ignored.
    assert paths.state_dir({"XDG_STATE_HOME": "rel"}) == Path.home() / ".local/state/rgt"
    assert paths.state_dir({}) == Path.home() / ".local/state/rgt"
    assert paths.db_path({"RGT_HOME": str(tmp_path)}) == tmp_path / "rgt.db"


def test_paths_read_the_environment_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RGT_HOME", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", "/srv/state")
    assert paths.db_path() == Path("/srv/state/rgt/rgt.db")
    monkeypatch.setenv("RGT_HOME", "/srv/rgt")
    assert paths.db_path() == Path("/srv/rgt/rgt.db")


# ---- files and schema -------------------------------------------------------


def test_new_store_is_private(home: Path) -> None:
    old = os.umask(0o022)  # a common umask: SQLite alone would create 0644 files
    try:
        with Store.open() as s:
            s.apply(RUN, [ev(1)], 1)  # a write, so the -wal and -shm files exist
            assert mode(home) == 0o700
            assert mode(home / "rgt.db") == 0o600
            for suffix in ("-wal", "-shm"):
                assert mode(Path(f"{s.path}{suffix}")) == 0o600
    finally:
        os.umask(old)


def test_loose_database_file_is_tightened(home: Path) -> None:
    Store.open().close()
    os.chmod(home / "rgt.db", 0o644)
    Store.open().close()
    assert mode(home / "rgt.db") == 0o600


def test_fresh_store_is_wal_at_the_newest_schema(db: Store) -> None:
    conn = sqlite3.connect(db.path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_migrations_are_numbered_in_order() -> None:
    assert [m.version for m in store.MIGRATIONS] == list(range(1, SCHEMA_VERSION + 1))


def test_newer_schema_is_refused_and_left_alone(home: Path) -> None:
    Store.open().close()
    path = home / "rgt.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 3}")
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()

    with pytest.raises(SchemaTooNew) as info:
        Store.open()
    message = str(info.value)
    assert f"schema version {SCHEMA_VERSION + 3}" in message
    assert f"version {SCHEMA_VERSION} this rgt understands" in message
    assert info.value.hint is not None and "upgrade rgt" in info.value.hint

    conn = sqlite3.connect(path)
    try:  # refused before anything was changed
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 3
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    finally:
        conn.close()


# The schema as rgt shipped it at version 1, frozen here on purpose: if
# migration 1 in store.py is ever edited, databases out there no longer match
# what the code expects, and this copy is what catches it.
V1_SCHEMA = [
    "CREATE TABLE hosts (name TEXT NOT NULL PRIMARY KEY, ssh TEXT NOT NULL DEFAULT '',"
    " profile TEXT NOT NULL DEFAULT '', added_at REAL NOT NULL)",
    "CREATE TABLE runs (run TEXT NOT NULL PRIMARY KEY, host TEXT NOT NULL DEFAULT '',"
    " boot_id TEXT NOT NULL DEFAULT '', protocol_version INTEGER NOT NULL DEFAULT 0,"
    " package_version TEXT NOT NULL DEFAULT '', meta TEXT NOT NULL DEFAULT '{}',"
    " endpoint TEXT NOT NULL DEFAULT '', first_seen REAL NOT NULL, last_seen REAL NOT NULL)",
    "CREATE TABLE events (run TEXT NOT NULL, seq INTEGER NOT NULL, ts REAL NOT NULL,"
    " kind TEXT NOT NULL, sev TEXT NOT NULL, host TEXT NOT NULL, data TEXT NOT NULL,"
    " received_at REAL NOT NULL, PRIMARY KEY (run, seq)) WITHOUT ROWID",
    "CREATE TABLE cursors (run TEXT NOT NULL PRIMARY KEY, last_seq INTEGER NOT NULL,"
    " boot_id TEXT NOT NULL DEFAULT '', updated_at REAL NOT NULL)",
]


def _columns(conn: sqlite3.Connection, table: str) -> List[str]:
    return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]


def test_migration_1_matches_the_frozen_v1_schema(tmp_path: Path) -> None:
    frozen = sqlite3.connect(tmp_path / "frozen.db")
    ours = sqlite3.connect(tmp_path / "ours.db")
    try:
        for sql in V1_SCHEMA:
            frozen.execute(sql)
        for sql in store.MIGRATIONS[0].statements:
            ours.execute(sql)
        for table in ("hosts", "runs", "events", "cursors"):
            assert _columns(ours, table) == _columns(frozen, table), table
    finally:
        frozen.close()
        ours.close()


def test_version_1_database_is_migrated_with_rows_intact(home: Path) -> None:
    home.mkdir(mode=0o700)
    path = home / "rgt.db"
    conn = sqlite3.connect(path)
    for sql in V1_SCHEMA:
        conn.execute(sql)
    conn.execute("INSERT INTO runs VALUES (?, 'box1', 'boot-1', 1, '0.1.0', '{\"cmd\":\"t.py\"}',"
                 " '', 10.0, 20.0)", (RUN,))
    conn.executemany(
        "INSERT INTO events VALUES (?, ?, ?, ?, 'info', 'box1', ?, 30.0)",
        [(RUN, 1, 100.5, "heartbeat", '{"n":1}'), (RUN, 2, 101.5, "gpu.sample", '{"gpu":0}')],
    )
    conn.execute("INSERT INTO cursors VALUES (?, 2, 'boot-1', 30.0)", (RUN,))
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()

    with Store.open() as s:
        assert s.cursor(RUN) == 2
        assert s.events(RUN) == [
            Event(run=RUN, host="box1", seq=1, ts=100.5, kind="heartbeat", sev="info", data={"n": 1}),
            Event(run=RUN, host="box1", seq=2, ts=101.5, kind="gpu.sample", sev="info",
                  data={"gpu": 0}),
        ]
        (run,) = s.runs()
        assert (run["run"], run["boot_id"], run["meta"], run["first_seen"]) == (
            RUN, "boot-1", {"cmd": "t.py"}, 10.0)
        s.record_gap(RUN, 3, 4, "disk full")  # the table migration 2 adds
        assert [g["reason"] for g in s.gaps(RUN)] == ["disk full"]

    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        indexes = [r[1] for r in conn.execute("PRAGMA index_list(events)")]
        assert "events_run_kind" in indexes
    finally:
        conn.close()


def test_a_failing_migration_step_is_rolled_back_whole(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Store.open().close()
    broken = Migration(SCHEMA_VERSION + 1, "broken", (
        "CREATE TABLE half_done (x INTEGER)",
        "CREATE TABLE runs (x INTEGER)",  # already exists: fails
    ))
    monkeypatch.setattr(store, "MIGRATIONS", (*store.MIGRATIONS, broken))
    with pytest.raises(StoreError, match="already exists"):
        Store.open()
    monkeypatch.undo()

    conn = sqlite3.connect(home / "rgt.db")
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "half_done" not in tables
    finally:
        conn.close()


def test_a_file_that_is_not_a_database_is_reported(home: Path) -> None:
    home.mkdir(mode=0o700)
    (home / "rgt.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreCorrupt) as info:
        Store.open()
    assert str(home / "rgt.db") in str(info.value)
    assert info.value.hint is not None and f"move {home / 'rgt.db'} aside" in info.value.hint


def test_a_held_write_lock_times_out_as_store_busy(
        db: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "BUSY_TIMEOUT_S", 0.05)
    with Store.open() as impatient:
        other = sqlite3.connect(db.path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(StoreBusy):
                impatient.apply(RUN, [ev(1)], 1)
            other.execute("ROLLBACK")
        finally:
            other.close()
        assert impatient.apply(RUN, [ev(1)], 1) == 1  # no transaction left open by the failure


# ---- apply and cursors ------------------------------------------------------


def test_apply_is_idempotent_on_run_and_seq(db: Store) -> None:
    batch = [ev(1), ev(2, "gpu.sample", gpu=0), ev(3, "gpu.xid", "warn", code=79)]
    assert db.apply(RUN, batch, 3) == 3
    assert db.apply(RUN, batch, 3) == 0
    assert db.count_events(RUN) == 3
    assert db.apply(RUN, [ev(2), ev(3), ev(4), ev(5)], 5) == 2
    assert db.count_events(RUN) == 5
    assert db.events(RUN)[:3] == batch  # the first copy stays


def test_apply_returns_only_new_rows_with_an_empty_batch(db: Store) -> None:
    assert db.apply(RUN, [], 7) == 0
    assert db.cursor(RUN) == 7


def test_cursor_persists_across_reopen(home: Path) -> None:
    with Store.open() as s:
        assert s.cursor(RUN) == 0
        s.apply(RUN, [ev(1), ev(2)], 2)
        s.apply(RUN, [ev(3)], 3)
    with Store.open() as s:
        assert s.cursor(RUN) == 3
        assert s.cursor("other") == 0
        assert [e.seq for e in s.events(RUN)] == [1, 2, 3]


def test_apply_writes_all_or_nothing(db: Store) -> None:
    db.apply(RUN, [ev(1)], 1)
    with pytest.raises(StoreError, match="seq 3"):
        db.apply(RUN, [ev(2), ev(3, blob=object())], 3)
    with pytest.raises(ValueError, match="belongs to run 'other'"):
        db.apply(RUN, [ev(2), ev(3, run="other")], 3)
    assert db.count_events(RUN) == 1
    assert db.cursor(RUN) == 1


def test_non_finite_numbers_read_back_as_on_the_wire(db: Store) -> None:
    db.apply(RUN, [ev(1, "train.nonfinite", "critical", loss=math.nan, grad=-math.inf)], 1)
    (got,) = db.events(RUN)
    assert got.data == {"loss": "nan", "grad": "-inf"}


def test_events_filter_by_since_kind_prefix_and_limit(db: Store) -> None:
    kinds = ["heartbeat", "gpu.sample", "gpu.xid", "gpux", "job.exited", "gpu.sample"]
    db.apply(RUN, [ev(i, k) for i, k in enumerate(kinds, 1)][::-1], 6)  # stored out of order
    db.apply("other", [ev(1, "gpu.xid", run="other")], 1)

    def seqs(**kw: Any) -> List[int]:
        return [e.seq for e in db.events(RUN, **kw)]

    assert seqs() == [1, 2, 3, 4, 5, 6]
    assert seqs(since=4) == [5, 6]
    assert seqs(kind_prefix="gpu.") == [2, 3, 6]
    assert seqs(kind_prefix="gpu") == [2, 3, 4, 6]
    assert seqs(kind_prefix="gpu.xid") == [3]
    assert seqs(kind_prefix="gpu.", since=2, limit=1) == [3]
    assert seqs(limit=0) == []
    assert seqs(kind_prefix="nope") == []


def test_kind_prefix_is_exact_at_unicode_edges(db: Store) -> None:
    # The prefix's upper bound increments its last code point: past U+10FFFF it
    # carries into the previous one, and after U+D7FF it skips the surrogates.
    kinds = ["x\U0010ffff", "x\U0010ffffa", "y", "a\ud7ffz", "a\ue000"]
    db.apply(RUN, [ev(i, k) for i, k in enumerate(kinds, 1)], 5)
    assert [e.kind for e in db.events(RUN, kind_prefix="x\U0010ffff")] == kinds[:2]
    assert [e.kind for e in db.events(RUN, kind_prefix="x")] == kinds[:2]
    assert [e.kind for e in db.events(RUN, kind_prefix="a\ud7ff")] == ["a\ud7ffz"]


# ---- runs, gaps, data_version ------------------------------------------------


def test_upsert_run_keeps_first_seen_and_known_fields(home: Path) -> None:
    now = [100.0]
    with Store.open(clock=lambda: now[0]) as s:
        s.upsert_run(RUN, host="box1", boot_id="b1", protocol_version=1, package_version="0.1.0",
                     meta={"cmd": "python train.py"}, endpoint="ipc:///tmp/x")
        now[0] = 200.0
        s.upsert_run(RUN, host="box1")  # nothing new known: only last_seen moves
        (run,) = s.runs()
        assert run == {
            "run": RUN, "host": "box1", "boot_id": "b1", "protocol_version": 1,
            "package_version": "0.1.0", "meta": {"cmd": "python train.py"},
            "endpoint": "ipc:///tmp/x", "first_seen": 100.0, "last_seen": 200.0,
            "last_seq": 0, "cursor_updated_at": None, "target": "", "run_dir": "",
            "resumed_from": "", "group_run": "", "node": "", "launch": {},
        }
        s.upsert_run(RUN, host="", target="box", run_dir="/r/x")  # rgt launch knows these first
        s.upsert_run(RUN, host="box1")
        assert (s.run(RUN[:3])["target"], s.run(RUN)["run_dir"]) == ("box", "/r/x")
        now[0] = 300.0
        s.upsert_run(RUN, host="box2", boot_id="b2")
        s.apply(RUN, [ev(1)], 1)
        (run,) = s.runs()
        assert (run["host"], run["boot_id"], run["first_seen"], run["last_seen"]) == (
            "box2", "b2", 100.0, 300.0)
        assert (run["last_seq"], run["cursor_updated_at"]) == (1, 300.0)


def test_runs_lists_newest_first_including_apply_only_runs(home: Path) -> None:
    now = [1.0]
    with Store.open(clock=lambda: now[0]) as s:
        s.upsert_run("old", host="a")
        now[0] = 2.0
        s.apply("applied-only", [ev(1, run="applied-only")], 1)
        now[0] = 3.0
        s.upsert_run("new", host="b")
        assert [r["run"] for r in s.runs()] == ["new", "applied-only", "old"]


def test_resolve_run_by_id_or_unique_prefix(db: Store) -> None:
    for run in ("train-abc1", "train-abd2", "train-1", "train-10"):
        db.upsert_run(run, host="box1")
    db.apply("gpu-job", [ev(1, run="gpu-job")], 1)

    assert db.resolve_run("train-abc1") == "train-abc1"
    assert db.resolve_run("train-abc") == "train-abc1"
    assert db.resolve_run("train-1") == "train-1"  # an exact id wins over being a prefix
    assert db.resolve_run("gpu") == "gpu-job"

    with pytest.raises(AmbiguousRun) as amb:
        db.resolve_run("train-ab")
    assert amb.value.candidates == ["train-abc1", "train-abd2"]
    assert "train-abc1, train-abd2" in str(amb.value)

    with pytest.raises(RunNotFound) as unknown:
        db.resolve_run("nope")
    assert set(unknown.value.candidates) == {"train-abc1", "train-abd2", "train-1", "train-10",
                                              "gpu-job"}
    assert unknown.value.hint is not None and "train-abc1" in unknown.value.hint
    with pytest.raises(RunNotFound):
        db.resolve_run("")


def test_resolve_run_in_an_empty_store_says_so(db: Store) -> None:
    with pytest.raises(RunNotFound) as info:
        db.resolve_run("x")
    assert info.value.hint is not None and "no runs are recorded" in info.value.hint


def test_record_gap_is_idempotent_and_checked(db: Store) -> None:
    db.record_gap(RUN, 5, 9, "disk full")
    db.record_gap(RUN, 5, 9, "disk full")
    db.record_gap(RUN, 2, 2, "dropped")
    assert [(g["first_seq"], g["last_seq"], g["reason"]) for g in db.gaps(RUN)] == [
        (2, 2, "dropped"), (5, 9, "disk full")]
    with pytest.raises(ValueError):
        db.record_gap(RUN, 9, 5, "backwards")
    with pytest.raises(ValueError):
        db.record_gap(RUN, 0, 5, "zero")


def test_data_version_moves_on_commits_by_other_connections(db: Store) -> None:
    with Store.open() as writer:
        before = db.data_version()
        assert db.data_version() == before
        writer.apply(RUN, [ev(1)], 1)
        after = db.data_version()
        assert after != before
        db.apply(RUN, [ev(2)], 2)  # its own commit does not count
        assert db.data_version() == after


def test_a_closed_store_raises_store_error(home: Path) -> None:
    s = Store.open()
    s.close()
    with pytest.raises(StoreError):
        s.cursor(RUN)


# ---- hosts, controller-side events, wakes, policies -------------------------


def test_hosts_are_added_once_listed_and_replaced_only_on_request(home: Path) -> None:
    with Store.open() as s:
        s.add_host("b", ssh="alias-b", profile="autodl")
        with pytest.raises(StoreError, match="exists already") as e:
            s.add_host("b", ssh="other")
        assert e.value.hint and "--replace" in e.value.hint
        s.set_installed("b", {"version": "0.1.0", "venv": "~/.rgt/venv"})
        s.add_host("b", ssh="alias-c", onbox="x/rgt-onbox", root="/data", replace=True)
        s.add_host("a", ssh="alias-a")
        assert [h["name"] for h in s.hosts()] == ["a", "b"]
        b = s.host("b")
        assert (b["ssh"], b["profile"], b["onbox"], b["root"]) == ("alias-c", "", "x/rgt-onbox", "/data")
        assert b["installed"] == {"version": "0.1.0", "venv": "~/.rgt/venv"}  # survives a replace
        with pytest.raises(HostNotFound, match="no host 'zz'") as missing:
            s.host("zz")
        assert missing.value.hint and "a, b" in missing.value.hint


def test_local_events_have_their_own_ids_and_filter_by_prefix(home: Path) -> None:
    with Store.open(clock=lambda: 5.0) as s:
        first = s.add_local_event(RUN, "link.lost", "warn", {"why": "ssh master gone"})
        s.add_local_event("other", "link.lost", "warn", {})
        s.add_local_event(RUN, "link.restored", "info", {"down_s": 1.5}, ts=9.0)
        s.add_local_event(RUN, "sidecar.silent", "warn", {})
        assert (first.ts, first.data) == (5.0, {"why": "ssh master gone"})
        kinds = [(e.kind, e.ts) for e in s.local_events(RUN)]
        assert kinds == [("link.lost", 5.0), ("link.restored", 9.0), ("sidecar.silent", 5.0)]
        assert [e.kind for e in s.local_events(RUN, since_id=first.id)] == ["link.restored", "sidecar.silent"]
        assert [e.kind for e in s.local_events(RUN, kind_prefix="link.")] == ["link.lost", "link.restored"]
        with pytest.raises(ValueError):
            s.add_local_event(RUN, "x", "loud", {})


def test_wakes_policies_and_shown_notices_are_remembered(home: Path) -> None:
    with Store.open() as s:
        assert s.mark_woken(RUN, "seq:7") and not s.mark_woken(RUN, "seq:7")
        assert list(s.woken(RUN)) == ["seq:7"] and s.woken("other") == {}
        assert s.policy(RUN) == {}
        s.set_policy(RUN, {"mute": ["gpu.throttle"]})
        s.set_policy("*", {"min_sev": "critical"})
        assert (s.policy(RUN), s.policy("*")) == ({"mute": ["gpu.throttle"]}, {"min_sev": "critical"})
        assert s.mark_shown("profile:autodl") and not s.mark_shown("profile:autodl")


def test_lineage_ties_a_run_to_its_resume_and_group(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s.db") as s:
        s.upsert_run("b", host="", target="h2", run_dir="/r/b")
        s.set_lineage("b", resumed_from="a")
        s.set_lineage("b", group_run="g", node="n1")
        s.set_lineage("b", resumed_from=None)  # None keeps what is there
        run = s.run("b")
        assert (run["resumed_from"], run["group_run"], run["node"]) == ("a", "g", "n1")


def test_transaction_rolls_back_on_error(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s.db") as s:
        with pytest.raises(RuntimeError):
            with s.transaction() as conn:
                conn.execute("INSERT INTO queues (name, hosts, created_at, updated_at) "
                             "VALUES ('q', '[]', 1, 1)")
                raise RuntimeError("boom")
        with s.transaction() as conn:
            assert conn.execute("SELECT COUNT(*) FROM queues").fetchone()[0] == 0


def test_change_marks_move_with_each_apply_and_local_event(tmp_path: Path) -> None:
    now = [100.0]
    with Store.open(tmp_path / "s.db", clock=lambda: now[0]) as s:
        assert s.change_marks() == {}
        s.apply("a", [ev(1, run="a")], 1)
        s.apply("b", [ev(1, run="b")], 1)
        first = s.change_marks()
        assert first == {"a": (1, 100.0, 0), "b": (1, 100.0, 0)}
        now[0] = 101.0
        s.apply("a", [ev(2, run="a")], 2)
        local = s.add_local_event("b", "link.lost", "warn", {})
        marks = s.change_marks()
        assert marks["a"] == (2, 101.0, 0) and marks["b"] == (1, 100.0, local.id)
        assert s.run("a")["last_seq"] == 2 and s.run("b")["run"] == "b"  # the exact-id path
