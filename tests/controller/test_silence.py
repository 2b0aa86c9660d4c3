"""sidecar.silent is judged after what has arrived: a follower that was not scheduled for a while
(a busy laptop; the suite's own load) must not call a sidecar silent whose events wait unread in
its socket. A real sidecar in this process, the watcher driven by hand on a clock of the test's."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, List

import pytest
import zmq

from controller.follow.watcher import LocalLink, Watcher
from controller.store.db import Store
from tests.controller.sidecars import RealSidecar
from tests.helpers import wait_until

RUN = "run-silence"


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        yield s


@pytest.fixture
def box(tmp_path: Path) -> Iterator[RealSidecar]:
    made = RealSidecar(tmp_path / "active" / RUN)
    try:
        yield made
    finally:
        made.close()


def silences(store: Store) -> List[str]:
    return [str(e.data.get("state")) for e in store.local_events(RUN) if e.kind == "sidecar.silent"]


def followed(store: Store, box: RealSidecar, clock: List[float]) -> Watcher:
    store.upsert_run(RUN, host="box", target="local", run_dir=str(box.run_dir))
    w = Watcher(RUN, LocalLink(str(box.run_dir)), monotonic=lambda: clock[0])

    def caught_up() -> bool:
        w.tick(store)
        w.step()
        return w.sub is not None and w.sub.caught_up and w.link_up

    wait_until(caught_up, 30, "the watcher to catch up with the sidecar")
    return w


def test_events_waiting_in_the_socket_are_not_silence(store: Store, box: RealSidecar) -> None:
    clock = [time.monotonic()]
    box.sidecar.emit("job.started", {"pid": 1})
    w = followed(store, box, clock)
    try:
        box.sidecar.emit("train.progress", {"step": 1})
        assert w.sub is not None and w.sub.link._sub.poll(30_000, zmq.POLLIN), "the event never arrived"
        clock[0] += 1e6                     # this process slept past any heartbeat budget
        w.tick(store)
        assert silences(store) == [], store.local_events(RUN)
        assert "train.progress" in [e.kind for e in store.events(RUN)]
    finally:
        w.end(store)


def test_a_sidecar_that_says_nothing_is_silent_once(store: Store, box: RealSidecar) -> None:
    clock = [time.monotonic()]
    box.sidecar.emit("job.started", {"pid": 1})
    w = followed(store, box, clock)
    try:
        clock[0] += 1e6
        w.tick(store)
        w.tick(store)
        assert silences(store) == ["onset"], store.local_events(RUN)
        box.sidecar.emit("train.progress", {"step": 1})
        assert w.sub is not None and w.sub.link._sub.poll(30_000, zmq.POLLIN), "the event never arrived"
        w.step()
        w.tick(store)
        assert silences(store) == ["onset", "cleared"], store.local_events(RUN)
    finally:
        w.end(store)
