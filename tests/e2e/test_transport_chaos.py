"""10,000 events, with the subscriber or the sidecar SIGKILLed at random points.

Every event the sidecar journaled must land in the store exactly once, in
order, with the same content: the store ends up equal to the journal.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

from controller.store.db import Store
from onbox.sidecar.journal import read_all
from tests.helpers import REPO, SidecarProcess, rgt_cmd, wait_until

pytestmark = pytest.mark.e2e

TOTAL = 10_000
RATE = "2500"   # events/s: long enough to be interrupted many times
RESTART_RATE = "1000"   # events/s for the sidecar kills: 10 s of stream, so each kill is mid-stream
KILLS, RESTARTS = 5, 3


def journal_lines(rgt_dir: Path) -> int:
    """Lines in the journal's files: a cheap count of what the sidecar has written."""
    return sum(p.read_bytes().count(b"\n") for p in rgt_dir.glob("events*.jsonl"))


class Attach:
    """`rgt attach RUN_DIR --quiet`: a subscriber process we can SIGKILL."""

    def __init__(self, run_dir: Path, home: Path) -> None:
        self.args = rgt_cmd("attach", str(run_dir), "--quiet")
        self.env = {**os.environ, "RGT_HOME": str(home)}
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> Attach:
        self.proc = subprocess.Popen(self.args, env=self.env, cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def cleanup() -> Iterator[List[object]]:
    things: List[object] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, Attach):
            thing.kill()
        elif isinstance(thing, SidecarProcess):
            thing.stop()


def stored(home: Path, run: str) -> List[dict]:
    with Store.open(home / "rgt.db") as store:
        return [{"seq": e.seq, "kind": e.kind, "sev": e.sev, "ts": e.ts, "data": dict(e.data)}
                for e in store.events(run)]


def count(home: Path, run: str) -> int:
    if not (home / "rgt.db").exists():
        return 0
    with Store.open(home / "rgt.db") as store:
        return store.count_events(run) if store.runs() else 0


def cursor(home: Path, run: str) -> int:
    with Store.open(home / "rgt.db") as store:
        return store.cursor(run)


def assert_store_equals_journal(home: Path, run: str, run_dir: Path) -> int:
    """The store holds a prefix of the journal: every seq once, in order, field by field.

    The subscriber may still be storing (heartbeats go on), so the store is read first and
    the journal after it: the journal then covers everything the store can hold."""
    got = stored(home, run)
    journal = [{k: e[k] for k in ("seq", "kind", "sev", "ts", "data")} for e in read_all(run_dir / "rgt")]
    assert len(got) >= TOTAL and len(journal) >= len(got)
    assert [e["seq"] for e in got] == list(range(1, len(got) + 1))
    assert got == journal[: len(got)]
    return len(got)


def test_subscriber_killed_and_restarted_at_random_points(tmp_path: Path, home: Path,
                                                          cleanup: List[object]) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    run_dir = tmp_path / "active" / "run-chaos"
    sidecar = SidecarProcess(run_dir, "--synthetic", str(TOTAL), "--synthetic-rate", RATE,
                             "--heartbeat", "0.5").start()
    cleanup.append(sidecar)
    kills = 0
    for _ in range(KILLS):   # a fixed number of kills, each at a random point: none depends on speed
        sub = Attach(run_dir, home).start()
        cleanup.append(sub)
        target = min(TOTAL, count(home, "run-chaos") + rng.randint(100, 1500))
        wait_until(lambda t=target: count(home, "run-chaos") >= t, 60,
                   f"store to reach {target} (seed {seed})")
        sub.kill()
        kills += 1
    final = Attach(run_dir, home).start()
    cleanup.append(final)
    wait_until(lambda: cursor(home, "run-chaos") >= TOTAL, 60, f"catch-up (seed {seed})")
    final.kill()
    assert kills == KILLS
    assert_store_equals_journal(home, "run-chaos", run_dir)


def test_sidecar_killed_and_restarted_mid_stream(tmp_path: Path, home: Path,
                                                 cleanup: List[object]) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    run_dir = tmp_path / "active" / "run-crash"
    args = ("--synthetic", str(TOTAL), "--synthetic-rate", RESTART_RATE, "--heartbeat", "0.5")
    sidecar = SidecarProcess(run_dir, *args).start()
    cleanup.append(sidecar)
    sub = Attach(run_dir, home).start()
    cleanup.append(sub)
    restarts = 0
    for _ in range(RESTARTS):
        # Each kill comes a few hundred events after the last start, read by counting lines (not by
        # parsing the journal, which a starved test could not keep up with): the stream is still
        # seconds from its end, so every kill lands mid-stream however loaded the machine is.
        target = journal_lines(run_dir / "rgt") + rng.randint(200, 800)
        wait_until(lambda t=target: journal_lines(run_dir / "rgt") >= t, 60,
                   f"journal to reach {target} lines (seed {seed})")
        assert journal_lines(run_dir / "rgt") < TOTAL, f"the stream ended before kill {restarts + 1}"
        sidecar.kill()
        sidecar = SidecarProcess(run_dir, *args).start()
        cleanup.append(sidecar)
        restarts += 1
    wait_until(lambda: cursor(home, "run-crash") >= TOTAL, 60, f"catch-up (seed {seed})")
    assert restarts == RESTARTS
    upto = assert_store_equals_journal(home, "run-crash", run_dir)
    boots = {e["data"]["boot_id"] for e in stored(home, "run-crash")[:upto] if e["kind"] == "sidecar.started"}
    assert len(boots) == restarts + 1
