"""Every reader of a run's ending tells controller.runs.life's story: `rgt status` (and its history and
LINK), `rgt runs`, the queue, the multi-node verdicts, the teardown gate; and `rgt stop` records
the stop request it makes, so the exit that follows is "stopped by request", never a crash.

Real store files throughout; the last tests stop a real job on host `local` with `rgt stop` and
read the outcome back through the real `rgt` commands.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional

import pytest
from click.testing import CliRunner, Result

from controller.cli import main as cli
from controller.queue import model as q
from controller.runs import group_status as status_group
from controller.runs import groups, life, status
from controller.store.db import Store
from protocol import Event
from tests.e2e.rgtbox import Rgt, rgt_local
from tests.helpers import wait_until

__all__ = ["rgt_local"]

RUN = "reader-run"
T0 = time.time() - 600.0


class Box:
    """Box events of several runs, stored the way their watchers store them."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seq: dict[str, int] = {}
        self.tick = 0   # one clock over every run: each event a second after the one before

    def add(self, run: str, kind: str, sev: str = "info", ts: Optional[float] = None, **data: Any) -> Event:
        if run not in self.seq:
            self.store.upsert_run(run, host="box1", target="h1", run_dir=f"/runs/{run}")
        self.seq[run] = self.seq.get(run, 0) + 1
        self.tick += 1
        seq = self.seq[run]
        ev = Event(run=run, host="box1", seq=seq, ts=T0 + self.tick if ts is None else ts, kind=kind, sev=sev,
                   data=data)
        self.store.apply(run, [ev], seq)
        return ev

    def ended(self, run: str, stop_by: Optional[str] = None, **exit_data: Any) -> None:
        """A started job that exits with exit_data, after a stop request by stop_by if given."""
        self.add(run, "job.started", pid=7)
        self.add(run, "heartbeat", interval_s=1.0)
        if stop_by:
            self.store.add_local_event(run, life.STOP_KIND, "info", {"by": stop_by, "grace": "30s"},
                                       ts=T0 + self.tick + 0.5)
        self.add(run, "job.exited", "warn", **exit_data)


@pytest.fixture
def box(home: Path) -> Iterator[Box]:
    with Store.open() as s:
        yield Box(s)


def rgt(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args))


# ---- rgt status -----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [143, 1, 0])
def test_status_says_stopped_by_request_whatever_the_code(box: Box, code: int) -> None:
    box.ended(RUN, stop_by="rgt stop", code=code, signal=None)
    s = status.summarize(box.store, RUN)
    assert s["state"] == "stopped by request" and "stopped by request (rgt stop)" in s["state_reason"]
    assert (s["life"]["state"], s["life"]["ok"], s["life"]["stopped_by"]) == ("stopped", True, "rgt stop")
    assert "failed" not in s["state"] and "SIGTERM" not in s["state_reason"]


def test_status_says_preempted_for_a_sigterm_nobody_asked_for_and_names_failures(box: Box) -> None:
    box.ended("p", code=143)
    box.ended("oom", code=137, signal=9, oom_killed=True)
    box.ended("crash", code=1)
    box.ended("vanished", code=None, vanished=True)
    box.add("lost", "job.started")
    box.add("lost", "sidecar.stopping")
    states = {r: status.summarize(box.store, r)["state"] for r in ("p", "oom", "crash", "vanished", "lost")}
    assert states == {"p": "preempted", "oom": "failed (oom)", "crash": "failed (error)",
                      "vanished": "vanished", "lost": "lost contact"}


def test_history_over_a_resume_shows_each_runs_life(box: Box) -> None:
    box.ended("first", code=143)
    box.ended("second", stop_by="rgt stop", code=143)
    box.store.set_lineage("second", resumed_from="first")
    chain = status.history(box.store, "second")
    assert [(h["run"], h["state"], h["life"]["state"], h["current"]) for h in chain] == [
        ("first", "preempted", "preempted", False), ("second", "stopped by request", "stopped", True)]


# ---- LINK -------------------------------------------------------------------------------------------------


def test_a_healthy_watched_run_with_no_link_event_is_up_from_its_fresh_box_data(box: Box) -> None:
    now = time.time()
    box.add(RUN, "job.started", ts=now - 5)
    box.add(RUN, "heartbeat", ts=now - 1, interval_s=1.0)
    link = status.summarize(box.store, RUN, now=now)["link"]
    assert link["state"] == "up" and link["by"] == "box data"
    assert status.summarize(box.store, RUN, now=now + 60)["link"]["state"] == "unknown"   # stale: 3 beats
    assert status.run_state(box.store, RUN, now)["link"] == "up"
    box.store.add_local_event(RUN, "link.lost", "warn", {"reason": "timeout"}, ts=now)
    assert status.summarize(box.store, RUN, now=now + 1)["link"]["state"] == "down"   # its events say first


def test_an_ended_runs_link_is_ended_not_down_forever(box: Box) -> None:
    box.add(RUN, "job.started")
    box.store.add_local_event(RUN, "link.lost", "warn", {"reason": "timeout"})
    box.add(RUN, "job.exited", code=0, final_ok=True)
    later = time.time() + 3600
    assert status.summarize(box.store, RUN, now=later)["link"]["state"] == "ended"
    assert status.run_state(box.store, RUN, later)["link"] == "ended"


# ---- rgt runs -----------------------------------------------------------------------------------------


def test_runs_shows_life_states_and_no_exit_code_for_a_stop(box: Box) -> None:
    box.ended("s", stop_by="rgt stop", code=143)
    box.ended("p", code=143)
    box.ended("f", code=0, final_ok=True)
    box.ended("x", code=2)
    box.add("r", "job.started", ts=time.time())
    box.store.upsert_run("l", host="", target="h1", run_dir="/runs/l")
    out = rgt("runs", "--json")
    assert out.exit_code == 0, out.output
    rows = {r["run"]: r for r in json.loads(out.stdout)["runs"]}
    assert {r: rows[r]["state"] for r in rows} == {"s": "stopped", "p": "preempted", "f": "finished",
                                                   "x": "failed", "r": "running", "l": "launched"}
    assert rows["s"]["stopped_by"] == "rgt stop" and rows["s"]["life"]["ok"] is True
    assert rows["s"]["code"] == 143 and rows["s"]["link"] == "ended" and rows["r"]["link"] == "up"
    text = {line.split()[0]: line.split()[2:4] for line in rgt("runs").stdout.splitlines()[1:]}
    assert text["s"] == ["stopped", "ended"] and text["x"] == ["failed", "2"]


# ---- the queue ------------------------------------------------------------------------------------------


def running_cell(store: Store, run: str, idx: int = 0) -> q.Cell:
    cell = q.cells(store, "abl")[idx]
    begun = q.begin_attempt(store, cell, host="h1", run=run, in_place=False, since_seq=0, since_local=0,
                            now=time.time())
    assert begun is not None
    running = q.launched(store, begun, {"pid": 1}, time.time())
    assert running is not None
    return running


def test_a_cell_stopped_by_request_is_stopped_not_retried_not_failed(box: Box) -> None:
    q.create(box.store, "abl", ["h1", "h2"], [["python", "a.py"], ["python", "b.py"]],
             q.Options(max_attempts=3), time.time())
    running_cell(box.store, "abl-0-s")
    running_cell(box.store, "abl-1-p", 1)
    box.ended("abl-0-s", stop_by="rgt stop", code=143)   # the user's `rgt stop RUN`
    box.ended("abl-1-p", code=143)                       # a SIGTERM nobody asked for
    changes = q.refresh(box.store, "abl", time.time())
    cells = {c.idx: c for c in q.cells(box.store, "abl")}
    assert {c.cell.idx: c.cell.state for c in changes} == {0: "stopped", 1: "retrying"}
    assert cells[0].state == q.STOPPED and cells[0].last["outcome"] == "stopped"
    assert "stopped by request (rgt stop)" in cells[0].reason
    assert cells[1].last["outcome"] == "preempted"
    assert q.STOPPED in q.TERMINAL and q.exit_code([cells[0]]) == 0 and q.finished([cells[0]])
    q.set_options(box.store, "abl", time.time(), cancelled=True)   # no dispatcher from this test
    out = rgt("queue", "status", "abl", "--json")
    assert out.exit_code == 0 and json.loads(out.stdout)["counts"] == {"stopped": 1, "retrying": 1}
    table = rgt("queue", "status", "abl").stdout
    assert any(line.split()[:2] == ["0", "stopped"] for line in table.splitlines())


def test_a_queue_cancel_stop_is_recorded_with_its_own_by(box: Box) -> None:
    q.create(box.store, "abl", ["h1"], [["python", "a.py"]], q.Options(), time.time())
    running_cell(box.store, "abl-0-c")
    box.ended("abl-0-c", stop_by="rgt queue cancel", code=None, signal=15)
    assert q.classify(box.store, "abl-0-c", now=time.time()) == q.Outcome(
        "stopped", life.of_run(box.store, "abl-0-c").reason, box.store.cursor("abl-0-c"))
    assert life.of_run(box.store, "abl-0-c").stopped_by == "rgt queue cancel"


# ---- the group verdict ------------------------------------------------------------------------------------


G = "grp-1"


def group(box: Box, nodes: List[str]) -> None:
    box.store.upsert_run(G, host="")
    box.store.set_lineage(G, group_run=G)
    for n in nodes:
        box.add(f"{G}.{n}", "sidecar.started")
        box.store.set_lineage(f"{G}.{n}", group_run=G, node=n)
        box.add(f"{G}.{n}", "job.started", pid=3)


def stop_node(box: Box, node: str, code: int = 143) -> None:
    stream = f"{G}.{node}"
    box.store.add_local_event(stream, life.STOP_KIND, "info", {"by": "rgt stop"}, ts=T0 + box.tick + 0.5)
    box.add(stream, "job.exited", "warn", code=code)


def test_a_node_stopped_by_request_is_no_failed_rank(box: Box) -> None:
    group(box, ["n0", "n1"])
    stop_node(box, "n0")
    assert groups.check(box.store, G) == []    # n1 still runs: no job.rank_failed for a stop
    box.add(f"{G}.n1", "job.exited", "warn", code=1)   # its peer went away on purpose
    assert groups.check(box.store, G) == []
    s = status_group.summarize(box.store, G)
    assert s["state"] == "stopped" and "stopped by request (rgt stop)" in s["state_reason"], s
    rows = {r["run"]: r["state"] for r in json.loads(rgt("runs", "--json").stdout)["runs"]}
    assert rows[G] == "stopped" and rows[f"{G}.n0"] == "stopped" and rows[f"{G}.n1"] == "failed"


def test_a_group_whose_nodes_were_all_stopped_is_stopped(box: Box) -> None:
    group(box, ["n0", "n1"])
    stop_node(box, "n0")
    stop_node(box, "n1", code=0)
    assert status_group.summarize(box.store, G)["state"] == "stopped"


def test_a_node_that_failed_before_any_stop_is_still_a_failed_rank(box: Box) -> None:
    group(box, ["n0", "n1"])
    box.add(f"{G}.n1", "job.exited", "warn", code=1)
    assert [e.kind for e in groups.check(box.store, G)] == ["job.rank_failed"]
    stop_node(box, "n0")   # then the user stops the one left waiting
    s = status_group.summarize(box.store, G)
    assert s["state"] == "failed" and "node n1" in s["state_reason"], s


# ---- rgt stop, for real on host local --------------------------------------------------------------------


def local_events(run: str) -> List[Any]:
    with Store.open() as s:
        return s.local_events(run, kind_prefix=life.STOP_KIND)


@pytest.mark.e2e
def test_rgt_stop_records_the_request_first_and_every_reader_says_stopped(rgt_local: Rgt) -> None:
    started = rgt_local.launch("--steps", "100000", "--step-seconds", "0.05", host="local")
    run = started["run_id"]
    with Store.open() as s:
        wait_until(lambda: s.events(run, kind_prefix="train.progress"), 60, "the job to progress")
    answer = json.loads(rgt_local("stop", run, "--grace", "10s", "--json").stdout.strip().splitlines()[-1])
    assert answer["exit"] == 0 and answer["outcome"] in ("stopped", "killed")
    asked = local_events(run)
    assert [(e.data["by"], e.data["grace"]) for e in asked] == [("rgt stop", "10s")]
    with Store.open() as s:
        wait_until(lambda: life.of_run(s, run).ended, 60, "the job's exit to be stored")
        ended = life.of_run(s, run)
        exit_ts = s.events(run, kind_prefix="job.exited")[-1].ts
    assert (ended.state, ended.stopped_by) == ("stopped", "rgt stop") and ended.ok
    assert asked[0].ts <= exit_ts   # recorded before the box was asked
    with Store.open() as s:
        said = s.local_events(run, kind_prefix=life.STOP_ANSWER_KIND)
    assert [(e.data["request_id"], e.data["outcome"]) for e in said] == [(asked[0].id, answer["outcome"])]
    shown = json.loads(rgt_local("status", run, "--json").stdout)
    assert shown["state"] == "stopped by request" and shown["life"]["stopped_by"] == "rgt stop"
    row = json.loads(rgt_local("runs", run, "--json").stdout)["runs"][0]
    assert (row["state"], row["link"]) == ("stopped", "ended")
    again = json.loads(rgt_local("stop", run, "--json").stdout.strip().splitlines()[-1])
    assert again["outcome"] == "not_running" and len(local_events(run)) == 1   # ended: nothing recorded


# ---- rgt hosts check --json ------------------------------------------------------------------------------


def test_hosts_check_json_on_the_group_or_the_command_and_when_unreachable(home: Path) -> None:
    for args in (["hosts", "check", "local", "--json"], ["hosts", "--json", "check", "local"]):
        out = rgt(*args)
        assert out.exit_code == 0, out.output
        report = json.loads(out.stdout)
        assert report["host"] == "local" and report["reachable"] is True and "onbox_version" in report
    assert rgt("hosts", "add", "gone", "--ssh", "nosuchhost.invalid").exit_code == 0
    out = rgt("hosts", "check", "gone", "--json")
    assert out.exit_code == 1
    report = json.loads(out.stdout)
    assert report["reachable"] is False and report["host"] == "gone" and report["error"]
