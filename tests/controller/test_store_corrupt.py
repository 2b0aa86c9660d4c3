"""A damaged store (a JSON column edited or torn, a file that is not SQLite, damaged pages) is
reported as such: the file, the row, and the way back; `rgt watch` keeps its one-JSON-line contract."""
from __future__ import annotations

import json
import shlex
import sqlite3
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
from click.testing import CliRunner, Result

from controller.cli import watch as cli_watch
from controller.cli.base import RgtGroup
from controller.store.db import Store, StoreCorrupt
from protocol import Event

RUN = "train-7f3a"


def ev(seq: int, kind: str = "heartbeat") -> Event:
    return Event(run=RUN, host="box1", seq=seq, ts=1_700_000_000.0 + seq, kind=kind, sev="info",
                 data={"n": seq})


@pytest.fixture
def db(home: Path) -> Path:
    """A store with one run, its events, a local event, a host and a policy; closed again."""
    with Store.open() as s:
        s.upsert_run(RUN, host="box1", meta={"cmd": "python train.py"}, target="gpu1", run_dir="/r/x")
        s.record_launch(RUN, {"command": ["python", "train.py"]})
        s.apply(RUN, [ev(1, "sidecar.started"), ev(2, "job.started"), ev(3)], 3)
        s.add_local_event(RUN, "link.lost", "warn", {"why": "eof"})
        s.add_host("gpu1", ssh="gpu1")
        s.set_policy(RUN, {"min_sev": "warn"})
        return s.path


def damage(path: Path, sql: str) -> None:
    """Write garbage into one column with plain sqlite3, as a hand edit or a torn copy would."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert conn.execute(sql).rowcount == 1
    finally:
        conn.close()


def assert_recoverable(e: StoreCorrupt, path: Path) -> None:
    assert str(path) in str(e)
    hint = e.hint or ""
    assert f"move {path} aside" in hint
    assert "journal" in hint and "rgt track HOST RUN" in hint and "rgt hosts add" in hint


READS: Dict[str, Callable[[Store], Any]] = {
    "runs": lambda s: s.runs(),
    "run": lambda s: s.run(RUN),
    "events": lambda s: s.events(RUN),
    "local_events": lambda s: s.local_events(RUN),
    "hosts": lambda s: s.hosts(),
    "policy": lambda s: s.policy(RUN),
}


@pytest.mark.parametrize("sql, read, where", [
    ("UPDATE runs SET meta = '{\"cmd\": ' WHERE run = 'train-7f3a'", "runs",
     "the meta of run 'train-7f3a' (table runs)"),
    ("UPDATE runs SET meta = 'nan nan' WHERE run = 'train-7f3a'", "run",
     "the meta of run 'train-7f3a' (table runs)"),
    ("UPDATE runs SET launch = '{' WHERE run = 'train-7f3a'", "runs",
     "the launch of run 'train-7f3a' (table runs)"),
    ("UPDATE events SET data = 'not json' WHERE run = 'train-7f3a' AND seq = 2", "events",
     "the data of event seq 2 of run 'train-7f3a' (table events)"),
    ("UPDATE local_events SET data = '{]' WHERE run = 'train-7f3a'", "local_events",
     "the data of local event 1 of run 'train-7f3a' (table local_events)"),
    ("UPDATE hosts SET installed = '\"unterminated' WHERE name = 'gpu1'", "hosts",
     "the install record of host 'gpu1' (table hosts)"),
    ("UPDATE policies SET policy = '' WHERE run = 'train-7f3a'", "policy",
     "the wake policy of 'train-7f3a' (table policies)"),
])
def test_a_damaged_json_column_names_the_file_the_row_and_the_way_back(
        db: Path, sql: str, read: str, where: str) -> None:
    damage(db, sql)
    with Store.open() as s:
        with pytest.raises(StoreCorrupt) as info:
            READS[read](s)
    assert f"the store {db} is damaged: {where} is not valid JSON" in str(info.value)
    assert_recoverable(info.value, db)


def test_the_other_rows_still_read_and_valid_non_objects_stay_harmless(db: Path) -> None:
    damage(db, "UPDATE events SET data = '[1, 2]' WHERE run = 'train-7f3a' AND seq = 3")
    with Store.open() as s:
        assert [e.data for e in s.events(RUN)] == [{"n": 1}, {"n": 2}, {}]


def test_a_file_that_is_not_sqlite_is_reported_with_the_way_back(home: Path) -> None:
    home.mkdir(mode=0o700)
    (home / "rgt.db").write_bytes(b"\x00garbage, not SQLite\xff" * 300)
    with pytest.raises(StoreCorrupt) as info:
        Store.open()
    assert "damaged or not an rgt database" in str(info.value)
    assert_recoverable(info.value, home / "rgt.db")


def test_damaged_pages_are_reported_with_the_way_back(db: Path) -> None:
    with Store.open() as s:   # enough rows for pages past the first, then fold the WAL in
        for i in range(60):
            s.add_local_event(RUN, "note", "info", {"text": "x" * 400, "i": i})
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    with open(db, "r+b") as f:   # keep the 100-byte header and the first page, smash the rest
        size = f.seek(0, 2)
        f.seek(4096)
        f.write(b"\xff" * (size - 4096))
    with pytest.raises(StoreCorrupt) as info:
        with Store.open() as s:
            s.runs()
            s.local_events(RUN)
    assert "malformed" in str(info.value)
    assert_recoverable(info.value, db)


# ---- the commands ------------------------------------------------------------------------


def invoke(args: List[str]) -> Result:
    rgt = RgtGroup("rgt")   # how controller/cli/main.py serves the commands
    rgt.add_command(cli_watch.watch_command)
    rgt.add_command(cli_watch.status_command)
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]  # click 8.1
    except TypeError:
        runner = CliRunner()                    # click 8.2+: stderr is apart already
    return runner.invoke(rgt, args)


def one_json_line(result: Result) -> Dict[str, Any]:
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    obj: Dict[str, Any] = json.loads(lines[0])
    return obj


@pytest.mark.parametrize("as_json", [["--json"], []])
def test_watch_on_a_damaged_row_prints_one_line_with_the_contract_keys_and_exits_5(
        db: Path, as_json: List[str]) -> None:
    damage(db, "UPDATE runs SET meta = '{' WHERE run = 'train-7f3a'")
    result = invoke(["watch", RUN, "--timeout", "5s", *as_json])
    assert result.exit_code == 5, result.output   # 5: the store is unusable, nothing judged; never 2 (usage)
    obj = one_json_line(result)
    assert {"exit", "run", "error", "event", "explain", "next", "entry"} <= set(obj)
    assert obj["exit"] == 5 and obj["event"] is None and obj["run"] == RUN
    assert str(db) in obj["error"] and "the meta of run 'train-7f3a'" in obj["error"]
    assert "nothing was judged" in obj["explain"]
    assert f"move {db} aside" in obj["hint"] and obj["next"].endswith(f"; rgt watch {RUN}")
    assert shlex.split(obj["next"])[:3] == ["for", "f", "in"] and str(db) in obj["next"]
    assert f"error: the store {db} is damaged" in result.stderr
    assert f"hint: move {db} aside" in result.stderr
    assert "internal error" not in result.output + result.stderr


def test_watch_on_a_garbage_file_prints_one_line_and_quotes_the_runs_to_watch_again(home: Path) -> None:
    home.mkdir(mode=0o700)
    (home / "rgt.db").write_bytes(b"not a database " * 500)
    odd = "run; rm -rf ~"
    result = invoke(["watch", odd, "--json"])
    assert result.exit_code == 5, result.output
    obj = one_json_line(result)
    assert obj["exit"] == 5 and obj["event"] is None and str(home / "rgt.db") in obj["error"]
    assert obj["next"].endswith("; " + shlex.join(["rgt", "watch", odd]))


def test_watch_on_a_damaged_event_exits_5_not_2(db: Path) -> None:
    damage(db, "UPDATE events SET data = 'x' WHERE run = 'train-7f3a' AND seq = 2")
    result = invoke(["watch", RUN, "--timeout", "5s", "--json"])
    assert result.exit_code == 5, result.output
    assert "event seq 2 of run 'train-7f3a'" in one_json_line(result)["error"]


def test_status_on_a_damaged_store_says_which_file_and_how_to_recover(db: Path) -> None:
    damage(db, "UPDATE runs SET meta = '{' WHERE run = 'train-7f3a'")
    result = invoke(["status"])
    assert result.exit_code == 1
    assert f"error: the store {db} is damaged: the meta of run 'train-7f3a' (table runs)" in result.stderr
    assert f"hint: move {db} aside" in result.stderr
    assert "internal error" not in result.stderr
