"""`rgt events` end to end: a real store file, click's runner, and a real follower process."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, List, Optional

import pytest
from click.testing import CliRunner, Result

from controller.cli import main as cli
from controller.store import events
from controller.store.db import SCHEMA_VERSION, Store
from protocol import Event, decode_event

RUN = "train-abc123"
REPO = Path(__file__).resolve().parents[2]
WAIT_S = 15.0  # generous upper bound for anything a test waits on; never a sleep


def ev(seq: int, kind: str = "heartbeat", sev: str = "info", run: str = RUN, **data: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=1_700_000_000.5 + seq, kind=kind, sev=sev,
                 data=data or {"n": seq})


EVENTS = [
    ev(1, "sidecar.started", pid=4242),
    ev(2, "gpu.sample", gpu=0, util_pct=97.5),
    ev(3, "gpu.xid", "warn", code=79, pci="0000:3b:00.0"),
    ev(4, "heartbeat", uptime_s=60),
    ev(5, "job.exited", "warn", code=1, signal=None, oom_killed=False),
]


@pytest.fixture
def populated(home: Path) -> Path:
    with Store.open() as s:
        s.upsert_run(RUN, host="box1", boot_id="b1")
        s.upsert_run("train-zzz999", host="box2")
        s.apply(RUN, EVENTS, 5)
    return home


def rgt(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def clock(seq: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(1_700_000_000.5 + seq))


# ---- listing ----------------------------------------------------------------


def test_table_has_a_header_and_one_line_per_event(populated: Path) -> None:
    result = rgt("events", RUN)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"\s*SEQ\s+TIME\s+SOURCE\s+SEV\s+KIND\s+DATA", lines[0])
    assert len(lines) == 1 + len(EVENTS)
    assert re.fullmatch(
        rf"\s+3  {clock(3)}  box\s+warn\s+gpu\.xid\s+code=79 pci=0000:3b:00\.0", lines[3])
    assert re.fullmatch(
        rf"\s+5  {clock(5)}  box\s+warn\s+job\.exited\s+code=1 signal=null oom_killed=false", lines[5])
    assert result.stderr == ""


def test_table_escapes_control_characters_and_cuts_long_data(home: Path) -> None:
    with Store.open() as s:
        s.apply(RUN, [ev(1, "job\x1b[2Jexited", msg="a" * 500), ev(2, line="\x9b31m red")], 2)
    lines = rgt("events", RUN).stdout.splitlines()
    assert "\x1b" not in lines[1] and "job\\x1b[2Jexited" in lines[1]
    assert lines[1].endswith("...") and len(lines[1]) < 160
    assert "\x9b" not in lines[2] and "\\x9b31m red" in lines[2]


def test_json_lines_parse_back_to_the_same_events(populated: Path) -> None:
    result = rgt("events", RUN, "--json")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [json.loads(line) for line in lines] == [{**e.to_dict(), "source": "box"} for e in EVENTS]
    assert [decode_event(line.encode()) for line in lines] == EVENTS


def test_kind_filter_is_a_prefix(populated: Path) -> None:
    lines = rgt("events", RUN, "--json", "--kind", "gpu.").stdout.splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["gpu.sample", "gpu.xid"]
    lines = rgt("events", RUN, "--json", "--kind", "job.exited").stdout.splitlines()
    assert [json.loads(line)["seq"] for line in lines] == [5]


def test_since_and_limit(populated: Path) -> None:
    lines = rgt("events", RUN, "--json", "--since", "3").stdout.splitlines()
    assert [json.loads(line)["seq"] for line in lines] == [4, 5]
    lines = rgt("events", RUN, "--json", "--since", "1", "--limit", "2").stdout.splitlines()
    assert [json.loads(line)["seq"] for line in lines] == [2, 3]


def test_run_by_unique_prefix(populated: Path) -> None:
    lines = rgt("events", "train-abc", "--json").stdout.splitlines()
    assert len(lines) == len(EVENTS)


# ---- errors and exit codes -----------------------------------------------------


def test_unknown_run_is_exit_1_with_a_hint_listing_runs(populated: Path) -> None:
    result = rgt("events", "nope")
    assert result.exit_code == 1
    assert result.stdout == ""
    err = result.stderr.splitlines()
    assert err[0].startswith("error: no run 'nope'")
    assert err[1].startswith("hint: ") and RUN in err[1] and "train-zzz999" in err[1]
    assert "Traceback" not in result.stderr


def test_ambiguous_prefix_is_exit_1(populated: Path) -> None:
    result = rgt("events", "train-")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: 'train-' matches 2 runs")


@pytest.mark.parametrize("args", [
    ["events"], ["events", RUN, "--limit", "0"], ["events", RUN, "--since", "-1"],
    ["events", RUN, "--bogus"], ["nosuchcommand"],
])
def test_usage_errors_are_exit_2(populated: Path, args: List[str]) -> None:
    result = rgt(*args)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ")
    assert "hint: see 'rgt" in result.stderr


def test_a_newer_store_is_exit_1_saying_upgrade(home: Path) -> None:
    Store.open().close()
    conn = sqlite3.connect(home / "rgt.db")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    result = rgt("events", RUN)
    assert result.exit_code == 1
    assert f"schema version {SCHEMA_VERSION + 1}" in result.stderr
    assert "hint: upgrade rgt" in result.stderr


def test_tracebacks_only_with_debug(populated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: Store, name: str) -> str:
        raise RuntimeError("kaput")

    monkeypatch.setattr(Store, "resolve_run", boom)
    quiet = rgt("events", RUN)
    assert quiet.exit_code == 1
    assert quiet.stderr.splitlines() == [
        "error: internal error: RuntimeError: kaput",
        "hint: rerun with --debug for the traceback",
    ]
    loud = rgt("--debug", "events", RUN)
    assert loud.exit_code == 1
    assert "Traceback (most recent call last)" in loud.stderr
    assert "error: internal error: RuntimeError: kaput" in loud.stderr


# ---- follow -----------------------------------------------------------------------


def seqs(batch: List[Event]) -> List[int]:
    return [e.seq for e in batch]


def test_follow_shows_late_and_backfilled_events_once(home: Path) -> None:
    stop = threading.Event()
    deadline = threading.Timer(WAIT_S, stop.set)  # a broken follow ends the test, not hangs it
    deadline.start()
    try:
        with Store.open() as writer, Store.open() as reader:
            writer.apply(RUN, [ev(1), ev(2), ev(5)], 2)  # 3 and 4 not repaired yet
            follow = events.iter_events(reader, RUN, follow=True, stop=stop, poll_s=0.01)
            assert seqs(next(follow)) == [1, 2, 5]
            writer.apply(RUN, [ev(3), ev(4)], 5)        # the gap repair lands
            assert seqs(next(follow)) == [3, 4]
            writer.apply(RUN, [ev(5), ev(6), ev(7, "gpu.xid")], 7)
            assert seqs(next(follow)) == [6, 7]
            stop.set()
            assert list(follow) == []
    finally:
        deadline.cancel()
        deadline.join()


def test_follow_applies_kind_and_limit(home: Path) -> None:
    stop = threading.Event()
    deadline = threading.Timer(WAIT_S, stop.set)
    deadline.start()
    try:
        with Store.open() as writer, Store.open() as reader:
            writer.apply(RUN, [ev(1), ev(2, "gpu.xid")], 2)
            follow = events.iter_events(reader, RUN, follow=True, kind_prefix="gpu.", limit=2,
                                     stop=stop, poll_s=0.01)
            assert seqs(next(follow)) == [2]
            writer.apply(RUN, [ev(3), ev(4, "gpu.ecc"), ev(5, "gpu.lost")], 5)
            assert seqs(next(follow)) == [4]
            assert list(follow) == []  # the limit ends it without waiting for stop
            assert not stop.is_set()
    finally:
        deadline.cancel()
        deadline.join()


def test_follow_with_limit_ends_on_its_own(populated: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    result = rgt("events", RUN, "--follow", "--json", "--limit", "3")
    assert result.exit_code == 0, result.stderr
    assert [json.loads(line)["seq"] for line in result.stdout.splitlines()] == [1, 2, 3]
    assert signal.getsignal(signal.SIGTERM) is before


class Lines:
    """Lines of a stream, read by a thread, fetched with a timeout."""

    def __init__(self, stream: IO[str]) -> None:
        self._queue: queue.Queue[Optional[str]] = queue.Queue()
        self._stream = stream
        self.thread = threading.Thread(target=self._read, name="follower-stdout", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self._stream:
            self._queue.put(line)
        self._queue.put(None)

    def _next(self) -> Optional[str]:
        try:
            return self._queue.get(timeout=WAIT_S)
        except queue.Empty:
            pytest.fail(f"nothing from the follower within {WAIT_S} s")

    def line(self) -> str:
        """The next line; fails at end of stream or after WAIT_S."""
        got = self._next()
        assert got is not None, "the follower closed its stdout early"
        return got

    def at_end(self) -> bool:
        """True when the stream ended with no further line; fails after WAIT_S."""
        return self._next() is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_follow_process_streams_new_events_and_exits_0_on_signal(
        populated: Path, sig: signal.Signals) -> None:
    # A suite started in the background (`make test &`) inherits SIGINT ignored, and so would the
    # child; a person's terminal never ignores it, so the child gets the default back, as there.
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.cli.main", "events", "train-abc", "--follow", "--json"],
        cwd=REPO, env=dict(os.environ), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        out = Lines(proc.stdout)
        backlog = [decode_event(out.line().encode()) for _ in EVENTS]
        assert backlog == EVENTS

        new = [ev(6, "gpu.xid", "warn", code=48), ev(7, "ckpt.saved", path="ckpt/7.pt")]
        with Store.open() as writer:
            writer.apply(RUN, new, 7)
            writer.apply("train-zzz999", [ev(1, run="train-zzz999")], 1)  # another run: not shown
            writer.apply(RUN, [ev(8)], 8)
        streamed = [decode_event(out.line().encode()) for _ in range(3)]
        assert streamed == [*new, ev(8)]

        proc.send_signal(sig)
        assert proc.wait(timeout=WAIT_S) == 0
        assert out.at_end()  # nothing more after the last event
        out.thread.join(WAIT_S)
        assert not out.thread.is_alive()
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
