"""`rgt events RUN` lists every event the laptop knows: the box's and the controller's own, in one
stream ordered by time, each marked with its source. A real store file, click's runner, and a
real `rgt events --follow` process."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any, Dict, List, Tuple

from click.testing import CliRunner, Result

from controller.cli import main as cli
from controller.runs import eventlog
from controller.store.db import Store
from protocol import Event
from tests.helpers import REPO, wait_until

RUN = "train-mix001"
T0 = 1_700_000_000.0


def ev(seq: int, kind: str, ts: float, sev: str = "info", **data: Any) -> Event:
    return Event(run=RUN, host="box1", seq=seq, ts=T0 + ts, kind=kind, sev=sev, data=data or {"n": seq})


BOX = [ev(1, "sidecar.started", 0.0, pid=7), ev(2, "job.started", 1.0, pid=8),
       ev(3, "train.progress", 5.0, step=10), ev(4, "job.exited", 20.0, code=0)]
# (kind, sev, data, ts): what rgt records itself
LOCAL: List[Tuple[str, str, Dict[str, Any], float]] = [
         ("link.lost", "warn", {"reason": "the SSH connection to the box closed"}, 2.0),
         ("link.restored", "info", {"down_s": 0.7, "attempts": 1}, 2.7),
         ("run.stop_requested", "info", {"by": "rgt stop"}, 10.0),
         ("sidecar.degraded", "warn", {"source": "controller", "error": "refused"}, 30.0)]
ORDER = [("box", "sidecar.started"), ("box", "job.started"), ("controller", "link.lost"),
         ("controller", "link.restored"), ("box", "train.progress"), ("controller", "run.stop_requested"),
         ("box", "job.exited"), ("controller", "sidecar.degraded")]


def populate(store: Store) -> None:
    store.upsert_run(RUN, host="box1")
    store.apply(RUN, BOX, 4)
    for kind, sev, data, ts in LOCAL:
        store.add_local_event(RUN, kind, sev, data, ts=T0 + ts)


def rgt(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def listed(*args: str) -> List[Dict[str, Any]]:
    result = rgt("events", RUN, "--json", *args)
    assert result.exit_code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_box_and_controller_events_come_in_one_stream_ordered_by_time(home: Path) -> None:
    with Store.open() as s:
        populate(s)
        local = s.local_events(RUN)
    got = listed()
    assert [(e["source"], e["kind"]) for e in got] == ORDER
    # box events keep their wire shape, with the source added
    assert got[0] == {**BOX[0].to_dict(), "source": "box"}
    lost = got[2]
    assert lost == {"run": RUN, "seq": None, "id": local[0].id, "ts": T0 + 2.0, "kind": "link.lost",
                    "sev": "warn", "data": LOCAL[0][2], "source": "controller"}
    # every controller event the store holds (what `rgt status` counts) is listed
    assert sum(e["source"] == "controller" for e in got) == len(local)


def test_the_table_marks_each_line_with_its_source(home: Path) -> None:
    with Store.open() as s:
        populate(s)
    result = rgt("events", RUN)
    assert result.exit_code == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert re.fullmatch(r"\s*SEQ\s+TIME\s+SOURCE\s+SEV\s+KIND\s+DATA", header)
    assert [row.split()[2:4] for row in rows[:3]] == [["box", "info"], ["box", "info"],
                                                     ["controller", "warn"]]
    assert re.fullmatch(r"\s+-  \d\d:\d\d:\d\d  controller\s+info\s+link\.restored\s+down_s=0\.7 attempts=1",
                        rows[3])
    assert re.fullmatch(r"\s+4  \d\d:\d\d:\d\d  box\s+info\s+job\.exited\s+code=0", rows[6])


def test_kind_since_and_limit_hold_for_both_sources(home: Path) -> None:
    with Store.open() as s:
        populate(s)
    assert [(e["source"], e["kind"]) for e in listed("--kind", "link.")] == ORDER[2:4]
    assert [(e["source"], e["kind"]) for e in listed("--kind", "job.")] == [ORDER[1], ORDER[6]]
    # after box seq 3 (ts 5): box seq 4, and the controller events recorded after ts 5
    assert [(e["source"], e["kind"]) for e in listed("--since", "3")] == ORDER[5:]
    assert [(e["source"], e["kind"]) for e in listed("--limit", "4")] == ORDER[:4]


def test_a_controller_event_string_from_a_box_is_escaped(home: Path) -> None:
    with Store.open() as s:
        s.upsert_run(RUN, host="box1")
        s.add_local_event(RUN, "sidecar.degraded", "warn", {"error": "boom\x1b[2J\u202e"}, ts=T0)
    out = rgt("events", RUN).stdout
    assert "\x1b" not in out and "\u202e" not in out and "boom\\x1b[2J" in out
    raw = rgt("events", RUN, "--json").stdout
    assert "\x1b" not in raw and "\u202e" not in raw
    assert json.loads(raw)["data"]["error"] == "boom\x1b[2J\u202e"


def test_following_merges_what_lands_from_both_sources(home: Path) -> None:
    stop = threading.Event()
    deadline = threading.Timer(15.0, stop.set)   # a broken follow ends the test, not hangs it
    deadline.start()
    try:
        with Store.open() as writer, Store.open() as reader:
            populate(writer)
            follow = eventlog.iter_stream(reader, RUN, follow=True, stop=stop, poll_s=0.01)
            assert [(eventlog.source_of(e), e.kind) for e in next(follow)] == ORDER
            writer.add_local_event(RUN, "link.lost", "warn", {"reason": "x"}, ts=T0 + 40)
            assert [(eventlog.source_of(e), e.kind) for e in next(follow)] == [("controller", "link.lost")]
            writer.apply(RUN, [ev(5, "heartbeat", 41.0)], 5)
            writer.add_local_event(RUN, "link.restored", "info", {"down_s": 1.0}, ts=T0 + 42)
            got: List[Any] = []
            while len(got) < 2:
                got += next(follow)
            assert [(eventlog.source_of(e), e.kind) for e in got] == [("box", "heartbeat"),
                                                                      ("controller", "link.restored")]
            stop.set()
            assert list(follow) == []
    finally:
        deadline.cancel()
        deadline.join()


def test_a_follower_process_prints_controller_events_as_they_are_recorded(home: Path) -> None:
    with Store.open() as s:
        populate(s)
    argv = [sys.executable, "-m", "controller.cli.main", "events", RUN, "--follow", "--json"]
    proc = subprocess.Popen(argv,
                            cwd=REPO, env=dict(os.environ), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        out: IO[str] = proc.stdout
        lines: List[Dict[str, Any]] = []
        reader = threading.Thread(target=lambda: lines.extend(json.loads(line) for line in out),
                                  name="follower-stdout")
        reader.start()
        wait_until(lambda: len(lines) == len(ORDER), 15, "the backlog")
        with Store.open() as s:
            s.add_local_event(RUN, "link.lost", "warn", {"reason": "master gone"})
        wait_until(lambda: len(lines) == len(ORDER) + 1, 15, "the new link.lost")
        assert (lines[-1]["source"], lines[-1]["kind"], lines[-1]["seq"]) == ("controller", "link.lost", None)
        proc.terminate()
        assert proc.wait(15) == 0
        reader.join(15)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(15)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
