"""Watchers end when their run has ended and its last events are stored; a link's outage is its
real length. Real sidecars (in this process, as tests/controller/test_identity.py runs them), the
real watcher loop on a thread, and a real follower daemon process."""
from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Iterator, List

import pytest

from controller.box.ssh import SshError
from controller.follow import readback, watcher
from controller.follow.client import follow, running_pid, stop_daemon
from controller.follow.subscriber import Subscriber
from controller.follow.watcher import LocalLink, Watcher, outage_s
from controller.store.db import Store
from onbox.sidecar.closing import closed_marker
from onbox.sidecar.journal import read_all
from protocol.endpoints import Endpoints
from tests.controller.sidecars import RealSidecar
from tests.helpers import wait_until

RUN = "run-end"


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        yield s


@pytest.fixture
def sidecars() -> Iterator[List[RealSidecar]]:
    made: List[RealSidecar] = []
    yield made
    for s in made:
        s.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "active" / RUN


class Serving:
    """Watcher.serve on a thread, with its own store connection; .result once it returned."""

    def __init__(self, w: Watcher, path: Path) -> None:
        self.w, self.result = w, []  # type: ignore[var-annotated]
        self.stores = (Store.open(path),)
        self.thread = threading.Thread(target=self._serve, name="test-watcher")
        self.thread.start()

    def _serve(self) -> None:
        self.result.append(self.w.serve(*self.stores))

    def end(self) -> None:
        self.w.stop.set()
        self.thread.join(15)
        for s in self.stores:
            s.close()


def kinds(store: Store, run: str = RUN) -> List[str]:
    return [e.kind for e in store.events(run)]


def follow_all(store: Store, sidecar: RealSidecar) -> None:
    """Store everything the sidecar journaled so far (what an earlier watcher would have)."""
    sub = Subscriber(store, Endpoints.read(sidecar.run_dir / "rgt"), expect_run=RUN, request_timeout_s=0.5)
    deadline = time.monotonic() + 20
    sub.run_until(threading.Event(), lambda: sub.caught_up or time.monotonic() > deadline)
    assert sub.caught_up


def exited(pid: int) -> bool:
    """Whether our child `pid` has exited (reaped here, or already by subprocess's own cleanup)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


# ---- after job.exited: drain, then end --------------------------------------------------------------


def test_the_watcher_ends_after_the_exit_once_what_follows_it_is_stored(
        store: Store, sidecars: List[RealSidecar], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watcher, "EXIT_SETTLE_S", 0.5)  # the sidecar lingers on and never stops here
    box = RealSidecar(run_dir)
    sidecars.append(box)
    box.sidecar.emit("job.started", {"pid": 1})
    # The watcher's clock stands still until the test moves it: however late the event after the
    # exit arrives on a loaded machine, no settle has passed before it is stored.
    now = [1000.0]
    serving = Serving(Watcher(RUN, LocalLink(str(run_dir)), monotonic=lambda: now[0]), store.path)
    try:
        wait_until(lambda: "job.started" in kinds(store), 20, "the job's start stored")
        assert serving.thread.is_alive()
        box.sidecar.emit("job.exited", {"code": 0})   # the sidecar closes the run: run.closed follows
        wait_until(lambda: kinds(store)[-2:] == ["job.exited", "run.closed"], 20, "the exit and close stored")
        box.sidecar.emit("ckpt.committed", {"path": "checkpoints/step100.pt", "step": 100})
        wait_until(lambda: kinds(store)[-1:] == ["ckpt.committed"], 20, "what follows stored")
        assert serving.thread.is_alive(), "the watcher ended before the settle"
        now[0] += 0.5
        serving.thread.join(20)
        assert not serving.thread.is_alive(), "the watcher ran on after the run ended"
        assert serving.result == [0]
        assert kinds(store)[-3:] == ["job.exited", "run.closed", "ckpt.committed"]   # what followed is in
        assert "sidecar.stopping" not in kinds(store)                   # ended on the settle, not a stop
    finally:
        serving.end()


def test_the_watcher_ends_at_once_on_the_sidecars_stop_after_the_exit(
        store: Store, sidecars: List[RealSidecar], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watcher, "EXIT_SETTLE_S", 3600.0)
    monkeypatch.setattr(watcher, "EXIT_SETTLE_MAX_S", 3600.0)
    box = RealSidecar(run_dir)
    sidecars.append(box)
    box.sidecar.emit("job.started", {"pid": 1})
    serving = Serving(Watcher(RUN, LocalLink(str(run_dir))), store.path)
    try:
        wait_until(lambda: "job.started" in kinds(store), 20, "the job's start stored")
        box.sidecar.emit("job.exited", {"code": 0})
        box.close()                                   # journals sidecar.stopping
        serving.thread.join(20)
        assert serving.result == [0]
        assert kinds(store)[-1] == "sidecar.stopping"
    finally:
        serving.end()


# ---- a watcher started for a run that had ended -------------------------------------------------------


def test_the_daemon_follows_an_ended_run_only_to_fetch_what_is_missing(
        store: Store, sidecars: List[RealSidecar], run_dir: Path) -> None:
    box = RealSidecar(run_dir)
    sidecars.append(box)
    box.sidecar.emit("job.started", {"pid": 1})
    box.sidecar.emit("job.exited", {"code": 0})
    wait_until(lambda: closed_marker(run_dir / "rgt"), 20, "the sidecar to close the run")
    follow_all(store, box)                           # an earlier watcher stored up to the close
    store.upsert_run(RUN, host="box", target="local", run_dir=str(run_dir))
    box.sidecar.emit("ckpt.committed", {"path": "checkpoints/final.pt", "step": 9})   # not stored yet
    pid = follow(store, RUN)                         # as `rgt status` asks; the sidecar lives on
    assert pid is not None
    wait_until(lambda: running_pid(RUN) is None, 30, "the daemon to end the run's follow by itself")
    assert kinds(store)[-1] == "ckpt.committed"
    assert store.local_events(RUN) == []             # no link.lost, no degraded: nothing went wrong
    assert stop_daemon() == pid


def test_a_catch_up_that_cannot_reach_the_box_gives_up_quietly(
        store: Store, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watcher, "CATCH_UP_S", 1.0)
    monkeypatch.setattr(watcher, "STARTUP_GRACE_S", 0.0)
    from protocol import Event
    store.apply(RUN, [Event(run=RUN, host="box", seq=1, ts=1.0, kind="job.started", sev="info", data={}),
                      Event(run=RUN, host="box", seq=2, ts=2.0, kind="job.exited", sev="info",
                            data={"code": 0})], 2)
    serving = Serving(Watcher(RUN, LocalLink(str(run_dir))), store.path)   # no sidecar there at all
    try:
        serving.thread.join(20)
        assert serving.result == [0]
        assert store.local_events(RUN) == []         # an ended run's gone box is no link.lost
    finally:
        serving.end()


def test_a_new_attempt_launched_under_an_ended_run_id_is_watched(
        store: Store, sidecars: List[RealSidecar], run_dir: Path) -> None:
    first = RealSidecar(run_dir)
    sidecars.append(first)
    first.sidecar.emit("job.started", {"pid": 1})
    first.sidecar.emit("job.exited", {"code": 1})
    follow_all(store, first)
    first.close()
    store.upsert_run(RUN, host="box", target="local", run_dir=str(run_dir))
    mark = watcher.files(RUN).launched
    mark.write_text(f"{time.time():.3f}\n")          # what ensure_watcher(launched=True) leaves
    second = RealSidecar(run_dir)                    # the relaunch: its job has not started yet
    sidecars.append(second)
    serving = Serving(Watcher(RUN, LocalLink(str(run_dir)), launch_mark=mark), store.path)
    try:
        wait_until(lambda: kinds(store).count("sidecar.started") == 2, 20, "the new sidecar's start stored")
        second.sidecar.emit("job.started", {"pid": 2})   # a catch-up watcher would have left already
        wait_until(lambda: kinds(store).count("job.started") == 2, 20, "the new attempt's start stored")
        assert serving.thread.is_alive() and not mark.exists()
        second.sidecar.emit("job.exited", {"code": 0})
        second.close()
        serving.thread.join(20)
        assert serving.result == [0]
    finally:
        serving.end()


def test_a_launch_mark_is_taken_once_and_only_when_fresh(tmp_path: Path) -> None:
    mark = tmp_path / "r.launched"
    assert not watcher.take_launch_mark(mark)
    mark.write_text("1000.0\n")
    assert watcher.take_launch_mark(mark, now=1010.0) and not mark.exists()
    assert not watcher.take_launch_mark(mark, now=1010.0)
    mark.write_text("1000.0\n")
    assert not watcher.take_launch_mark(mark, now=1000.0 + 2 * watcher.LAUNCHED_FRESH_S)   # a leftover
    assert not mark.exists()


# ---- link.restored says the real outage -------------------------------------------------------------


class FlakyLink(LocalLink):
    """The run's own sockets, behind a switch the test flips: down means the master died;
    `blink` makes the next liveness check fail once, the next connect succeeding at once."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(run_dir)
        self.up = threading.Event()
        self.up.set()
        self.blink = False
        self.connects = 0

    def connect(self) -> Endpoints:
        self.connects += 1
        if not self.up.is_set():
            raise SshError("ssh: connect to host box: Connection refused")
        return super().connect()

    def alive(self) -> bool:
        if self.blink:
            self.blink = False
            return False
        return self.up.is_set()


def restored(store: Store) -> List[float]:
    return [e.data["down_s"] for e in store.local_events(RUN, kind_prefix="link.restored")]


def test_a_loss_mended_in_the_same_check_is_down_0_not_minus_0(
        store: Store, sidecars: List[RealSidecar], run_dir: Path) -> None:
    sidecars.append(RealSidecar(run_dir))
    link = FlakyLink(str(run_dir))
    w = Watcher(RUN, link)
    assert w._supervise(store) is not None           # up
    link.blink = True                                 # the master died and came back between checks
    assert w._supervise(store) is not None           # found dead, reconnected within the same check
    assert [e.kind for e in store.local_events(RUN)] == ["link.lost", "link.restored"]
    (down_s,) = restored(store)
    assert down_s >= 0.0 and math.copysign(1.0, down_s) == 1.0, down_s


def test_link_restored_down_s_is_the_outage_length(
        store: Store, sidecars: List[RealSidecar], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watcher, "SUPERVISE_S", 0.05)
    box = RealSidecar(run_dir)
    sidecars.append(box)
    box.sidecar.emit("job.started", {"pid": 1})
    link = FlakyLink(str(run_dir))
    from rgtlib.backoff import Backoff
    serving = Serving(Watcher(RUN, link, backoff=Backoff(base_s=0.05, cap_s=0.1)), store.path)
    try:
        wait_until(lambda: "job.started" in kinds(store), 20, "the job's start stored")
        link.up.clear()
        wait_until(lambda: store.local_events(RUN, kind_prefix="link.lost"), 20, "link.lost")
        down_from = time.monotonic()
        tries = link.connects
        wait_until(lambda: link.connects >= tries + 3, 20, "three failed reconnects")
        link.up.set()
        down_for = time.monotonic() - down_from
        (down_s,) = wait_until(lambda: restored(store), 20, "link.restored")
        assert down_s >= round(down_for, 3) - 0.001, (down_s, down_for)
        assert down_s < down_for + 10
        box.sidecar.emit("job.exited", {"code": 0})
        box.close()
        serving.thread.join(20)
        assert serving.result == [0]
    finally:
        serving.end()


def test_outage_s_is_never_negative() -> None:
    assert outage_s(10.0, 12.3456) == 2.346
    for got in (outage_s(10.0, 10.0), outage_s(10.0000001, 10.0), outage_s(10.0, 9.0)):
        assert got == 0.0 and math.copysign(1.0, got) == 1.0


# ---- a sidecar that no longer answers: its journal read back ------------------------------------


def test_an_exit_journaled_while_nobody_followed_is_read_back_once_the_sidecar_has_gone(
        store: Store, sidecars: List[RealSidecar], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readback, "READBACK_AFTER_S", 0.2)
    box = RealSidecar(run_dir)
    sidecars.append(box)
    box.sidecar.emit("job.started", {"pid": 1})
    follow_all(store, box)                           # followed until here; the laptop then slept
    for step in range(1, 1201):                      # more than one page of `rgt-onbox journal`
        box.sidecar.emit("train.progress", {"step": step})
    box.sidecar.emit("ckpt.committed", {"path": "checkpoints/step1200.pt", "step": 1200})
    box.sidecar.emit("job.exited", {"code": 0})
    box.close()                                      # the linger ran out: the sockets are gone
    journaled = [e["kind"] for e in read_all(run_dir / "rgt")]
    assert journaled[-1] == "sidecar.stopping" and (run_dir / "rgt" / "endpoints.json").exists()
    assert len(journaled) - store.cursor(RUN) > 1000
    store.upsert_run(RUN, host="box", target="local", run_dir=str(run_dir))
    serving = Serving(Watcher(RUN, LocalLink(str(run_dir))), store.path)
    try:
        serving.thread.join(60)
        assert serving.result == [0], "the watcher did not end on the exit read back"
    finally:
        serving.end()
    assert kinds(store) == journaled                 # every event, once, in order
    assert store.cursor(RUN) == len(journaled) and store.gaps(RUN) == []
    assert store.local_events(RUN) == []             # no link.lost, no sidecar.silent


def test_a_read_back_racing_the_sidecars_own_hello_stores_every_event_once(
        store: Store, sidecars: List[RealSidecar], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read back at once (no wait), while the live sidecar's hello is on its way: both paths store,
    each event once, no gap, and the run ends as ever once the sidecar has gone."""
    monkeypatch.setattr(readback, "READBACK_AFTER_S", 0.0)
    box = RealSidecar(run_dir)
    sidecars.append(box)
    box.sidecar.emit("job.started", {"pid": 1})
    box.sidecar.emit("job.exited", {"code": 0})
    store.upsert_run(RUN, host="box", target="local", run_dir=str(run_dir))
    serving = Serving(Watcher(RUN, LocalLink(str(run_dir))), store.path)
    try:
        wait_until(lambda: "job.exited" in kinds(store), 30, "the exit stored")
        box.close()
        serving.thread.join(60)
        assert serving.result == [0]
    finally:
        serving.end()
    assert kinds(store) == [e["kind"] for e in read_all(run_dir / "rgt")]
    assert store.gaps(RUN) == []
