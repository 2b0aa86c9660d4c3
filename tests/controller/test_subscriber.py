"""The subscriber against a real sidecar over real ZeroMQ ipc sockets, in-process."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator, List, Sequence

import pytest

from controller.follow.subscriber import Subscriber
from controller.store.db import Store
from onbox.sidecar.journal import read_all
from onbox.sidecar.server import Sidecar, SidecarConfig
from protocol import Event
from protocol.endpoints import Endpoints
from tests.helpers import wait_until


class Running:
    """A sidecar serving on a thread, and a subscriber following it on another."""

    def __init__(self, tmp_path: Path) -> None:
        self.run_dir = tmp_path / "active" / "run-sub"
        self.sidecar = Sidecar(SidecarConfig(run_dir=self.run_dir, heartbeat_s=3600, gpu="none",
                                             kmsg=False))
        self.sidecar.start()
        self.serve_thread = threading.Thread(target=self.sidecar.serve, name="test-serve")
        self.serve_thread.start()
        self.store = Store.open(tmp_path / "state" / "rgt.db")
        self.seen: List[Event] = []
        self.sub_stop = threading.Event()
        self.sub: Subscriber
        self.sub_thread: threading.Thread

    def follow(self, **kw: object) -> Subscriber:
        def hook(events: Sequence[Event]) -> None:
            self.seen.extend(events)

        self.sub_stop.clear()
        self.sub = Subscriber(self.store, Endpoints.read(self.run_dir / "rgt"), on_events=hook, **kw)  # type: ignore[arg-type]
        self.sub_thread = threading.Thread(target=self.sub.run_until, args=(self.sub_stop,), name="test-sub")
        self.sub_thread.start()
        return self.sub

    def unfollow(self) -> None:
        self.sub_stop.set()
        self.sub_thread.join(10)

    @property
    def base(self) -> int:
        """Events the sidecar journaled on its own at start (started, capability)."""
        return 2

    def stored(self) -> List[int]:
        return [e.seq for e in self.store.events(self.sidecar.run_id)]

    def close(self) -> None:
        if not self.sub_stop.is_set():
            self.unfollow()
        self.sidecar.stop()
        self.serve_thread.join(10)
        self.sidecar.close()
        self.store.close()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    r = Running(tmp_path)
    try:
        yield r
    finally:
        r.close()


def journal_seqs(r: Running) -> List[int]:
    return [e["seq"] for e in read_all(r.run_dir / "rgt")]


def test_backlog_then_live_events_arrive_once_in_order(running: Running) -> None:
    for i in range(50):
        running.sidecar.emit("train.progress", {"step": i})
    running.follow()
    b = running.base
    wait_until(lambda: running.sub.caught_up and len(running.stored()) == b + 50, what="backlog")
    for i in range(50, 100):
        running.sidecar.emit("train.progress", {"step": i})
    wait_until(lambda: len(running.stored()) == b + 100, what="live events")
    assert running.stored() == list(range(1, b + 101)) == journal_seqs(running)
    assert [e.seq for e in running.seen] == list(range(1, b + 101))
    assert running.sub.stats.live_applied > 0 and running.sub.stats.replayed >= b + 50


def test_events_missed_while_away_are_replayed(running: Running) -> None:
    running.follow()
    running.sidecar.emit("train.progress", {"step": 0})
    b = running.base
    wait_until(lambda: len(running.stored()) == b + 1, what="first events")
    running.unfollow()
    for i in range(1, 1500):  # more than one since page
        running.sidecar.emit("train.progress", {"step": i})
    running.follow(page=500)
    wait_until(lambda: len(running.stored()) == b + 1500, what="replay")
    assert running.stored() == journal_seqs(running)
    assert running.sub.stats.since_requests >= 3


def test_live_gap_triggers_since_and_repairs(running: Running) -> None:
    running.follow()
    wait_until(lambda: running.sub.caught_up, what="catch up")
    # Journal without publishing: exactly what a dropped live frame looks like.
    for i in range(10):
        running.sidecar.journal.append("train.progress", {"step": i})
    running.sidecar.emit("heartbeat", {})
    b = running.base
    wait_until(lambda: len(running.stored()) == b + 11, what="gap repair")
    assert running.stored() == list(range(1, b + 12))
    assert running.sub.stats.since_requests >= 2


def test_quiet_tail_is_found_by_the_resync_probe(running: Running) -> None:
    running.follow(resync_s=0.2)
    wait_until(lambda: running.sub.caught_up, what="catch up")
    running.sidecar.journal.append("train.progress", {"step": 1})  # never published
    wait_until(lambda: len(running.stored()) == running.base + 1, what="resync probe")


def test_store_written_twice_stays_exactly_once(running: Running) -> None:
    for i in range(20):
        running.sidecar.emit("train.progress", {"step": i})
    running.follow()
    b = running.base
    wait_until(lambda: len(running.stored()) == b + 20, what="first pass")
    running.unfollow()
    running.store.apply(running.sidecar.run_id, [], 0)  # forget the cursor: replay all again
    running.follow()
    wait_until(lambda: running.sub.caught_up and running.sub.cursor == b + 20, what="second pass")
    assert running.stored() == list(range(1, b + 21))
