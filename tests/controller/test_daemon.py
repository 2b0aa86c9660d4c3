"""The follower daemon: one real process follows every run; killing it loses nothing; one bad box
ends only its own follow; it is the one writer of a group's verdicts; it ends itself when idle.

Real sidecars serve on threads of this process (their sockets in each run's directory, host
`local`); the daemon is the real `python -m controller.follow.daemon serve`, started through
follow() as `rgt launch` starts it, and ended by the pid its lock names."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Iterator, List

import pytest

from controller.follow import client
from controller.store.db import Store
from protocol import Event
from tests.controller.sidecars import RealSidecar
from tests.helpers import wait_until


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        yield s


@pytest.fixture
def boxes(tmp_path: Path, store: Store) -> Iterator[List[RealSidecar]]:
    made: List[RealSidecar] = []
    yield made
    for box in made:
        box.close()


def sidecar_for(store: Store, boxes: List[RealSidecar], tmp_path: Path, run: str,
                answers_as: str = "") -> RealSidecar:
    run_dir = tmp_path / "active" / run
    store.upsert_run(run, host="", target="local", run_dir=str(run_dir))
    box = RealSidecar(run_dir, run=answers_as)
    boxes.append(box)
    return box


def kinds(store: Store, run: str) -> List[str]:
    return [e.kind for e in store.events(run)]


def test_one_daemon_follows_every_run_and_a_sigkill_loses_nothing(
        store: Store, boxes: List[RealSidecar], tmp_path: Path) -> None:
    a = sidecar_for(store, boxes, tmp_path, "run-a")
    b = sidecar_for(store, boxes, tmp_path, "run-b")
    a.sidecar.emit("job.started", {"pid": 1})
    b.sidecar.emit("job.started", {"pid": 2})
    first = client.follow(store, "run-a")
    assert first is not None and client.follow(store, "run-b") == first      # one process for both
    assert sorted(client.followed()) == ["run-a", "run-b"]
    assert client.running_pid("run-a") == client.running_pid("run-b") == first
    for run in ("run-a", "run-b"):
        wait_until(lambda r=run: "job.started" in kinds(store, r), 20, f"{run}'s start stored")

    os.kill(first, signal.SIGKILL)                                           # the daemon dies
    wait_until(lambda: client.daemon_pid() is None, 20, "the killed daemon's lock to be released")
    assert client.running_pid("run-a") is None
    for box, step in ((a, 10), (b, 20)):                                     # the jobs train on
        box.sidecar.emit("train.progress", {"step": step})

    second = client.follow(store, "run-a")    # the next `rgt status` of one run starts a new one...
    assert second is not None and second != first
    wait_until(lambda: "train.progress" in kinds(store, "run-b"), 20,
               "run-b (not asked for) resumed from its marker")             # ... which resumes both
    wait_until(lambda: "train.progress" in kinds(store, "run-a"), 20, "run-a followed again")
    for run in ("run-a", "run-b"):
        seqs = [e.seq for e in store.events(run)]
        assert seqs == list(range(1, len(seqs) + 1)), seqs                  # nothing lost, nothing twice
        assert store.gaps(run) == []

    for box in (a, b):                                                       # both runs end
        box.sidecar.emit("job.exited", {"code": 0})
        box.close()
    wait_until(lambda: client.followed() == [], 30, "both follows to end by themselves")
    assert client.running_pid("run-a") is None and client.running_pid("run-b") is None
    assert client.daemon_pid() == second                                     # the daemon stays a while
    assert client.stop_daemon() == second and client.daemon_pid() is None


def test_one_bad_box_ends_only_its_own_follow(store: Store, boxes: List[RealSidecar], tmp_path: Path) -> None:
    sidecar_for(store, boxes, tmp_path, "run-bad", answers_as="run-other")   # answers for another run
    good = sidecar_for(store, boxes, tmp_path, "run-good")
    pid = client.follow(store, "run-bad")
    assert client.follow(store, "run-good") == pid
    (degraded,) = wait_until(lambda: store.local_events("run-bad", kind_prefix="sidecar.degraded"), 20,
                             "the bad box's follow to end, recorded")
    assert "answered for run 'run-other'" in degraded.data["error"]
    assert client.followed() == ["run-good"] and client.daemon_pid() == pid
    good.sidecar.emit("train.progress", {"step": 5})
    wait_until(lambda: "train.progress" in kinds(store, "run-good"), 20, "the good run still followed")
    assert client.unfollow("run-good") is True                              # ended before it answers
    assert client.followed() == [] and client.running_pid("run-good") is None
    assert client.unfollow("run-good") is False
    assert client.stop_daemon() == pid


def test_the_daemon_records_a_groups_verdict_when_a_watch_asks(store: Store) -> None:
    group, n0, n1 = "train-g", "train-g.n0", "train-g.n1"
    store.upsert_run(group, host="")
    store.set_lineage(group, group_run=group)
    for stream, node in ((n0, "n0"), (n1, "n1")):
        store.upsert_run(stream, host=f"node-{node}")
        store.set_lineage(stream, group_run=group, node=node)
        store.apply(stream, [Event(run=stream, host="node", seq=1, ts=1.0, kind="job.started",
                                   sev="info", data={"pid": 1})], 1)
    store.apply(n1, [Event(run=n1, host="node", seq=2, ts=2.0, kind="job.exited", sev="warn",
                           data={"code": 1, "final_ok": False})], 2)
    try:
        assert client.check_group(group) == 1                  # recorded by the daemon before it answers
        (verdict,) = store.local_events(group, kind_prefix="job.rank_failed")
        assert verdict.data["node"] == "n1"
        assert client.check_group(group) == 0                  # once
    finally:
        client.stop_daemon()


def test_an_idle_daemon_ends_itself(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGT_DAEMON_IDLE_S", "0.3")
    pid = client.ensure_daemon()
    assert pid is not None
    # Its last line, not daemon_pid() turning None: the pid file goes just before that line is written.
    log = home / "daemon.log"
    wait_until(lambda: f"follower daemon {pid} ended" in log.read_text(), 20, "the idle daemon to end")
    assert "nothing followed for 0.3s: ending" in log.read_text()
    assert client.daemon_pid() is None and not (home / "daemon.pid").exists()


def test_rgt_daemon_status_and_stop(store: Store, boxes: List[RealSidecar], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from controller.cli.main import main as cli

    runner = CliRunner()
    idle = json.loads(runner.invoke(cli, ["daemon", "status", "--json"]).output)
    assert idle["pid"] is None and idle["runs"] == []
    sidecar_for(store, boxes, tmp_path, "run-s")
    pid = client.follow(store, "run-s")
    shown = json.loads(runner.invoke(cli, ["daemon", "status", "--json"]).output)
    assert shown["pid"] == pid and shown["runs"] == ["run-s"] and shown["answering"] is True
    assert "follower daemon pid" in runner.invoke(cli, ["daemon", "status"]).output
    stopped = runner.invoke(cli, ["daemon", "stop", "--json"])
    assert stopped.exit_code == 0 and json.loads(stopped.output) == {"stopped": pid}
    assert client.daemon_pid() is None and client.running_pid("run-s") is None
    assert (tmp_path / "state" / "watchers" / "run-s.followed").exists()   # the next daemon resumes it
